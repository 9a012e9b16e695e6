"""Training progress: a rich progress bar on a terminal, plain lines elsewhere, and `metrics.jsonl`.

The callback replaces transformers' own printer/tqdm callbacks so metrics are shown once, in one format.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

# Metrics worth a place on the progress line, in this order, when a stage logs them.
HEADLINE = ("loss", "mean_token_accuracy", "reward", "reward_std", "rewards/accuracies", "rewards/margins",
            "accuracy", "kl", "learning_rate")


def format_value(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or (1e-3 <= abs(value) < 1e4):
            return f"{value:.4g}"
        return f"{value:.2e}"
    return str(value)


def headline(logs: dict[str, Any]) -> str:
    shown = [(k, logs[k]) for k in HEADLINE if k in logs]
    return "  ".join(f"{k.split('/')[-1] if k.startswith('rewards/') else k} {format_value(v)}" for k, v in shown)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the resumed run rewrites from its checkpoint
    return rows


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume from checkpoint N, drop lines logged after step N (they will be logged again)."""
    kept = [row for row in read_metrics(path) if row.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(row) + "\n" for row in kept))


def make_progress_callback(stage_name: str, metrics_path: Path, console: Console, label: str = ""):
    from transformers import TrainerCallback

    class KitProgress(TrainerCallback):
        """Shows progress and appends every logged metrics dict (with step and time) to metrics.jsonl."""

        def __init__(self) -> None:
            self.progress = None
            self.task = None
            self.started = time.time()
            self.last_line = ""

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.time()
            self.first_step = state.global_step
            if console.is_terminal:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

                self.progress = Progress(
                    TextColumn(f"[bold]{label or stage_name}[/]"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
                    console=console, transient=False,
                )
                self.progress.start()
                self.task = self.progress.add_task(stage_name, total=state.max_steps, completed=state.global_step,
                                                   metrics="")

        def on_step_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.update(self.task, completed=state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:  # under `kit run --launcher`, the main process writes metrics
                return
            logs = dict(logs or {})
            row = {"step": state.global_step, "epoch": round(state.epoch or 0.0, 4), "time": round(time.time(), 3),
                   **{k: v for k, v in logs.items() if isinstance(v, (int, float, str, bool)) or v is None}}
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")
            text = headline(logs)
            if self.progress is not None:
                self.progress.update(self.task, completed=state.global_step, metrics=text)
                return
            if not text:
                return
            done = state.global_step - self.first_step
            elapsed = time.time() - self.started
            remaining = (state.max_steps - state.global_step) * elapsed / done if done > 0 else math.nan
            eta = f"{remaining:.0f}s" if math.isfinite(remaining) else "?"
            console.print(f"[{stage_name}] step {state.global_step}/{state.max_steps}  {text}  eta {eta}",
                          highlight=False, markup=False, soft_wrap=True)

        def on_train_end(self, args, state, control, **kwargs):
            if self.progress is not None:
                self.progress.update(self.task, completed=state.global_step)
                self.progress.stop()
                self.progress = None

    return KitProgress()


def attach_progress(trainer, stage_name: str, metrics_path: Path, console: Console) -> None:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(make_progress_callback(stage_name, metrics_path, console))
