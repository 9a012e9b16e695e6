"""The dashboard: each stage type's metrics with trends in a recorded rich console, recent RL completions, plain
lines without escape codes off a terminal, JSON lines with --json, and `kit run --quiet / --json` end to end."""

from __future__ import annotations

import io
import json
from collections import defaultdict, deque
from types import SimpleNamespace

import pytest
from helpers import DATA, run_cli, write_recipe
from rich.console import Console

from kitcli.display.dashboard import StageDashboard, trend_line
from kitcli.recipe import stage_types
from kitcli.training.progress import make_progress_callback, samples_from_trainer

STREAMS = {
    "sft": ({"loss": 2.5, "mean_token_accuracy": 0.41, "learning_rate": 1e-3, "grad_norm": 1.0},
            ["loss", "token_acc", "lr"]),
    "reward": ({"loss": 0.62, "accuracy": 0.71, "margin": 0.93, "learning_rate": 1e-4},
               ["loss", "accuracy", "margin"]),
    "dpo": ({"loss": 0.64, "rewards/margins": 0.21, "rewards/accuracies": 0.77, "rewards/chosen": 0.1,
             "rewards/rejected": -0.11, "logps/chosen": -12.0}, ["loss", "margin", "accuracy", "chosen", "rejected"]),
    "grpo": ({"reward": 0.63, "reward_std": 0.31, "rewards/exact_match/mean": 0.5, "rewards/format/mean": 0.13,
              "frac_reward_zero_std": 0.25, "kl": 0.012, "clip_ratio/region_mean": 0.02,
              "completions/mean_length": 3.5, "entropy": 0.77, "loss": 0.01},
             ["reward", "exact_match", "format", "reward_std", "zero_std_frac", "kl", "clip_ratio", "length",
              "entropy"]),
    "ppo": ({"objective/scores": 0.4, "objective/kl": 0.03, "objective/non_score_reward": -0.01, "loss/policy": 0.02,
             "loss/value": 0.3, "policy/entropy": 1.1, "policy/clipfrac": 0.05, "policy/approxkl": 0.001,
             "val/explained_variance": 0.2, "rewards/exact_match/mean": 0.4},
            ["score", "kl", "non_score", "pg_loss", "vf_loss", "entropy", "clipfrac", "approxkl", "explained_var",
             "exact_match"]),
    "custom": ({"my_metric": 1.25, "other": 3.0, "note": "text"}, ["my_metric", "other"]),
}
SAMPLES = [{"prompt": "Ada has 3 apples and gets 5 more. How many?", "completion": "8", "reward": 1.0,
            "rewards": {"exact_match": 1.0}},
           {"prompt": "Ben has 0 books and gets 2 more. How many?", "completion": "[3]", "reward": 0.0,
            "rewards": {"exact_match": 0.0}}]


def drive(board: StageDashboard, logs: dict, steps: int = 5, samples=None) -> None:
    board.begin(steps)
    for step in range(1, steps + 1):
        board.advance(step)
        row = {k: (v * (1 + 0.1 * step) if isinstance(v, float) else v) for k, v in logs.items()}
        board.log(step, row, samples=samples)
    board.end(steps)


@pytest.mark.parametrize("stage_type", list(STREAMS))
def test_dashboard_shows_each_stage_types_metrics(tmp_path, stage_type):
    logs, labels = STREAMS[stage_type]
    console = Console(file=io.StringIO(), force_terminal=True, width=160, record=True)
    board = StageDashboard("train-" + stage_type, tmp_path / "metrics.jsonl", console,
                           spec=None if stage_type == "custom" else stage_types.spec(stage_type), index=2, total=4)
    rl = stage_type in ("grpo", "ppo")
    drive(board, logs, samples=SAMPLES if rl else None)
    text = console.export_text()
    final = text[text.rindex("stage 2/4"):]  # the last frame of the live panel
    assert f"train-{stage_type}" in final and "5/5" in final and "eta" in final and "step/s" in final
    for label in labels:
        assert f"{label} " in final, (label, final)
    last = {k: v * 1.5 for k, v in logs.items() if isinstance(v, float)}
    first_key, first_label = next((k, lbl) for k, lbl in zip(logs, labels) if k in last)
    assert f"{first_label} {last[first_key]:.4g}" in final  # the latest value
    assert any(c in final for c in "▁▂▃▄▅▆▇█")  # trend lines
    if stage_type == "sft":
        assert "grad_norm" not in final  # only the metrics that matter for the stage
    if stage_type == "custom":
        assert "note" not in final  # numeric metrics only
    if rl:
        assert "recent completions" in final and "Ada has 3 apples" in final and "[3]" in final
    else:
        assert "recent completions" not in final


def test_trend_line():
    assert trend_line([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert trend_line([2.0, 2.0, 2.0]) == "▅▅▅"
    assert len(trend_line(list(range(100)))) == 24
    assert trend_line([]) == ""


def test_plain_lines_without_escape_codes(tmp_path):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=300)
    logs, labels = STREAMS["grpo"]
    drive(StageDashboard("grpo", tmp_path / "metrics.jsonl", console, spec=stage_types.spec("grpo"), index=3, total=4),
          logs,
          steps=6, samples=SAMPLES)
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 6  # one per logging step: no bar, no panel, no samples
    assert lines[0].startswith("[grpo] step 1/6  reward 0.693  exact_match 0.55  format 0.143")
    assert all(f" {label} " in lines[-1] for label in labels) and "step/s" in lines[-1] and "eta" in lines[-1]
    assert "{" not in text  # never a raw metrics dict


def test_json_lines(tmp_path):
    stream = io.StringIO()
    console_out = io.StringIO()
    board = StageDashboard("sft", tmp_path / "metrics.jsonl", Console(file=console_out), spec=stage_types.spec("sft"),
                           index=1,
                           total=2, mode="json", json_stream=stream)
    drive(board, STREAMS["sft"][0], steps=4)
    board.log(4, {"train_runtime": 1.5, "train_loss": 2.0})
    objects = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [o["event"] for o in objects] == ["log"] * 4 + ["stage_end"]
    assert objects[0]["stage"] == "sft" and objects[0]["stage_index"] == 1 and objects[0]["stages"] == 2
    assert objects[-2]["step"] == 4 and objects[-2]["metrics"]["loss"] == pytest.approx(2.5 * 1.4)
    assert console_out.getvalue() == ""
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5


def test_samples_from_a_grpo_trainer(tmp_path):
    logs = {"prompt": deque([[{"role": "user", "content": f"question {i}"}] for i in range(6)]),
            "completion": deque([[{"role": "assistant", "content": f"answer {i}"}] for i in range(6)]),
            "rewards": defaultdict(deque, {"exact_match": deque([0, 1, 0, 1, 0, 1.0]),
                                           "format": deque([1.0] * 6)})}
    import torch

    trainer = SimpleNamespace(_logs=logs, reward_weights=torch.tensor([1.0, 0.5]))
    samples = samples_from_trainer(trainer)
    assert [s["completion"] for s in samples] == ["answer 3", "answer 4", "answer 5"]
    assert samples[-1] == {"prompt": "question 5", "completion": "answer 5",
                           "rewards": {"exact_match": 1.0, "format": 1.0}, "reward": 1.5}
    assert samples_from_trainer(SimpleNamespace()) == []

    # the callback reads them at each log and keeps them in completions.jsonl
    from transformers import TrainerControl, TrainerState, TrainingArguments

    console = Console(file=io.StringIO(), force_terminal=True, width=150, record=True)
    callback = make_progress_callback("grpo", tmp_path / "metrics.jsonl", console, trainer=trainer,
                                      spec=stage_types.spec("grpo"))
    args, state, control = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), \
        TrainerState(), TrainerControl()
    state.max_steps, state.global_step = 2, 1
    callback.on_train_begin(args, state, control)
    callback.on_log(args, state, control, logs={"reward": 0.5, "rewards/exact_match/mean": 0.5})
    callback.on_train_end(args, state, control)
    assert "answer 5" in console.export_text()
    saved = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [s["completion"] for s in saved] == ["answer 3", "answer 4", "answer 5"] and saved[0]["step"] == 1


def tiny_sft_recipe(path):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 4, "learning_rate": 2e-3, "per_device_train_batch_size": 8, "logging_steps": 2,
                       "save_steps": 100}}
    return write_recipe(path, [stage])


@pytest.mark.slow
def test_kit_run_json_and_quiet(in_tmp, tiny_model_dir):
    recipe = tiny_sft_recipe(in_tmp / "sft.yaml")
    result = run_cli("run", recipe, "--output", in_tmp / "run", "--json")
    objects = [json.loads(line) for line in result.stdout.splitlines()]  # stdout: JSON objects only
    assert [o["event"] for o in objects] == ["log", "log", "stage_end", "summary"]
    assert objects[0]["stage"] == "sft" and objects[0]["step"] == 2 and "loss" in objects[0]["metrics"]
    assert objects[-1]["run_dir"] == str(in_tmp / "run") and objects[-1]["stages"][0]["status"] == "ran"
    assert objects[-1]["report"] == str(in_tmp / "run" / "report.md")

    quiet = run_cli("run", recipe, "--output", in_tmp / "run", "--quiet", "--force")
    assert quiet.stdout.strip() == f"done: {in_tmp / 'run'}"
    assert "[sft] step" not in quiet.output

    both = run_cli("run", recipe, "--quiet", "--json", expect=2)
    assert "--quiet and --json exclude each other" in both.output


@pytest.mark.slow
def test_grpo_stage_shows_rewards_and_keeps_recent_completions(in_tmp, tiny_model_dir):
    stage = {"name": "grpo", "type": "grpo", "data": {"path": str(DATA / "arithmetic_prompts.jsonl"), "limit": 16},
             "rewards": ["exact_match"],
             "train": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                       "max_completion_length": 4, "learning_rate": 1e-4, "logging_steps": 1, "save_steps": 100}}
    result = run_cli("run", write_recipe(in_tmp / "grpo.yaml", [stage]), "--output", in_tmp / "run")
    lines = [line for line in result.output.splitlines() if line.startswith("[grpo] step")]
    assert len(lines) == 2 and "\x1b" not in result.output
    for label in ("reward", "exact_match", "reward_std", "zero_std_frac", "kl", "length", "entropy"):
        assert f"  {label} " in lines[-1], (label, lines[-1])
    saved = [json.loads(line) for line in (in_tmp / "run" / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saved] == [1, 1, 1, 2, 2, 2]
    assert all(set(s) >= {"prompt", "completion", "rewards", "reward"} and "exact_match" in s["rewards"]
               for s in saved)
    assert "How many" in saved[0]["prompt"]
    report = (in_tmp / "run" / "report.md").read_text()
    assert "Recent completions (step 2):" in report and (in_tmp / "run" / "plots" / "grpo.svg").exists()


def test_five_long_named_rewards_leave_the_completion_60_characters(tmp_path):
    names = ["exact_match_numeric", "format_think_answer", "ends_with_answer_tag", "length_penalty_overlong",
             "reasoning_steps_counted"]
    completion = ("<think>Ada starts with 3 apples and is given 5 more, so 3 + 5 = 8 apples in all.</think> "
                  "<answer>8</answer>")
    samples = [{"prompt": "Ada has 3 apples and gets 5 more. How many apples does Ada have?", "completion": completion,
                "rewards": {name: 0.5 * i for i, name in enumerate(names)}, "reward": 5.0}]
    console = Console(file=io.StringIO(), force_terminal=True, width=160, record=True)
    drive(StageDashboard("grpo", tmp_path / "metrics.jsonl", console, spec=stage_types.spec("grpo"), index=1, total=1),
          STREAMS["grpo"][0], steps=2, samples=samples)
    text = console.export_text()
    table = text[text.rindex("recent completions"):]
    shown = next(n for n in range(len(completion), 0, -1) if completion[:n] in table)  # characters of it shown
    assert shown >= 60, table
    for name in names:  # every reward still named with its score
        assert name in table, table
    assert "reasoning_steps_counted 2" in table and "length_penalty_overlong 1.5" in table
