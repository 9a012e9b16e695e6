"""Run report: `report.md` and SVG plots (one figure per stage, plus the evaluation table) in a run directory.

    kit report runs/tiny-sft-20261202-120000
    kit run tiny-sft                 (writes the report at the end and prints its path)

Everything is read back from the run directory (recipe.lock.yaml, each stage's DONE, metrics.jsonl, alarms.jsonl,
completions.jsonl and samples.jsonl), so a report can be written for a finished, interrupted or old run.
The figures are written as SVG by kitcli/display/svgplot.py (no matplotlib: a run's report costs milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kitcli.display import svgplot
from kitcli.display.conversation import call_counts, turns_line, turns_markdown
from kitcli.display.eval_table import (
    BENCHMARKS,
    before_after,
    eval_metric_keys,
    format_score,
    format_seconds,
    markdown_table,
    metric_label,
    with_benchmarks,
)
from kitcli.display.formatting import format_value, message_text
from kitcli.display.signal_report import filter_section
from kitcli.display.trainer_notes import trainer_notes
from kitcli.recipe import stage_types
from kitcli.records import read_jsonl
from kitcli.rundir import RunDir, StageDir, read_run_lock

FALLBACK_SKIP = {"step", "epoch", "time", "total_flos", "num_tokens", "train_runtime", "train_samples_per_second",
                 "train_steps_per_second", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
FALLBACK_PANELS = 9


@dataclass
class StageRecord:
    stage: dict[str, Any]
    index: int
    directory: Path
    done: dict[str, Any] | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    alarms: list[dict[str, Any]] = field(default_factory=list)
    completions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.stage["name"]

    @property
    def type(self) -> str:
        return self.stage["type"]

    @property
    def status(self) -> str:
        if self.done is not None:
            return "done"
        return "incomplete" if self.metrics or self.directory.exists() else "not run"


@dataclass
class RunRecord:
    run_dir: Path
    lock: dict[str, Any]
    stages: list[StageRecord]

    @property
    def name(self) -> str:
        return str(self.lock.get("recipe", {}).get("name", self.run_dir.name))

    def evals(self) -> list[StageRecord]:
        return [s for s in self.stages if s.done is not None and stage_types.specs().get(s.type) is not None
                and stage_types.spec(s.type).evaluates]


def load_run(run_dir: Path) -> RunRecord:
    run = RunDir(Path(run_dir))
    lock = read_run_lock(run)
    stages = []
    for index, stage in enumerate(lock.get("recipe", {}).get("stages", []), start=1):
        directory = run.stage(stage["name"])
        stages.append(StageRecord(stage, index, directory.path, directory.done(), directory.read_metrics(),
                                  read_jsonl(directory.alarms), read_jsonl(directory.completions)))
    return RunRecord(run.path, lock, stages)


# --- figures ------------------------------------------------------------------------------------------------

def matching_keys(pattern: str, rows: list[dict[str, Any]]) -> list[str]:
    if "*" not in pattern:
        return [pattern]
    head, tail = pattern.split("*", 1)
    found = []
    for row in rows:
        for key in row:
            if key.startswith(head) and key.endswith(tail) and key not in found:
                found.append(key)
    return found


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of a logged metric, finite values only."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(row.get("step", len(xs)))
            ys.append(float(value))
    return xs, ys


def stage_panels(stage_type: str, rows: list[dict[str, Any]]) -> list[tuple[str, str, list[str]]]:
    """The panels to draw for a stage: its type's curves that were logged, else every numeric metric."""
    spec = stage_types.specs().get(stage_type)
    panels = []
    for title, ylabel, patterns in spec.display.panels if spec is not None else ():
        keys = [k for p in patterns for k in matching_keys(p, rows) if series(rows, k)[1]]
        if keys:
            panels.append((title, ylabel, keys))
    held_out = [k for k in matching_keys("eval/*", rows) if k != "eval/seconds" and series(rows, k)[1]]
    if held_out and panels:  # `eval:` (kitcli/training/held_out.py): beside the first training curve
        panels.insert(1, ("held-out evaluation against step", "score", held_out))
    if panels or (spec is not None and spec.display.panels):
        return panels
    numeric = []
    for row in rows:
        for key, value in row.items():
            if key not in FALLBACK_SKIP and key not in numeric and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                numeric.append(key)
    return [(key, key, [key]) for key in numeric[:FALLBACK_PANELS]]


def stage_figure(title: str, stage_type: str, rows: list[dict[str, Any]]) -> str | None:
    """One SVG figure for a stage: a titled panel per curve group, step on x, the metric on y; None if nothing
    was logged."""
    panels = stage_panels(stage_type, rows)
    if not panels:
        return None
    return svgplot.line_figure(title, [
        svgplot.Panel(panel_title, ylabel, [svgplot.Series(series_label(key), *series(rows, key)) for key in keys])
        for panel_title, ylabel, keys in panels])


def series_label(key: str) -> str:
    return key.split("/", 1)[1].rsplit("/", 1)[0] if key.startswith("rewards/") and key.endswith("/mean") else key


def eval_figure(evals: list[tuple[dict[str, Any], dict[str, Any]]]) -> str | None:
    """Grouped bars: one group per eval stage, one bar per score."""
    keys = eval_metric_keys([summary for _, summary in evals])
    if not evals or not keys:
        return None
    groups = [f"{stage['name']}\n({stage.get('init') or 'base'})" for stage, _ in evals]
    bars = [svgplot.Series(metric_label(key), list(range(len(evals))),
                           [summary.get(key) if isinstance(summary.get(key), (int, float)) else 0.0
                            for _, summary in evals]) for key in keys]
    return svgplot.bar_figure("held-out evaluation before and after training", groups, bars,
                              "eval stage (model evaluated)", "score")


def up_to_date(figure: Path, stage_dir: Path) -> bool:
    """Whether a stage's plot is newer than every file it is drawn from. A run of several stages redraws only the
    stages that ran."""
    if not figure.is_file():
        return False
    sources = [stage_dir / name for name in ("DONE", "metrics.jsonl")]
    newest = max((f.stat().st_mtime_ns for f in sources if f.is_file()), default=None)
    return newest is not None and figure.stat().st_mtime_ns > newest


def save_figure(figure: str, path: Path) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(figure, encoding="utf-8")
    staging.replace(path)


# --- report.md ----------------------------------------------------------------------------------------------

def curve_summary(rows: list[dict[str, Any]], keys: list[str]) -> list[list[str]]:
    out = []
    for key in keys:
        _, ys = series(rows, key)
        if ys:
            out.append([key, format_value(ys[0]), format_value(ys[-1]), format_value(min(ys)), format_value(max(ys))])
    return out


def write_report(run_dir: Path) -> Path:
    """Write `<run_dir>/report.md` and `<run_dir>/plots/*.svg`; returns the report's path."""
    run = load_run(Path(run_dir))
    plots = RunDir(run.run_dir).plots
    plots.mkdir(exist_ok=True)
    recipe = run.lock.get("recipe", {})
    versions = run.lock.get("versions", {})
    lines = [f"# Run report: {run.name}", ""]
    if recipe.get("description"):
        lines += [str(recipe["description"]), ""]
    model = recipe.get("model", {})
    lines += [f"- run directory: `{run.run_dir}`",
              f"- recipe: `{run.lock.get('source', '?')}`, seed {run.lock.get('seed', '?')}, created "
              f"{run.lock.get('created', '?')}",
              f"- model: `{model.get('name', '?')}` (max_seq_length {model.get('max_seq_length', '?')}, 4-bit "
              f"{model.get('load_in_4bit', '?')}, dtype {model.get('dtype', '?')})",
              f"- platform: {run.lock.get('platform', '?')}; " +
              ", ".join(f"{k} {v}" for k, v in versions.items() if v != "not installed"), ""]

    lines += ["## Stages", ""]
    rows = [[str(s.index), s.name, s.type, s.status, format_seconds((s.done or {}).get("seconds")),
             str((s.done or {}).get("headline", ""))] for s in run.stages]
    lines += [markdown_table(["#", "stage", "type", "status", "seconds", "result"], rows), ""]

    evals = with_benchmarks(run.run_dir, [(s.stage, s.done) for s in run.evals()], [s.name for s in run.stages])
    if evals:
        header, table = before_after(evals)
        lines += ["## Evaluation (held-out)", "", markdown_table(header, table), ""]
        svg = plots / "eval.svg"
        drawn = len(evals) == len(run.evals()) and all(up_to_date(svg, s.directory) for s in run.evals()) and \
            not any((run.run_dir / BENCHMARKS).glob("*.json"))
        if not drawn:
            figure = eval_figure(evals)
            if figure is not None:
                save_figure(figure, svg)
                drawn = True
        if drawn:
            lines += [f"![held-out evaluation]({plots.name}/eval.svg)", ""]

    for record in run.stages:
        lines += [f"## Stage {record.index}: {record.name} ({record.type})", ""]
        if record.status != "done":
            lines += [f"Status: {record.status}.", ""]
        if (record.done or {}).get("resumed"):
            lines += [f"Interrupted and {record.done['resumed']}.", ""]
        if (record.done or {}).get("warnings"):
            lines += [f"- **warning**: {warning}" for warning in record.done["warnings"]] + [""]
        lines += trainer_notes(record.done or {})  # GRPO / GSPO: the kl metric, the pad token, Unsloth's speed paths
        lines += held_out_note(record.done or {})
        if stage_types.specs().get(record.type) is not None and stage_types.spec(record.type).evaluates:
            lines += eval_section(record)
            continue
        lines += filter_section(record.name, record.done or {}, plots)  # `filter:`: pass rates before / after
        svg = plots / f"{record.name}.svg"
        drawn = up_to_date(svg, record.directory)  # by an earlier `kit run` from the same files: keep it
        if not drawn:
            figure = stage_figure(f"stage {record.index}: {record.name} ({record.type})", record.type,
                                  record.metrics)
            if figure is not None:
                save_figure(figure, svg)
                drawn = True
        if drawn:
            lines += [f"![{record.name} training curves]({plots.name}/{record.name}.svg)", ""]
            keys = [k for _, _, ks in stage_panels(record.type, record.metrics) for k in ks]
            lines += [markdown_table(["metric", "first", "last", "min", "max"], curve_summary(record.metrics, keys)),
                      ""]
        elif record.status == "done":
            lines += ["No metrics were logged.", ""]
        lines += ["Alarms: " + ("none." if not record.alarms else ""), ""]
        lines += [f"- step {a.get('step')}: **{a.get('code')}**: {a.get('message')}" for a in record.alarms]
        if record.alarms:
            lines.append("")
        if record.completions:
            last_step = record.completions[-1].get("step")
            recent = [c for c in record.completions if c.get("step") == last_step]
            lines += [f"Recent completions (step {last_step}):", "",
                      markdown_table(["reward", "prompt", "completion"],
                                     [[format_score(c.get("reward", sum(v for v in (c.get("rewards") or {}).values()
                                                                         if isinstance(v, (int, float))))),
                                       message_text(c.get("prompt", ""), 80),
                                       turns_line(c["turns"], 160) if c.get("turns") else
                                       message_text(c.get("completion", ""), 160)]
                                      for c in recent]), ""]
        lines += conversation_section([c for c in record.completions if c.get("turns")])
    path = RunDir(run.run_dir).report
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return path


def held_out_note(done: dict[str, Any]) -> list[str]:
    """A training stage's `eval:` in a line: its curve's first, best (step, checkpoint) and last, and its cost."""
    if done.get("eval_best_step") is None:
        return []
    kept = f", {done['eval_best_checkpoint']}" if done.get("eval_best_checkpoint") else ", no checkpoint kept"
    cost = (f"; {format_seconds(done['eval_seconds_each'])} s per evaluation, {done['eval_share']:.0%} of the "
            f"stage" if done.get("eval_seconds_each") is not None else "")
    return [f"Held-out {str(done['eval_metric']).replace('_', ' ')} (eval:): {format_score(done['eval_first'])} at "
            f"step {done['eval_steps'][0]} -> {format_score(done['eval_last'])} at step {done['eval_steps'][-1]}; best "
            f"{format_score(done['eval_best'])} at step {done['eval_best_step']}{kept}{cost}.", ""]


def conversation_section(samples: list[dict[str, Any]]) -> list[str]:
    """The latest logged completion that called a tool, turn by turn (a stage with tools:)."""
    if not samples:
        return []
    sample = samples[-1]
    calls, failures = call_counts(sample["turns"])
    step = f" at step {sample['step']}" if "step" in sample else ""
    reward = f", reward {format_score(sample['reward'])}" if sample.get("reward") is not None else ""
    return [f"Sample conversation{step} ({calls} tool call{'s' * (calls != 1)}, {failures} failed{reward}):", "",
            f"- **prompt**: {message_text(sample.get('prompt', ''), 300)}", *turns_markdown(sample["turns"]), ""]


def eval_section(record: StageRecord, shown: int = 5) -> list[str]:
    lines = []
    if record.done:
        lines += [f"Model: {record.stage.get('init') or 'base'}; {record.done.get('headline', '')}", ""]
    samples = read_jsonl(StageDir(record.directory).samples)[:shown]
    if samples:
        header = ["prompt", "completion"] + (["answer", "correct"] if "answer" in samples[0] else []) + \
            (["reward"] if "reward" in samples[0] else [])
        rows = []
        for s in samples:
            row = [message_text(s.get("prompt"), 80), message_text(s.get("completion"), 160)]
            if "answer" in s:
                row += [message_text(s["answer"], 160), "yes" if s.get("correct") else "no"]
            if "reward" in s:
                row.append(format_score(s["reward"]))
            rows.append(row)
        lines += [markdown_table(header, rows), ""]
    with_tools = [{**s["with_tools"], "prompt": s.get("prompt", "")} for s in samples if s.get("with_tools")]
    return lines + conversation_section(with_tools[:1])
