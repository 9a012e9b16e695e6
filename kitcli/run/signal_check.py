"""`kit check --signal N`: the reward signal of each RL stage, measured before training.

For each grpo / gspo / rloo stage with reward functions: load the stage's starting policy (the base model, or the
output of its `init:` stage in the run directory `kit run` would use), sample k completions (the stage's
`filter.k`, else its num_generations) for its first N prompts at the stage's own sampling settings (with its
`tools:` live, as it trains), score them
with its rewards (kitcli/training/signal.py) and report the share of groups with zero reward variance (and why:
all solved, none solved, truncated), the reward mean and spread, the share truncated at max_completion_length,
each reward's distribution (mean, spread, the share it did not score; a reward that is constant or never scores is
named) and, for a stage with `filter:`, the same figures after filtering. The pass rate needs a pass rule
(kitcli/training/signal.py): a stage without `filter:` whose rewards declare no finite range (TRL's, open-r1's)
gets every other figure and a pass rate "not defined". A constant reward next to a reference column written as
GSM8K writes it ("... #### 42") is told why. A stage whose starting policy has not been trained yet is reported as
not measured.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.check import resolved_values
from kitcli.run.findings import Finding
from rewards.sample_scores import worked_solution_advice, worked_solution_column


def starting_policy(ctx: StageContext) -> tuple[Path | None, str | None]:
    """(init directory or None for the base model, None) or (None, why it cannot be measured)."""
    init = ctx.stage.init
    if not init:
        return None, None
    folder = ctx.run_dir / init
    if (folder / "DONE").is_file() and ((folder / "adapter").is_dir() or (folder / "model").is_dir()):
        return folder, None
    return None, (f"its starting policy (stage '{init}') is not trained in {ctx.run_dir}; run the recipe up to it "
                  f"(or give --output RUN_DIR of a run that has it)")


def figures_text(figures: dict[str, Any]) -> str:
    """The reward signal's line: the pass rate only where one is defined, "no score" where nothing scored."""
    reward = "no score" if figures["reward_mean"] is None else \
        (f"{figures['reward_mean']:.3f} +- {figures['reward_std']:.3f} (within groups "
         f"{figures['within_group_std']:.3f})")
    unscored = f", unscored {figures['unscored_share']:.0%}" if figures.get("unscored_share") else ""
    passed = "" if figures.get("pass_rate_mean") is None else f", pass rate {figures['pass_rate_mean']:.2f}"
    return (f"{figures['prompts']} prompts x {figures['k']}: zero-variance groups {figures['zero_variance_share']:.0%}"
            f", reward {reward}{unscored}, truncated {figures['truncated_share']:.0%}{passed}")


def worked_solution_hint(reward, dist: dict[str, Any], reference: tuple[str, str, str] | None) -> str:
    """Why a reward constant at its lowest (its declared minimum, else 0: what a mismatch scores) may be so: the
    column it compares with is a GSM8K worked solution."""
    if reference is None or not dist["constant"]:
        return ""
    low = reward.score_range[0] if reward.score_range is not None else 0.0
    if dist["min"] != (low if math.isfinite(low) else 0.0):
        return ""
    advice = worked_solution_advice(reward.fn, reference)
    return f"; {advice}" if advice else ""


def reward_finding(stage: str, name: str, dist: dict[str, Any], samples: int, hint: str = "") -> Finding:
    """One reward's distribution; a reward that never scores, scores the same every time or scores only some
    samples says so (a constant one with `hint`: kitcli's guess at why)."""
    if dist["mean"] is None:
        return Finding(stage, f"reward {name}", "warn", f"never scored: None for {samples} of {samples} samples, "
                                                        f"{dist['unscored']:.0%} not scored",
                       "it returned None (no score) for every sample: TRL ignores it, so it adds no signal; check "
                       "that the columns it reads are filled in")
    text = (f"mean {dist['mean']:.3f} +- {dist['std']:.3f}, min {dist['min']:.3f}, max {dist['max']:.3f}, at max "
            f"{dist['share_at_max']:.0%}, scored {dist['scored']:.0%}")
    unscored = round(dist["unscored"] * samples)
    not_scored = f"; no score (None) for {unscored} of {samples} samples ({dist['unscored']:.0%})" if unscored else ""
    if not dist["constant"]:
        return Finding(stage, f"reward {name}", "ok", text, "varies" + not_scored)
    return Finding(stage, f"reward {name}", "warn", text, f"constant ({dist['min']:g} for every sample it scored): "
                                                          f"it adds no signal{not_scored}{hint}")


def stage_signal(ctx: StageContext, prompts: int, log) -> tuple[list[Finding], dict[str, Any] | None]:
    """The findings of one RL stage, and its figures (None when not measured)."""
    from kitcli.models.backend import load_stage_policy
    from kitcli.training.filtering import filter_record, keep_within, measure_groups, sampling_settings
    from kitcli.training.signal import no_pass_rate, pass_rule, summarize, why_no_signal
    from kitcli.training.tool_use import stage_toolbox
    from rewards.registry import load_rewards

    stage = ctx.name
    rewards = load_rewards(ctx.stage.rewards, ctx.recipe.base_dir, f"{ctx.where}: rewards")
    if not rewards:
        return [Finding(stage, "reward signal", "info", "", "a reward model only: not measured")], None
    init_dir, why_not = starting_policy(ctx)
    if declared(ctx.stage, "environment"):
        why_not = "its environment: cannot run outside the trainer (TRL makes one instance per rollout)"
    if why_not:
        return [Finding(stage, "reward signal", "info", "", f"not measured: {why_not}")], None
    values = resolved_values(ctx)
    spec = declared(ctx.stage, "filter")
    k = spec.k if spec is not None else values["num_generations"]
    names = [r.name for r in ctx.stage.rewards]
    rule = pass_rule(rewards, spec, ctx.where, names, required=spec is not None)
    rows = ctx.spec.rows.read(ctx)[:prompts]
    sampling, max_new_tokens = sampling_settings(values)
    loaded = load_stage_policy(ctx.model, lora=None, seed=ctx.seed, init_from=init_dir, trainable=False, log=log,
                               label="starting policy")
    groups = measure_groups(loaded.model, loaded.tokenizer, rows, rewards, rule, k=k, sampling=sampling,
                            max_new_tokens=max_new_tokens, seed=ctx.seed,
                            toolbox=stage_toolbox(ctx.stage, loaded.tokenizer, values, model_name=ctx.model.name,
                                                  base_dir=ctx.recipe.base_dir, where=ctx.where))
    figures = summarize(groups)
    figures["pass"] = None if rule is None else rule.describe
    found = [Finding(stage, "reward signal", "ok", figures_text(figures), "most groups can teach")]
    warning = why_no_signal(figures)
    if warning:
        found[0].level, found[0].verdict = "warn", warning
    if rule is None:
        figures["no_pass_rate"] = no_pass_rate(rewards)
        found.append(Finding(stage, "pass rate", "info", "", figures["no_pass_rate"]))
    if figures["truncated_share"] > 0.5:
        found.append(Finding(stage, "truncated completions", "warn", f"{figures['truncated_share']:.0%} of "
                             f"{figures['prompts'] * k}", f"most completions hit max_completion_length "
                             f"{max_new_tokens}; raise train.max_completion_length"))
    reference = worked_solution_column({k: [r.get(k) for r in rows] for k in (rows[0] if rows else {})})
    for reward in rewards:
        found.append(reward_finding(stage, reward.name, figures["rewards"][reward.name], figures["prompts"] * k,
                                    worked_solution_hint(reward, figures["rewards"][reward.name], reference)))
    if spec is not None:
        kept = keep_within(groups, spec.min_pass, spec.max_pass)
        record = filter_record(groups, kept, spec, rule.describe, "check")
        figures["filter"] = record
        after = (f"zero-variance groups {record['zero_variance_share_before']:.0%} -> "
                 f"{record.get('zero_variance_share_after', 0):.0%}" if kept else "nothing kept")
        found.append(Finding(stage, "filter", "ok" if kept else "warn",
                             f"keeps {len(kept)} of {len(groups)} ({record['kept_share']:.0%}); {after}",
                             f"pass in [{spec.min_pass:g}, {spec.max_pass:g}], pass = {rule.describe}"))
    return found, figures


def check_signal(recipe: Recipe, run_dir: Path, prompts: int, console) -> tuple[list[Finding], dict[str, Any]]:
    """Findings and figures of every RL stage that samples completions."""
    outputs = {s.name: run_dir / s.name for s in recipe.stages}
    found: list[Finding] = []
    figures: dict[str, Any] = {}
    for stage in recipe.stages:
        if not stage.spec.groups:
            continue
        ctx = StageContext(recipe, stage, run_dir, console, outputs)
        console.print(f"kit check: sampling the starting policy of stage '{ctx.name}' ...", highlight=False,
                      markup=False)
        stage_found, stage_figures = stage_signal(ctx, prompts, log=lambda message: None)
        found += stage_found
        if stage_figures is not None:
            figures[ctx.name] = stage_figures
    return found, figures
