"""The GRPO and GSPO objectives of the reference page, and of the kit's other GRPO presets (CISPO, SAPO, VESPO) and
GSPO's LUSPO variant as their papers and TRL define them, computed here from scratch on a fixed small batch and
compared with what the trainer the kit builds (the real `build_trainer`, after Unsloth's patching) computes.

A TRL or Unsloth change that alters an advantage, a ratio, the clipping or the aggregation fails here. Every test runs
twice: on TRL's own GRPOTrainer (what a CPU run uses) and on Unsloth's generated UnslothGRPOTrainer (what a GPU run
uses), forced on the CPU (conftest.trainer_family).
Rewards are fixed numbers (a reward file returns them by position), so the advantages are known in advance;
old log-probabilities are shifted by a fixed random amount so that ratios differ from 1 and some are clipped.

The tests that compare a loss also run at the GPU's precision (conftest.precision, docs/conformance.md): the "-bf16"
cases build the trainer with the kit's GPU dtype settings and run the test's own forwards under bf16 autocast, on
the CPU too. Their tolerances are derived from the gap between the test's forwards at bf16 and at float32, measured
on the test's own batch (helpers.PrecisionGap), and their clip decisions are kept clear of the clip edges by twice
the largest per-token gap (helpers.clear_of). In float32 (the cases without a suffix) nothing of that changes a
number: the fixtures and tolerances are the float32 ones.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    DATA,
    PrecisionGap,
    clear_of,
    forward_precision,
    move_policy,
    precision_scale,
    trainer_loss,
    write_recipe,
)
from rich.console import Console

from kitcli.recipe.load import load_recipe
from kitcli.recipe.stage_context import StageContext
from kitcli.stages import grpo, gspo
from kitcli.training.trainers import is_unsloth_class

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families

GROUPS = 2
G = 4  # completions per prompt
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.5, 0.0]  # group 1, then group 2
TEMPERATURE = 0.8  # not 1, so a trainer that forgot the sampling temperature in its log-probs would be caught


def build(tmp_path: Path, stage_type: str, train: dict | None = None, variant: str | None = None):
    (tmp_path / "fixed_rewards.py").write_text(textwrap.dedent(f"""
        SCORES = {SCORES!r}

        def fixed(prompts, completions, **kwargs):
            return SCORES[: len(completions)]
    """))
    stage = {"name": "rl", "type": stage_type, "data": str(DATA / "arithmetic_prompts.jsonl"),
             "rewards": ["fixed_rewards.py:fixed"],
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G, "max_completion_length": 6,
                       "temperature": TEMPERATURE, **(train or {})}}
    if variant:
        stage["variant"] = variant
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", [stage])))
    ctx = StageContext(recipe, recipe.stage("rl"), tmp_path / "run", Console(quiet=True), {})
    if stage_type == "gspo":
        preset = gspo.VARIANTS[variant or gspo.DEFAULT_VARIANT]
    else:
        preset = grpo.VARIANTS[variant or grpo.DEFAULT_VARIANT]
    trainer, _, _ = grpo.build_trainer(ctx, preset)
    assert is_unsloth_class(type(trainer)) == (os.environ["KIT_TRAINERS"] == "unsloth"), type(trainer)
    return trainer


def generation_batch(trainer) -> dict:
    """One generation batch scored by the fixed rewards, computed in eval mode (no gradient accumulation)."""
    rows = [trainer.train_dataset[i] for i in range(GROUPS)]
    trainer.model.eval()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([row for row in rows for _ in range(G)])


def policy_logps(model, batch: dict) -> torch.Tensor:
    """log pi_theta(o_t | q, o_<t) of each completion token at the sampling temperature, by a plain forward pass."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with forward_precision():
        logits = model(input_ids=ids, attention_mask=mask).logits
    n = batch["completion_ids"].shape[1]
    logits = logits[:, -n - 1:-1, :].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def with_old_logps(trainer, batch: dict, spread: float, offsets: torch.Tensor | None = None,
                   edges: tuple[float, ...] = (), margin: float = 0.0):
    """The batch with old log-probabilities = current - shift, so the token ratios are exp(shift): a fixed random
    shift per token, plus `offsets` per sequence (to place whole sequences inside or outside the clip range).
    `edges`, `margin`: every token's log-ratio kept `margin` clear of each clip edge (0 in float32: unchanged)."""
    with torch.no_grad():
        current = policy_logps(trainer.model, batch)
    noise = torch.rand(current.shape, generator=torch.Generator().manual_seed(1))
    shift = ((noise * 2 - 1) * spread).to(current.device)
    if offsets is not None:
        shift = shift + offsets.to(current.device).unsqueeze(1)
    shift = clear_of(shift, edges, margin)
    return {**batch, "old_per_token_logps": current - shift}, shift


def clip_edges(config) -> tuple[float, float]:
    """The clip range [1 - epsilon, 1 + epsilon_high] as log-ratios."""
    return math.log(1 - config.epsilon), math.log(1 + config.epsilon_high)


def logprob_gap(model, batch: dict) -> PrecisionGap:
    """The policy's per-token log-probs at bf16 and at float32 on this batch (nothing measured in float32)."""
    return PrecisionGap(lambda: {"logps": policy_logps(model, batch)}, batch["completion_mask"].float())


def group_rewards() -> torch.Tensor:
    return torch.tensor(SCORES).view(GROUPS, G)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def loss_and_grads(loss: torch.Tensor, model) -> tuple[float, list[torch.Tensor]]:
    params = trainable(model)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.item(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def assert_same(trl: tuple[float, list], ours: tuple[float, list], magnitude: float = 1.0,
                bf16: tuple[float, float] = (0.0, 0.0)) -> None:
    """`magnitude`: how many times larger than a mean over tokens the loss's terms are (its float32 rounding too).
    `bf16`: the (loss, gradient) tolerances measured for the bf16 case (bf16_tolerances), added to the float32 ones."""
    scale = precision_scale()  # 1 on a CPU
    assert trl[0] == pytest.approx(ours[0], rel=1e-4 * scale, abs=1e-7 * scale * magnitude + bf16[0])
    for a, b in zip(trl[1], ours[1]):
        torch.testing.assert_close(a, b, rtol=1e-3 * scale, atol=1e-7 * scale * magnitude + bf16[1])


def bf16_tolerances(gap: PrecisionGap, objective, model) -> tuple[float, float]:
    """The loss's and the gradient's tolerance in bf16, derived from the gap of `objective`'s inputs (0 in float32)."""
    return gap.value_tolerance(objective), gap.gradient_tolerance(objective, model)


def test_group_z_score_advantage(tmp_path):
    """GRPO: A_i = (R_i - mean(R_group)) / std(R_group), the same for every token of o_i."""
    trainer = build(tmp_path, "grpo", variant="grpo")
    advantages = generation_batch(trainer)["advantages"].cpu().view(GROUPS, G)
    rewards = group_rewards()
    expected = (rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)  # sample std, as TRL
    # TRL adds 1e-4 to the std to avoid dividing by zero; that is the only difference allowed.
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=1e-3)


def test_dr_grpo_advantage_is_unscaled(tmp_path):
    """Dr. GRPO: A_i = R_i - mean(R_group), no division by the group's std."""
    trainer = build(tmp_path, "grpo", variant="dr_grpo")
    advantages = generation_batch(trainer)["advantages"].cpu().view(GROUPS, G)
    rewards = group_rewards()
    torch.testing.assert_close(advantages, rewards - rewards.mean(1, keepdim=True))


def test_batch_scaled_advantage(tmp_path):
    """scale_rewards: batch, the other fix for the difficulty bias: divide by the whole batch's std."""
    trainer = build(tmp_path, "grpo", variant="dr_grpo", train={"scale_rewards": "batch"})
    advantages = generation_batch(trainer)["advantages"].cpu().view(GROUPS, G)
    rewards = group_rewards()
    expected = (rewards - rewards.mean(1, keepdim=True)) / rewards.flatten().std()
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=1e-3)


def clipped(ratio, advantage, low, high):
    return torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)


def test_grpo_loss_matches_deepseekmath_formula(tmp_path, precision):
    """L = -1/G sum_i 1/|o_i| sum_t [min(r A, clip(r) A) - beta KL_t], KL_t = pi_ref/pi - log(pi_ref/pi) - 1,
    with the policy moved off its reference first (a fresh LoRA has B = 0: KL and its gradient would be 0 whatever
    the trainer does) and the reference log-probs computed here, from the starting weights, not taken from the
    trainer. A dropped or sign-flipped KL term, or a reference that follows the live policy, fails (in bf16 too:
    the KL term must outweigh the tolerance)."""
    trainer = build(tmp_path, "grpo", variant="grpo", train={"beta": 0.5})
    config = trainer.args
    assert (config.loss_type, config.beta, config.epsilon) == ("grpo", 0.5, 0.2)
    model = trainer.model
    move_policy(model, 0.025)  # before sampling: the trainer's reference log-probs must still be the start's

    def starting_policy(batch: dict) -> torch.Tensor:
        with torch.no_grad(), model.disable_adapter():  # the starting policy: the base (its fresh adapter adds 0)
            return policy_logps(model, batch)

    raw = generation_batch(trainer)
    gap = PrecisionGap(lambda: {"logps": policy_logps(model, raw), "start": starting_policy(raw)},
                       raw["completion_mask"].float())
    batch, _ = with_old_logps(trainer, raw, spread=0.4, edges=clip_edges(config),
                              margin=gap.input_tolerance("logps"))
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"].unsqueeze(1)
    start = starting_policy(batch)
    if gap.measured:  # bf16: two roundings of one value differ token by token by up to the sum of their errors,
        # which on one token may each be the largest (the trainer's and this test's own largest are different
        # samples): compared on average, the trainer's error and the test's are each the measured mean gap
        difference = (batch["ref_per_token_logps"] - start).abs()[mask.bool()].mean().item()
        assert difference <= gap.mean_tolerance("start"), (difference, str(gap))
    else:
        torch.testing.assert_close(batch["ref_per_token_logps"], start, rtol=1e-4 * precision_scale(),
                                   atol=1e-5 * precision_scale())

    def token_kl(logps, start):
        log_ref_ratio = start - logps
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1

    def token_mean_kl(logps, start):
        return (token_kl(logps, start) * mask).sum() / mask.sum()

    def objective(logps, start):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        kl_term = config.beta * token_kl(logps, start)
        per_token = clipped(ratio, advantages, config.epsilon, config.epsilon_high) - kl_term
        return -((per_token * mask).sum(1) / mask.sum(1)).mean()

    logps = policy_logps(model, batch)
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    kl = token_kl(logps, start)
    mean_kl = token_mean_kl(logps, start).item()
    assert mean_kl > 0.01, "the policy must have moved off its reference, or the KL term is not tested"
    ours = objective(logps, start)
    assert 0 < ((ratio - 1).abs() > config.epsilon).float().mean() < 1, "the batch must exercise the clipping"

    tolerances = bf16_tolerances(gap, objective, model)
    kl_term = (config.beta * (kl * mask).sum(1) / mask.sum(1)).mean().item()
    assert kl_term > tolerances[0], f"the KL term ({kl_term:.2e}) must outweigh the tolerance ({tolerances[0]:.2e})"
    assert_same(loss_and_grads(trainer_loss(trainer, batch, model), model), loss_and_grads(ours, model),
                bf16=tolerances)
    if is_unsloth_class(type(trainer)):  # the autocast Unsloth latched for its loss (rl_replacements.py)
        assert (trainer._autocast_enabled, trainer._autocast_dtype) == (precision == "bf16", torch.bfloat16)
    assert trainer._metrics["eval"]["kl"][-1] == pytest.approx(
        mean_kl, rel=1e-4 * precision_scale(), abs=gap.value_tolerance(token_mean_kl) or None), str(gap)


def sequence_offsets(config, gap: PrecisionGap, spread: float) -> torch.Tensor:
    """Sequence log-ratios from -1.5e-3 to 1.5e-3 around GSPO's clip range [1 - 3e-4, 1 + 4e-4]. In bf16, moved out
    of it on both sides by more than a bf16 forward can move a sequence's mean log-ratio (twice the largest
    per-token gap) plus the token noise (`spread`): the range is narrower than that, so no sequence stays inside."""
    margin = gap.input_tolerance("logps") + spread if gap.measured else 0.0
    return clear_of(torch.linspace(-1.5e-3, 1.5e-3, GROUPS * G), clip_edges(config), margin)


def test_gspo_sequence_ratio_and_clipped_objective(tmp_path, precision):
    """s_i = exp(1/|y_i| sum_t log(pi/pi_old)), the geometric mean of the token ratios;
    L = -1/G sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i)."""
    trainer = build(tmp_path, "gspo", train={"per_device_train_batch_size": GROUPS * G // 4})
    assert trainer.args.steps_per_generation == 4 and trainer.args.gradient_accumulation_steps == 1
    config = trainer.args
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)
    # token noise on top of each sequence's offset
    batch, shift = with_old_logps(trainer, raw, spread=5e-4, offsets=sequence_offsets(config, gap, 5e-4))
    assert (config.importance_sampling_level, config.loss_type, config.beta) == ("sequence", "grpo", 0.0)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]

    def sequence_ratio_of(logps):
        token_ratio = torch.exp(logps - batch["old_per_token_logps"])
        return torch.exp((torch.log(token_ratio) * mask).sum(1) / mask.sum(1))

    def objective(logps):
        return -clipped(sequence_ratio_of(logps), advantages, config.epsilon, config.epsilon_high).mean()

    logps = policy_logps(trainer.model, batch)
    sequence_ratio = sequence_ratio_of(logps)
    geometric_mean = torch.exp((shift * mask).sum(1) / mask.sum(1))  # the ratios as constructed
    torch.testing.assert_close(sequence_ratio.detach(), geometric_mean, rtol=1e-5, atol=1e-6)
    ours = objective(logps)
    outside = ((sequence_ratio < 1 - config.epsilon) & (advantages < 0)) | (
        (sequence_ratio > 1 + config.epsilon_high) & (advantages > 0))
    assert 0 < outside.float().mean() < 1, "the batch must exercise the sequence-level clipping"

    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                bf16=bf16_tolerances(gap, objective, trainer.model))
    # TRL's clip metric counts sequences, one ratio each
    assert trainer._metrics["eval"]["clip_ratio/region_mean"][-1] == pytest.approx(outside.float().mean().item())


@pytest.mark.parametrize("variant", ["dapo", "dr_grpo", "bnpo"])
def test_token_level_aggregations(tmp_path, variant, precision):
    """DAPO/BNPO: sum over all tokens / number of tokens; Dr. GRPO: sum / (G * max_completion_length).
    (Masking of truncated completions is off here: the untrained tiny model rarely stops within 6 tokens.)"""
    trainer = build(tmp_path, "grpo", variant=variant, train={"mask_truncated_completions": False})
    config = trainer.args
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=0.4, edges=clip_edges(config), margin=gap.input_tolerance("logps"))
    mask = batch["completion_mask"].float()

    def objective(logps):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        per_token = clipped(ratio, batch["advantages"].unsqueeze(1), config.epsilon, config.epsilon_high) * mask
        if variant == "dr_grpo":
            return -per_token.sum() / (mask.shape[0] * config.max_completion_length)
        return -per_token.sum() / mask.sum()

    ours = objective(policy_logps(trainer.model, batch))
    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                bf16=bf16_tolerances(gap, objective, trainer.model))


def test_dapo_masks_truncated_completions(tmp_path):
    """DAPO's overlong filtering: a completion cut at max_completion_length contributes no token to the loss."""
    trainer = build(tmp_path, "grpo", variant="dapo", train={"max_completion_length": 2})
    assert trainer.args.mask_truncated_completions is True
    batch = generation_batch(trainer)
    stops = {*trainer.eos_token_ids, trainer.processing_class.pad_token_id}
    truncated = torch.tensor([ids[-1].item() not in stops for ids in batch["completion_ids"]])
    assert truncated.any()
    assert (batch["completion_mask"][truncated] == 0).all()
    assert (batch["completion_mask"][~truncated][:, 0] == 1).all()


# --- the other presets: CISPO, SAPO, VESPO (grpo) and LUSPO (gspo) ----------------------------------------------


def test_cispo_clips_the_detached_weight_not_the_update(tmp_path, precision):
    """CISPO (MiniMax-M1): per token -sg(min(r, eps_max)) A log pi, with eps_max = epsilon_high (5.0, ScaleRL) and no
    lower bound on r; summed over all tokens / number of tokens, like DAPO."""
    trainer = build(tmp_path, "grpo", variant="cispo")
    config = trainer.args
    assert (config.loss_type, config.epsilon_high, config.beta, config.importance_sampling_level) == (
        "cispo", 5.0, 0.0, "token")
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=2.5,  # token ratios from 0.08 to 12
                              edges=(math.log(config.epsilon_high),), margin=gap.input_tolerance("logps"))
    mask = batch["completion_mask"].float()

    def per_token_terms(logps):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        weight = torch.clamp(ratio, max=config.epsilon_high).detach()
        return -weight * batch["advantages"].unsqueeze(1) * logps * mask

    def objective(logps):
        return per_token_terms(logps).sum() / mask.sum()

    logps = policy_logps(trainer.model, batch)
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    terms = per_token_terms(logps)
    ours = terms.sum() / mask.sum()
    capped = ((ratio > config.epsilon_high) & (mask > 0)).float().sum() / mask.sum()
    assert 0 < capped < 1, "some token weights must be capped, not all"
    assert (((ratio < 1 - config.epsilon) & (mask > 0)).sum() > 0), "low ratios are kept as they are (no lower clip)"

    # The per-token terms (up to 5 x |A| x |log pi|) are far larger than their mean, which cancels to about 1e-3;
    # their float32 rounding is what a second computation of the same sum may differ by. (In bf16 the loss's
    # tolerance is larger than the loss, for the same reason: each term moves with its own token's gap while the
    # sum cancels. There the gradient is the check that binds.)
    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                magnitude=terms.detach().abs().max().item(), bf16=bf16_tolerances(gap, objective, trainer.model))


def test_sapo_soft_gate(tmp_path, precision):
    """SAPO: per token -(4 / tau) sigmoid(tau (r - 1)) A, tau = sapo_temperature_pos (1.0) for A > 0 and
    sapo_temperature_neg (1.05) otherwise; per-sequence mean, then mean over sequences (as GRPO). (No clip: no
    edge to keep clear of in bf16.)"""
    trainer = build(tmp_path, "grpo", variant="sapo")
    config = trainer.args
    assert (config.loss_type, config.sapo_temperature_pos, config.sapo_temperature_neg) == ("sapo", 1.0, 1.05)
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=0.6)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"].unsqueeze(1)
    assert (advantages > 0).any() and (advantages < 0).any(), "both temperatures must be used"

    def objective(logps):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        tau = torch.where(advantages > 0, torch.tensor(1.0), torch.tensor(1.05))
        gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        return -((gate * advantages * mask).sum(1) / mask.sum(1)).mean()

    ours = objective(policy_logps(trainer.model, batch))
    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                bf16=bf16_tolerances(gap, objective, trainer.model))


def test_vespo_gamma_weight_of_the_sequence_ratio(tmp_path, precision):
    """VESPO: w_i = prod_t r_i,t (the sequence's importance weight), phi(w) = e^lam w^k e^(-lam w) (phi(1) = 1) with
    (k, lam) = (2, 3) for A >= 0 and (3, 2) for A < 0, detached; per token -phi(w_i) A_i log pi, summed over all
    tokens / number of tokens."""
    trainer = build(tmp_path, "grpo", variant="vespo")
    config = trainer.args
    assert (config.loss_type, config.importance_sampling_level) == ("vespo", "token")
    assert (config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg) == (
        2.0, 3.0, 3.0, 2.0)
    offsets = torch.linspace(-0.6, 0.6, GROUPS * G)  # sequence weights well away from 1, on both sides
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)  # (no clip: no edge to keep clear of in bf16)
    batch, _ = with_old_logps(trainer, raw, spread=0.1, offsets=offsets)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"].unsqueeze(1)

    def gamma_weight(logps):
        with torch.no_grad():
            w = torch.exp(((logps - batch["old_per_token_logps"]) * mask).sum(1, keepdim=True))
            k = torch.where(advantages >= 0, torch.tensor(2.0), torch.tensor(3.0))
            lam = torch.where(advantages >= 0, torch.tensor(3.0), torch.tensor(2.0))
            return torch.exp(lam) * w ** k * torch.exp(-lam * w)

    def objective(logps):
        return (-gamma_weight(logps) * advantages * logps * mask).sum() / mask.sum()

    logps = policy_logps(trainer.model, batch)
    assert (gamma_weight(logps) - 1).abs().max() > 0.1, "the weights must differ from the on-policy 1"
    ours = objective(logps)

    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                bf16=bf16_tolerances(gap, objective, trainer.model))


def test_luspo_scales_each_sequence_term_by_its_length(tmp_path, precision):
    """LUSPO: GSPO's sequence ratio s_i and clipped objective, each sequence's term times its length |o_i|:
    L = -1/G sum_i |o_i| min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i)."""
    trainer = build(tmp_path, "gspo", variant="luspo", train={"per_device_train_batch_size": GROUPS * G // 4})
    config = trainer.args
    assert (config.importance_sampling_level, config.loss_type, config.beta, config.epsilon, config.epsilon_high) == (
        "sequence", "luspo", 0.0, 3e-4, 4e-4)
    raw = generation_batch(trainer)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=5e-4, offsets=sequence_offsets(config, gap, 5e-4))
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]

    def sequence_ratio_of(logps):
        return torch.exp(((logps - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1))

    def objective(logps):
        return -(mask.sum(1) * clipped(sequence_ratio_of(logps), advantages, config.epsilon,
                                       config.epsilon_high)).mean()

    logps = policy_logps(trainer.model, batch)
    sequence_ratio = sequence_ratio_of(logps)
    ours = objective(logps)
    outside = ((sequence_ratio < 1 - config.epsilon) & (advantages < 0)) | (
        (sequence_ratio > 1 + config.epsilon_high) & (advantages > 0))
    assert 0 < outside.float().mean() < 1, "the batch must exercise the sequence-level clipping"

    # The terms are up to |o_i| times GSPO's, and so is their float32 rounding. (Not the trainer's loss divided by
    # the length instead: Unsloth's compiled loss ignores the gradient flowing into it, so a scaled loss keeps its
    # unscaled gradient.)
    assert_same(loss_and_grads(trainer_loss(trainer, batch), trainer.model), loss_and_grads(ours, trainer.model),
                magnitude=config.max_completion_length, bf16=bf16_tolerances(gap, objective, trainer.model))
