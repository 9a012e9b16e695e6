"""Fitting a GPU: the changes that lower a stage's peak, most harmless first, applied until it fits, and the
`--set` flags that make them."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kitcli.plan.estimate import Estimate, MiB, estimate

if TYPE_CHECKING:
    from kitcli.plan.architecture import Architecture
    from kitcli.plan.settings import Settings


@dataclass
class Change:
    key: str
    old: Any
    new: Any


def halved(value: int, floor: int) -> int:
    return max(floor, value // 2)


def candidate_moves(s: Settings) -> list[tuple[list[Change], Settings]]:
    """Changes that lower memory, most harmless first: checkpointing, batch (keeping the effective batch with
    gradient accumulation), generations, lengths, LoRA rank, 4-bit."""
    moves: list[tuple[list[Change], Settings]] = []
    if not s.gradient_checkpointing and not s.evaluates:
        moves.append(([Change("train.gradient_checkpointing", False, True)], replace(s, gradient_checkpointing=True)))
    if s.evaluates and s.eval_batch_size > 1:
        new = halved(s.eval_batch_size, 1)
        moves.append(([Change("generation.batch_size", s.eval_batch_size, new)], replace(s, eval_batch_size=new)))
    if not s.evaluates and s.per_device_train_batch_size > 1:
        new = halved(s.per_device_train_batch_size, 1)
        factor = s.per_device_train_batch_size // new
        accumulation = s.gradient_accumulation_steps * factor
        changes = [Change("train.per_device_train_batch_size", s.per_device_train_batch_size, new),
                   Change("train.gradient_accumulation_steps", s.gradient_accumulation_steps, accumulation)]
        updated = replace(s, per_device_train_batch_size=new, gradient_accumulation_steps=accumulation)
        if s.rl and not s.generation_batch_size:
            steps = s.steps_per_generation * factor  # the same completions per generation round
            if s.spec.groups:  # GRPO's family sets it; a distillation's generation batch follows the accumulation
                changes.append(Change("train.steps_per_generation", s.steps_per_generation, steps))
            updated = replace(updated, steps_per_generation=steps)
        moves.append((changes, updated))
    if s.rl and s.num_generations > 2 and not s.use_vllm:
        new = halved(s.num_generations, 2)
        batch = s.completions_at_once * new // s.num_generations  # same prompts per round, fewer completions
        changes = [Change("train.num_generations", s.num_generations, new)]
        if not s.generation_batch_size and batch % s.per_device_train_batch_size == 0:
            steps = batch // s.per_device_train_batch_size  # TRL takes steps_per_generation or the batch, not both
            changes.append(Change("train.steps_per_generation", s.steps_per_generation, steps))
            moves.append((changes, replace(s, num_generations=new, steps_per_generation=steps)))
        else:
            changes.append(Change("train.generation_batch_size", s.completions_at_once, batch))
            moves.append((changes, replace(s, num_generations=new, generation_batch_size=batch)))
    if s.completion_len > 64 and s.rl:
        new = halved(s.completion_len, 64)
        moves.append(([Change("train.max_completion_length", s.completion_len, new)],
                      replace(s, completion_len=new, seq_len=s.prompt_len + new)))
    if "max_length" in s.memory_settings and s.seq_len > 256:
        new = halved(s.seq_len, 256)
        moves.append(([Change("train.max_length", s.seq_len, new)], replace(s, seq_len=new)))
    if s.lora_r is not None and s.lora_r > 8:
        new = halved(s.lora_r, 8)
        moves.append(([Change("lora.r", s.lora_r, new)], replace(s, lora_r=new)))
    if s.lora_r is not None and not s.load_in_4bit:
        moves.append(([Change("model.load_in_4bit", False, True)], replace(s, load_in_4bit=True)))
    return moves


def fit(arch: Architecture, s: Settings, budget: float, limit: int = 24) -> tuple[list[Change], Settings, Estimate]:
    """Apply the first move that lowers the peak, repeatedly, until the stage fits `budget` (or nothing helps)."""
    changes: list[Change] = []
    current = s
    current_estimate = estimate(arch, current, budget)
    for _ in range(limit):
        if current_estimate.peak <= budget:
            break
        for moved, candidate in candidate_moves(current):
            candidate_estimate = estimate(arch, candidate, budget)
            if candidate_estimate.peak < current_estimate.peak - MiB:
                changes = merge_changes(changes, moved)
                current, current_estimate = candidate, candidate_estimate
                break
        else:
            break
    touched = {c.key for c in changes}
    if s.rl and s.spec.groups and not current.generation_batch_size and touched & {
            "train.per_device_train_batch_size", "train.gradient_accumulation_steps", "train.num_generations"}:
        # spell out steps_per_generation: the kit's default for it follows gradient_accumulation_steps
        changes = [c for c in changes if c.key != "train.steps_per_generation"]
        changes.append(Change("train.steps_per_generation", s.steps_per_generation, current.steps_per_generation))
    return changes, current, current_estimate


def merge_changes(changes: list[Change], new: list[Change]) -> list[Change]:
    merged = {c.key: c for c in changes}
    for change in new:
        merged[change.key] = Change(change.key, merged[change.key].old if change.key in merged else change.old,
                                    change.new)
    return [c for c in merged.values() if c.old != c.new]


def set_flag(stage_name: str, change: Change) -> str:
    if change.key.startswith(("lora.", "model.")):
        return f"--set {change.key}={json.dumps(change.new)}"
    return f"--set stages.{stage_name}.{change.key}={json.dumps(change.new)}"

