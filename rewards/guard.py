"""Rewards during training: check what each reward returns, name the reward and sample at fault, time them.

A reward that raises, returns the wrong number of scores, NaN or a non-number stops the run with a KitError
naming the reward, the sample index and the value. A score outside the range the reward declares (`score_range`,
rewards/registry.py) stops it too, whatever on_error says: the reward broke its promise, so its scores cannot be
trusted. With `on_error: skip` the failing sample scores None instead
(TRL then ignores that reward for that sample; when the whole batch raised, each sample is scored alone so only
the failing ones are skipped) and the skips are counted in the metrics (`reward_skipped/<name>`, with the last
error as `reward_error/<name>`), next to the seconds spent in each reward (`reward_seconds/<name>`,
`reward_seconds/total`).

TRL's contract, whole: a score is a float, an int or a bool (TRL sums them as floats), or None for "no score" (TRL
leaves that sample out of the reward's mean; `trl.rewards.accuracy_reward` returns None for a gold answer it cannot
parse). `reward_unscored/<name>` is the share of the samples since the last log that a reward did not score (None
or skipped); the alarms (kitcli/display/alarms.py) name a reward that scored nothing for several logs in a row.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from kitcli.errors import KitError
from rewards.registry import LoadedReward


@dataclass
class RewardStats:
    """Per-reward seconds and skipped samples since the last `pop_metrics`."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    samples: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    unscored: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # None returned, or skipped
    errors: dict[str, str] = field(default_factory=dict)  # the last error a skipped sample raised
    calls: int = 0

    def count(self, name: str, scores: list[float | None]) -> None:
        self.samples[name] += len(scores)
        self.unscored[name] += sum(score is None for score in scores)

    def pop_metrics(self) -> dict[str, float | str]:
        metrics: dict[str, float | str] = {f"reward_seconds/{name}": round(value, 4)
                                           for name, value in self.seconds.items()}
        metrics.update({f"reward_skipped/{name}": count for name, count in self.skipped.items()})
        metrics.update({f"reward_unscored/{name}": round(self.unscored[name] / count, 4)
                        for name, count in self.samples.items() if count})
        metrics.update({f"reward_error/{name}": error for name, error in self.errors.items()})
        if self.seconds:
            metrics["reward_seconds/total"] = round(sum(self.seconds.values()), 4)
        for counts in (self.seconds, self.skipped, self.samples, self.unscored, self.errors):
            counts.clear()
        return metrics


def check_score(value: Any) -> float | None:
    """The score as a float, None for "no score"; raises ValueError for anything else."""
    if value is None:
        return None
    if not isinstance(value, Real):  # bools and ints are Reals: TRL sums them as floats
        raise ValueError(f"{value!r} is not a number")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{value!r} is not a finite number")
    return value


def format_range(bounds: tuple[float, float]) -> str:
    return "[" + ", ".join(f"{b:g}" for b in bounds) + "]"


def out_of_range(reward: LoadedReward, scores: list[float | None]) -> list[tuple[int, float]]:
    """(sample index, score) for each score outside the reward's declared range."""
    if reward.score_range is None:
        return []
    low, high = reward.score_range
    return [(i, s) for i, s in enumerate(scores) if s is not None and not low <= s <= high]


def guard_reward(reward: LoadedReward, stats: RewardStats,
                 enforce_range: bool = True) -> Callable[..., list[float | None]]:
    """Wrap `reward.fn` for a trainer; the wrapper keeps the reward's `__name__` (TRL logs by it).
    `enforce_range=False` leaves scores outside the declared range to the caller (`kit rewards test` flags them)."""

    def call(prompts, completions, **kwargs):
        return reward.fn(prompts=prompts, completions=completions, **kwargs)

    def checked(prompts, completions, kwargs) -> list[float | None]:
        try:
            raw = call(prompts, completions, **kwargs)
        except KitError:
            raise
        except Exception as error:
            if reward.on_error == "skip":
                return score_one_by_one(call, prompts, completions, kwargs, reward.name, stats)
            index = failing_sample(call, prompts, completions, kwargs)
            at = f" on sample {index} (completion {short(completions[index])})" if index is not None else ""
            raise KitError(f"reward '{reward.name}' raised {type(error).__name__}: {error}{at}; fix the function "
                           f"or set on_error: skip on it") from None
        if raw is None or isinstance(raw, (str, bytes)) or not hasattr(raw, "__len__") \
                or len(raw) != len(completions):
            if reward.on_error == "skip":
                return score_one_by_one(call, prompts, completions, kwargs, reward.name, stats)
            got = (f"{len(raw)} scores" if hasattr(raw, "__len__") and not isinstance(raw, (str, bytes))
                   else short(raw))
            raise KitError(f"reward '{reward.name}' returned {got} for {len(completions)} completions; "
                           f"it must return a list with one float (or None) per completion, or set on_error: "
                           f"skip")
        scores: list[float | None] = []
        for index, value in enumerate(raw):
            try:
                scores.append(check_score(value))
            except ValueError as problem:
                if reward.on_error == "skip":
                    stats.skipped[reward.name] += 1
                    stats.errors[reward.name] = f"returned {problem} for a sample"
                    scores.append(None)
                    continue
                raise KitError(f"reward '{reward.name}' returned {problem} for sample {index}; return a float "
                               f"or None per completion, or set on_error: skip") from None
        return scores

    def guarded(prompts, completions, **kwargs) -> list[float | None]:
        started = time.perf_counter()
        try:
            scores = checked(prompts, completions, kwargs)
            outside = out_of_range(reward, scores) if enforce_range else []
            if outside:
                index, value = outside[0]
                raise KitError(f"reward '{reward.name}' returned {value!r} for sample {index}, outside its declared "
                               f"range {format_range(reward.score_range)}; fix the function or its score_range")
            stats.count(reward.name, scores)
            return scores
        finally:
            stats.seconds[reward.name] += time.perf_counter() - started

    guarded.__name__ = reward.name
    guarded.__qualname__ = reward.name
    guarded.__doc__ = reward.fn.__doc__
    return guarded


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_sample(kwargs: dict[str, Any], index: int, count: int) -> dict[str, Any]:
    """The keyword arguments for sample `index` alone: per-sample lists sliced, the rest (trainer_state,
    log_extra, ...) as they are."""
    return {k: (v[index:index + 1] if isinstance(v, list) and len(v) == count else v) for k, v in kwargs.items()}


def failing_sample(call, prompts, completions, kwargs) -> int | None:
    """Re-run the reward one sample at a time to find the index that raises."""
    for index in range(len(completions)):
        try:
            call(prompts[index:index + 1], completions[index:index + 1], **one_sample(kwargs, index, len(completions)))
        except Exception:
            return index
    return None


def score_one_by_one(call, prompts, completions, kwargs, name: str, stats: RewardStats) -> list[float | None]:
    """After a batch raised under on_error: skip, score each sample alone; the ones that fail score None."""
    scores: list[float | None] = []
    for index in range(len(completions)):
        try:
            value = call(prompts[index:index + 1], completions[index:index + 1],
                         **one_sample(kwargs, index, len(completions)))
            if value is None or len(value) != 1:
                raise ValueError(f"returned {short(value)} for one completion")
            scores.append(check_score(value[0]))
        except Exception as error:
            stats.skipped[name] += 1
            stats.errors[name] = f"{type(error).__name__}: {str(error)[:120]}"
            scores.append(None)
    return scores


def guard_rewards(rewards: list[LoadedReward], stats: RewardStats) -> list[Callable[..., list[float | None]]]:
    names = [r.name for r in rewards]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise KitError(f"rewards: two rewards are both named '{sorted(duplicates)[0]}'; metrics are logged by name, "
                       f"so give each a distinct function (factories can set __name__)")
    return [guard_reward(r, stats) for r in rewards]
