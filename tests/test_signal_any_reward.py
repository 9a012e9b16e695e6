"""`kit check --signal` with rewards that declare no score range (TRL's, open-r1's, most users'): on a stage without
`filter:` everything that needs no pass rate is measured (zero-variance groups, each reward's mean and spread, a
constant reward and a never-scoring one named, truncation) and the pass rate is said to be not defined; a stage whose
rewards declare a range keeps its pass rate; a constant reward next to a GSM8K-style `answer` column ("... #### 42")
is told that the column holds a worked solution. Real code path: the tiny base model sampled on the CPU."""

from __future__ import annotations

import json

import pytest
from helpers import DATA, run_cli, write_recipe

REWARDS = '''
def text(completion):
    return completion[-1]["content"] if isinstance(completion, list) else completion


def always_one(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def never(prompts, completions, **kwargs):
    return [None] * len(completions)


def varied(prompts, completions, **kwargs):
    return [float(len(text(c))) for c in completions]
'''

GRPO = {"name": "grpo", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
        "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                  "max_completion_length": 8, "save_steps": 50}}


def check_signal(tmp_path, stage: dict, prompts: int = 4) -> tuple[dict, dict[str, dict], str]:
    """`kit check --signal` run twice as a user runs it: the JSON report (figures, findings by topic) and the text."""
    path = write_recipe(tmp_path / "r.yaml", [stage])
    report = json.loads(run_cli("check", path, "--signal", prompts, "--json").output.strip().splitlines()[-1])
    text = run_cli("check", path, "--signal", prompts).output
    return report["signal"][stage["name"]], {f["topic"]: f for f in report["findings"] if f["stage"] == "grpo"}, text


@pytest.mark.slow
def test_rewards_without_a_range_are_measured_without_a_pass_rate(tmp_path):
    (tmp_path / "mine.py").write_text(REWARDS)
    stage = {**GRPO, "rewards": ["mine.py:always_one", "mine.py:never", "mine.py:varied"]}
    figures, found, text = check_signal(tmp_path, stage)
    assert figures["prompts"] == 4 and figures["k"] == 4
    assert figures["pass_rate_mean"] is None and figures["pass_rate_histogram"] is None and figures["pass"] is None
    assert figures["constant_rewards"] == ["always_one"] and figures["never_scored_rewards"] == ["never"]
    assert figures["rewards"]["never"]["unscored"] == 1.0 and figures["rewards"]["varied"]["std"] > 0
    lengths = figures["rewards"]["varied"]
    assert lengths["min"] < lengths["mean"] < lengths["max"]
    assert 0 <= figures["zero_variance_share"] <= 1 and figures["unscored_share"] == 0  # always_one scores each

    signal = found["reward signal"]["figures"]
    assert signal.startswith("4 prompts x 4: zero-variance groups ") and "pass rate" not in signal, signal
    assert found["pass rate"]["verdict"].startswith("not defined: 'always_one', 'never', 'varied' declare no finite "
                                                    "score range"), found["pass rate"]
    assert found["reward always_one"]["level"] == "warn" and "constant (1 for every sample" in \
        found["reward always_one"]["verdict"]
    assert found["reward never"]["level"] == "warn"
    assert found["reward never"]["figures"] == "never scored: None for 16 of 16 samples, 100% not scored"
    assert found["reward varied"]["level"] == "ok"
    # the text a user reads: the warnings name both rewards; the pass rate is said once, never given a number
    assert "warning: warn: grpo: reward always_one: constant (1 for every sample it scored)" in text, text
    assert "warning: warn: grpo: reward never: it returned None (no score) for every sample" in text, text
    assert "(never scored: None for 16 of 16 samples, 100% not scored)" in text, text
    assert "zero-variance groups" in text and "pass rate" in text and "pass rate 0" not in text, text


@pytest.mark.slow
def test_a_reward_with_a_range_keeps_its_pass_rate(tmp_path):
    figures, found, _ = check_signal(tmp_path, {**GRPO, "rewards": ["exact_match"]}, prompts=2)
    assert figures["pass"] == "weighted total >= 1 (every reward at its best)"
    assert figures["pass_rate_mean"] is not None and sum(figures["pass_rate_histogram"]) == 2
    assert ", pass rate " in found["reward signal"]["figures"] and "pass rate" not in found


@pytest.mark.slow
def test_a_constant_reward_beside_a_worked_solution_column_is_told_why(tmp_path):
    """GSM8K's `answer` is the worked solution then '#### 42': exact_match against it as is never matches."""
    rows = [{"prompt": f"What is {a} * {b}?", "answer": f"so {a} * {b} = {a * b} #### {a * b}"}
            for a, b in ((6, 7), (3, 4))]
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "mine.py").write_text(REWARDS)
    stage = {**GRPO, "data": str(tmp_path / "gsm.jsonl"), "rewards": ["exact_match", "mine.py:always_one"]}
    _, found, _ = check_signal(tmp_path, stage, prompts=2)
    verdict = found["reward exact_match"]["verdict"]
    assert verdict.startswith("constant (0 for every sample it scored): it adds no signal"), verdict
    assert ("column 'answer' holds a worked solution with the answer after '####' (e.g. 'so 6 * 7 = 42 #### 42'), "
            "and the reward compares against it as is") in verdict, verdict
    assert "holding only the part after '####' ('42')" in verdict
    assert "####" not in found["reward always_one"]["verdict"]  # constant at 1: not a mismatch
    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps({**row, "answer": "42"}) + "\n" for row in rows))
    _, found, _ = check_signal(tmp_path, stage, prompts=2)
    assert "####" not in found["reward exact_match"]["verdict"], found["reward exact_match"]



def test_none_scores_are_left_out_as_trl_leaves_them_out(tmp_path):
    """A completion no reward scored has no total (TRL: NaN, out of its group's mean and spread): a group with fewer
    than two scored totals has no advantage; means are over the scored samples; nothing scored reads "no score"."""
    from kitcli.run.signal_check import figures_text
    from kitcli.training.signal import pass_rule, score_groups, summarize, why_no_signal
    from rewards.registry import load_rewards

    (tmp_path / "mine.py").write_text(REWARDS + '''

def some(prompts, completions, **kwargs):
    return [None if text(c).startswith("x") else float(len(text(c))) for c in completions]
''')
    rewards = load_rewards(["mine.py:never", "mine.py:some"], tmp_path)
    assert pass_rule(rewards, None, "grpo", required=False) is None
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    samples = [[("xx", [1, 2], False), ("abc", [1, 2, 3], False), ("abcde", [1], False)],  # one scored: no advantage
               [("x", [1], True), ("ab", [1, 2], True), ("abcd", [1, 2], False)]]
    groups = score_groups(rewards, None, rows, samples)
    assert [g.totals for g in groups] == [[None, 3.0, 5.0], [None, 2.0, 4.0]] and groups[0].passed is None
    assert not groups[0].zero_variance
    figures = summarize(groups)
    assert figures["reward_mean"] == 3.5 and figures["unscored_share"] == 2 / 6 and figures["pass_rate_mean"] is None
    assert figures["rewards"]["some"]["mean"] == 3.5 and figures["rewards"]["some"]["unscored"] == 2 / 6
    assert figures["never_scored_rewards"] == ["never"] and figures["constant_rewards"] == []
    assert ", unscored 33%" in figures_text(figures) and "pass rate" not in figures_text(figures)

    lone = score_groups(rewards, None, rows[:1], [[("xx", [1], False), ("x", [1], False), ("abc", [1], False)]])
    assert lone[0].zero_variance  # a single scored completion: its advantage is 0, as in TRL
    nothing = summarize(score_groups(rewards, None, rows[:1], [[("x", [1], False), ("xy", [1], False)]]))
    assert nothing["reward_mean"] is None and nothing["within_group_std"] is None
    assert "reward no score, unscored 100%" in figures_text(nothing)
    assert "fewer than two completions scored by any reward" in why_no_signal(nothing)
