"""The GRPO and GSPO objectives of the reference page, and of the kit's other GRPO presets (CISPO, SAPO, VESPO) and
GSPO's LUSPO variant as their papers and TRL define them, computed here from scratch on a fixed small batch and
compared with what the trainer the kit builds (the real `build_trainer`, after Unsloth's patching) computes.

A TRL or Unsloth change that alters an advantage, a ratio, the clipping or the aggregation fails here. Every test runs
twice: on TRL's own GRPOTrainer (what a CPU run uses) and on Unsloth's generated UnslothGRPOTrainer (what a GPU run
uses), forced on the CPU (conftest.trainer_family).
Rewards are fixed numbers (a reward file returns them by position), so the advantages are known in advance; the
completions end at unequal lengths (LENGTHS), so every normalisation is its own; old log-probabilities are the
trainer's own current ones shifted by fixed amounts, so the ratios its loss sees are known and fall on both sides of
each clip edge. The constants of each formula (beta, epsilon, the temperatures) are written here as the paper and the
kit's preset give them, not read from the trainer: a preset or trainer with another value fails on the loss.

Each loss is checked twice (docs/conformance.md): against the formula evaluated on the trainer's own per-token
log-probs from the same forward (recorded while it computes the loss: tests/same_forward.py), loss and gradient, to
float32 rounding in both precision modes; and against the test's own forward pass: in float32 (the cases without a
suffix) the loss and gradient of the formula on it, as before; at the GPU's precision (the "-bf16" cases,
conftest.precision: the kit's GPU dtype settings and bf16 autocast on the CPU too) the trainer's log-probs against it,
on average within the gap measured between the test's forwards at bf16 and at float32 (helpers.PrecisionGap).
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path

import pytest
import torch
from grpo_batches import (
    GROUPS,
    LENGTHS,
    MAX_LENGTH,
    MICRO,
    SCORES,
    TEMPERATURE,
    G,
    assert_both_sides_of_each_edge,
    assert_policy_is_the_tests,
    assert_trainer_is_the_formula,
    clip_crossings,
    clip_edges,
    clipped,
    generation_batch,
    held,
    logprob_gap,
    loss_logps,
    micro_batch,
    only,
    per_sequence_mean,
    policy_logps,
    with_old_logps,
)
from helpers import DATA, PrecisionGap, move_policy, precision_scale, trainer_loss, write_recipe
from rich.console import Console
from same_forward import compared, float32_tolerance

from kitcli.recipe.load import load_recipe
from kitcli.recipe.stage_context import StageContext
from kitcli.stages import grpo, gspo
from kitcli.training.trainers import is_unsloth_class

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families


def build(tmp_path: Path, stage_type: str, train: dict | None = None, variant: str | None = None):
    (tmp_path / "fixed_rewards.py").write_text(textwrap.dedent(f"""
        SCORES = {SCORES!r}

        def fixed(prompts, completions, **kwargs):
            return SCORES[: len(completions)]
    """))
    stage = {"name": "rl", "type": stage_type, "data": str(DATA / "arithmetic_prompts.jsonl"),
             "rewards": ["fixed_rewards.py:fixed"],
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G,
                       "max_completion_length": MAX_LENGTH, "temperature": TEMPERATURE, **(train or {})}}
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


def group_rewards() -> torch.Tensor:
    return torch.tensor(SCORES).view(GROUPS, G)


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


def test_grpo_loss_matches_deepseekmath_formula(tmp_path, precision):
    """L = -1/G sum_i 1/|o_i| sum_t [min(r A, clip(r) A) - beta KL_t], KL_t = pi_ref/pi - log(pi_ref/pi) - 1,
    with beta 0.5 (the stage's train.beta) and DeepSeekMath's clip 0.2 on both sides (the grpo preset's), the policy
    moved off its reference first (a fresh LoRA has B = 0: KL and its gradient would be 0 whatever the trainer does)
    and the reference log-probs computed here, from the starting weights, not taken from the trainer. A dropped,
    sign-flipped or rescaled KL term, a reference that follows the live policy, another clip or Dr. GRPO's
    normalisation (the completions' lengths differ) fails, in bf16 too."""
    beta, epsilon = 0.5, 0.2
    trainer = build(tmp_path, "grpo", variant="grpo", train={"beta": beta})
    config = trainer.args
    assert (config.loss_type, config.beta, config.epsilon, config.epsilon_high) == ("grpo", beta, epsilon, epsilon)
    model = trainer.model
    move_policy(model, 0.025)  # before sampling: the trainer's reference log-probs must still be the start's

    def starting_policy(batch: dict) -> torch.Tensor:
        with torch.no_grad(), model.disable_adapter():  # the starting policy: the base (its fresh adapter adds 0)
            return policy_logps(model, batch)

    raw = generation_batch(trainer, LENGTHS)
    mask = raw["completion_mask"].float()
    gap = PrecisionGap(lambda: {"logps": policy_logps(model, raw), "start": starting_policy(raw)}, mask)
    batch, _ = with_old_logps(trainer, raw, spread=0.4, edges=clip_edges(epsilon, epsilon),
                              margin=gap.input_tolerance("logps"))
    advantages = batch["advantages"].unsqueeze(1)
    start = starting_policy(batch)
    if gap.measured:  # bf16: two roundings of one value differ token by token by up to the sum of their errors,
        # which on one token may each be the largest (the trainer's and this test's own largest are different
        # samples): compared on average, the trainer's error and the test's are each the measured mean gap
        difference = (batch["ref_per_token_logps"] - start).abs()[mask.bool()].mean().item()
        assert compared("reference log-probs", difference, gap.mean_tolerance("start")), (difference, str(gap))
    else:  # (on the completions' tokens: the padding after a shorter one is nobody's log-prob)
        torch.testing.assert_close(batch["ref_per_token_logps"][mask.bool()], start[mask.bool()],
                                   rtol=1e-4 * precision_scale(), atol=1e-5 * precision_scale())

    def token_kl(logps, reference):
        log_ref_ratio = reference - logps
        return torch.exp(log_ref_ratio) - log_ref_ratio - 1

    def objective(logps, reference, aggregate=per_sequence_mean):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        return -aggregate(clipped(ratio, advantages, epsilon, epsilon) - beta * token_kl(logps, reference), mask)

    def dr_grpo(per_token, mask):  # Dr. GRPO's aggregation, for the batch's check
        return (per_token * mask).sum() / (mask.shape[0] * MAX_LENGTH)

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch, model)
    logps, reference = only(seen, batch), batch["ref_per_token_logps"]  # the trainer's own, from its own forwards
    with torch.no_grad():
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        assert_both_sides_of_each_edge(clip_crossings(ratio, advantages, epsilon, epsilon, mask))
        mean_kl = ((token_kl(logps, reference) * mask).sum() / mask.sum()).item()
        kl_term = beta * per_sequence_mean(token_kl(logps, reference), mask).item()
        tolerance = float32_tolerance(objective(logps, reference).item())
        normalised_apart = abs(objective(logps, reference).item() - objective(logps, reference, dr_grpo).item())
    assert mean_kl > 0.01, "the policy must have moved off its reference, or the KL term is not tested"
    assert 0.2 * kl_term > 3 * tolerance, f"a fifth of the KL term ({kl_term:.2e}) must outweigh the tolerance"
    assert normalised_apart > 3 * tolerance, "the batch must tell GRPO's normalisation from Dr. GRPO's"

    trainer_result = assert_trainer_is_the_formula(loss, lambda logps: objective(logps, reference), logps, model)
    assert_policy_is_the_tests(trainer_result, lambda logps: objective(logps, start), logps, model, batch, gap)
    if is_unsloth_class(type(trainer)):  # the autocast Unsloth latched for its loss (rl_replacements.py)
        assert (trainer._autocast_enabled, trainer._autocast_dtype) == (precision == "bf16", torch.bfloat16)
    # the logged kl: per token, of the trainer's own log-probs; in float32 also of the test's forward
    logged = trainer._metrics["eval"]["kl"][-1]
    assert compared("kl metric", abs(logged - mean_kl), 1e-4 * mean_kl), (logged, mean_kl)
    if not gap.measured:
        ours = policy_logps(model, batch)
        expected_kl = ((token_kl(ours, start) * mask).sum() / mask.sum()).item()
        assert logged == pytest.approx(expected_kl, rel=1e-4 * precision_scale())


# GSPO's and LUSPO's clip range, [1 - 3e-4, 1 + 4e-4] (the GSPO paper's), and the sequences' log-ratios placed around
# it on the trainer's own log-probs, by advantage sign (+ - - + - + - -): held above (1.5e-3) and below (-1.5e-3,
# -6e-4) the range, inside it (2e-4, -1e-4), above it with A < 0 (not held), and far outside (+-0.1). The ten times
# wider range [1 - 3e-3, 1 + 4e-3] would not hold the first three. Token ratios spread +-0.01 around their
# sequence's (centred: a sequence's geometric mean is its offset), so token-level ratios would clip other tokens.
SEQUENCE_EPSILONS = (3e-4, 4e-4)
SEQUENCE_OFFSETS = torch.tensor([1.5e-3, -1.5e-3, 2e-4, -1e-4, 1.5e-3, 0.1, -0.1, -6e-4])
TOKEN_SPREAD = 0.01


def sequence_level_batch(trainer, lengths: tuple[int, ...] | None = None) -> tuple[dict, torch.Tensor]:
    """A GSPO / LUSPO batch: old log-probs placing each sequence at its offset (completions of `lengths`)."""
    raw = generation_batch(trainer, lengths)
    return with_old_logps(trainer, raw, spread=TOKEN_SPREAD, offsets=SEQUENCE_OFFSETS, centred=True)


def sequence_ratio_of(logps, batch: dict):
    """s_i = exp(1/|o_i| sum_t log(pi/pi_old)), the geometric mean of the token ratios."""
    mask = batch["completion_mask"].float()
    return torch.exp(((logps - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1))


def assert_sequences_placed(logps, batch: dict, objective, token_level, tolerance: float) -> None:
    """The trainer's own sequence ratios are the offsets (float32 rounding apart), on both sides of each edge of the
    paper's range and inside it, and the batch tells the sequence-level loss from the token-level one and the
    paper's clip range from one ten times wider (by more than three tolerances)."""
    low, high = SEQUENCE_EPSILONS
    with torch.no_grad():
        ratio = sequence_ratio_of(logps, batch)
        torch.testing.assert_close(torch.log(ratio), SEQUENCE_OFFSETS.to(ratio), rtol=0, atol=1e-6)
        assert_both_sides_of_each_edge(clip_crossings(ratio, batch["advantages"], low, high))
        value = objective(logps, low, high).item()
        assert abs(value - objective(logps, 10 * low, 10 * high).item()) > 3 * tolerance, "a wider clip must show"
        assert abs(value - token_level(logps, low, high).item()) > 3 * tolerance, "token ratios must show"


def test_gspo_sequence_ratio_and_clipped_objective(tmp_path, precision):
    """s_i = exp(1/|y_i| sum_t log(pi/pi_old)), the geometric mean of the token ratios;
    L = -1/G sum_i min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i) (the paper's clip range)."""
    trainer = build(tmp_path, "gspo", train={"per_device_train_batch_size": GROUPS * G // 4})
    assert trainer.args.steps_per_generation == 4 and trainer.args.gradient_accumulation_steps == 1
    config = trainer.args
    assert (config.importance_sampling_level, config.loss_type, config.beta) == ("sequence", "grpo", 0.0)
    assert (config.epsilon, config.epsilon_high) == SEQUENCE_EPSILONS
    batch, shift = sequence_level_batch(trainer)
    gap = logprob_gap(trainer.model, batch)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]

    def objective(logps, low=SEQUENCE_EPSILONS[0], high=SEQUENCE_EPSILONS[1]):
        return -clipped(sequence_ratio_of(logps, batch), advantages, low, high).mean()

    def token_level(logps, low, high):  # the same clip on each token's ratio, averaged per sequence
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        return -per_sequence_mean(clipped(ratio, advantages.unsqueeze(1), low, high), mask)

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    assert_sequences_placed(logps, batch, objective, token_level, float32_tolerance(objective(logps).item()))
    if not gap.measured:  # and the test's own float32 forward gives the ratios as constructed
        geometric_mean = torch.exp((shift * mask).sum(1) / mask.sum(1))
        torch.testing.assert_close(sequence_ratio_of(policy_logps(trainer.model, batch), batch).detach(),
                                   geometric_mean, rtol=1e-5, atol=1e-6)

    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap)
    # TRL's clip metric counts sequences, one ratio each
    crossings = clip_crossings(sequence_ratio_of(logps, batch).detach(), advantages, *SEQUENCE_EPSILONS)
    assert trainer._metrics["eval"]["clip_ratio/region_mean"][-1] == pytest.approx(held(crossings) / len(advantages))


@pytest.mark.parametrize("variant", ["dapo", "dr_grpo", "bnpo"])
def test_token_level_aggregations(tmp_path, variant, precision):
    """On one micro-batch of the generation batch (MICRO, half of it, as a training step gets it), with completions
    of unequal length: DAPO: sum over the micro-batch's tokens / the generation batch's token count; BNPO: / the
    micro-batch's token count; Dr. GRPO: / (its sequences x max_completion_length). Clip 0.2, and for DAPO 0.28
    above (clip-higher; the presets'). (Masking of truncated completions is off here: the full-length completions
    would drop out.)"""
    low, high = {"dapo": (0.2, 0.28), "dr_grpo": (0.2, 0.2), "bnpo": (0.2, 0.2)}[variant]
    trainer = build(tmp_path, "grpo", variant=variant,
                    train={"mask_truncated_completions": False, "per_device_train_batch_size": GROUPS * G // 2,
                           "gradient_accumulation_steps": 2})
    config = trainer.args
    assert (config.loss_type, config.epsilon, config.epsilon_high, config.steps_per_generation) == (
        variant, low, high, 2)
    raw = generation_batch(trainer, LENGTHS)
    generation_tokens = raw["completion_mask"].sum().item()
    raw = micro_batch(raw, MICRO)
    gap = logprob_gap(trainer.model, raw)
    # each completion's token log-ratios -0.6, -0.3, -0.1, 0.1, 0.3, 0.6 (ratios 0.55 to 1.82): below, inside and
    # above the clip range, held at each edge by the rows' advantage signs (+ - - +)
    batch, _ = with_old_logps(trainer, raw, pattern=(-0.6, -0.3, -0.1, 0.1, 0.3, 0.6), edges=clip_edges(low, high),
                              margin=gap.input_tolerance("logps"))
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"].unsqueeze(1)
    divisors = {"dapo": lambda: generation_tokens, "bnpo": lambda: mask.sum(),
                "dr_grpo": lambda: mask.shape[0] * MAX_LENGTH}

    def objective(logps, aggregation=variant):
        per_token = clipped(torch.exp(logps - batch["old_per_token_logps"]), advantages, low, high) * mask
        if aggregation == "grpo":
            return -per_sequence_mean(per_token, mask)
        return -per_token.sum() / divisors[aggregation]()

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    with torch.no_grad():
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        assert_both_sides_of_each_edge(clip_crossings(ratio, advantages, low, high, mask))
        values = {name: objective(logps, name).item() for name in ("grpo", "dapo", "bnpo", "dr_grpo")}
    tolerance = float32_tolerance(values[variant])
    assert all(abs(values[variant] - value) > 3 * tolerance for name, value in values.items() if name != variant), (
        "the batch must tell the four aggregations apart", values)
    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap)


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
    """CISPO (MiniMax-M1): per token -sg(min(r, eps_max)) A log pi, with eps_max = 5.0 (ScaleRL's, the cispo preset's
    epsilon_high) and no lower bound on r; summed over all tokens / number of tokens, like DAPO."""
    cap = 5.0
    trainer = build(tmp_path, "grpo", variant="cispo")
    config = trainer.args
    assert (config.loss_type, config.epsilon_high, config.beta, config.importance_sampling_level) == (
        "cispo", cap, 0.0, "token")
    raw = generation_batch(trainer, LENGTHS)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=2.5,  # token ratios from 0.08 to 12
                              edges=(math.log(cap),), margin=gap.input_tolerance("logps"))
    mask = batch["completion_mask"].float()

    def per_token_terms(logps):
        weight = torch.clamp(torch.exp(logps - batch["old_per_token_logps"]), max=cap).detach()
        return -weight * batch["advantages"].unsqueeze(1) * logps * mask

    def objective(logps):
        return per_token_terms(logps).sum() / mask.sum()

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    with torch.no_grad():
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        capped = ((ratio > cap) & (mask > 0)).float().sum() / mask.sum()
        magnitude = per_token_terms(logps).abs().max().item()
    assert 0 < capped < 1, "some token weights must be capped, not all"
    assert (((ratio < 1 - config.epsilon) & (mask > 0)).sum() > 0), "low ratios are kept as they are (no lower clip)"

    # The per-token terms (up to 5 x |A| x |log pi|) are far larger than their mean, which cancels to about 1e-3;
    # their float32 rounding is what a second computation of the same sum may differ by.
    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model, magnitude)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap, magnitude)


def test_sapo_soft_gate(tmp_path, precision):
    """SAPO: per token -(4 / tau) sigmoid(tau (r - 1)) A, tau = 1.0 for A > 0 and 1.05 otherwise (the paper's, the
    sapo preset's sapo_temperature_pos / _neg); per-sequence mean, then mean over sequences (as GRPO)."""
    trainer = build(tmp_path, "grpo", variant="sapo")
    config = trainer.args
    assert (config.loss_type, config.sapo_temperature_pos, config.sapo_temperature_neg) == ("sapo", 1.0, 1.05)
    raw = generation_batch(trainer, LENGTHS)
    gap = logprob_gap(trainer.model, raw)
    batch, _ = with_old_logps(trainer, raw, spread=0.6)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"].unsqueeze(1)
    assert (advantages > 0).any() and (advantages < 0).any(), "both temperatures must be used"

    def objective(logps):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        tau = torch.where(advantages > 0, torch.tensor(1.0), torch.tensor(1.05))
        gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        return -per_sequence_mean(gate * advantages, mask)

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap)


def test_vespo_gamma_weight_of_the_sequence_ratio(tmp_path, precision):
    """VESPO: w_i = prod_t r_i,t (the sequence's importance weight), phi(w) = e^lam w^k e^(-lam w) (phi(1) = 1) with
    (k, lam) = (2, 3) for A >= 0 and (3, 2) for A < 0 (the paper's), detached; per token -phi(w_i) A_i log pi, summed
    over all tokens / number of tokens."""
    trainer = build(tmp_path, "grpo", variant="vespo")
    config = trainer.args
    assert (config.loss_type, config.importance_sampling_level) == ("vespo", "token")
    assert (config.vespo_k_pos, config.vespo_lambda_pos, config.vespo_k_neg, config.vespo_lambda_neg) == (
        2.0, 3.0, 3.0, 2.0)
    offsets = torch.linspace(-0.6, 0.6, GROUPS * G)  # sequence weights well away from 1, on both sides
    raw = generation_batch(trainer, LENGTHS)
    gap = logprob_gap(trainer.model, raw)  # (no clip: no edge to keep clear of)
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

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    assert (gamma_weight(logps) - 1).abs().max() > 0.1, "the weights must differ from the on-policy 1"
    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap)


def test_luspo_scales_each_sequence_term_by_its_length(tmp_path, precision):
    """LUSPO: GSPO's sequence ratio s_i and clipped objective (clip [1 - 3e-4, 1 + 4e-4]), each sequence's term times
    its length |o_i| (the lengths differ): L = -1/G sum_i |o_i| min(s_i A_i, clip(s_i, 1-eps, 1+eps_high) A_i)."""
    trainer = build(tmp_path, "gspo", variant="luspo", train={"per_device_train_batch_size": GROUPS * G // 4})
    config = trainer.args
    assert (config.importance_sampling_level, config.loss_type, config.beta) == ("sequence", "luspo", 0.0)
    assert (config.epsilon, config.epsilon_high) == SEQUENCE_EPSILONS
    batch, _ = sequence_level_batch(trainer, LENGTHS)
    gap = logprob_gap(trainer.model, batch)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]

    def objective(logps, low=SEQUENCE_EPSILONS[0], high=SEQUENCE_EPSILONS[1]):
        return -(mask.sum(1) * clipped(sequence_ratio_of(logps, batch), advantages, low, high)).mean()

    def token_level(logps, low, high):
        ratio = torch.exp(logps - batch["old_per_token_logps"])
        return -(clipped(ratio, advantages.unsqueeze(1), low, high) * mask).sum(1).mean()

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch)
    logps = only(seen, batch)
    # The terms are up to |o_i| times GSPO's, and so is their float32 rounding. (Not the trainer's loss divided by
    # the length instead: Unsloth's compiled loss ignores the gradient flowing into it, so a scaled loss keeps its
    # unscaled gradient.)
    tolerance = float32_tolerance(objective(logps).item(), MAX_LENGTH)
    assert_sequences_placed(logps, batch, objective, token_level, tolerance)
    assert len(set(mask.sum(1).tolist())) > 1, "the lengths must differ, or the scaling is a constant"
    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, trainer.model, MAX_LENGTH)
    assert_policy_is_the_tests(trainer_result, objective, logps, trainer.model, batch, gap, MAX_LENGTH)
