"""Rewards as people write them (tests/published_rewards.py: the notebook and open-r1 shapes, None, ints and bools;
and TRL 1.15's own `trl.rewards`, used from the installed package), taken as they are through `kit rewards test`,
`kit check` and a short real GRPO run on the tiny model: each scores what a direct call returns, factories are
named with and without `args:`, and a reward that scores nothing (None for every sample) is logged as "no score",
raises an alarm and a warning in DONE and the report instead of crashing the stage after it has trained."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import published_rewards as published
import pytest
from helpers import SMALL_LORA, TINY_MODEL, done, metrics, run_cli, write_recipe

HERE = Path(__file__).resolve().parent
GOOD = "<think>\nseven and four\n</think>\n<answer>\n11\n</answer>"
# Completions written to vary every reward below: right and wrong answers, with and without the tags, repeated words.
COMPLETIONS = [GOOD, "<think>\nhm\n</think>\n<answer>\n12\n</answer>", "11", "<answer>11</answer>",
               "the the the the the", "", "<think>x</think> <answer>eleven</answer>", "11 apples"]
ANSWERS = ["11", "11", "11", "11", "11", "11", "n/a", "n/a"]
SOLUTIONS = ["$11$", "$11$", "$11$", "$11$", "$11$", "$11$", "no number here", "no number here"]

# name in a recipe -> (the direct call's reward, the name TRL logs it by)
FROM_FILE = {
    "correctness_reward_func": published.correctness_reward_func,
    "int_reward_func": published.int_reward_func,
    "soft_format_reward_func": published.soft_format_reward_func,
    "xmlcount_reward_func": published.xmlcount_reward_func,
    "tag_count_reward": published.tag_count_reward,
    "starts_with_digit": published.starts_with_digit,
    "answer_length": published.answer_length,
    "numeric_answers_only": published.numeric_answers_only,
    "never_scores": published.never_scores,
}


def as_messages(texts: list[str]) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def direct(fn, completions: list[str], answers: list[str], solutions: list[str]) -> list[float | None]:
    """A reward called as TRL calls it, its scores as TRL sums them (bools and ints as floats)."""
    prompts = [[{"role": "user", "content": "Ada has 7 apples and gets 4 more. How many?"}]] * len(completions)
    scores = fn(prompts=prompts, completions=as_messages(completions), answer=answers, solution=solutions,
                completion_ids=[[1] * max(1, len(c)) for c in completions], trainer_state=None)
    return [None if s is None else float(s) for s in scores]


@pytest.fixture
def samples(tmp_path) -> Path:
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": "Ada has 7 apples and gets 4 more."}],
                                        "completion": [{"role": "assistant", "content": c}], "answer": a,
                                        "solution": s, "completion_ids": [1] * max(1, len(c))}) + "\n"
                            for c, a, s in zip(COMPLETIONS, ANSWERS, SOLUTIONS)))
    shutil.copy(HERE / "published_rewards.py", tmp_path / "published_rewards.py")
    return path


def scores_in_table(output: str, count: int) -> list[float | None]:
    """The scores column of `kit rewards test`'s table (the last cell of each numbered row)."""
    scores = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].isdigit():
            scores.append(None if cells[-1] in ("None", "-", "n/a") else float(cells[-1].split()[0]))
    assert len(scores) == count, output
    return scores


def trl_reward(name: str, **args):
    """One of TRL's `trl.rewards`, from the installed package: the function, or what its factory makes of `args`."""
    import trl.rewards

    target = getattr(trl.rewards, name)
    return target(**args) if name.startswith("get_") else target


@pytest.mark.parametrize("reward, args, make", [
    *[(f"published_rewards.py:{name}", [], lambda fn=fn: fn) for name, fn in FROM_FILE.items()],
    ("published_rewards.py:get_repetition_penalty_reward", ["ngram_size=2", "max_penalty=-1.0"],
     lambda: published.get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)),
    ("published_rewards.py:get_cosine_scaled_reward", [], lambda: published.get_cosine_scaled_reward()),
    ("trl.rewards:think_format_reward", [], lambda: trl_reward("think_format_reward")),
    ("trl.rewards:accuracy_reward", [], lambda: trl_reward("accuracy_reward")),
    ("trl.rewards:get_soft_overlong_punishment", ["max_completion_len=20", "soft_punish_cache=10"],
     lambda: trl_reward("get_soft_overlong_punishment", max_completion_len=20, soft_punish_cache=10)),
    ("trl.rewards:get_repetition_penalty_reward", [], lambda: trl_reward("get_repetition_penalty_reward")),
], ids=lambda v: v if isinstance(v, str) else "")
def test_kit_rewards_test_scores_what_a_direct_call_returns(reward, args, make, samples, monkeypatch):
    monkeypatch.chdir(samples.parent)
    published.PRINTED_TIMES = 0
    result = run_cli("rewards", "test", reward, "--data", samples, *[x for a in args for x in ("--arg", a)])
    expected = direct(make(), COMPLETIONS, ANSWERS, SOLUTIONS)
    assert len(set(expected)) > 1 or reward.endswith("never_scores"), f"{reward}: the samples do not vary it"
    got = scores_in_table(result.output, len(COMPLETIONS))
    assert got == pytest.approx(expected, abs=5e-4), (reward, result.output)


@pytest.mark.parametrize("spec, words", [
    ({"name": "trl.rewards:get_soft_overlong_punishment"},
     "is a factory, get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int)"),
    ({"name": "trl.rewards:think_format_reward", "args": {"x": 1}},
     "is a reward function, think_format_reward(completions"),
    ({"name": "trl.rewards:get_soft_overlong_punishment", "args": {"max_len": 4}},
     "has no argument 'max_len'; did you mean 'max_completion_len'?"),
    ({"name": "published_rewards.py:get_repetition_penalty_reward", "args": {"ngram_size": 2, "max_penalty": 1}},
     "reward 'published_rewards.py:get_repetition_penalty_reward' rejected its args {'ngram_size': 2, "
     "'max_penalty': 1}: max_penalty 1 should not be positive"),
    ({"name": "published_rewards.py:extract_xml_answer", "args": {"text": "x"}},
     "returned str 'x', not a reward function"),
    ({"name": "trl.rewards:think_format_rewardz"}, "did you mean 'think_format_reward'?"),
    ({"name": "published_rewards.py:correctness_reward_fun"}, "did you mean 'correctness_reward_func'?"),
])
def test_bad_rewards_are_one_line_before_any_model_loads(spec, words, tmp_path):
    """kit check and --dry-run resolve every reward (modules imported, factories called) and refuse what does not
    resolve in one line naming the stage and the reward, exit 2."""
    shutil.copy(HERE / "published_rewards.py", tmp_path / "published_rewards.py")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}) + "\n")
    stage = {"name": "grpo", "type": "grpo", "data": str(prompts), "rewards": [spec],
             "train": {"max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    for command in (("check", recipe), ("run", recipe, "--dry-run")):
        result = run_cli(*command, expect=2)
        line = result.output.strip().splitlines()[-1]
        assert line.startswith("Error: ") and "stage 'grpo'" in line and words in line, (command, result.output)
        assert "Traceback" not in result.output


def test_two_rewards_of_one_name_are_refused_until_one_is_renamed(tmp_path):
    """TRL's and open-r1's factories both make a `repetition_penalty_reward`: refused before anything loads, naming
    both sources; `name_as:` renames one."""
    shutil.copy(HERE / "published_rewards.py", tmp_path / "published_rewards.py")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}) + "\n")
    both = [{"name": "published_rewards.py:get_repetition_penalty_reward", "args": {"ngram_size": 2,
                                                                                  "max_penalty": -1.0}},
            "trl.rewards:get_repetition_penalty_reward"]
    stage = {"name": "grpo", "type": "grpo", "data": str(prompts), "rewards": both,
             "train": {"max_steps": 1, "per_device_train_batch_size": 2, "num_generations": 2}}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]), expect=2)
    line = result.output.strip().splitlines()[-1]
    assert "stage 'grpo'" in line and "published_rewards.py:get_repetition_penalty_reward" in line
    assert "trl.rewards:get_repetition_penalty_reward" in line and "name_as:" in line
    stage["rewards"][1] = {"name": "trl.rewards:get_repetition_penalty_reward", "name_as": "trl_repetition"}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]), "--json")
    found = [f for f in json.loads(result.output)["findings"] if f["topic"] == "rewards"]
    assert found[0]["figures"] == "repetition_penalty_reward, trl_repetition"


# --- a real GRPO run with all of them --------------------------------------------------------------------------

RUN_REWARDS = [*(f"published_rewards.py:{name}" for name in FROM_FILE),
               {"name": "published_rewards.py:get_repetition_penalty_reward", "args": {"ngram_size": 2,
                                                                                     "max_penalty": -1.0}},
               "published_rewards.py:get_cosine_scaled_reward",
               "trl.rewards:think_format_reward",
               {"name": "trl.rewards:get_soft_overlong_punishment", "args": {"max_completion_len": 6,
                                                                             "soft_punish_cache": 2}},
               {"name": "trl.rewards:get_repetition_penalty_reward", "name_as": "trl_repetition"},
               "trl.rewards:accuracy_reward"]
LOGGED_NAMES = [*FROM_FILE, "repetition_penalty_reward", "cosine_scaled_reward", "think_format_reward",
                "soft_overlong_punishment_reward", "trl_repetition", "accuracy_reward"]
TEXT_REWARDS = {**FROM_FILE, "repetition_penalty_reward": published.get_repetition_penalty_reward(2, -1.0),
                "cosine_scaled_reward": published.get_cosine_scaled_reward()}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, tiny_model_dir) -> tuple[Path, str, list[dict]]:
    root = tmp_path_factory.mktemp("published")
    shutil.copy(HERE / "published_rewards.py", root / "published_rewards.py")
    rows = [{"prompt": [{"role": "user", "content": f"Ada has {a} apples and gets {b} more. How many?"}],
             "answer": str(a + b) if i % 2 else "about a dozen", "solution": f"${a + b}$" if i % 2 else "n/a"}
            for i, (a, b) in enumerate((a, b) for a in range(1, 5) for b in range(1, 5))]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = {"name": "grpo", "type": "grpo", "data": str(root / "prompts.jsonl"), "rewards": RUN_REWARDS,
             "train": {"max_steps": 4, "per_device_train_batch_size": 8, "num_generations": 4,
                       "max_completion_length": 6, "logging_steps": 1, "save_steps": 2, "temperature": 1.0}}
    recipe = write_recipe(root / "r.yaml", [stage], model=TINY_MODEL, lora=SMALL_LORA)
    checked = run_cli("check", recipe)
    result = run_cli("run", recipe, "--output", root / "run")
    return root / "run", checked.output + result.output, rows


@pytest.mark.slow
def test_a_grpo_run_with_published_rewards_trains_and_scores_each_as_a_direct_call(grpo_run):
    run_dir, output, rows = grpo_run
    summary = done(run_dir / "grpo")
    assert summary["steps"] == 4
    for name in LOGGED_NAMES:  # every reward logged under its name, with a figure or "no score" (None)
        assert f"rewards/{name}/mean_first" in summary, name
    assert summary["rewards/never_scores/mean_first"] is None
    assert isinstance(summary["rewards/starts_with_digit/mean_first"], float)
    answers = {r["prompt"][0]["content"]: r["answer"] for r in rows}
    logged = [json.loads(line) for line in (run_dir / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(logged) >= 8
    for sample in logged:  # the scores the run logged are what a direct call gives the same completion
        answer = answers[sample["prompt"]]
        for name, fn in TEXT_REWARDS.items():
            published.PRINTED_TIMES = 1  # not printing
            expected = direct(fn, [sample["completion"]], [answer], ["n/a"])[0]
            got = sample["rewards"][name]
            assert (got is None and expected is None) or got == pytest.approx(expected, abs=1e-6), (name, sample)
    # numeric_answers_only scores the rows with a numeric answer only: its mean is over those
    means = [row["rewards/numeric_answers_only/mean"] for row in metrics(run_dir / "grpo")
             if "rewards/numeric_answers_only/mean" in row]
    assert all(m is None or 0.0 <= m <= 1.0 for m in means)
    assert "correctness_reward_func" in output and "Question:" in output  # its prints reach the console


@pytest.mark.slow
def test_a_reward_that_never_scores_is_an_alarm_and_a_warning_not_a_crash(grpo_run):
    run_dir, output, _ = grpo_run
    assert "internal error" not in output and "Traceback" not in output
    assert "ALARM step 3 reward_unscored/never_scores: reward 'never_scores' scored no sample for 3 logging steps" \
        in " ".join(output.split())
    warnings = done(run_dir / "grpo")["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("reward 'never_scores' scored no sample in the whole stage")
    assert "returned None (no score) for every sample" in warnings[0]
    assert "**warning**: reward 'never_scores' scored no sample" in (run_dir / "report.md").read_text()
    shares = [row["reward_unscored/never_scores"] for row in metrics(run_dir / "grpo") if "step" in row
              and "reward_unscored/never_scores" in row]
    assert shares == [1.0] * 4
    assert all(row.get("rewards/never_scores/mean") is None for row in metrics(run_dir / "grpo")
               if "rewards/never_scores/mean" in row)
    assert not math.isnan(done(run_dir / "grpo")["reward_first"])


@pytest.mark.slow
def test_kit_check_resolves_every_published_reward(grpo_run):
    """kit check (before the run) resolved all 15: each under the name TRL logs it by, with where it came from."""
    run_dir, _, _ = grpo_run
    result = run_cli("check", run_dir.parent / "r.yaml", "--json")
    found = [f for f in json.loads(result.output)["findings"] if f["topic"] == "rewards"]
    assert len(found) == 1 and found[0]["figures"].split(", ") == LOGGED_NAMES
    assert "soft_overlong_punishment_reward from trl.rewards:get_soft_overlong_punishment" in found[0]["verdict"]


def test_a_gsm8k_answer_column_read_as_is_is_named_when_every_score_is_0(tmp_path, monkeypatch):
    """GSM8K's `answer` is the worked solution, "... #### 72": a reward comparing a final answer with it as is
    scores 0 everywhere; `kit rewards test` says why and how to extract the answer, not only "always 0"."""
    rows = [{"completion": str(n), "answer": f"She sold {n} / 2 = {n // 2} clips.\n#### {n}"} for n in (72, 10, 5)]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    flat = " ".join(run_cli("rewards", "test", "exact_match", "--data", "gsm.jsonl").output.split())
    assert "constant over the 3 samples (always 0)" in flat
    assert "column 'answer' holds a worked solution with the answer after '####'" in flat
    assert "answer.split('####')[-1].strip()" in flat
    rows = [{**r, "answer": r["answer"].split("####")[-1].strip()} for r in rows]  # extracted: it scores
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flat = " ".join(run_cli("rewards", "test", "exact_match", "--data", "gsm.jsonl").output.split())
    assert "always 1" in flat and "worked solution" not in flat
