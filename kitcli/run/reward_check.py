"""`kit check`'s rewards: each stage's reward functions resolved before any model loads, as the stage will resolve
them (modules and files imported, factories called with their `args:`, two rewards of one name refused), and the
columns each reads checked against the stage's rows. A name that does not resolve is one line, exit 2, with the
closest public callable of the module it names (rewards/registry.py)."""

from __future__ import annotations

from typing import Any

from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding


def reward_findings(ctx: StageContext, rows: list[dict[str, Any]] | None) -> tuple[list[Finding], list]:
    """A stage's rewards resolved as the stage will resolve them (modules imported, factories called, two of one
    name refused: KitError, exit 2), and the columns each reads checked against the stage's rows as it reads them.
    Returns the finding and the loaded rewards (the filter's check reads them: each factory is called once)."""
    from kitcli.data.rows import read_rows
    from kitcli.training.tool_use import has_tools, stage_tools
    from rewards.registry import check_columns, load_rewards

    if has_tools(ctx.stage):  # its tools and environment resolve too (a KitError names the one that does not)
        stage_tools(ctx.stage, ctx.recipe.base_dir, ctx.where)
    found = held_out_findings(ctx)
    written = declared(ctx.stage, "rewards")
    if not written:
        return found, []
    rewards = load_rewards(written, ctx.recipe.base_dir, f"{ctx.where}: rewards", run_dir=ctx.run_dir)
    if rows:  # every column the stage reads (after its `columns:` mapping), not only those the checks measure
        spec = ctx.stage.data
        check_columns(rewards, read_rows(spec.model_copy(update={"limit": 1}), ctx.where)[0], ctx.where,
                      f"'{spec.path}'")
    return found + [Finding(ctx.name, "rewards", "ok", ", ".join(r.name for r in rewards),
                            "resolved: " + "; ".join(f"{r.name} from {r.source}" for r in rewards))], rewards


def held_out_findings(ctx: StageContext) -> list[Finding]:
    """A training stage's `eval:` resolved as the stage will resolve it: its rows read, its rewards imported and
    their columns checked (a KitError, exit 2, names the key), and one line of what it will score."""
    if declared(ctx.stage, "eval") is None:
        return []
    from kitcli.training.held_out import describe_held_out, held_out_plan

    plan = held_out_plan(ctx.stage, base_dir=ctx.recipe.base_dir, run_dir=ctx.run_dir, seed=ctx.seed, where=ctx.where)
    return [Finding(ctx.name, "held-out eval", "ok", describe_held_out(plan)["eval"], "resolved")]


def best_checkpoint_findings(ctx: StageContext, values: dict[str, Any]) -> list[Finding]:
    """With `eval:`, the best step's weights survive only if a checkpoint is saved at that step: every evaluation
    step must be a multiple of train.save_steps (the kit forces no extra save: one inside a GRPO generation batch
    would break an exact resume)."""
    held_out = declared(ctx.stage, "eval")
    every, save = held_out.every if held_out is not None else None, values.get("save_steps")
    if not isinstance(every, int) or not isinstance(save, int) or save <= 0 or every % save == 0:
        return []
    return [Finding(ctx.name, "best checkpoint", "warn", f"eval.every {every}, train.save_steps {save}",
                    f"an evaluation step that is not a multiple of {save} has no checkpoint, so a best step there "
                    f"cannot be exported; set train.save_steps to {every} (or a divisor of it)")]
