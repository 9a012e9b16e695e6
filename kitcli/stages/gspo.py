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

`variant:` picks the sequence-level objective; each sets every field that decides it:

    variant  loss_type  importance_sampling  beta  epsilon  epsilon_high  steps_per_gen  aggregation
    gspo     grpo       sequence             0.0   3e-4     4e-4          4              mean over sequences of
                                                                                         min(s_i A_i, clip(s_i) A_i)
    luspo    luspo      sequence             0.0   3e-4     4e-4          4              the same objective, each
                                                                                         sequence's term times its
                                                                                         length |o_i| (mean over
                                                                                         sequences of |o_i| min(...))

(both: scale_rewards group, mask_truncated_completions false, gradient_accumulation_steps 1, and the soft-gate
knobs of kitcli/stages/grpo.py's base). LUSPO keeps GSPO's ratio, clip range and schedule and only removes GSPO's
bias towards short completions (a sequence's term no longer shrinks with its length). LUSPO needs the
sequence-level ratio; a grpo stage with `loss_type: luspo` on token-level ratios is refused.

Papers: GSPO, Zheng et al. 2025, Group Sequence Policy Optimization (arXiv 2507.18071), configuration from TRL's
paper index; LUSPO, Liu et al. 2026, Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli import dist
from kitcli.errors import KitError
from kitcli.recipe.schema import RESERVED_TRAIN
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Launcher, Rows, StageSpec
from kitcli.recipe.unsloth_spec import UnslothSpec, unsloth_field
from kitcli.stages import grpo, sampling
from kitcli.training.tool_use import ToolsSection


class GSPOSection(ToolsSection):
    """GSPO: GRPO with the importance ratio and clipping at the sequence level (the paper's configuration)."""

    type: Literal["gspo"]
    variant: Literal["gspo", "luspo"] = Field("gspo", description="The objective: gspo, or luspo (each sequence's "
                                                                  "term scaled by its length)")
    allow_on_policy: bool = Field(False, description="Run on-policy settings anyway (the sequence ratio is then 1).")
    unsloth: UnslothSpec = unsloth_field()
    reserved: ClassVar[dict[str, str]] = {**RESERVED_TRAIN, "reward_weights": "each reward's weight: gives it"}
    train_ranges: ClassVar[dict] = sampling.SAMPLING_RANGES
    train_choices: ClassVar[dict] = sampling.SAMPLING_CHOICES


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
VARIANTS: dict[str, dict[str, Any]] = {"gspo": GSPO_PRESET, "luspo": {**GSPO_PRESET, "loss_type": "luspo"}}
DEFAULT_VARIANT = "gspo"


def variant_name(ctx: StageContext) -> str:
    return ctx.section.variant or DEFAULT_VARIANT


def preset(ctx: StageContext) -> dict[str, Any]:
    return VARIANTS[variant_name(ctx)]


def check_off_policy(ctx: StageContext) -> None:
    train = ctx.section.train
    if train.get("importance_sampling_level", "sequence") != "sequence":
        raise KitError(f"{ctx.where}: a gspo stage uses importance_sampling_level 'sequence'; for token-level "
                       f"ratios use a stage of type grpo")
    if ctx.section.allow_on_policy:
        return
    values = {**grpo.stage_defaults(ctx, preset(ctx)), **train}
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
    return grpo.describe_stage(ctx, preset(ctx), {"method": "gspo", "variant": variant_name(ctx),
                                                  "allow_on_policy": ctx.section.allow_on_policy})


def run(ctx: StageContext) -> dict[str, Any]:
    check_off_policy(ctx)
    return grpo.train_stage(ctx, preset(ctx), {"method": "gspo", "variant": variant_name(ctx)})


SPEC = StageSpec(
    type="gspo", order=70, module=__name__, section=GSPOSection,
    summary="GRPO with importance_sampling_level sequence and the paper's configuration (variant gspo or luspo)",
    output="policy", init_from=("policy",), trainer="trl.trainer.grpo_trainer:GRPOTrainer",
    config="trl.trainer.grpo_config:GRPOConfig", rows=Rows(shape="prompts", read=grpo.load_rows), groups=True,
    rl=True, memory=sampling.RL_MEMORY, display=sampling.RL_DISPLAY,
    launcher=Launcher("data parallel (TRL GRPOTrainer)"),
    defaults=lambda ctx, on_gpu=None: grpo.stage_defaults(ctx, preset(ctx), on_gpu))
