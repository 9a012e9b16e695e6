"""Rewards during training: a reward that raises, returns the wrong length, a non-number or a score outside its
declared range stops the run with an error naming the reward, the sample index and the value; `on_error: skip`
scores the first kinds None and counts them; the seconds spent in each reward go into the metrics. Every built-in
declares its range, plugins declare theirs, `kit rewards test` shows it and flags the rows outside it."""

from __future__ import annotations

import math
import sys
import time

import pytest

from kitcli.errors import KitError
from rewards.guard import RewardStats, check_score, guard_reward, guard_rewards
from rewards.registry import LoadedReward

PROMPTS = ["a", "b", "c", "d"]
COMPLETIONS = ["ok", "ok", "boom", "ok"]


def raises_on_boom(prompts, completions, **kwargs):
    if "boom" in completions:
        raise ZeroDivisionError("division by zero")
    return [1.0] * len(completions)


def ones(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def guarded(fn, name="my_reward", on_error="raise", stats=None):
    stats = stats if stats is not None else RewardStats()
    return guard_reward(LoadedReward(fn=fn, name=name, on_error=on_error), stats), stats


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.5, 0.5), (-2, -2.0), (None, None), (True, 1.0),
                                             (False, 0.0)])
def test_check_score_accepts_numbers_and_none(value, expected):
    assert check_score(value) == expected


@pytest.mark.parametrize("value", ["1.0", [1.0], float("nan"), float("inf"), object()])
def test_check_score_rejects_the_rest(value):
    with pytest.raises(ValueError):
        check_score(value)


def test_a_raising_reward_names_reward_sample_and_value():
    reward, _ = guarded(raises_on_boom)
    with pytest.raises(KitError) as error:
        reward(PROMPTS, COMPLETIONS)
    message = error.value.format_message()
    assert "reward 'my_reward' raised ZeroDivisionError: division by zero on sample 2 (completion 'boom')" in message
    assert "on_error: skip" in message


@pytest.mark.parametrize("values, words", [
    ([1.0, 1.0], "returned 2 scores for 4 completions"),
    (None, "returned None for 4 completions"),
    (1.0, "returned 1.0 for 4 completions"),
    ("1111", "returned '1111' for 4 completions"),
])
def test_wrong_length_names_the_reward(values, words):
    reward, _ = guarded(lambda prompts, completions, **kw: values)
    with pytest.raises(KitError, match="reward 'my_reward' " + words):
        reward(PROMPTS, COMPLETIONS)


@pytest.mark.parametrize("bad, shown", [("0.5", "'0.5' is not a number"), (math.nan, "nan is not a finite number"),
                                        ({"score": 1}, r"\{'score': 1\} is not a number"),
                                        ([1], r"\[1\] is not a number")])
def test_a_non_number_names_reward_sample_and_value(bad, shown):
    reward, _ = guarded(lambda prompts, completions, **kw: [1.0, bad, 0.0, 1.0])
    with pytest.raises(KitError, match=f"reward 'my_reward' returned {shown} for sample 1"):
        reward(PROMPTS, COMPLETIONS)


def test_ints_bools_and_none_are_scores_as_trl_takes_them():
    """TRL's contract: a float, an int, a bool (summed as 1.0 / 0.0) or None ("no score"), which the guard passes on
    and counts as unscored."""
    reward, stats = guarded(lambda prompts, completions, **kw: [True, 2, None, False])
    assert reward(PROMPTS, COMPLETIONS) == [1.0, 2.0, None, 0.0]
    assert all(type(score) is float for score in reward(PROMPTS, COMPLETIONS) if score is not None)
    metrics = stats.pop_metrics()
    assert metrics["reward_unscored/my_reward"] == 0.25  # 2 of 8 samples over the two calls
    assert "reward_skipped/my_reward" not in metrics and "reward_error/my_reward" not in metrics


def test_skip_scores_only_the_failing_samples_none_and_counts_them():
    reward, stats = guarded(raises_on_boom, on_error="skip")
    assert reward(PROMPTS, COMPLETIONS) == [1.0, 1.0, None, 1.0]
    reward_nan, _ = guarded(lambda prompts, completions, **kw: [1.0, math.nan, "x", 0.0], name="nan_reward",
                            on_error="skip", stats=stats)
    assert reward_nan(PROMPTS, COMPLETIONS) == [1.0, None, None, 0.0]
    short, _ = guarded(lambda prompts, completions, **kw: [1.0, 1.0], name="short_reward", on_error="skip",
                       stats=stats)
    assert short(PROMPTS, COMPLETIONS) == [None, None, None, None]
    metrics = stats.pop_metrics()
    assert metrics["reward_skipped/my_reward"] == 1
    assert metrics["reward_skipped/nan_reward"] == 2
    assert metrics["reward_skipped/short_reward"] == 4
    assert metrics["reward_unscored/my_reward"] == 0.25 and metrics["reward_unscored/short_reward"] == 1.0
    assert metrics["reward_error/my_reward"] == "ZeroDivisionError: division by zero"  # raises_on_boom's error
    assert metrics["reward_error/short_reward"] == "ValueError: returned [1.0, 1.0] for one completion"
    assert stats.pop_metrics() == {}  # popped: the next logging step starts from zero


def test_columns_are_sliced_per_sample_when_scoring_one_by_one():
    def needs_answer(prompts, completions, answer, trainer_state=None, **kwargs):
        assert len(answer) == len(completions)
        assert trainer_state == "state"  # passed through as it is, not sliced
        if "boom" in completions:
            raise ValueError("bad")
        return [float(c == a) for c, a in zip(completions, answer)]

    reward, _ = guarded(needs_answer, on_error="skip")
    assert reward(PROMPTS, COMPLETIONS, answer=["ok", "no", "x", "ok"], trainer_state="state") == [1.0, 0.0, None, 1.0]


def test_time_spent_per_reward_goes_into_the_metrics():
    def slow(prompts, completions, **kwargs):
        time.sleep(0.05)
        return [0.0] * len(completions)

    stats = RewardStats()
    first, second = guard_rewards([LoadedReward(fn=slow, name="slow"),
                                   LoadedReward(fn=ones, name="fast")], stats)
    first(PROMPTS, COMPLETIONS)
    second(PROMPTS, COMPLETIONS)
    metrics = stats.pop_metrics()
    assert metrics["reward_seconds/slow"] >= 0.05
    assert 0 <= metrics["reward_seconds/fast"] < 0.05
    both = metrics["reward_seconds/slow"] + metrics["reward_seconds/fast"]
    assert metrics["reward_seconds/total"] == pytest.approx(both, abs=1e-3)


def test_the_wrapper_keeps_the_name_trl_logs_by():
    reward, _ = guarded(raises_on_boom, name="format_think_answer")
    assert reward.__name__ == "format_think_answer"


def test_two_rewards_with_one_name_are_refused():
    with pytest.raises(KitError, match="both named 'same'"):
        guard_rewards([LoadedReward(fn=raises_on_boom, name="same"), LoadedReward(fn=raises_on_boom, name="same")],
                      RewardStats())


def test_errors_pass_through_the_cli_as_one_line(tmp_path):
    from helpers import run_cli

    data = tmp_path / "samples.jsonl"
    data.write_text('{"completion": "a"}\n{"completion": "boom"}\n')
    module = tmp_path / "bad.py"
    module.write_text("def explodes(prompts, completions, **kw):\n"
                      "    return [1 / 0 if c == 'boom' else 1.0 for c in completions]\n")
    result = run_cli("rewards", "test", f"{module}:explodes", "--data", data, expect=2)
    assert "reward 'explodes' raised ZeroDivisionError" in result.output and "on sample 1" in result.output
    assert "Traceback" not in result.output


# --- declared score ranges ------------------------------------------------------------------------------------

def over_one(prompts, completions, **kwargs):
    return [0.5, 1.5, 0.0, 1.0][: len(completions)]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_score_outside_the_declared_range_stops_the_run(on_error):
    """Even with on_error: skip: a reward that breaks its promise cannot be trusted on any sample."""
    reward = guard_reward(LoadedReward(fn=over_one, name="my_reward", on_error=on_error, score_range=(0.0, 1.0)),
                          RewardStats())
    with pytest.raises(KitError, match=r"reward 'my_reward' returned 1.5 for sample 1, outside its declared "
                                       r"range \[0, 1\]; fix the function or its score_range"):
        reward(PROMPTS, COMPLETIONS)
    # the one-by-one path a skip takes after the batch raised is checked too
    def raises_then_over(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch")
        return [2.0]

    skip = guard_reward(LoadedReward(fn=raises_then_over, name="later", on_error="skip", score_range=(0.0, 1.0)),
                        RewardStats())
    with pytest.raises(KitError, match=r"reward 'later' returned 2.0 for sample 0, outside"):
        skip(PROMPTS, COMPLETIONS)
    inside = guard_reward(LoadedReward(fn=over_one, name="wide", score_range=(-1.0, 1.5)), RewardStats())
    assert inside(PROMPTS, COMPLETIONS) == [0.5, 1.5, 0.0, 1.0]  # the bounds themselves are inside


BUILTIN_ARGS = {"length_penalty": {"max_length": 8, "max_penalty": -2.0}, "overlong_penalty": {"max_length": 8,
                "cache": 4}, "repetition_penalty": {"ngram": 1, "max_penalty": -0.5},
                "reward_model": {"path": "model"}, "numeric_closeness": {"scale": 0.5}}
BUILTIN_RANGES = {"exact_match": (0, 1), "math_equal": (0, 1), "numeric_closeness": (0, 1), "format": (0, 1),
                  "tag_credit": (0, 1), "length_penalty": (-2, 0), "overlong_penalty": (-1, 0),
                  "repetition_penalty": (-0.5, 0), "code_exec": (0, 1), "reward_model": (-math.inf, math.inf)}


def test_every_builtin_declares_its_range_and_keeps_to_it(tmp_path):
    from rewards.registry import BUILTIN_DISTRIBUTION, entry_points, load_reward

    names = [n for n, ep in entry_points().items() if getattr(ep.dist, "name", None) == BUILTIN_DISTRIBUTION]
    (tmp_path / "model").mkdir()  # reward_model loads its model on first use; its range is declared before
    assert set(names) == set(BUILTIN_RANGES)
    completions = ["<think>2+2</think><answer>4</answer>", "4 4 4 4 4 4 4 4 4 4 4", "", "\\boxed{5}",
                   "```python\ndef f(x):\n    return x\n```", "<answer>-3</answer> word " * 3]
    columns = {"answer": ["4", "4", "4", "5", "1", "-3"],
               "tests": [["assert f(1) == 1"], ["assert f(1) == 1"], [], None, ["assert f(2) == 2",
                                                                              "assert f(3) == 4"], "assert f(0) == 0"]}
    for name in names:
        reward = load_reward({"name": name, "args": BUILTIN_ARGS.get(name, {})}, tmp_path)
        assert reward.score_range == BUILTIN_RANGES[name], name
        if name != "reward_model":  # a model to load; its range is every number
            scores = guard_reward(reward, RewardStats())(["q"] * len(completions), completions, **columns)
            assert any(s is not None for s in scores), name


PLUGIN = """
from rewards.registry import reward_factory, score_range

@score_range(0, 1)
def by_decorator(prompts, completions, **kwargs):
    return [min(len(c) / 4, 2.0) for c in completions]

def by_attribute(prompts, completions, **kwargs):
    return [-0.5] * len(completions)
by_attribute.score_range = (-1, 1)

@score_range(0, 10)
@reward_factory
def made(scale: float = 1.0):
    def made_reward(prompts, completions, **kwargs):
        return [scale] * len(completions)
    return made_reward

def undeclared(prompts, completions, **kwargs):
    return [1e9] * len(completions)

def broken(prompts, completions, **kwargs):
    return [0.0] * len(completions)
broken.score_range = (1, 0)

@score_range(0, 1)
def past_one_later(prompts, completions, trainer_state=None, **kwargs):
    return [1.5 if trainer_state.global_step >= 1 else 0.5] + [0.5] * (len(completions) - 1)
"""


def test_a_plugin_declares_its_range_by_decorator_or_attribute(tmp_path):
    from rewards.registry import load_reward

    (tmp_path / "plugin.py").write_text(PLUGIN)
    ranges = {name: load_reward({"name": f"plugin.py:{name}"}, tmp_path).score_range
              for name in ("by_decorator", "by_attribute", "made", "undeclared")}
    assert ranges == {"by_decorator": (0.0, 1.0), "by_attribute": (-1.0, 1.0), "made": (0.0, 10.0),
                      "undeclared": None}
    with pytest.raises(KitError, match=r"reward 'broken' declares score_range \(1, 0\); it must be \(low, high\)"):
        load_reward({"name": "plugin.py:broken"}, tmp_path)


def test_kit_rewards_test_shows_the_range_and_flags_violations(tmp_path):
    from helpers import run_cli

    (tmp_path / "plugin.py").write_text(PLUGIN)
    data = tmp_path / "samples.jsonl"
    data.write_text("".join(f'{{"completion": "{"x" * n}"}}\n' for n in (1, 4, 6, 9)))
    result = run_cli("rewards", "test", f"{tmp_path / 'plugin.py'}:by_decorator", "--data", data, expect=2)
    lines = result.output.strip().splitlines()
    assert "scores in [0, 1]" in result.output
    flagged = [line for line in lines if "(outside!)" in line]
    assert len(flagged) == 2 and "1.5" in flagged[0] and "2" in flagged[1], result.output
    assert lines[-1] == ("Error: kit rewards test: reward 'by_decorator' scored outside its declared range [0, 1] "
                         "on rows 2, 3; fix the function or its score_range")
    fine = run_cli("rewards", "test", f"{tmp_path / 'plugin.py'}:by_attribute", "--data", data)
    assert "scores in [-1, 1]" in fine.output and "(outside!)" not in fine.output
    assert "no declared range" in run_cli("rewards", "test", f"{tmp_path / 'plugin.py'}:undeclared", "--data",
                                          data).output


BAD_OUTPUTS = """
import math
def strings(prompts, completions, **kwargs):
    return ["high"] * len(completions)
def not_finite(prompts, completions, **kwargs):
    return [0.0, math.inf, 0.0][: len(completions)]
def nan(prompts, completions, **kwargs):
    return [math.nan] * len(completions)
def short(prompts, completions, **kwargs):
    return [0.0]
def raises(prompts, completions, **kwargs):
    return [1 / len(c) for c in completions]
"""


@pytest.mark.parametrize("name, words", [
    ("strings", "reward 'strings' returned 'high' is not a number for sample 0"),
    ("not_finite", "reward 'not_finite' returned inf is not a finite number for sample 1"),
    ("nan", "reward 'nan' returned nan is not a finite number for sample 0"),
    ("short", "reward 'short' returned 1 scores for 3 completions"),
    ("raises", "reward 'raises' raised ZeroDivisionError: division by zero on sample 2 (completion '')"),
])
def test_bad_scores_are_one_line_naming_the_function(tmp_path, name, words):
    from helpers import run_cli

    (tmp_path / "bad.py").write_text(BAD_OUTPUTS)
    data = tmp_path / "samples.jsonl"
    data.write_text('{"completion": "a"}\n{"completion": "bb"}\n{"completion": ""}\n')
    result = run_cli("rewards", "test", f"{tmp_path / 'bad.py'}:{name}", "--data", data, expect=2)
    assert result.output.strip().splitlines() == [f"Error: {words}" + result.output.split(words, 1)[1].strip()]
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_stage_stops_on_a_score_outside_the_range_and_can_resume(tmp_path):
    """The second step's score breaks the range: exit 2, one line, no DONE; with the reward fixed, the same command
    resumes from the first step's checkpoint and finishes."""
    from helpers import DATA, done, run_cli, write_recipe

    (tmp_path / "plugin.py").write_text(PLUGIN)
    stage = {"name": "grpo", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
             "rewards": ["plugin.py:past_one_later"],
             "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                       "max_completion_length": 12, "logging_steps": 1, "save_steps": 1}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    result = run_cli("run", recipe, "--output", tmp_path / "run", expect=2)
    line = result.output.strip().splitlines()[-1]
    assert "stage 'grpo'" in line and "reward 'past_one_later' returned 1.5 for sample 0, outside its declared " \
        "range [0, 1]" in line, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "grpo" / "DONE").exists()
    (tmp_path / "plugin.py").write_text(PLUGIN.replace("1.5 if", "0.75 if"))
    for name in [n for n in sys.modules if n.startswith("kit_reward_file_")]:
        del sys.modules[name]  # read the fixed file, as the next `kit run` process would
    run_cli("run", recipe, "--output", tmp_path / "run")
    assert done(tmp_path / "run" / "grpo")["resumed_from"] == "checkpoint-1"
