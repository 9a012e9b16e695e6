"""RLOO's leave-one-out advantage and its loss (kitcli/stages/rloo.py), computed here from scratch on a fixed small
batch and compared with what the trainer the kit builds computes, on TRL's RLOOTrainer and on Unsloth's generated
UnslothRLOOTrainer (forced on the CPU, conftest.trainer_family).

Rewards are fixed numbers (a reward file returns them by position), so the leave-one-out baselines are known in
advance; the policy is moved away from its reference so that the KL penalty in the reward is not zero. The
constants are the kit's RLOO preset's, written here: beta 0.05, epsilon 0.2 on both sides. Completions end at
unequal lengths (test_rl_formulas.LENGTHS).
The two loss tests check the trainer's loss and gradient against the formula on its own log-probs from the same
forward, in both precision modes, and against the test's own forward (in bf16: the log-probs on average within the
measured gap), as test_rl_formulas does; the sequence ratios are placed on the trainer's own log-probs, on both
sides of each clip edge. The advantage tests run in float32 only (the rewards are fixed, and with the KL penalty the
trainer's own scoring is what they read).
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
    assert_same,
    assert_trainer_is_the_formula,
    clip_crossings,
    clipped,
    generation_batch,
    gradients,
    held,
    logprob_gap,
    loss_logps,
    micro_batch,
    only,
    policy_logps,
    trainer_logps,
)
from helpers import DATA, move_policy, stage_context, trainer_loss, write_recipe
from same_forward import compared

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
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G,
                       "max_completion_length": MAX_LENGTH, "temperature": TEMPERATURE, **(train or {})}}
    ctx = stage_context(write_recipe(tmp_path / "r.yaml", [stage]), "rl", tmp_path / "run", {})
    trainer, _, _ = grpo.build_trainer(ctx, rloo.RLOO_PRESET, kind="rloo")
    assert is_unsloth_class(type(trainer)) == (os.environ["KIT_TRAINERS"] == "unsloth"), type(trainer)
    assert type(trainer).__name__.removeprefix("Unsloth") == "RLOOTrainer"
    return trainer


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
    beta = 0.05  # the kit's RLOO preset's
    trainer = build(tmp_path)
    assert (trainer.args.beta, trainer.args.normalize_advantages, trainer.args.reward_clip_range) == (beta, False, None)
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


# Sequence log-ratios placed on the trainer's own log-probs, by advantage sign (+ - - + - + - -), around the clip
# range [log 0.8, log 1.2] = [-0.223, 0.182]: held above (0.3) and below (-0.4, -0.3), inside (-0.1, 0.05, 0.1), and
# outside with the other sign (0.3 with A < 0, -0.4 with A > 0); each at least 0.077 from an edge.
RLOO_OFFSETS = torch.tensor([0.3, -0.4, -0.1, 0.05, 0.3, -0.4, -0.3, 0.1])


def sequence_logps(logps, mask):
    return (logps * mask).sum(1)


def test_clipped_sequence_ratio_loss(tmp_path, precision):
    """rho_i = exp(sum_t log pi_theta - sum_t log pi_old) (one ratio per sequence, the product of its token ratios);
    L = -1/B sum_i min(rho_i A_i, clip(rho_i, 1 - 0.2, 1 + 0.2) A_i)."""
    epsilon = 0.2
    trainer = build(tmp_path)
    config = trainer.args
    assert (config.epsilon, config.epsilon_high, config.num_iterations) == (epsilon, epsilon, 1)
    model = trainer.model
    raw = generation_batch(trainer, LENGTHS)
    mask = raw["completion_mask"].float()
    gap = logprob_gap(model, raw)
    current = sequence_logps(trainer_logps(trainer, raw), mask)
    batch = {**raw, "old_logps": current - RLOO_OFFSETS.to(current)}
    advantages = batch["advantages"]
    assert (advantages != 0).all()

    def objective(logps):  # of the per-token log-probs
        ratio = torch.exp(sequence_logps(logps, mask) - batch["old_logps"])
        return -clipped(ratio, advantages, epsilon, epsilon).mean()

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch, model)
    logps = only(seen, batch)
    with torch.no_grad():
        ratio = torch.exp(sequence_logps(logps, mask) - batch["old_logps"])
        torch.testing.assert_close(torch.log(ratio), RLOO_OFFSETS.to(ratio), rtol=0, atol=1e-5)
    crossings = clip_crossings(ratio, advantages, epsilon, epsilon)
    assert_both_sides_of_each_edge(crossings)

    trainer_result = assert_trainer_is_the_formula(loss, objective, logps, model)
    assert_policy_is_the_tests(trainer_result, objective, logps, model, batch, gap)
    mode = "train" if model.training else "eval"  # the metrics' key, as the trainer read it (Unsloth's sets train)
    assert trainer._metrics[mode]["clip_ratio/region_mean"][-1] == pytest.approx(held(crossings) / len(ratio))


def test_on_policy_gradient_is_reinforce_with_the_baseline(tmp_path, precision):
    """With the kit's on-policy defaults rho_i = 1, the loss is -1/B sum_i A_i and its gradient
    -1/B sum_i A_i grad log pi_theta(y_i | x). On one micro-batch of the generation batch (MICRO: groups mixed, as a
    training step with half of it gets it), so the value is not 0 (a whole group's advantages sum to 0).
    (In bf16 the trainer's ratio is its loss forward against its own scoring forward, 1 within their gap.)"""
    trainer = build(tmp_path, {"per_device_train_batch_size": GROUPS * G // 2, "gradient_accumulation_steps": 2})
    model = trainer.model
    batch = micro_batch(generation_batch(trainer, LENGTHS), MICRO)
    mask = batch["completion_mask"].float()
    advantages = batch["advantages"]
    gap = logprob_gap(model, batch)
    expected = -advantages.mean().item()

    def reinforce_of(logps):  # of the per-token log-probs
        return -(advantages * sequence_logps(logps, mask)).mean()

    def ratio_loss(logps):  # the trainer's value, -1/B sum_i rho_i A_i, of the per-token log-probs
        return -(torch.exp(sequence_logps(logps, mask) - batch["old_logps"]) * advantages).mean()

    with loss_logps(trainer) as seen:
        loss = trainer_loss(trainer, batch, model)
    logps = only(seen, batch)
    # the ratios: 1, to float32 rounding or within the gap of two bf16 forwards of a sequence (the scoring's, the
    # loss's); the value -1/B sum_i A_i within what that moves it
    off = gap.sequence_tolerance("logps")
    with torch.no_grad():
        log_ratio = sequence_logps(logps, mask) - batch["old_logps"]
        assert compared("on-policy log-ratios", log_ratio.abs().max().item(), 1e-5 + off), log_ratio
    value_tolerance = 1e-6 + advantages.abs().mean().item() * math.expm1(off)
    assert abs(expected) > 3 * value_tolerance, "the micro-batch's advantages must not cancel"
    assert compared("on-policy value", abs(loss.item() - expected), value_tolerance), (loss.item(), expected)
    trainer_result = assert_trainer_is_the_formula(loss, ratio_loss, logps, model)
    if not gap.measured:  # the test's own float32 forward: REINFORCE's gradient, and the ratios 1
        ours = sequence_logps(policy_logps(model, batch), mask)
        torch.testing.assert_close(ours.detach(), batch["old_logps"], rtol=1e-5, atol=1e-5)
        assert_same((0.0, trainer_result[1]), (0.0, gradients(reinforce_of(policy_logps(model, batch)), model)))
    else:
        assert_policy_is_the_tests(trainer_result, ratio_loss, logps, model, batch, gap)
