"""The run report's signal panel for an RL stage that filtered its prompts (`filter:`, kitcli/training/filtering.py):
the starting policy's pass-rate histogram before and after filtering, the kept share, and the shares of groups
with zero reward variance and of truncated completions before and after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kitcli.display import svgplot


def histogram_figure(title: str, record: dict[str, Any]) -> str:
    before, after = record["pass_rate_histogram_before"], record["pass_rate_histogram_after"]
    width = 1 / len(before)
    groups = [f"{i * width:.1f}-{(i + 1) * width:.1f}" for i in range(len(before))]
    series = [svgplot.Series("before filtering", list(range(len(before))), [float(n) for n in before]),
              svgplot.Series("kept", list(range(len(after))), [float(n) for n in after])]
    return svgplot.bar_figure(title, groups, series, f"pass rate of the starting policy over k={record['k']} samples",
                              "prompts")


def share(value: Any) -> str:
    return f"{value:.0%}" if isinstance(value, (int, float)) else "n/a"


def filter_section(name: str, done: dict[str, Any], plots: Path) -> list[str]:
    """Markdown lines (and plots/<name>-filter.svg) for a stage whose DONE holds a filter record; [] otherwise."""
    record = done.get("filter")
    if not isinstance(record, dict) or "pass_rate_histogram_before" not in record:
        return []
    svg = plots / f"{name}-filter.svg"
    staging = svg.with_name(svg.name + ".tmp")
    staging.write_text(histogram_figure(f"{name}: pass rates before and after filtering", record), encoding="utf-8")
    staging.replace(svg)
    return [f"Difficulty filter (pass = {record['pass']}; kept pass rates in [{record['min_pass']:g}, "
            f"{record['max_pass']:g}]): kept {record['kept']} of {record['prompts']} prompts "
            f"({share(record['kept_share'])}); groups with zero reward variance "
            f"{share(record['zero_variance_share_before'])} -> {share(record.get('zero_variance_share_after'))}; "
            f"truncated completions "
            f"{share(record['truncated_share_before'])} -> {share(record.get('truncated_share_after'))}.", "",
            f"![{name} pass rates]({plots.name}/{svg.name})", ""]
