"""Score a sample with each reward before any training: distributions, and warnings for rewards that cannot
teach anything (constant over the sample, failing, or never scoring). Used by `kit rewards test` and
`kit rewards preview`; no heavy imports.
"""

from __future__ import annotations

import inspect
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

from kitcli.errors import KitError
from rewards.guard import RewardStats, format_range, guard_reward, out_of_range
from rewards.registry import LoadedReward

GSM8K_ANSWER = re.compile(r"\S.*####\s*(\S[^\n]*?)\s*$", re.DOTALL)  # "Natalia sold 48/2 = 24 ... #### 72"


def worked_solution_column(columns: dict[str, list[Any]]) -> tuple[str, str, str] | None:
    """(column, a value, the answer after '####') when a reference column holds GSM8K's worked solutions, which a
    reward comparing a final answer with the column as it is never matches; else None."""
    for column, values in columns.items():
        if column not in ("prompt", "completion") and values and all(isinstance(v, str) and GSM8K_ANSWER.match(v)
                                                                     for v in values):
            return column, values[0], GSM8K_ANSWER.match(values[0]).group(1)
    return None


def reads_column(fn, column: str) -> bool | None:
    """Whether reward `fn` takes `column`: True when a parameter names it, None when only **kwargs may hold it."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.name == column for p in parameters):
        return True
    return None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters) else False


def worked_solution_advice(fn, reference: tuple[str, str, str] | None) -> str:
    """Why a reward that never matches may be so: the column it compares with holds a GSM8K worked solution ("" when
    there is none, or the reward cannot read that column)."""
    if reference is None:
        return ""
    column, value, answer = reference
    reads = reads_column(fn, column)
    if reads is False:
        return ""
    shown = value if len(value) <= 60 else "..." + value[-57:]
    told = (f"column '{column}' holds a worked solution with the answer after '####' (e.g. {shown!r}), and the "
            f"reward compares against it as is")
    return (f"{told if reads else 'if ' + told}: a final answer never equals it; give the reward a column holding "
            f"only the part after '####' ({answer!r}), e.g. {column}.split('####')[-1].strip()")


@dataclass
class RewardReport:
    reward: LoadedReward
    scores: list[float | None]
    seconds: float
    error: str | None = None
    skipped: int = 0
    reference: tuple[str, str, str] | None = None  # a GSM8K-style worked-solution column (worked_solution_column)

    @property
    def name(self) -> str:
        return self.reward.name

    @property
    def values(self) -> list[float]:
        return [s for s in self.scores if s is not None]

    @property
    def violations(self) -> list[tuple[int, float]]:
        """(sample index, score) for the scores outside the reward's declared range."""
        return out_of_range(self.reward, self.scores)

    def summary(self) -> dict[str, Any]:
        values = self.values
        if not values:
            return {"n": len(self.scores), "scored": 0}
        return {"n": len(self.scores), "scored": len(values), "mean": statistics.fmean(values),
                "std": statistics.pstdev(values), "min": min(values), "max": max(values),
                "zero": sum(v == 0 for v in values) / len(values)}

    def warnings(self) -> list[str]:
        if self.error:
            return [f"reward '{self.name}' failed: {self.error}"]
        values = self.values
        if not values:
            return [f"reward '{self.name}' scored no sample (None for all {len(self.scores)}); check that the "
                    f"columns it reads are filled in"]
        out = []
        if self.violations:
            index, value = self.violations[0]
            out.append(f"reward '{self.name}' scored {value:g} on sample {index}, outside its declared range "
                       f"{format_range(self.reward.score_range)} ({len(self.violations)} of {len(self.scores)} "
                       f"samples): training would stop there")
        if len(values) > 1 and max(values) == min(values):
            value = values[0]
            which = {0.0: "always 0", 1.0: "always 1"}.get(value, f"always {value:g}")
            advice = worked_solution_advice(self.reward.fn, self.reference) if value == 0 else ""
            hint = f"; {advice}" if advice else " (does the model ever produce what it looks for?)" if value == 0 \
                else ""
            out.append(f"reward '{self.name}' is constant over the {len(values)} samples ({which}): it gives GRPO "
                       f"no signal{hint}")
        if self.skipped:
            out.append(f"reward '{self.name}' skipped {self.skipped} of {len(self.scores)} samples (on_error: skip)")
        elif len(values) < len(self.scores):
            out.append(f"reward '{self.name}' returned None for {len(self.scores) - len(values)} of "
                       f"{len(self.scores)} samples")
        return out


def score_sample(reward: LoadedReward, prompts: list[Any], completions: list[Any], columns: dict[str, list],
                 *, keep_going: bool = True) -> RewardReport:
    """Score through the same guard the trainers use; a failure becomes the report's error (or, with
    `keep_going=False`, the KitError that names the sample). Scores outside the declared range are kept and
    listed in `violations` (and the warnings), so that every offending sample can be shown."""
    stats = RewardStats()
    guarded = guard_reward(reward, stats, enforce_range=False)
    started = time.perf_counter()
    try:
        scores = guarded(prompts, completions, **columns)
    except KitError as error:
        if not keep_going:
            raise
        return RewardReport(reward, [None] * len(completions), time.perf_counter() - started,
                            error=error.format_message())
    return RewardReport(reward, scores, time.perf_counter() - started, skipped=sum(stats.skipped.values()),
                        reference=worked_solution_column(columns))


def weighted_total(reports: list[RewardReport]) -> list[float | None]:
    """Per sample, the weighted sum of the rewards that scored it (TRL's sum over rewards, None ignored)."""
    totals: list[float | None] = []
    for index in range(len(reports[0].scores) if reports else 0):
        parts = [r.reward.weight * r.scores[index] for r in reports if r.scores[index] is not None]
        totals.append(sum(parts) if parts else None)
    return totals


def histogram(values: list[float], bins: int = 8, width: int = 30) -> list[tuple[str, int, str]]:
    """(label, count, bar) rows: one per distinct value when there are few, else equal-width bins."""
    if not values:
        return []
    distinct = sorted(set(values))
    if len(distinct) <= bins:
        counts = [(f"{v:g}", values.count(v)) for v in distinct]
    else:
        low, high = min(values), max(values)
        step = (high - low) / bins
        counts = []
        for i in range(bins):
            start, end = low + i * step, low + (i + 1) * step
            count = sum(start <= v < end or (i == bins - 1 and v == high) for v in values)
            counts.append((f"[{start:.3g}, {end:.3g}{']' if i == bins - 1 else ')'}", count))
    most = max(c for _, c in counts) or 1
    return [(label, count, "#" * max(1 if count else 0, math.ceil(width * count / most))) for label, count in counts]


def format_number(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.3g}"
    return str(value)
