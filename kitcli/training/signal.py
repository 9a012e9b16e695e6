"""The learning signal of an RL stage, measured: k completions of each prompt from the stage's starting policy,
scored by the stage's own reward functions, summed as TRL sums them (each reward times its weight, a None score
counting 0; a completion that no reward scored has no total, and TRL leaves it out of its group's mean and spread),
and what that leaves a group-relative advantage to learn from.

A group whose k totals are all equal has zero advantage: GRPO, GSPO and RLOO learn nothing from it. It happens
when the policy solves the prompt every time, never solves it, or every completion is cut at
max_completion_length (and scores the same). `kit check --signal N` reports these shares; difficulty filtering
(kitcli/training/filtering.py) keeps the prompts whose pass rate lies between two bounds.

What passes: with `filter: {pass_reward: NAME}` a sample passes when that reward's score reaches `pass_score`
(default: the reward's declared maximum, 1.0 for exact_match); otherwise when the weighted total reaches the
highest total the rewards can give (each weight times the end of its declared range), i.e. every reward at its best.
A stage without `filter:` whose rewards do not all declare a finite range (TRL's, open-r1's and most users' rewards
declare none) has no pass rule: `kit check --signal` then measures everything that needs none (zero-variance groups,
each reward's distribution, constant and never-scoring rewards, truncation) and says the pass rate is not defined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kitcli.errors import KitError

if TYPE_CHECKING:
    from kitcli.recipe.filter_spec import FilterSpec

HISTOGRAM_BINS = 10  # pass-rate histogram: [0, 0.1), [0.1, 0.2), ... [0.9, 1.0]
EPSILON = 1e-9


@dataclass
class Group:
    """One prompt's k samples: totals, each reward's scores, passes, truncation, completion lengths."""

    index: int
    totals: list[float | None]  # None: no reward scored that completion
    rewards: dict[str, list[float | None]]
    passed: list[bool] | None  # None: the stage has no pass rule
    truncated: list[bool]
    lengths: list[int] = field(default_factory=list)

    @property
    def pass_rate(self) -> float | None:
        return None if self.passed is None else sum(self.passed) / len(self.passed)

    @property
    def scored_totals(self) -> list[float]:
        return [t for t in self.totals if t is not None]

    @property
    def zero_variance(self) -> bool:
        """Equal totals, as TRL sees them: fewer than two scored completions leave no advantage either."""
        scored = self.scored_totals
        return len(scored) < 2 or max(scored) - min(scored) <= EPSILON * max(1.0, abs(max(scored)))

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


def unranged(rewards) -> list[str]:
    """The rewards whose best score is unknown: no finite end of a declared range on the side their weight favours."""
    out = []
    for reward in rewards:
        bounds = reward.score_range
        end = None if bounds is None else (bounds[1] if reward.weight >= 0 else bounds[0])
        if end is None or not math.isfinite(end):
            out.append(reward.name)
    return out


def pass_rule(rewards, spec: FilterSpec | None, where: str, names: list[str] | None = None, *,
              required: bool = True) -> PassRule | None:
    """The rule of `filter:` (`spec`, the stage's typed section; None: the default) for these loaded rewards. `names`
    are the rewards' names as the recipe writes them (a `pass_reward:` may use either those or the functions'
    names). A default rule that cannot be formed (a reward without a finite range) is an error, or None where a pass
    rate is optional (`required=False`: a stage without `filter:`, measured by `kit check --signal`)."""
    if not rewards:
        raise KitError(f"{where}: filter: needs reward functions to decide a pass (a reward model's score has no "
                       f"maximum); add rewards: [...] to the stage")
    chosen = spec.pass_reward if spec is not None else None
    pass_score = spec.pass_score if spec is not None else None
    if chosen is not None:
        written = names or [r.name for r in rewards]
        match = [r for r, w in zip(rewards, written) if chosen in (r.name, w)]
        if not match:
            known = ", ".join(dict.fromkeys([*written, *(r.name for r in rewards)]))
            raise KitError(f"{where}: filter.pass_reward '{chosen}' is not one of the stage's rewards ({known})")
        reward = match[0]
        threshold = pass_score
        if threshold is None:
            if reward.score_range is None or not math.isfinite(reward.score_range[1]):
                raise KitError(f"{where}: filter.pass_reward '{chosen}' declares no finite maximum score; give "
                               f"filter.pass_score (the score that counts as a pass)")
            threshold = reward.score_range[1]
        return PassRule(reward.name, float(threshold), f"{reward.name} >= {threshold:g}")
    if pass_score is not None:
        return PassRule(None, float(pass_score), f"weighted total >= {pass_score:g}")
    missing = unranged(rewards)
    if missing:
        if not required:
            return None
        raise KitError(f"{where}: reward '{missing[0]}' declares no finite score range, so the highest total "
                       f"is unknown; name the reward that decides a pass with filter.pass_reward (and "
                       f"filter.pass_score)")
    best = sum(r.weight * (r.score_range[1] if r.weight >= 0 else r.score_range[0]) for r in rewards)
    return PassRule(None, best, f"weighted total >= {best:g} (every reward at its best)")


def no_pass_rate(rewards) -> str:
    """Why a stage without `filter:` has no pass rate (its rule is None), in the words of the report."""
    missing = unranged(rewards)
    which = ", ".join(f"'{name}'" for name in missing)
    declare = "declares" if len(missing) == 1 else "declare"
    return (f"not defined: {which} {declare} no finite score range (a filter: with pass_reward and pass_score "
            f"defines a pass); every other figure needs none")


def score_groups(rewards, rule: PassRule | None, rows: list[dict[str, Any]], samples,
                 start_index: int = 0) -> list[Group]:
    """Score each row's samples (kitcli.models.generate.sample's output, or tool_loop.sample_with_tools') with the
    rewards, as TRL's trainer calls them (through the kit's guard: same arguments, same checks). Without a `rule`
    no sample is judged (`passed` None)."""
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
        totals = [None if all(per[r.name][i] is None for r in rewards) else
                  sum(r.weight * (per[r.name][i] or 0.0) for r in rewards) for i in range(count)]
        passed = None if rule is None else \
            [rule.passes(totals[i], {name: per[name][i] for name in per}) for i in range(count)]
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


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and population spread; (None, None) for no values (nothing scored)."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def reward_distribution(values: list[float | None]) -> dict[str, Any]:
    """One reward's scores over every sample: mean and spread over the scored ones, the shares not scored and at
    the highest score seen; `constant` when it scored at least two samples, all alike."""
    scored = [v for v in values if v is not None]
    unscored = (len(values) - len(scored)) / len(values)
    if not scored:
        return {"mean": None, "std": None, "scored": 0.0, "unscored": unscored, "constant": False}
    mean, std = mean_std(scored)
    low, high = min(scored), max(scored)
    return {"mean": mean, "std": std, "min": low, "max": high,
            "share_at_max": sum(v >= high - EPSILON for v in scored) / len(scored),
            "scored": len(scored) / len(values), "unscored": unscored,
            "constant": len(scored) > 1 and high - low <= EPSILON * max(1.0, abs(high))}


def summarize(groups: list[Group]) -> dict[str, Any]:
    """The signal figures of scored groups: zero-variance share and why, reward mean and spread, truncation,
    each reward's distribution (and which are constant or never score), the pass-rate histogram (None without a
    pass rule)."""
    samples = sum(len(g.totals) for g in groups)
    scored = [t for g in groups for t in g.scored_totals]
    flat_truncated = [t for g in groups for t in g.truncated]
    zero = [g for g in groups if g.zero_variance]
    judged = all(g.passed is not None for g in groups)
    mean, std = mean_std(scored)
    within = [mean_std(g.scored_totals)[1] for g in groups if g.scored_totals]
    figures: dict[str, Any] = {
        "prompts": len(groups), "k": len(groups[0].totals),
        "zero_variance_share": len(zero) / len(groups),
        "zero_variance_all_passed": sum(all(g.passed) for g in zero) if judged else None,
        "zero_variance_none_passed": sum(not any(g.passed) for g in zero) if judged else None,
        "zero_variance_all_truncated": sum(all(g.truncated) for g in zero),
        "zero_variance_unscored": sum(len(g.scored_totals) < 2 for g in zero),
        "reward_mean": mean, "reward_std": std, "within_group_std": sum(within) / len(within) if within else None,
        "unscored_share": (samples - len(scored)) / samples,
        "truncated_share": sum(flat_truncated) / len(flat_truncated),
        "pass_rate_mean": sum(g.pass_rate for g in groups) / len(groups) if judged else None,
        "pass_rate_histogram": histogram([g.pass_rate for g in groups]) if judged else None,
        "completion_length_mean": sum(n for g in groups for n in g.lengths) / max(1, len(flat_truncated)),
        "rewards": {name: reward_distribution([v for g in groups for v in g.rewards[name]])
                    for name in groups[0].rewards},
    }
    figures["constant_rewards"] = [name for name, dist in figures["rewards"].items() if dist["constant"]]
    figures["never_scored_rewards"] = [name for name, dist in figures["rewards"].items() if dist["mean"] is None]
    return figures


def why_no_signal(figures: dict[str, Any]) -> str | None:
    """A warning when most groups carry no signal, with the reason; None when at least half of them learn."""
    if figures["zero_variance_share"] <= 0.5:
        return None
    zero = round(figures["zero_variance_share"] * figures["prompts"])
    reasons = [(figures["zero_variance_all_truncated"], "every completion cut at max_completion_length (raise it)"),
               (figures["zero_variance_unscored"], "fewer than two completions scored by any reward (every reward "
                                                   "returned None)")]
    if figures["zero_variance_all_passed"] is not None:
        reasons += [(figures["zero_variance_all_passed"], "all solved (the prompts are too easy for this policy: "
                                                          "filter them or give harder ones)"),
                    (figures["zero_variance_none_passed"], "none solved (too hard: train SFT first, filter them, or "
                                                           "give partial credit)")]
    count, reason = max(reasons, key=lambda pair: pair[0])
    if count:
        detail = f"{reason}: {count} of them"
    elif figures["zero_variance_all_passed"] is None:
        detail = "equal rewards (no pass rule to tell solved from unsolved: see each reward's distribution)"
    else:
        detail = "equal rewards that are neither pass nor fail"
    return (f"{figures['zero_variance_share']:.0%} of groups ({zero} of {figures['prompts']}) have zero reward "
            f"variance and teach nothing; mostly {detail}")
