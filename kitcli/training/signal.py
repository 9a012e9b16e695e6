"""The learning signal of an RL stage, measured: k completions of each prompt from the stage's starting policy,
scored by the stage's own reward functions, summed as TRL sums them (each reward times its weight, a None score
counting 0), and what that leaves a group-relative advantage to learn from.

A group whose k totals are all equal has zero advantage: GRPO, GSPO and RLOO learn nothing from it. It happens
when the policy solves the prompt every time, never solves it, or every completion is cut at
max_completion_length (and scores the same). `kit check --signal N` reports these shares; difficulty filtering
(kitcli/training/filtering.py) keeps the prompts whose pass rate lies between two bounds.

What passes: with `filter: {pass_reward: NAME}` a sample passes when that reward's score reaches `pass_score`
(default: the reward's declared maximum, 1.0 for exact_match); otherwise when the weighted total reaches the
highest total the rewards can give (each weight times the end of its declared range), i.e. every reward at its best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kitcli.errors import KitError

HISTOGRAM_BINS = 10  # pass-rate histogram: [0, 0.1), [0.1, 0.2), ... [0.9, 1.0]
EPSILON = 1e-9


@dataclass
class Group:
    """One prompt's k samples: totals, each reward's scores, passes, truncation, completion lengths."""

    index: int
    totals: list[float]
    rewards: dict[str, list[float | None]]
    passed: list[bool]
    truncated: list[bool]
    lengths: list[int] = field(default_factory=list)

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / len(self.passed)

    @property
    def zero_variance(self) -> bool:
        return max(self.totals) - min(self.totals) <= EPSILON * max(1.0, abs(max(self.totals)))

    def record(self) -> dict[str, Any]:
        return {"index": self.index, "totals": self.totals, "rewards": self.rewards, "passed": self.passed,
                "truncated": self.truncated, "lengths": self.lengths}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Group:
        return cls(**record)


@dataclass(frozen=True)
class PassRule:
    """Decides whether one sample passes; `describe` says how, in the words of the report."""

    reward: str | None  # None: the weighted total
    threshold: float
    describe: str

    def passes(self, total: float, scores: dict[str, float | None]) -> bool:
        value = total if self.reward is None else scores.get(self.reward)
        return value is not None and value >= self.threshold - EPSILON


def pass_rule(rewards, spec: dict[str, Any] | None, where: str, names: list[str] | None = None) -> PassRule:
    """The rule of `filter:` (`spec`; None: the default) for these loaded rewards. `names` are the rewards' names
    as the recipe writes them (a `pass_reward:` may use either those or the functions' names)."""
    spec = spec or {}
    if not rewards:
        raise KitError(f"{where}: filter: needs reward functions to decide a pass (a reward model's score has no "
                       f"maximum); add rewards: [...] to the stage")
    chosen = spec.get("pass_reward")
    if chosen is not None:
        written = names or [r.name for r in rewards]
        match = [r for r, w in zip(rewards, written) if chosen in (r.name, w)]
        if not match:
            known = ", ".join(dict.fromkeys([*written, *(r.name for r in rewards)]))
            raise KitError(f"{where}: filter.pass_reward '{chosen}' is not one of the stage's rewards ({known})")
        reward = match[0]
        threshold = spec.get("pass_score")
        if threshold is None:
            if reward.score_range is None or not math.isfinite(reward.score_range[1]):
                raise KitError(f"{where}: filter.pass_reward '{chosen}' declares no finite maximum score; give "
                               f"filter.pass_score (the score that counts as a pass)")
            threshold = reward.score_range[1]
        return PassRule(reward.name, float(threshold), f"{reward.name} >= {threshold:g}")
    if spec.get("pass_score") is not None:
        return PassRule(None, float(spec["pass_score"]), f"weighted total >= {spec['pass_score']:g}")
    best = 0.0
    for reward in rewards:
        bounds = reward.score_range
        end = None if bounds is None else (bounds[1] if reward.weight >= 0 else bounds[0])
        if end is None or not math.isfinite(end):
            raise KitError(f"{where}: reward '{reward.name}' declares no finite score range, so the highest total "
                           f"is unknown; name the reward that decides a pass with filter.pass_reward (and "
                           f"filter.pass_score)")
        best += reward.weight * end
    return PassRule(None, best, f"weighted total >= {best:g} (every reward at its best)")


def score_groups(rewards, rule: PassRule, rows: list[dict[str, Any]], samples, start_index: int = 0) -> list[Group]:
    """Score each row's samples (kitcli.models.generate.sample's output, or tool_loop.sample_with_tools') with the
    rewards, as TRL's trainer calls them (through the kit's guard: same arguments, same checks)."""
    from rewards.guard import RewardStats, guard_rewards

    flat_rows = [row for row, group in zip(rows, samples) for _ in group]
    prompts = [row["prompt"] for row in flat_rows]
    texts = [text for group in samples for text, _, _ in group]
    conversational = isinstance(prompts[0], list)
    completions = [t if isinstance(t, list) else [{"role": "assistant", "content": t}] for t in texts] \
        if conversational else texts  # a list: a conversation's turns after the prompt (sampled with tools)
    completion_ids = [ids for group in samples for _, ids, _ in group]
    columns = {key: [row.get(key) for row in flat_rows] for key in flat_rows[0] if key not in ("prompt",
                                                                                              "completion")}
    scores: dict[str, list[float | None]] = {}
    for reward, fn in zip(rewards, guard_rewards(rewards, RewardStats())):
        scores[reward.name] = fn(prompts, completions, completion_ids=completion_ids, trainer_state=None, **columns)
    groups, at = [], 0
    for offset, group in enumerate(samples):
        count = len(group)
        per = {name: values[at:at + count] for name, values in scores.items()}
        totals = [sum(r.weight * (per[r.name][i] or 0.0) for r in rewards) for i in range(count)]
        passed = [rule.passes(totals[i], {name: per[name][i] for name in per}) for i in range(count)]
        groups.append(Group(index=start_index + offset, totals=totals, rewards=per, passed=passed,
                            truncated=[t for _, _, t in group], lengths=[len(ids) for _, ids, _ in group]))
        at += count
    return groups


def histogram(rates: list[float], bins: int = HISTOGRAM_BINS) -> list[int]:
    """Counts of pass rates in `bins` equal bins over [0, 1] (1.0 falls in the last)."""
    counts = [0] * bins
    for rate in rates:
        counts[min(int(rate * bins), bins - 1)] += 1
    return counts


def mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def summarize(groups: list[Group]) -> dict[str, Any]:
    """The signal figures of scored groups: zero-variance share and why, reward mean and spread, truncation,
    each reward's distribution, the pass-rate histogram."""
    totals = [t for g in groups for t in g.totals]
    flat_truncated = [t for g in groups for t in g.truncated]
    zero = [g for g in groups if g.zero_variance]
    mean, std = mean_std(totals)
    within = [mean_std(g.totals)[1] for g in groups]
    figures: dict[str, Any] = {
        "prompts": len(groups), "k": len(groups[0].totals),
        "zero_variance_share": len(zero) / len(groups),
        "zero_variance_all_passed": sum(all(g.passed) for g in zero),
        "zero_variance_none_passed": sum(not any(g.passed) for g in zero),
        "zero_variance_all_truncated": sum(all(g.truncated) for g in zero),
        "reward_mean": mean, "reward_std": std, "within_group_std": sum(within) / len(within),
        "truncated_share": sum(flat_truncated) / len(flat_truncated),
        "pass_rate_mean": sum(g.pass_rate for g in groups) / len(groups),
        "pass_rate_histogram": histogram([g.pass_rate for g in groups]),
        "completion_length_mean": sum(n for g in groups for n in g.lengths) / max(1, len(flat_truncated)),
        "rewards": {},
    }
    for name in groups[0].rewards:
        values = [v for g in groups for v in g.rewards[name] if v is not None]
        scored = len(values) / len(totals)
        if values:
            low, high = min(values), max(values)
            figures["rewards"][name] = {"mean": sum(values) / len(values), "min": low, "max": high,
                                        "share_at_max": sum(v >= high - EPSILON for v in values) / len(values),
                                        "scored": scored}
        else:
            figures["rewards"][name] = {"mean": None, "scored": 0.0}
    return figures


def why_no_signal(figures: dict[str, Any]) -> str | None:
    """A warning when most groups carry no signal, with the reason; None when at least half of them learn."""
    if figures["zero_variance_share"] <= 0.5:
        return None
    zero = round(figures["zero_variance_share"] * figures["prompts"])
    reasons = [(figures["zero_variance_all_truncated"], "every completion cut at max_completion_length (raise it)"),
               (figures["zero_variance_all_passed"], "all solved (the prompts are too easy for this policy: filter "
                                                     "them or give harder ones)"),
               (figures["zero_variance_none_passed"], "none solved (too hard: train SFT first, filter them, or give "
                                                      "partial credit)")]
    count, reason = max(reasons, key=lambda pair: pair[0])
    detail = f"{reason}: {count} of them" if count else "equal rewards that are neither pass nor fail"
    return (f"{figures['zero_variance_share']:.0%} of groups ({zero} of {figures['prompts']}) have zero reward "
            f"variance and teach nothing; mostly {detail}")
