"""The arithmetic of PPO for language models (RLHF), as the reference page states it; no models, only tensors.

Shapes: every per-token tensor is [batch, response_length], aligned to the response; `mask` is 1 for the
response's tokens (up to and including its end-of-sequence token) and 0 for the padding after it.

    r_t^KL  = log pi_theta(a_t | s_t) - log pi_ref(a_t | s_t)            per-token KL estimate
    R_total = score - beta * sum_t r_t^KL                              score given at the last token
    A_t     = GAE(gamma, lambda) over the per-token rewards and the critic's V(s_t); returns = A_t + V(s_t)
    L_clip  = -mean_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)  rho_t = pi_theta / pi_old
    L_value = 0.5 * mean_t max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the unmasked entries."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    squares = masked_mean((values - mean) ** 2, mask)
    return squares * count / (count - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Scale to unit variance over the unmasked entries (and zero mean unless `shift_mean` is False)."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(a_t | s_t) of the chosen tokens, under the sampling distribution softmax(logits / temperature)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(logprobs, 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


def kl_shaped_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      mask: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards -beta * r_t^KL, plus the score at each response's last token; and r_t^KL itself.

    Summed over a response they give R_total = score - beta * sum_t r_t^KL.
    """
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation; returns (advantages, returns = advantages + values).

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t) with V = 0 after the last token; A_t = delta_t + gamma lam A_{t+1}.
    """
    rewards, values = rewards * mask, values * mask
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, advantages + values


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio: torch.Tensor


def clipped_surrogate_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                           mask: torch.Tensor, cliprange: float) -> PolicyLoss:
    """-mean min(rho A, clip(rho, 1-eps, 1+eps) A). Once rho has left the clip range in the direction A
    favours, the clipped (constant) term wins the min and the token's gradient is zero."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped < unclipped).float(), mask)
        approx_kl = 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask)
        mean_ratio = masked_mean(ratio, mask)
    return PolicyLoss(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl, ratio=mean_ratio)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * mean max((V - R)^2, (V_clipped - R)^2), V_clipped kept within cliprange_value of the rollout's V;
    and the fraction of tokens where the clipped term is the larger."""
    clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).float(), mask)
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."""
    variance = masked_var(returns, mask)
    if variance.item() == 0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / variance)


class KLController:
    """beta for the KL penalty: fixed, or adaptive (Ziegler et al. 2019) towards a target KL per response."""

    def __init__(self, kl_coef: float, adaptive: bool = False, target: float = 6.0, horizon: int = 10000):
        self.value = kl_coef
        self.adaptive = adaptive
        self.target = target
        self.horizon = horizon

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps (accelerate's register_for_checkpointing): beta, which adapts during a run."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]

    def update(self, current_kl: float, n_responses: int) -> None:
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_responses / self.horizon
