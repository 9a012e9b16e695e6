"""PPO's arithmetic against hand-computed numbers and the reference page's statements (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from kitcli.ppo.losses import (
    KLController,
    clipped_surrogate_loss,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_shaped_rewards,
    masked_mean,
    masked_whiten,
)


def test_gae_matches_a_hand_computed_example():
    gamma, lam = 0.9, 0.8
    # row 0: three tokens; row 1: two tokens then padding (its reward and value there must be ignored)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.2, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [0.1, 0.2, 9.9]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    # row 0: delta_2 = 1 - 0.3 = 0.7; delta_1 = 0.9*0.3 - 0.4 = -0.13; delta_0 = 0.9*0.4 - 0.5 = -0.14
    #        A_2 = 0.7; A_1 = -0.13 + 0.72*0.7 = 0.374; A_0 = -0.14 + 0.72*0.374 = 0.12928
    # row 1: delta_1 = 1.0 + 0.9*0 - 0.2 = 0.8 (V = 0 after the last token); delta_0 = 0.2 + 0.9*0.2 - 0.1 = 0.28
    #        A_1 = 0.8; A_0 = 0.28 + 0.72*0.8 = 0.856; padding: 0
    expected = torch.tensor([[0.12928, 0.374, 0.7], [0.856, 0.8, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.62928, 0.774, 1.0], [0.956, 1.0, 0.0]]), atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.1, -0.2, 1.0]])
    values = torch.tensor([[0.3, 0.2, 0.1]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert torch.allclose(returns, torch.tensor([[0.9, 0.8, 1.0]]))
    assert torch.allclose(advantages, torch.tensor([[0.6, 0.6, 0.9]]))


def surrogate_gradient(ratio: float, advantage: float, cliprange: float = 0.2) -> float:
    """d loss / d log pi_theta for one token whose ratio to the old policy is `ratio`."""
    logprob = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = clipped_surrogate_loss(logprob, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), cliprange)
    out.loss.backward()
    return float(logprob.grad)


@pytest.mark.parametrize("ratio, advantage", [(1.5, 1.0), (1.21, 2.0), (0.5, -1.0), (0.79, -0.5)])
def test_clipped_surrogate_gradient_is_zero_once_the_ratio_left_the_range_the_way_the_advantage_favours(
        ratio, advantage):
    assert surrogate_gradient(ratio, advantage) == 0.0


@pytest.mark.parametrize("ratio, advantage", [(1.0, 1.0), (1.1, 1.0), (0.9, -1.0), (0.85, 2.0), (1.15, -2.0)])
def test_clipped_surrogate_gradient_is_nonzero_inside_the_range(ratio, advantage):
    # loss = -rho * A, so d loss / d log pi = -rho * A
    assert surrogate_gradient(ratio, advantage) == pytest.approx(-ratio * advantage, rel=1e-5)


@pytest.mark.parametrize("ratio, advantage", [(0.5, 1.0), (1.5, -1.0)])
def test_clipped_surrogate_still_pulls_back_a_ratio_that_left_the_range_against_the_advantage(ratio, advantage):
    # the unclipped term wins the min, so the update moves the ratio back towards the range
    assert surrogate_gradient(ratio, advantage) == pytest.approx(-ratio * advantage, rel=1e-5)


def test_clip_fraction_and_approx_kl():
    logprobs = torch.log(torch.tensor([[1.5, 1.0, 0.5, 1.1]]))
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = clipped_surrogate_loss(logprobs, torch.zeros(1, 4), advantages, torch.ones(1, 4), 0.2)
    assert float(out.clipfrac) == pytest.approx(0.5)  # tokens 0 and 2 are clipped
    assert float(out.approx_kl) == pytest.approx(0.5 * float((logprobs ** 2).mean()), rel=1e-6)


def test_kl_shaped_reward_equals_the_formula():
    torch.manual_seed(0)
    logprobs, ref_logprobs = -torch.rand(3, 5), -torch.rand(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([1.5, -0.5, 2.0])
    beta = 0.1
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref_logprobs, mask, beta)
    r_kl = (logprobs - ref_logprobs) * mask
    assert torch.equal(kl, r_kl)
    # R_total = R_RM - beta * sum_t r_t^KL
    assert torch.allclose(rewards.sum(1), scores - beta * r_kl.sum(1))
    # the score sits on each response's last token; every other token carries -beta * r_t^KL; padding nothing
    last = torch.tensor([4, 1, 0])
    for row in range(3):
        for t in range(5):
            expected = -beta * r_kl[row, t] + (scores[row] if t == last[row] else 0.0)
            assert rewards[row, t] == pytest.approx(float(expected), abs=1e-7)
    assert torch.all(rewards[mask == 0] == 0)


def test_value_loss_clips_around_the_rollout_values():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.5, 0.1]], requires_grad=True)
    loss, clipfrac = clipped_value_loss(values, old, returns, torch.ones(1, 2), 0.2)
    # token 0 moved 0.5 > 0.2: the clipped prediction 0.2 has the larger error (0.64 vs 0.25), so it counts
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 0.81) / 2)
    assert float(clipfrac) == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0, 0] == 0.0 and values.grad[0, 1] != 0.0


def test_whitening_and_explained_variance():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    whitened = masked_whiten(values, mask)
    assert float(masked_mean(whitened, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(whitened[0, :3].var()) == pytest.approx(1.0, rel=1e-4)
    assert whitened[0, 3] == 0.0
    returns = torch.tensor([[1.0, 2.0, 4.0]])
    assert explained_variance(returns, returns, torch.ones(1, 3)) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 3), 7.0 / 3), returns, torch.ones(1, 3)) == pytest.approx(0.0, abs=1e-6)


def test_kl_controller_fixed_and_adaptive():
    fixed = KLController(0.1)
    fixed.update(100.0, 64)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, adaptive=True, target=1.0, horizon=100)
    adaptive.update(5.0, 10)  # KL far above target: error clipped to +0.2, beta *= 1 + 0.2 * 10 / 100
    assert adaptive.value == pytest.approx(0.1 * 1.02)
    adaptive.update(0.0, 10)
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 0.98)
