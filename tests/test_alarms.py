"""Alarms on synthetic metric streams: each fires on its failure, stays quiet on a healthy run, and shows up in
the dashboard, the plain log and alarms.jsonl."""

from __future__ import annotations

import io
import json
import math
import random

import pytest
from rich.console import Console

from kitcli.display.alarms import AlarmMonitor
from kitcli.display.dashboard import StageDashboard
from kitcli.recipe import stage_types


def healthy_grpo(steps: int = 40, seed: int = 0):
    """Reward rising with noise, some zero-std groups, small KL, lengths that move, loss near zero."""
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        reward = min(1.0, 0.2 + 0.015 * step + rng.uniform(-0.05, 0.05))
        yield step, {"loss": rng.uniform(-0.05, 0.05), "grad_norm": rng.uniform(0.1, 2.0), "reward": reward,
                     "reward_std": rng.uniform(0.1, 0.4), "frac_reward_zero_std": (0.0, 0.5, 1.0, 0.25)[step % 4],
                     "kl": 0.001 * step + rng.uniform(0, 0.002), "completions/mean_length": rng.uniform(3, 12),
                     "completions/clipped_ratio": rng.uniform(0.0, 0.3), "entropy": rng.uniform(0.5, 1.5)}


def raised(stream, stage_type="grpo"):
    monitor = AlarmMonitor(stage_types.spec(stage_type))
    codes = []
    for step, logs in stream:
        codes += [(a.code, a.step) for a in monitor.update(step, logs)]
    return codes, monitor


def with_changes(change, start: int, steps: int = 40):
    """The healthy stream with `change(step, logs)` applied from `start` on."""
    for step, logs in healthy_grpo(steps):
        if step >= start:
            change(step, logs)
        yield step, logs


def test_quiet_on_healthy_streams():
    for seed in range(5):
        assert raised(healthy_grpo(60, seed))[0] == []
    sft = ((s, {"loss": 3.0 * 0.97 ** s + 0.01 * math.sin(s), "grad_norm": 1.0, "mean_token_accuracy": 0.5})
           for s in range(1, 80))
    assert raised(sft, "sft")[0] == []
    dpo = ((s, {"loss": 0.69 - 0.005 * s, "rewards/margins": 0.01 * s, "rewards/accuracies": 0.5})
           for s in range(1, 60))
    assert raised(dpo, "dpo")[0] == []
    # eval logs and the final summary are not training steps
    assert raised([(10, {"eval_loss": float("nan")}), (10, {"train_runtime": 3.0, "train_loss": 1e9})], "sft")[0] == []


def set_(key, value):
    return lambda step, logs: logs.__setitem__(key, value(step) if callable(value) else value)


@pytest.mark.parametrize("code, change, start", [
    ("reward_constant", set_("reward", 0.0), 20),
    ("zero_std_groups", set_("frac_reward_zero_std", 1.0), 20),
    ("kl_growing", set_("kl", lambda step: 0.05 * 2 ** (step - 19)), 20),
    ("length_collapsed", set_("completions/mean_length", 1.0), 20),
    ("length_pinned", set_("completions/clipped_ratio", 1.0), 20),
    ("loss_nan", set_("loss", float("nan")), 20),
    ("loss_nan", set_("grad_norm", float("inf")), 20),
    ("loss_exploding", set_("loss", lambda step: 10.0 * 2 ** (step - 18)), 20),
])
def test_each_alarm_fires_once_on_its_failure(code, change, start):
    codes, monitor = raised(with_changes(change, start))
    assert [c for c, _ in codes] == [code], codes  # only this alarm, raised once while the condition holds
    assert codes[0][1] >= start
    assert code in monitor.active


def test_alarm_clears_and_fires_again():
    def broken(step, logs):
        if 10 <= step < 15 or step >= 30:
            logs["frac_reward_zero_std"] = 1.0
        else:
            logs["frac_reward_zero_std"] = 0.0

    codes, monitor = raised(with_changes(broken, 1))
    assert codes == [("zero_std_groups", 12), ("zero_std_groups", 32)]


def test_ppo_names_are_checked():
    stream = [(s, {"objective/scores": 0.5, "objective/kl": 0.01, "loss/policy": 0.1}) for s in range(1, 12)]
    assert [c for c, _ in raised(stream, "ppo")[0]] == ["reward_constant"]


def test_alarm_in_plain_log_dashboard_and_file(tmp_path):
    out = io.StringIO()
    board = StageDashboard("grpo", tmp_path / "metrics.jsonl", Console(file=out, force_terminal=False, width=200),
                           spec=stage_types.spec("grpo"), index=2, total=3, mode="auto")
    board.begin(8)
    for step in range(1, 9):
        board.log(step, {"reward": 0.5, "frac_reward_zero_std": 1.0, "kl": 0.0})
    board.end(8)
    lines = out.getvalue().splitlines()
    alarms = [line for line in lines if "ALARM" in line]
    assert len(alarms) == 1 and alarms[0].startswith("[grpo] ALARM step 3 zero_std_groups: every group had zero")
    assert len(lines) == 8 + 1  # one line per logging step, plus the alarm
    saved = [json.loads(line) for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert [(a["code"], a["step"], a["stage"]) for a in saved] == [("zero_std_groups", 3, "grpo")]

    recorded = Console(file=io.StringIO(), force_terminal=True, width=140, record=True)
    live = StageDashboard("grpo", tmp_path / "live.jsonl", recorded, spec=stage_types.spec("grpo"), index=2, total=3,
                          mode="auto")
    live.begin(8)
    for step in range(1, 9):
        live.log(step, {"reward": 0.5, "frac_reward_zero_std": 1.0})
    live.end(8)
    text = recorded.export_text()
    assert "alarm [grpo] step 3 zero_std_groups" in text  # printed above the panel, stays in the scrollback
    assert "! zero_std_groups (step 3)" in text  # and listed in the panel while active


# --- reward hacking on a code_exec stage ----------------------------------------------------------------------

def code_stream(reward, passed, steps: int = 30, touches=lambda step: 0.0):
    """The healthy stream with code_exec's reward, its test pass share and its judge-touching share."""
    for step, logs in healthy_grpo(steps):
        logs.update({"rewards/code_exec/mean": reward(step), "code_exec/tests_passed": passed(step),
                     "code_exec/judge_touches": touches(step)})
        yield step, logs


def test_reward_unbacked_when_the_code_reward_outruns_the_tests():
    codes, monitor = raised(code_stream(lambda s: min(0.9, 0.1 + 0.04 * s), lambda s: 0.1))
    assert [c for c, _ in codes] == ["reward_unbacked"], codes
    assert "rose by" in monitor.active["reward_unbacked"].message and "code_exec/tests_passed" in \
        monitor.active["reward_unbacked"].message
    # the same rise, backed by the tests passed: quiet
    assert raised(code_stream(lambda s: min(0.9, 0.1 + 0.04 * s), lambda s: min(0.9, 0.1 + 0.04 * s)))[0] == []


def test_reward_unbacked_by_the_held_out_score():
    def run(held_out_after: float):
        monitor = AlarmMonitor(stage_types.spec("ppo"))
        monitor.update(0, {"eval/score": 0.2, "eval/rewards/code_exec/mean": 0.2})  # before training
        for step, logs in code_stream(lambda s: min(0.9, 0.1 + 0.04 * s), lambda s: min(0.9, 0.1 + 0.04 * s)):
            monitor.update(step, logs)
        return monitor.update(30, {"eval/score": held_out_after, "eval/rewards/code_exec/mean": held_out_after})

    alarms = run(0.22)
    assert [a.code for a in alarms] == ["reward_unbacked"] and "held-out" in alarms[0].message
    assert run(0.7) == []


def test_judge_touched_names_the_share_and_a_sample():
    monitor = AlarmMonitor(stage_types.spec("grpo"))
    honest = {"completion": "```python\ndef add(a, b):\n    return a + b\n```", "rewards": {"code_exec": 1.0}}
    hack = {"completion": "```python\nimport sys\nsys._getframe(1).f_globals['exec'] = print\n```",
            "rewards": {"code_exec": 0.0}}
    logs = {"reward": 0.5, "rewards/code_exec/mean": 0.5, "code_exec/judge_touches": 0.0}
    assert monitor.update(1, logs, [honest]) == []
    alarms = monitor.update(2, {**logs, "code_exec/judge_touches": 0.25}, [honest, hack])
    assert [a.code for a in alarms] == ["judge_touched"]
    message = alarms[0].message
    assert "25% of completions" in message and "_getframe, f_globals" in message
    assert "sample: import sys sys._getframe(1).f_globals" in message
    assert monitor.update(3, logs, [honest]) == [] and "judge_touched" not in monitor.active  # cleared
    # from the logged share alone, when no shown sample touches the judge
    assert "see completions.jsonl" in monitor.update(4, {**logs, "code_exec/judge_touches": 0.1}, [honest])[0].message
    # a stage without code_exec is not read for it
    assert AlarmMonitor(stage_types.spec("grpo")).update(1, {"reward": 0.5}, [hack]) == []


def test_the_dashboard_raises_the_hacking_alarm_with_its_sample(tmp_path):
    out = io.StringIO()
    board = StageDashboard("grpo", tmp_path / "metrics.jsonl", Console(file=out, force_terminal=False, width=400),
                           spec=stage_types.spec("grpo"), index=1, total=1, mode="auto")
    board.begin(2)
    sample = {"prompt": "Write add(a, b).", "completion": "import builtins\nbuiltins.abs = lambda x: 0",
              "rewards": {"code_exec": 0.0}}
    board.log(1, {"reward": 0.0, "rewards/code_exec/mean": 0.0}, samples=[sample])
    board.end(1)
    alarm = [line for line in out.getvalue().splitlines() if "ALARM" in line]
    assert len(alarm) == 1 and "judge_touched" in alarm[0] and "builtins.abs = lambda x: 0" in alarm[0]
    saved = [json.loads(line) for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert [a["code"] for a in saved] == ["judge_touched"]


def test_a_reward_that_scores_nothing_is_named_with_why():
    """TRL's contract lets a reward return None ("no score"); one that scores no sample for 3 logs in a row (every
    score None, or every call skipped under on_error: skip) is named, with the share or the error, and clears once
    it scores again."""
    def none_then_back(step, logs):
        logs["rewards/accuracy/mean"] = None if 20 <= step < 30 else 0.5
        logs["reward_unscored/accuracy"] = 1.0 if 20 <= step < 30 else 0.25  # partly None is no alarm

    codes, monitor = raised(with_changes(none_then_back, 1))
    assert codes == [("reward_unscored/accuracy", 22)]
    assert "reward_unscored/accuracy" not in monitor.active  # cleared at step 30
    assert "returned None (no score) for 100% of its samples" in monitor.raised[0].message

    def skipped(step, logs):
        logs["reward_unscored/parse"] = 1.0
        logs["reward_error/parse"] = "KeyError: 'answer'"

    codes, monitor = raised(with_changes(skipped, 5))
    assert codes == [("reward_unscored/parse", 7)]
    assert "reward 'parse' scored no sample for 3 logging steps" in monitor.raised[0].message
    assert "on_error: skip" in monitor.raised[0].message and "KeyError: 'answer'" in monitor.raised[0].message


def test_length_pinned_names_the_stage_s_own_length_reward_instead_of_suggesting_one():
    def pinned(step, logs):
        logs["completions/clipped_ratio"] = 1.0
        logs["rewards/soft_overlong_punishment_reward/mean"] = -0.9

    _, monitor = raised(with_changes(pinned, 10))
    message = monitor.raised[0].message
    assert "'soft_overlong_punishment_reward' reward did not stop it" in message
    assert "add an overlong_penalty" not in message
    _, bare = raised(with_changes(set_("completions/clipped_ratio", 1.0), 10))
    assert "add an overlong_penalty / format reward" in bare.raised[0].message
