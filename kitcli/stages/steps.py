"""The training library's calls that every training stage makes with its context: the context unpacked into their
typed arguments here, once (kitcli/training/ takes no StageContext)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kitcli.recipe.stage_context import StageContext
from kitcli.training.checkpoints import resume_checkpoint, stage_lora
from kitcli.training.held_out import HeldOutPlan, held_out_plan


def plan_held_out(ctx: StageContext) -> HeldOutPlan | None:
    """The stage's `eval:` checked and resolved (kitcli/training/held_out.py), None without one."""
    return held_out_plan(ctx.stage, base_dir=ctx.recipe.base_dir, run_dir=ctx.run_dir, seed=ctx.seed,
                         where=ctx.where)


def checkpoint_to_resume(ctx: StageContext, settings: dict[str, Any]) -> Path | None:
    """The stage's last checkpoint, checked against `settings` and the LoRA it trains with, before anything trains
    (kitcli/training/checkpoints.py resume_checkpoint); None to start afresh."""
    return resume_checkpoint(ctx.dir, settings, lora=stage_lora(ctx.init_dir, ctx.lora), where=ctx.where,
                             log=ctx.log, checkpoint_files=ctx.spec.resume.files)
