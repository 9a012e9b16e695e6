"""Generation batches of the stages that sample groups (GRPO, GSPO, RLOO): every batch holds whole groups of
num_generations completions of one prompt, and a checkpoint falls where a generation batch starts (TRL keeps the
batch's completions in memory, not in a checkpoint), so that a resume continues exactly."""

from __future__ import annotations

import math
from typing import Any

from kitcli import dist
from kitcli.errors import KitError


def check_group_sizes(values: dict[str, Any], where: str) -> None:
    """Every generation batch must hold whole groups of num_generations completions of one prompt."""
    per_device = values["per_device_train_batch_size"]
    num_generations = values["num_generations"]
    if not isinstance(num_generations, int) or num_generations < 2:
        raise KitError(f"{where}: train.num_generations must be an integer >= 2 (the advantage compares "
                       f"completions of the same prompt), got {num_generations!r}")
    if values.get("generation_batch_size") is not None:
        batch = values["generation_batch_size"]
        source = f"generation_batch_size {batch}"
    else:
        steps = values["steps_per_generation"]
        batch = per_device * steps
        source = f"per_device_train_batch_size {per_device} x steps_per_generation {steps}"
    if batch % num_generations:
        fits = [g for g in range(2, batch + 1) if batch % g == 0]
        multiple = num_generations * per_device // math.gcd(num_generations, per_device)
        other = f"use num_generations {', '.join(map(str, fits))}, or " if fits else ""
        raise KitError(f"{where}: num_generations {num_generations} does not divide the generation batch of "
                       f"{batch} completions ({source}); {other}make the generation batch a multiple of "
                       f"{num_generations} (e.g. train.generation_batch_size: {multiple}, or "
                       f"per_device_train_batch_size: {multiple}; Unsloth's notebooks leave it to Unsloth to raise "
                       f"the batch to num_generations, which the kit does not do behind your back)")


def generation_cycle(values: dict[str, Any]) -> int:
    """Optimizer steps between two generation batches that start at an optimizer-step boundary. TRL generates
    every steps_per_generation x num_iterations micro-batches and keeps the completions in memory (not in a
    checkpoint), so only a checkpoint at a multiple of this resumes exactly."""
    accumulation = values["gradient_accumulation_steps"]
    if values.get("generation_batch_size") is not None:  # TRL: generation batch / (per device batch x processes)
        per_generation = values["generation_batch_size"] // (values["per_device_train_batch_size"] * dist.world_size())
    else:
        per_generation = values["steps_per_generation"]
    micro = per_generation * values["num_iterations"]
    return micro * accumulation // math.gcd(micro, accumulation) // accumulation


def check_save_steps(values: dict[str, Any], where: str) -> None:
    cycle = generation_cycle(values)
    save_steps = values.get("save_steps")
    if values.get("save_strategy", "steps") == "steps" and isinstance(save_steps, int) and save_steps % cycle:
        lower = save_steps - save_steps % cycle
        options = " or ".join(str(n) for n in (lower, lower + cycle) if n > 0)
        raise KitError(f"{where}: train.save_steps {save_steps} is not a multiple of {cycle}, the optimizer steps "
                       f"between two generation batches (steps_per_generation x num_iterations / "
                       f"gradient_accumulation_steps); a checkpoint inside a generation batch could not resume "
                       f"exactly; use save_steps {options}")
