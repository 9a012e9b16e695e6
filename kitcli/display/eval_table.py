"""The evaluation tables: the eval stages' scores before and after training (the run's report, the runner's summary,
`kit eval`, bench/seeds.py), with the lm-eval scores of `kit eval RUN --tasks` beside them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

BENCHMARK_PREFIX = "benchmark/"  # kitcli/models/benchmarks.py PREFIX: lm-eval's scores in an eval summary
BENCHMARKS = "benchmarks"  # RUN/benchmarks/: `kit eval RUN --tasks`


def eval_metric_keys(summaries: list[dict[str, Any]]) -> list[str]:
    """The score keys the eval summaries hold, in table order: exact match (and with tools, the tool calls per
    problem and the share of calls that failed, where an eval ran with tools), pass@k, reward, each reward, then
    lm-eval's scores (`benchmark/<task>/<metric>,<filter>`, kitcli/models/benchmarks.py)."""
    present = {k for s in summaries for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    keys = [k for k in ("exact_match", "exact_match_with_tools", "tool_calls_per_problem", "tool_failure_rate")
            if k in present]
    keys += sorted((k for k in present if k.startswith("pass@") and k[5:].isdigit()), key=lambda k: int(k[5:]))
    keys += [k for k in ("reward",) if k in present]
    keys += sorted(k for k in present if k.startswith("rewards/") and k.count("/") == 1)
    keys += sorted(k for k in present if k.startswith(BENCHMARK_PREFIX))
    return keys


def metric_label(key: str) -> str:
    if key == "exact_match":
        return "exact match"
    if key == "exact_match_with_tools":
        return "exact match, with tools"
    if key == "tool_calls_per_problem":
        return "tool calls per problem"
    if key == "tool_failure_rate":
        return "failed tool calls (share)"
    if key == "reward":
        return "total reward"
    if key.startswith(BENCHMARK_PREFIX):  # benchmark/gsm8k/exact_match,strict-match -> gsm8k: exact_match (strict..)
        task, metric = key[len(BENCHMARK_PREFIX):].rsplit("/", 1)
        name, _, kind = metric.partition(",")
        return f"{task}: {name}" + (f" ({kind})" if kind and kind != "none" else "")
    return f"reward: {key.split('/', 1)[1]}" if key.startswith("rewards/") else key


def format_score(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.3f}" if isinstance(value, (int, float)) else str(value)


def format_seconds(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def format_change(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def before_after(evals: list[tuple[dict[str, Any], dict[str, Any]]]) -> tuple[list[str], list[list[str]]]:
    """The before/after table: one row per score, one column per eval stage (with the model it evaluated), and
    the change from the first eval that has the score to the last that has it (a recipe's kit evals and its
    lm-eval stages are columns of one table)."""
    keys = eval_metric_keys([summary for _, summary in evals])
    header = ["score", *[f"{stage['name']} ({stage.get('init') or 'base'})" for stage, _ in evals]]
    if len(evals) >= 2:
        header.append("change")
    rows = []
    for key in keys:
        row = [metric_label(key), *[format_score(summary.get(key)) for _, summary in evals]]
        if len(evals) >= 2:
            scored = [s[key] for _, s in evals if isinstance(s.get(key), (int, float))]
            row.append(format_change(scored[-1] - scored[0]) if len(scored) >= 2 else "-")
        rows.append(row)
    rows.append(["prompts", *[str(summary.get("n", "")) for _, summary in evals], *([""] if len(evals) >= 2 else [])])
    return header, rows


def benchmark_file(run_dir: Path, model: str) -> Path:
    """Where `kit eval RUN --tasks` keeps lm-eval's scores of one model of the run: RUN/benchmarks/<stage>.json,
    or base.json for the run's base model (samples beside it, <stage>-samples.jsonl)."""
    return Path(run_dir) / BENCHMARKS / f"{model}.json"


def with_benchmarks(run_dir: Path, evals: list[tuple[dict[str, Any], dict[str, Any]]],
                    stages: list[str]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The eval columns with the scores of `kit eval RUN --tasks` beside them: a column `lm-eval (<model>)` per
    evaluated model (a stage, or the base), after the eval stages of the same model, in the run's stage order (its
    own column, so that the prompts row gives the documents its scores are over)."""
    columns = list(evals)
    order = {"base": -1, **{name: i for i, name in enumerate(stages)}}
    for path in sorted((Path(run_dir) / BENCHMARKS).glob("*.json"), key=lambda p: order.get(p.stem, len(stages))):
        saved = read_json(path)
        model, scores = saved.get("model"), saved.get("scores")
        if not isinstance(model, str) or not isinstance(scores, dict):
            continue
        place = order.get(model, len(stages))
        at = sum(1 for stage, _ in columns if order.get(stage.get("init") or "base", len(stages)) <= place)
        columns.insert(at, ({"name": "lm-eval", "init": None if model == "base" else model},
                            {"n": saved.get("n"), **scores}))
    return columns


def read_json(path: Path) -> dict[str, Any]:

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
