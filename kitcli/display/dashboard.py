"""Training progress as a user sees it: a live dashboard on a terminal, plain lines elsewhere, JSON lines with
`--json`, and `metrics.jsonl` / `alarms.jsonl` / `completions.jsonl` in the stage directory.

On a terminal (rich) each stage shows: stage i of N and its name, a progress bar with ETA and steps/s, the latest
value and a trend line of the metrics that matter for its type (its StageSpec's `metrics`; any numeric metric for
a type it does not know), for RL stages a few recent completions with their rewards, and the alarms of
`kitcli/display/alarms.py`. Not on a terminal (CI, logs, `| tee`): one plain line per logging step, no escape codes.
`--quiet`: nothing but alarms (on stderr). `--json`: one JSON object per logging step on stdout.

A stage with its own loop (PPO) drives a `StageDashboard` directly: `begin(max_steps, start)`, `advance(step)`,
`log(step, row, samples=...)`, `end(step)`; TRL trainers get one through kitcli/training/progress.py's callback.
The runner says which stage of how many is running (`stage_display`), the CLI chooses the mode (`output_mode`):
kitcli/display/output.py.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from kitcli.display.alarms import AlarmMonitor
from kitcli.display.conversation import turns_line
from kitcli.display.formatting import clip, format_value, message_text
from kitcli.display.output import DISPLAY, json_safe
from kitcli.rundir import StageDir

# Never worth a place on screen (bookkeeping, or shown another way).
NOT_SHOWN = {"epoch", "step", "total_flos", "num_tokens", "train_runtime", "train_samples_per_second",
             "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "time"}
TREND = "▁▂▃▄▅▆▇█"
TREND_POINTS = 24
SAMPLES_SHOWN = 3
REWARD_CELL = 32  # the sample table's reward column at its widest
COMPLETION_SHOWN = 60  # characters of a completion the sample table keeps when the console has room


# --- formatting ---------------------------------------------------------------------------------------------

def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def stage_metrics(spec) -> tuple[tuple[str, str], ...] | None:
    """(logged key, label) pairs a stage type (its StageSpec) shows; None for none (every number is shown)."""
    return spec.display.metrics if spec is not None and spec.display.metrics else None


def shown_metrics(logs: dict[str, Any], spec) -> list[tuple[str, str]]:
    """(key, label) of the metrics in `logs` worth showing for this stage type (its StageSpec), in display order."""
    evaluating = bool(logs) and all(str(k).startswith("eval_") for k in logs if k not in NOT_SHOWN | {"epoch"})
    prefix = "eval_" if evaluating else ""
    metrics = stage_metrics(spec)
    if metrics is None:
        return [(k, k) for k, v in logs.items() if is_number(v) and k not in NOT_SHOWN]
    shown = []
    for key, label in metrics:
        if "*" in key:
            head, tail = (prefix + key).split("*")
            for logged in logs:
                if logged.startswith(head) and logged.endswith(tail) and (is_number(logs[logged])
                                                                           or logs[logged] is None):
                    name = logged[len(head): len(logged) - len(tail)]
                    shown.append((logged, prefix + name))
        elif is_number(logs.get(prefix + key)):
            shown.append((prefix + key, prefix + label))
    return shown


def shown_value(value: Any) -> str:
    """A metric as the dashboard shows it; "n/a" for a reward that scored no sample of the step (TRL logs NaN)."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format_value(value)


def headline(logs: dict[str, Any], spec=None) -> str:
    return "  ".join(f"{label} {shown_value(logs[key])}" for key, label in shown_metrics(logs, spec))


def trend_line(values: list[float], points: int = TREND_POINTS) -> str:
    """A sparkline of the last `points` values (min to max of those values)."""
    values = [v for v in values[-points:] if math.isfinite(v)]
    if not values:
        return ""
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return TREND[len(TREND) // 2] * len(values)
    return "".join(TREND[min(len(TREND) - 1, int((v - low) / (high - low) * len(TREND)))] for v in values)


def clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


# --- the display of one stage -------------------------------------------------------------------------------

class StageDashboard:
    """Progress, metrics, trends, samples and alarms of one stage; writes the stage's metric and alarm logs."""

    def __init__(self, stage_name: str, metrics_path: Path, console: Console, *, spec=None, index: int | None = None,
                 total: int | None = None, mode: str | None = None, json_stream=None, label: str = ""):
        self.name = stage_name
        self.label = label or stage_name
        self.metrics_path = Path(metrics_path)
        self.console = console
        self.spec = spec if spec is not None else DISPLAY.spec  # the stage type's StageSpec (None: none known)
        self.stage_type = self.spec.type if self.spec is not None else None
        self.index = index if index is not None else DISPLAY.stage_index
        self.total = total if total is not None else DISPLAY.stage_total
        mode = mode or DISPLAY.mode
        self.mode = ("live" if console.is_terminal else "plain") if mode == "auto" else mode
        self.json_stream = json_stream or DISPLAY.json_stream or sys.stdout
        self.monitor = AlarmMonitor(self.spec)
        self.history: dict[str, list[float]] = {}
        self.latest: dict[str, Any] = {}
        self.latest_eval: dict[str, Any] = {}
        self.samples: list[dict[str, Any]] = []
        self.max_steps = 0
        self.first_step = 0
        self.step = 0
        self.started = time.time()
        self.live = None
        self.last_refresh = 0.0

    @property
    def title(self) -> str:
        position = f"stage {self.index}/{self.total}: " if self.index is not None and self.total else ""
        kind = f" ({self.stage_type})" if self.stage_type else ""
        return f"{position}{self.label}{kind}"

    def rate(self) -> float:
        elapsed = time.time() - self.started
        done = self.step - self.first_step
        return done / elapsed if done > 0 and elapsed > 0 else math.nan

    def eta(self) -> float:
        rate = self.rate()
        return (self.max_steps - self.step) / rate if rate and math.isfinite(rate) else math.nan

    # --- events ---

    def begin(self, max_steps: int, start_step: int = 0) -> None:
        self.max_steps, self.first_step, self.step = int(max_steps or 0), start_step, start_step
        self.started = time.time()
        if self.mode == "live":
            from rich.live import Live

            self.live = Live(self.render(), console=self.console, auto_refresh=False, transient=False)
            self.live.start(refresh=True)

    def advance(self, step: int) -> None:
        self.step = step
        if self.live is not None and time.time() - self.last_refresh > 0.25:
            self.refresh()

    def log(self, step: int, logs: dict[str, Any], *, epoch: float | None = None,
            samples: list[dict[str, Any]] | None = None) -> None:
        """One logging step: append it to metrics.jsonl, check alarms, show it once in the chosen mode."""
        self.step = step
        row = {"step": step, **({"epoch": round(epoch or 0.0, 4)} if epoch is not None else {}),
               "time": round(time.time(), 3),
               **{k: v for k, v in logs.items() if isinstance(v, (int, float, str, bool)) or v is None}}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
        if "train_runtime" in logs:
            self.finished(logs)
            return
        evaluating = bool(shown_metrics(logs, self.spec)) and \
            all(key.startswith("eval_") for key, _ in shown_metrics(logs, self.spec))
        for key, value in logs.items():
            if is_number(value):
                self.history.setdefault(key, []).append(float(value))
        (self.latest_eval if evaluating else self.latest).update(logs)
        alarms = self.monitor.update(step, logs, samples)
        if alarms:
            with open(StageDir(self.metrics_path.parent).alarms, "a", encoding="utf-8") as f:
                for alarm in alarms:
                    f.write(json.dumps({"stage": self.name, **alarm.as_dict()}) + "\n")
        if samples:
            self.samples = samples[-SAMPLES_SHOWN:]
            with open(StageDir(self.metrics_path.parent).completions, "a", encoding="utf-8") as f:
                for sample in self.samples:
                    f.write(json.dumps(json_safe({"step": step, **sample}), ensure_ascii=False, default=str) + "\n")
        self.show(step, logs, alarms, evaluating)

    def held_out(self, step: int, figures: dict[str, Any], line: str) -> None:
        """A held-out evaluation inside the stage (kitcli/training/held_out.py): its `eval/...` figures appended to
        metrics.jsonl at its step, and one line above the live panel, in the plain log, or a JSON event."""
        row = {"step": step, "time": round(time.time(), 3), **figures}
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
        if self.mode == "json":
            self.json_stream.write(json.dumps(json_safe({"event": "held_out", "stage": self.name, "step": step,
                                                         "metrics": figures}), default=str) + "\n")
            self.json_stream.flush()
        elif self.mode != "quiet":
            self.plain(f"[{self.name}] {line}")

    def show(self, step: int, logs: dict[str, Any], alarms, evaluating: bool) -> None:
        if self.mode == "json":
            self.json_stream.write(json.dumps(json_safe({
                "event": "log", "stage": self.name, "type": self.stage_type, "stage_index": self.index,
                "stages": self.total, "step": step, "max_steps": self.max_steps,
                "metrics": {k: v for k, v in logs.items() if is_number(v) or v is None},
                "alarms": [a.as_dict() for a in alarms]}), default=str) + "\n")
            self.json_stream.flush()
            return
        if self.mode == "quiet":
            for alarm in alarms:
                print(f"[{self.name}] ALARM step {alarm.step} {alarm.code}: {alarm.message}", file=sys.stderr)
            return
        if self.mode == "live":
            from rich.text import Text

            for alarm in alarms:
                line = Text("alarm", style="bold red")
                line.append(f" [{self.name}] step {alarm.step} {alarm.code}: {alarm.message}")
                self.console.print(line, highlight=False, soft_wrap=True)
            self.refresh()
            return
        for alarm in alarms:
            self.plain(f"[{self.name}] ALARM step {alarm.step} {alarm.code}: {alarm.message}")
        text = headline(logs, self.spec)
        if not text:
            return
        if evaluating:
            self.plain(f"[{self.name}] eval at step {step}  {text}")
            return
        rate = self.rate()
        speed = f"  {rate:.3g} step/s" if math.isfinite(rate) else ""
        eta = self.eta()
        self.plain(f"[{self.name}] step {step}/{self.max_steps}  {text}{speed}  "
                   f"eta {f'{eta:.0f}s' if math.isfinite(eta) else '?'}")

    def plain(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def finished(self, logs: dict[str, Any]) -> None:
        seconds = logs.get("train_runtime")
        if self.mode == "json":
            self.json_stream.write(json.dumps(json_safe({
                "event": "stage_end", "stage": self.name, "type": self.stage_type, "step": self.step,
                "metrics": {k: v for k, v in logs.items() if is_number(v)}}), default=str) + "\n")
            self.json_stream.flush()
        elif self.mode == "plain":
            loss = logs.get("train_loss")
            extra = f"  train_loss {format_value(loss)}" if is_number(loss) else ""
            steps = self.step - self.first_step
            self.plain(f"[{self.name}] finished {steps} steps in {format_value(float(seconds or 0))}s{extra}")

    def end(self, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if self.live is not None:
            self.live.update(self.render(), refresh=True)
            self.live.stop()
            self.live = None

    # --- the live panel ---

    def refresh(self) -> None:
        if self.live is not None:
            self.last_refresh = time.time()
            self.live.update(self.render(), refresh=True)

    def render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        bar = Table.grid(padding=(0, 1))
        bar.add_column(width=30)
        bar.add_column()
        rate, eta = self.rate(), self.eta()
        elapsed = time.time() - self.started
        bar.add_row(ProgressBar(total=max(self.max_steps, 1), completed=self.step, width=30),
                    Text(f"{self.step}/{self.max_steps}  {clock(elapsed)} elapsed  eta {clock(eta)}  "
                         f"{f'{rate:.3g}' if math.isfinite(rate) else '?'} step/s"))
        parts: list[Any] = [bar]
        metrics = self.metric_grid(self.latest)
        if metrics is not None:
            parts.append(metrics)
        evals = self.metric_grid(self.latest_eval)
        if evals is not None:
            parts.append(evals)
        if self.monitor.active:
            alarms = Text()
            for alarm in self.monitor.active.values():
                alarms.append(f"! {alarm.code} (step {alarm.step}): {alarm.message}\n", style="bold red")
            parts.append(alarms)
        if self.samples and (self.spec is None or self.spec.rl):
            parts.append(self.sample_table())
        return Panel(Group(*parts), title=Text(self.title, style="bold"), title_align="left")

    def metric_grid(self, logs: dict[str, Any]):
        from rich.table import Table
        from rich.text import Text

        shown = shown_metrics(logs, self.spec)
        if not shown:
            return None
        columns = max(1, min(3, (self.console.width - 4) // 40))
        grid = Table.grid(padding=(0, 3))
        for _ in range(columns):
            grid.add_column()
        cells = []
        for key, label in shown:
            cell = Text(f"{label} {shown_value(logs[key])} ", style="bold")
            cell.append(trend_line(self.history.get(key, [])), style="cyan")
            cells.append(cell)
        for start in range(0, len(cells), columns):
            grid.add_row(*cells[start:start + columns])
        return grid

    def sample_table(self):
        from rich.table import Table
        from rich.text import Text

        table = Table(title="recent completions", title_justify="left", show_edge=False, expand=True)
        # The rewards take at most REWARD_CELL columns (several lines when there are many) and the prompt gives way
        # before the completion, which keeps COMPLETION_SHOWN characters wherever the console has room for them.
        room = self.console.width - 4 - REWARD_CELL - 7  # the panel's border and padding, the columns' separators
        table.add_column("reward", justify="right", no_wrap=True, overflow="ellipsis", max_width=REWARD_CELL)
        table.add_column("prompt", width=max(10, min(room * 2 // 5, room - COMPLETION_SHOWN)), overflow="ellipsis",
                         no_wrap=True)
        table.add_column("completion", ratio=1, overflow="ellipsis", no_wrap=True)
        for sample in self.samples:
            table.add_row(reward_cell(sample), Text(clip(sample.get("prompt", ""), 80)),
                          Text(turns_line(sample["turns"], 120) if sample.get("turns") else
                               message_text(sample.get("completion", ""), 120)))  # as one line
        return table


def reward_cell(sample: dict[str, Any]):
    """A sample's total reward, with each reward's score when there are several: on one line while that fits in
    REWARD_CELL, else the total above the `name score` pairs, as many to a line as fit."""
    from rich.text import Text

    scores = sample.get("rewards") or {}
    total = sample.get("reward")
    if total is None and scores:
        total = sum(v for v in scores.values() if v is not None and math.isfinite(v))
    shown = format_value(total) if total is not None else "-"
    if len(scores) < 2:
        return Text(shown)
    parts = [f"{clip(name, REWARD_CELL - 1 - len(score))} {score}"  # a long name is cut, never its score
             for name, score in ((name, format_value(value)) for name, value in scores.items())]
    line = f"{shown} ({' '.join(parts)})"
    if len(line) <= REWARD_CELL:
        return Text(line)
    lines = [shown, parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 2 + len(part) <= REWARD_CELL:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return Text("\n".join(lines))
