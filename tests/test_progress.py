"""Progress output: a rich bar on a terminal, plain escape-free lines elsewhere, every log in metrics.jsonl."""

from __future__ import annotations

import io
import json

from rich.console import Console
from transformers import TrainerControl, TrainerState, TrainingArguments

from kitcli.training.progress import make_progress_callback


def drive(console: Console, tmp_path):
    callback = make_progress_callback("sft", tmp_path / "metrics.jsonl", console)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    state, control = TrainerState(), TrainerControl()
    state.max_steps = 4
    callback.on_train_begin(args, state, control)
    for step in range(1, 5):
        state.global_step, state.epoch = step, step / 4
        callback.on_step_end(args, state, control)
        callback.on_log(args, state, control, logs={"loss": 2.0 / step, "learning_rate": 1e-3})
    callback.on_train_end(args, state, control)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_plain_lines_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    rows = drive(Console(file=out, force_terminal=False, width=200), tmp_path)
    text = out.getvalue()
    assert "\x1b[" not in text
    assert text.splitlines()[0].startswith("[sft] step 1/4  loss 2  learning_rate 0.001")
    assert len(text.splitlines()) == 4
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] == 0.5


def test_progress_bar_on_a_terminal(tmp_path):
    out = io.StringIO()
    drive(Console(file=out, force_terminal=True, width=150), tmp_path)
    text = out.getvalue()
    assert "\x1b[" in text  # rich rendering
    assert "4/4" in text and "loss 0.5" in text
    assert "[sft] step" not in text  # no duplicate plain lines
