"""Rewards during training: a reward that raises, returns the wrong length or a non-number stops the run with an
error naming the reward, the sample index and the value; `on_error: skip` scores those samples None and counts
them; the seconds spent in each reward go into the metrics."""

from __future__ import annotations

import math
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


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.5, 0.5), (-2, -2.0), (None, None)])
def test_check_score_accepts_numbers_and_none(value, expected):
    assert check_score(value) == expected


@pytest.mark.parametrize("value", ["1.0", True, [1.0], float("nan"), float("inf"), object()])
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
                                        (True, "True is not a number"), ([1], r"\[1\] is not a number")])
def test_a_non_number_names_reward_sample_and_value(bad, shown):
    reward, _ = guarded(lambda prompts, completions, **kw: [1.0, bad, 0.0, 1.0])
    with pytest.raises(KitError, match=f"reward 'my_reward' returned {shown} for sample 1"):
        reward(PROMPTS, COMPLETIONS)


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
