"""`kit check`'s batch arithmetic: the generation batch against num_generations (whole groups), steps per epoch,
the total steps and the share of them spent warming up, as the stage's trainer will count them."""

from __future__ import annotations

import math
from typing import Any

from kitcli import dist
from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding


def steps_per_epoch_rl(rows: int, values: dict[str, Any], world: int) -> float:
    completions = rows * values["num_generations"]
    per_step = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] * world
    return completions / per_step * values.get("num_iterations", 1)


def batch_findings(ctx: StageContext, rows: int, values: dict[str, Any]) -> list[Finding]:
    stage, spec, world = ctx.name, ctx.spec, dist.world_size()
    if spec.evaluates or "per_device_train_batch_size" not in values:
        return []
    per, accum = values["per_device_train_batch_size"], values["gradient_accumulation_steps"]
    found = []
    if spec.groups:
        generations = values["num_generations"]
        batch = values.get("generation_batch_size") or per * values.get("steps_per_generation", accum) * world
        per_epoch = steps_per_epoch_rl(rows, values, world)
        found.append(Finding(stage, "generation batch", "ok" if batch % generations == 0 else "warn",
                             f"{batch} completions = {batch // max(1, generations)} prompts x num_generations "
                             f"{generations}; {world} process(es)",
                             "whole groups" if batch % generations == 0 else "num_generations does not divide it"))
    else:
        per_epoch = math.ceil(math.ceil(rows / (per * world)) / accum)
    max_steps = values.get("max_steps") or -1
    total = max_steps if max_steps > 0 else math.ceil(float(values.get("num_train_epochs", 1)) * per_epoch)
    epochs = total / per_epoch if per_epoch else 0
    figures = f"{rows} rows, {per_epoch:g} steps per epoch, {total} steps ({epochs:.2f} epochs)"
    if declared(ctx.stage, "filter") is not None:  # how many it keeps is known once the policy is sampled
        figures += (" before the filter, which keeps only the prompts the starting policy passes sometimes (--signal "
                    "or the run's filter says how many)")
    if total <= 0:
        found.append(Finding(stage, "steps", "warn", figures, "trains zero steps; set train.max_steps or give "
                                                                   "more rows"))
    elif epochs < 0.5 and max_steps > 0:
        found.append(Finding(stage, "steps", "info", figures, f"sees {epochs:.0%} of the rows once"))
    else:
        found.append(Finding(stage, "steps", "ok", figures, "trains"))
    warmup = values.get("warmup_steps") or 0
    warmup = warmup * total if isinstance(warmup, float) and warmup < 1 else warmup
    warmup = max(warmup, (values.get("warmup_ratio") or 0) * total)
    if total > 0 and warmup:
        share = warmup / total
        found.append(Finding(stage, "warm-up", "warn" if share > 0.3 else "ok", f"{warmup:g} of {total} steps",
                             f"{share:.0%} of training at a reduced learning rate" +
                             ("; lower warmup_steps" if share > 0.3 else "")))
    return found
