"""A `kit check` finding, and lengths measured against the setting that cuts them (kitcli/run/check.py and
kitcli/run/tool_check.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Finding:
    stage: str
    topic: str
    level: str  # "ok", "warn" or "info"
    figures: str
    verdict: str

    def line(self) -> str:
        return f"{self.level}: {self.stage}: {self.topic}: {self.verdict}" + (f" ({self.figures})"
                                                                             if self.figures else "")


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def spread(values: list[int]) -> str:
    return f"p50 {percentile(values, 0.5)} / p95 {percentile(values, 0.95)} / max {max(values)}"


def cut_finding(stage: str, what: str, lengths: list[int], limit: int | None, setting: str) -> Finding:
    """Lengths against a limit: the share cut and the value of `setting` that cuts none."""
    if not lengths:
        return Finding(stage, what, "info", "", "no rows")
    figures = f"{spread(lengths)} tokens" + (f" vs {setting} {limit}" if limit else "")
    if not limit:
        return Finding(stage, what, "info", figures, f"no {setting} set" if setting else "cut only as part of the "
                                                                                           "whole row")
    over = sum(n > limit for n in lengths)
    if not over:
        return Finding(stage, what, "ok", figures, f"all {len(lengths)} fit")
    return Finding(stage, what, "warn", figures, f"{over / len(lengths):.0%} of {len(lengths)} would be cut; set "
                                                 f"{setting} >= {max(lengths)} (or drop the longest rows)")
