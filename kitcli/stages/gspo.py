"""GSPO stage: GRPO with the importance ratio and clipping moved to the sequence level.

    kit run tiny-gspo

TRL has no GSPO trainer: GSPO is `GRPOConfig(importance_sampling_level="sequence")`, and that switch alone does
not give the paper's objective (TRL's default loss_type "dapo" aggregates over tokens). The preset below is the
configuration TRL's paper index gives to reproduce the paper: one ratio per sequence, the geometric mean of its
token ratios, clipped to [1 - 3e-4, 1 + 4e-4], each sequence weighted equally, no KL penalty, and four optimizer
steps per generation batch so that the ratio differs from 1.

The sequence ratio only matters off-policy. When `gradient_accumulation_steps` is a multiple of
`steps_per_generation * num_iterations` every update is on-policy, the ratio is exactly 1 and the stage would be
plain GRPO with sequence weighting; the kit refuses that unless the stage sets `allow_on_policy: true`.
Everything else (rewards, reward_model, init, train overrides) is as in the GRPO stage.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli import dist
from kitcli.context import StageContext
from kitcli.errors import KitError
from kitcli.schema import RESERVED_TRAIN, RewardedSection, StageSpec
from kitcli.stages import grpo


class GSPOSection(RewardedSection):
    """GSPO: GRPO with the importance ratio and clipping at the sequence level (the paper's configuration)."""

    type: Literal["gspo"]
    allow_on_policy: bool = Field(False, description="Run on-policy settings anyway (the sequence ratio is then 1).")
    config: ClassVar[str] = "GRPOConfig"
    reserved: ClassVar[dict[str, str]] = {**RESERVED_TRAIN, "reward_weights": "each reward's weight: gives it"}


GSPO_PRESET: dict[str, Any] = {
    "importance_sampling_level": "sequence",
    "loss_type": "grpo",
    "scale_rewards": "group",
    "beta": 0.0,
    "epsilon": 3e-4,
    "epsilon_high": 4e-4,
    "mask_truncated_completions": False,
    "gradient_accumulation_steps": 1,
    "steps_per_generation": 4,
}


def check_off_policy(ctx: StageContext) -> None:
    train = ctx.stage.get("train", {})
    if train.get("importance_sampling_level", "sequence") != "sequence":
        raise KitError(f"{ctx.where}: a gspo stage uses importance_sampling_level 'sequence'; for token-level "
                       f"ratios use a stage of type grpo")
    if ctx.stage.get("allow_on_policy"):
        return
    values = {**grpo.stage_defaults(ctx, GSPO_PRESET), **train}
    accumulation = values["gradient_accumulation_steps"]
    iterations = values["num_iterations"]
    if values.get("generation_batch_size") is not None:  # TRL: generation batch / (per device batch x processes)
        steps = values["generation_batch_size"] // (values["per_device_train_batch_size"] * dist.world_size())
    else:
        steps = values["steps_per_generation"]
    if accumulation % (steps * iterations) == 0:
        raise KitError(
            f"{ctx.where}: these settings are on-policy (gradient_accumulation_steps {accumulation} is a multiple of "
            f"steps_per_generation {steps} x num_iterations {iterations}), so every sequence ratio is exactly 1 and "
            f"GSPO's sequence-level clipping never acts; set steps_per_generation above gradient_accumulation_steps "
            f"(the paper: 4 with gradient_accumulation_steps 1) or num_iterations > 1, or set allow_on_policy: true "
            f"on the stage to run it anyway")


def describe(ctx: StageContext) -> dict[str, Any]:
    check_off_policy(ctx)
    return grpo.describe_stage(ctx, GSPO_PRESET, {"method": "gspo", "allow_on_policy": ctx.stage.get(
        "allow_on_policy", False)})


def run(ctx: StageContext) -> dict[str, Any]:
    check_off_policy(ctx)
    return grpo.train_stage(ctx, GSPO_PRESET, {"method": "gspo"})


SPEC = StageSpec(
    type="gspo", module=__name__, section=GSPOSection,
    summary="GRPO with importance_sampling_level sequence and the paper's configuration",
    output="policy", init_from=("policy",), trainer="grpo", metrics=grpo.RL_METRICS, panels=grpo.RL_PANELS, rl=True,
    launcher="data parallel (TRL GRPOTrainer)", memory_settings=grpo.RL_MEMORY,
    defaults=lambda ctx, on_gpu=None: grpo.stage_defaults(ctx, GSPO_PRESET, on_gpu), rows=grpo.load_rows)
