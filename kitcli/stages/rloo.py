"""RLOO stage: TRL's RLOOTrainer, REINFORCE with a leave-one-out baseline, against a KL reference that is the
stage's starting policy.

    kit run tiny-rloo
    kit run recipes/qwen3-4b-rloo.yaml --dry-run

The method (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", arXiv 2402.14740; the leave-one-out baseline is Kool et al. 2019's "Buy 4 REINFORCE samples, get
a baseline for free!"), as TRL 1.15's RLOOTrainer computes it. For each prompt x the policy samples k =
`num_generations` completions y_1..y_k. Each is scored by the stage's rewards (and/or reward model), and the KL
penalty is part of the reward, summed over the completion's tokens with the first-order log ratio of the sampling
policy to the reference:

    R_i = r(x, y_i) - beta * sum_t (log pi_old(y_i,t | x, y_i,<t) - log pi_ref(y_i,t | x, y_i,<t))

The baseline of completion i is the mean reward of the other k - 1 completions of the same prompt, so the advantage
needs no critic and no extra sample:

    A_i = R_i - 1/(k-1) * sum_{j != i} R_j

The loss clips a sequence-level ratio (the product of the token ratios, not their geometric mean as in GSPO) as PPO
does, and averages over the sequences of the batch:

    rho_i = pi_theta(y_i | x) / pi_old(y_i | x) = exp(sum_t log pi_theta(y_i,t) - sum_t log pi_old(y_i,t))
    L = -1/B * sum_i min(rho_i A_i, clip(rho_i, 1 - epsilon, 1 + epsilon_high) A_i)

With the kit's defaults the update is on-policy (num_iterations 1, one optimizer step per generation batch), so
rho_i is 1 and the gradient is REINFORCE's, -1/B sum_i A_i grad log pi_theta(y_i | x); the clip matters only when
`num_iterations` > 1 or `steps_per_generation` > `gradient_accumulation_steps`. Log-probabilities are taken at the
sampling temperature.

Every field that decides the objective is set by the kit (and `--dry-run` prints them; `train:` still wins):

    beta 0.05 (KL penalty in the reward; 0 loads no reference), num_generations 8 (k), epsilon 0.2,
    epsilon_high 0.2, num_iterations 1, normalize_advantages false (A_i as above, not re-scaled over the batch),
    reward_clip_range null, mask_truncated_completions false, temperature 1.0, top_p 1.0, top_k 0, min_p null,
    repetition_penalty 1.0, max_completion_length 256, reward_weights (from each reward's weight:),
    steps_per_generation = gradient_accumulation_steps, disable_dropout true, learning_rate 5e-6

Rewards and reward models are given exactly as for GRPO (`rewards:`, `reward_model:`, `system_prompt:`; a reward that
fails stops the stage naming the reward and the sample). The reference: the policy is the base plus one LoRA
adapter holding exactly the weights `init:` saved; RLOOTrainer copies that adapter into a frozen adapter "ref" and
computes the reference log-probs with it. `kitcli/training/trainers.py` checks, on TRL's trainer and on Unsloth's
generated one alike, that "ref" equals the starting adapter and is frozen (so with `init: sft` the KL is to the SFT
model, and the first logged `kl` is 0). The "ref" adapter is not saved in `adapter/`.

Data, generation batches, checkpoints (at whole generation batches), the dashboard, alarms and the report are the
GRPO stage's: this module reuses kitcli/stages/grpo.py, which builds the RLOOTrainer its StageSpec names. Unlike a
GRPO stage it takes no `tools:` or `environment:`: TRL 1.15's RLOOTrainer has no `tools=` or `environment_factory=`
(docs/tools.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from kitcli.recipe.filter_spec import FilteredSection
from kitcli.recipe.schema import RESERVED_TRAIN
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Launcher, Rows, StageSpec
from kitcli.stages import grpo, sampling


class RLOOSection(FilteredSection):
    """RLOO: TRL's RLOOTrainer (REINFORCE with a leave-one-out baseline, KL penalty in the reward)."""

    type: Literal["rloo"]
    reserved: ClassVar[dict[str, str]] = {**RESERVED_TRAIN, "reward_weights": "each reward's weight: gives it"}
    train_ranges: ClassVar[dict] = sampling.SAMPLING_RANGES
    train_choices: ClassVar[dict] = {"vllm_mode": sampling.SAMPLING_CHOICES["vllm_mode"]}


# The fields that decide RLOO's objective beyond the generation settings it shares with GRPO (grpo.base_defaults).
RLOO_PRESET: dict[str, Any] = {
    "beta": 0.05,
    "epsilon": 0.2,
    "epsilon_high": 0.2,
    "num_iterations": 1,
    "normalize_advantages": False,
    "reward_clip_range": None,
    "mask_truncated_completions": False,
}


def reference(ctx: StageContext) -> str:
    beta = ctx.section.train.get("beta", RLOO_PRESET["beta"])
    if beta == 0:
        return "none (beta 0: no KL penalty, no reference computed)"
    return f"frozen copy of the starting policy ({ctx.section.init or 'base model'}), KL penalty beta {beta:g}"


def describe(ctx: StageContext) -> dict[str, Any]:
    return grpo.describe_stage(ctx, RLOO_PRESET, {"method": "rloo", "reference": reference(ctx)})


def run(ctx: StageContext) -> dict[str, Any]:
    return grpo.train_stage(ctx, RLOO_PRESET, {"method": "rloo", "reference": reference(ctx)})


SPEC = StageSpec(
    type="rloo", order=80, module=__name__, section=RLOOSection,
    summary="TRL RLOOTrainer: REINFORCE with a leave-one-out baseline, KL to the starting policy in the reward",
    output="policy", init_from=("policy",), trainer="trl.trainer.rloo_trainer:RLOOTrainer",
    config="trl.trainer.rloo_config:RLOOConfig", rows=Rows(shape="prompts", read=grpo.load_rows), groups=True,
    rl=True, memory=sampling.RL_MEMORY, display=sampling.RL_DISPLAY,
    refused_keys={"tools": "TRL 1.15's RLOOTrainer takes no tools"},
    launcher=Launcher("data parallel (TRL RLOOTrainer): each process generates its share of the completions"),
    defaults=lambda ctx, on_gpu=None: grpo.stage_defaults(ctx, RLOO_PRESET, on_gpu))
