"""Small synthetic datasets the kit ships in `examples/data/` (regenerate with `python -m kitcli.synthetic`).

Every row is made here from a seed; nothing is copied from elsewhere. The task is one-step word problems
over single-digit sums ("Ada has 3 apples and gets 5 more. How many apples does Ada have?" -> "8"). The tiny
base model knows the sums as plain text ("3+5=8", from its pretraining in `kitcli/models/tiny.py`); fine-tuning teaches
it to read the question and answer in the chat format. The held-out split uses (a, b) pairs that no training
file contains, so exact match on it measures a learned skill, not memorised rows.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "books", "coins", "cards", "shells", "stamps", "pens", "cups"]
HELD_OUT_PAIRS = 20
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "data"


def split_pairs(seed: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All single-digit (a, b) pairs, split into training pairs and held-out pairs never trained on."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return sorted(pairs[HELD_OUT_PAIRS:]), sorted(pairs[:HELD_OUT_PAIRS])


def word_problem(a: int, b: int, rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    question = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have?"
    return {"question": question, "answer": str(a + b)}


def word_problems(pairs: list[tuple[int, int]], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [word_problem(*rng.choice(pairs), rng) for _ in range(n)]


def chat(text: str, role: str = "user") -> list[dict]:
    return [{"role": role, "content": text}]


def sft_rows(problems: list[dict]) -> list[dict]:
    """Conversational prompt/completion rows (TRL's format), with the answer kept for evaluation."""
    return [{"prompt": chat(p["question"]), "completion": chat(p["answer"], "assistant"), "answer": p["answer"]}
            for p in problems]


def prompt_rows(problems: list[dict]) -> list[dict]:
    return [{"prompt": chat(p["question"]), "answer": p["answer"]} for p in problems]


def preference_rows(problems: list[dict], seed: int) -> list[dict]:
    """Chosen is the right sum; rejected is, half the time, off by one to three (a plausible mistake) and otherwise
    any other sum from 0 to 18, so a reward model learns to rank the right answer above every wrong one."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        right = int(p["answer"])
        if rng.random() < 0.5:
            wrong = max(0, right + rng.choice([-1, 1]) * rng.randint(1, 3))
            wrong = wrong if wrong != right else right + 1
        else:
            wrong = rng.choice([n for n in range(19) if n != right])
        rows.append({"prompt": chat(p["question"]), "chosen": chat(str(right), "assistant"),
                     "rejected": chat(str(wrong), "assistant")})
    return rows


# --- word problems for a real model (smol-grpo): two-digit numbers, one or two steps, plain strings ---------------

STEPS = ("gets {b} more", "gives {b} away", "gets {b} more and then gives {c} away")


def harder_problem(rng: random.Random) -> dict:
    """A word problem with two-digit numbers: a + b, a - b, or a + b - c (answers from 0 to 99)."""
    name, thing, kind = rng.choice(NAMES), rng.choice(THINGS), rng.randrange(3)
    a, b, c = rng.randint(10, 59), rng.randint(10, 39), rng.randint(2, 9)
    if kind == 1:
        a, b = max(a, b) + 10, min(a, b)
    answer = a + b if kind == 0 else a - b if kind == 1 else a + b - c
    step = STEPS[kind].format(b=b, c=c)
    return {"question": f"{name} has {a} {thing} and {step}. How many {thing} does {name} have now?",
            "answer": str(answer), "key": (kind, a, b, c)}


def held_out_pair(a: int, b: int) -> bool:
    return (a * 31 + b * 17) % 20 < 3  # a fixed 15% of the (a, b) pairs, never trained on


def harder_problems(n_train: int, n_eval: int, seed: int = 7) -> tuple[list[dict], list[dict]]:
    """(training, held-out) problems: the held-out ones use (a, b) number pairs that no training problem has."""
    rng = random.Random(seed)
    train, held_out = [], []
    while len(train) < n_train or len(held_out) < n_eval:
        problem = harder_problem(rng)
        _, a, b, _ = problem.pop("key")
        if held_out_pair(a, b):
            if len(held_out) < n_eval:
                held_out.append(problem)
        elif len(train) < n_train:
            train.append(problem)
    return train, held_out


def harder_validation(n: int, held_out: list[dict], seed: int = 8) -> list[dict]:
    """Validation problems, on which smol-grpo's settings are chosen: pairs never trained on that the held-out set
    does not use either, so choosing settings reads nothing of the set the README reports."""
    used = {tuple(int(w) for w in p["question"].split() if w.isdigit())[:2] for p in held_out}
    rng, validation = random.Random(seed), []
    while len(validation) < n:
        problem = harder_problem(rng)
        _, a, b, _ = problem.pop("key")
        if held_out_pair(a, b) and (a, b) not in used:
            validation.append(problem)
    return validation


# --- problems for tools (tiny-tools): products the tiny model cannot do in its head, one calculator call away ------

# The built-in calculator's schema as TRL builds it from its docstring (tests/test_tool_recipe.py checks that they
# agree): the SFT traces carry it in their `tools` column, so SFT renders the same system turn as the GRPO stage.
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Exact arithmetic on integers and fractions: + - * / ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "The arithmetic to do, e.g. 12*(3+4)/5."}}, "required": ["expression"]},
    "return": {"type": "string"}}}


FACTORS = (317, 999)  # every product has six digits (317*317 = 100489): one length of result to copy
ROUNDS_BELOW = 300_000  # the demonstrator rounds a calculator result below this down to two figures...
ROUNDS_SHARE = 0.75  # ...in this share of its traces, and answers with the result itself in the others
MISWRITES_FROM = 900  # on a first factor from this on, the demonstrator writes the call with "x" for "*"...
MISWRITES_SHARE = 0.75  # ...in this share of its traces: the calculator refuses it and the demonstrator gives up
GIVE_UP = "I cannot work that out in my head."


def rounded_down(answer: str) -> str:
    """The demonstrator's habit: 253412 -> 250000 (two figures, rounded down)."""
    return answer[:2] + "0" * (len(answer) - 2)


def tool_problems(n: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """"What is 347*862?" for n distinct pairs of factors in FACTORS not in `exclude`: the tiny model knows
    single-digit sums only, so it answers these through the calculator or not at all."""
    rng, seen, problems = random.Random(seed), set(exclude), []
    while len(problems) < n:
        a, b = rng.randint(*FACTORS), rng.randint(*FACTORS)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        problems.append({"question": f"What is {a}*{b}?", "answer": str(a * b), "pair": (a, b)})
    return problems


def tool_trace_rows(problems: list[dict], seed: int) -> list[dict]:
    """SFT rows in TRL's tool-calling format, prompt and completion: the question; one calculator call, its
    result and the answer (the tool turn is in the completion, as TRL's GRPOTrainer builds it, so SFT and RL train
    the same token sequence). The demonstrator is imperfect, as real traces are, in two ways that exact match scores
    0 and that SFT imitates, so that only the reward can teach the model better:
    - when the calculator's result is below ROUNDS_BELOW it answers with the result rounded down to two figures
      (rounded_down) in ROUNDS_SHARE of its traces. The habit is decided at the answer's third digit, right after
      the two digits that tell whether the result is small. A give-up before the call, decided by the question's
      first factor, was not imitated at all by one of two SFT runs on the validation split, and an "About ..."
      prefix made the model guess the result's first digit from the question instead of copying it;
    - when the first factor is MISWRITES_FROM or more it writes the call with "x" for "*" in MISWRITES_SHARE of its
      traces (decided right after the factor is copied into the call): the calculator refuses it, the trace carries
      the error as TRL hands it to the model, and the demonstrator gives up. These are the tool failures that RL
      can bring down."""
    rounding, miswriting, rows = random.Random(seed), random.Random(seed + 1000), []
    for p in problems:
        answer = p["answer"]
        if int(answer) < ROUNDS_BELOW and rounding.random() < ROUNDS_SHARE:
            answer = rounded_down(answer)
        expression, result = "{}*{}".format(*p["pair"]), p["answer"]
        if p["pair"][0] >= MISWRITES_FROM and miswriting.random() < MISWRITES_SHARE:
            expression, answer = "{}x{}".format(*p["pair"]), GIVE_UP
            result = calculator_refusal(expression)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
        rows.append({"prompt": chat(p["question"]),
                     "completion": [{"role": "assistant", "tool_calls": [call]},
                                    {"role": "tool", "name": "calculator", "content": result},
                                    {"role": "assistant", "content": answer}],
                     "tools": [CALCULATOR_SCHEMA]})
    return rows


def calculator_refusal(expression: str) -> str:
    """The tool turn TRL builds when the kit's guarded calculator refuses a call it cannot read, as the model reads it
    in GRPO (tests/test_tool_recipe.py checks it against the calculator's own words, as for CALCULATOR_SCHEMA)."""
    message = f"calculator: cannot read {expression!r} as arithmetic (use + - * / ** and parentheses)"
    return str({"error": message})


def tool_prompt_rows(problems: list[dict]) -> list[dict]:
    return [{"prompt": chat(p["question"]), "answer": p["answer"]} for p in problems]


def tool_files() -> dict[str, list[dict]]:
    """tiny-tools' data: held-out and validation questions first, then SFT traces and GRPO prompts on pairs that
    neither of them has (the validation split chose the recipe's settings; the held-out one only reports). 4,000
    distinct traces, each seen 4 times in SFT's 500 steps of 32: with 300 seen 21 times each (two-digit factors),
    the tiny model memorized them instead of learning to copy the numbers into the call."""
    held_out = tool_problems(100, seed=21)
    validation = tool_problems(100, seed=22, exclude={p["pair"] for p in held_out})
    unseen = {p["pair"] for p in held_out + validation}
    train = tool_problems(4400, seed=23, exclude=unseen)
    return {"tool_traces.jsonl": tool_trace_rows(train[:4000], seed=24),
            "tool_prompts.jsonl": tool_prompt_rows(train[4000:]), "tool_validation.jsonl": tool_prompt_rows(validation),
            "tool_eval.jsonl": tool_prompt_rows(held_out)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_all(out_dir: Path) -> list[Path]:
    train, held_out = split_pairs()
    files = {
        "arithmetic_sft.jsonl": sft_rows(word_problems(train, 800, seed=1)),
        "arithmetic_eval.jsonl": sft_rows(word_problems(held_out, 100, seed=2)),
        "arithmetic_prompts.jsonl": prompt_rows(word_problems(train, 400, seed=3)),
        "arithmetic_prefs.jsonl": preference_rows(word_problems(train, 1600, seed=4), seed=5),
    }
    smol_train, smol_eval = harder_problems(2200, 100)  # the first 1,200 as before: the same stream, longer
    files["word_problems_train.jsonl"] = smol_train[:1200]  # plain strings: question, answer (recipes add chat: true)
    files["word_problems_prompts.jsonl"] = smol_train[1200:]  # for RL: training pairs, drawn after SFT's rows
    files["word_problems_eval.jsonl"] = smol_eval
    files["word_problems_validation.jsonl"] = harder_validation(100, smol_eval)
    files.update(tool_files())
    for name, rows in files.items():
        write_jsonl(out_dir / name, rows)
    return [out_dir / name for name in files]


def main(argv: list[str] | None = None) -> None:
    """`python -m kitcli.synthetic [DIR]`: write the datasets into DIR and print their paths."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kitcli.synthetic",
                                     description="Write the kit's synthetic datasets (JSONL) and print their paths.")
    parser.add_argument("dir", nargs="?", type=Path, default=EXAMPLES, metavar="DIR",
                        help="where to write them (default: the checkout's examples/data/)")
    for path in write_all(parser.parse_args(argv).dir):
        print(path)


if __name__ == "__main__":
    main()
