"""RLOO's leave-one-out advantage and its loss (kitcli/stages/rloo.py), computed here from scratch on a fixed small
batch and compared with what the trainer the kit builds computes, on TRL's RLOOTrainer and on Unsloth's generated
UnslothRLOOTrainer (forced on the CPU, conftest.trainer_family).

Rewards are fixed numbers (a reward file returns them by position), so the leave-one-out baselines are known in
advance; the policy is moved away from its reference so that the KL penalty in the reward is not zero.
The two loss tests also run at the GPU's precision (their "-bf16" cases, conftest.precision), with tolerances
derived from the gap between the test's forwards at bf16 and at float32 (helpers.PrecisionGap) and sequence ratios
kept clear of the clip edges by more than that gap can move them; the advantage tests run in float32 only (the
rewards are fixed, and with the KL penalty the trainer's own scoring is what they read).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import DATA, clear_of, move_policy, stage_context, trainer_loss, write_recipe
from test_rl_formulas import (
    GROUPS,
    SCORES,
    TEMPERATURE,
    G,
    assert_same,
    bf16_tolerances,
    clip_edges,
    clipped,
    logprob_gap,
    loss_and_grads,
    policy_logps,
)

from kitcli.stages import grpo, rloo
from kitcli.training.trainers import is_unsloth_class

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families


def build(tmp_path: Path, train: dict | None = None):
    (tmp_path / "fixed_rewards.py").write_text(textwrap.dedent(f"""
        SCORES = {SCORES!r}

        def fixed(prompts, completions, **kwargs):
            return SCORES[: len(completions)]
    """))
    stage = {"name": "rl", "type": "rloo", "data": str(DATA / "arithmetic_prompts.jsonl"),
             "rewards": ["fixed_rewards.py:fixed"],
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G, "max_completion_length": 6,
                       "temperature": TEMPERATURE, **(train or {})}}
    ctx = stage_context(write_recipe(tmp_path / "r.yaml", [stage]), "rl", tmp_path / "run", {})
    trainer, _, _ = grpo.build_trainer(ctx, rloo.RLOO_PRESET, kind="rloo")
    assert is_unsloth_class(type(trainer)) == (os.environ["KIT_TRAINERS"] == "unsloth"), type(trainer)
    assert type(trainer).__name__.removeprefix("Unsloth") == "RLOOTrainer"
    return trainer


def generation_batch(trainer) -> dict:
    """One generation batch scored by the fixed rewards, computed in eval mode (no gradient accumulation)."""
    rows = [trainer.train_dataset[i] for i in range(GROUPS)]
    trainer.model.eval()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([row for row in rows for _ in range(G)])


def test_leave_one_out_advantage_without_kl(tmp_path):
    """beta 0: A_i = r_i - 1/(k-1) sum_{j != i} r_j, here for the rewards [1, 0, 0, 1] and [0.5, 2, 0.5, 0]."""
    trainer = build(tmp_path, {"beta": 0.0})
    advantages = generation_batch(trainer)["advantages"].cpu()
    by_hand = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3,
                            0.5 - 2.5 / 3, 2 - 1 / 3, 0.5 - 2.5 / 3, 0 - 3 / 3])
    torch.testing.assert_close(advantages, by_hand)


def test_leave_one_out_advantage_with_the_kl_penalty_in_the_reward(tmp_path):
    """R_i = r_i - beta sum_t (log pi_old - log pi_ref) (first-order log ratio, summed over the completion, at the
    sampling temperature); A_i = R_i - 1/(k-1) sum_{j != i} R_j."""
    trainer = build(tmp_path)
    beta = trainer.args.beta
    assert (beta, trainer.args.normalize_advantages, trainer.args.reward_clip_range) == (0.05, False, None)
    model = trainer.model
    move_policy(model)
    batch = generation_batch(trainer)
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        policy = policy_logps(model, batch)
        with model.disable_adapter():  # the reference: the starting policy, here the base (a fresh LoRA is zero)
            reference = policy_logps(model, batch)
    kl = ((policy - reference) * mask).sum(1).cpu()
    assert kl.abs().max() > 0.1, "the policy must differ from its reference, or the KL term is not tested"
    rewards = (torch.tensor(SCORES) - beta * kl).view(GROUPS, G)
    baseline = (rewards.sum(1, keepdim=True) - rewards) / (G - 1)
    torch.testing.assert_close(batch["advantages"].cpu(), (rewards - baseline).flatten(), rtol=1e-4, atol=1e-5)
    # the logged kl is the per-token mean of the same log ratio
    logged = trainer._metrics["eval"]["kl"][-1]
    assert logged == pytest.approx((((policy - reference) * mask).sum() / mask.sum()).item(), rel=1e-4, abs=1e-6)


def test_clipped_sequence_ratio_loss(tmp_path, precision):
    """rho_i = exp(sum_t log pi_theta - sum_t log pi_old) (one ratio per sequence, the product of its token ratios);
    L = -1/B sum_i min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps_high) A_i)."""
    trainer = build(tmp_path)
    config = trainer.args
    assert (config.epsilon, config.epsilon_high, config.num_iterations) == (0.2, 0.2, 1)
    model = trainer.model
    batch = generation_batch(trainer)
    mask = batch["completion_mask"].float()
    gap = logprob_gap(model, batch)
    with torch.no_grad():
        current = (policy_logps(model, batch) * mask).sum(1)
    # ratios 0.61 .. 1.65, around [0.8, 1.2]; in bf16, clear of its edges by more than a bf16 forward can move a
    # sequence's summed log-ratio (twice the largest sum of one sequence's per-token gaps)
    offsets = clear_of(torch.linspace(-0.5, 0.5, GROUPS * G), clip_edges(config), gap.sequence_tolerance("logps"))
    batch = {**batch, "old_logps": current - offsets.to(current.device)}
    advantages = batch["advantages"]
    assert (advantages != 0).all()

    def objective(logps):  # of the per-token log-probs
        ratio = torch.exp((logps * mask).sum(1) - batch["old_logps"])
        return -clipped(ratio, advantages, config.epsilon, config.epsilon_high).mean()

    logps = (policy_logps(model, batch) * mask).sum(1)
    ratio = torch.exp(logps - batch["old_logps"])
    ours = -clipped(ratio, advantages, config.epsilon, config.epsilon_high).mean()
    outside = ((ratio < 1 - config.epsilon) & (advantages < 0)) | ((ratio > 1 + config.epsilon_high) & (advantages > 0))
    assert 0 < outside.float().mean() < 1, "the batch must exercise the clipping"

    assert_same(loss_and_grads(trainer_loss(trainer, batch, model), model), loss_and_grads(ours, model),
                bf16=bf16_tolerances(gap, objective, model))
    mode = "train" if model.training else "eval"  # the metrics' key, as the trainer read it (Unsloth's sets train)
    assert trainer._metrics[mode]["clip_ratio/region_mean"][-1] == pytest.approx(outside.float().mean().item())


def test_on_policy_gradient_is_reinforce_with_the_baseline(tmp_path, precision):
    """With the kit's on-policy defaults rho_i = 1, and the gradient is -1/B sum_i A_i grad log pi_theta(y_i | x).
    (In bf16 the trainer's ratio is its loss forward against its own scoring forward, 1 within their gap.)"""
    trainer = build(tmp_path)
    model = trainer.model
    batch = generation_batch(trainer)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]
    gap = logprob_gap(model, batch)
    logps = (policy_logps(model, batch) * mask).sum(1)
    torch.testing.assert_close(logps.detach(), batch["old_logps"], rtol=1e-5,
                               atol=1e-5 + gap.sequence_tolerance("logps"))

    def reinforce_of(logps):  # of the per-token log-probs
        return -(advantages * (logps * mask).sum(1)).mean()

    def ratio_loss(logps):  # the trainer's value, -1/B sum_i rho_i A_i, of the per-token log-probs
        return -(torch.exp((logps * mask).sum(1) - batch["old_logps"]) * advantages).mean()

    reinforce = -(advantages * logps).mean()
    trl, ours = loss_and_grads(trainer_loss(trainer, batch, model), model), loss_and_grads(reinforce, model)
    assert trl[0] == pytest.approx(-advantages.mean().item(),  # the value: ratios of 1
                                   abs=1e-6 + gap.value_tolerance(ratio_loss))
    assert_same((0.0, trl[1]), (0.0, ours[1]), bf16=(0.0, gap.gradient_tolerance(reinforce_of, model)))
