"""Seconds per 1,000 scored completions for each built-in reward, on this machine.

    python bench/rewards.py                 # every built-in; code_exec on 200 completions, scaled
    python bench/rewards.py --code 1000     # code_exec on the full 1,000

Completions are arithmetic answers in the shape a GRPO run produces (tags, plain numbers, LaTeX, empty ones);
the reward model is the tiny model with a fresh one-output head (its speed, not its quality, is measured).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path


def completions(count: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    rng = random.Random(seed)
    prompts, texts, answers = [], [], []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        guess = a + b if rng.random() < 0.6 else a + b + rng.choice([-1, 1])
        shape = rng.choice([
            f"<think>{a} + {b} = {guess}</think>\n<answer>{guess}</answer>",
            f"{guess}",
            f"The answer is \\boxed{{{guess}}}",
            f"<think>adding {a} and {b} {'again ' * rng.randint(0, 20)}</think> <answer>{guess}</answer>",
            "",
        ])
        prompts.append(f"Ada has {a} apples and gets {b} more. How many apples does Ada have?")
        texts.append(shape)
        answers.append(str(a + b))
    return prompts, texts, answers


def code_completions(count: int, seed: int = 0) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(seed)
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    texts = [good if rng.random() < 0.7 else wrong for _ in range(count)]
    return texts, [["assert add(2, 3) == 5", "assert add(0, 0) == 0"]] * count


def reward_model_dir(root: Path) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kitcli.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(seed=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny), num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(root / "merged"))
    tokenizer.save_pretrained(str(root / "merged"))
    return root / "merged"


def timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=int, default=200, help="completions to run through code_exec")
    options = parser.parse_args()

    from rewards.builtin import (
        code_exec,
        exact_match,
        format,
        length_penalty,
        math_equal,
        overlong_penalty,
        repetition_penalty,
        reward_model,
        tag_credit,
    )

    prompts, texts, answers = completions(1000)
    ids = [[1] * len(t) for t in texts]
    math_equal(prompts[:2], texts[:2], answer=answers[:2])  # import math-verify and sympy outside the timing
    rows = []
    for name, fn, extra in [
        ("exact_match", exact_match, {"answer": answers}),
        ("math_equal", math_equal, {"answer": answers}),
        ("format (soft)", format(), {}),
        ("format (strict)", format(strict=True), {}),
        ("tag_credit", tag_credit(), {}),
        ("length_penalty", length_penalty(max_length=64), {"completion_ids": ids}),
        ("overlong_penalty", overlong_penalty(max_length=64, cache=16), {"completion_ids": ids}),
        ("repetition_penalty", repetition_penalty(), {}),
    ]:
        rows.append((name, timed(fn, prompts, texts, **extra), 1000))
    with tempfile.TemporaryDirectory() as root:
        scorer = reward_model(path=reward_model_dir(Path(root)), batch_size=16)
        scorer(prompts[:2], texts[:2])  # load the model outside the timing
        rows.append(("reward_model (tiny, batch 16)", timed(scorer, prompts, texts), 1000))
    code_texts, tests = code_completions(options.code)
    for workers in (1, 2):
        rows.append((f"code_exec ({workers} worker{'s' if workers > 1 else ''})",
                     timed(code_exec(time_limit=5, workers=workers), ["q"] * options.code, code_texts, tests=tests),
                     options.code))
    print(f"{'reward':32} {'s / 1,000':>10}  measured on")
    for name, seconds, count in rows:
        print(f"{name:32} {seconds * 1000 / count:10.3f}  {count} completions")


if __name__ == "__main__":
    main()
