"""The GRPO-family formula tests' batches and comparisons (tests/test_rl_formulas.py, tests/test_rloo_formulas.py):
a generation batch of fixed rewards with completions of chosen lengths, the trainer's own per-token log-probs
(recorded while its loss computes them), old log-probs placed on them, and the two checks of a loss
(docs/conformance.md): against the formula on the trainer's own log-probs from the same forward, and against the
test's own forward pass.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
from helpers import PrecisionGap, clear_of, forward_precision, precision_scale, trainer_loss
from same_forward import (
    assert_gradient_is_the_formulas,
    assert_loss_is_the_formula,
    compared,
    float32_tolerance,
    gradient,
    recorded_calls,
)

GROUPS = 2
G = 4  # completions per prompt
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.5, 0.0]  # group 1, then group 2
TEMPERATURE = 0.8  # not 1, so a trainer that forgot the sampling temperature in its log-probs would be caught
MAX_LENGTH = 6  # max_completion_length
# Each completion's length in tokens (the untrained tiny model rarely samples its EOS in 6 tokens: the shorter ones are
# cut with an EOS where the trainer generates them; the 6s are truncated, without one): per-sequence means, token
# means and Dr. GRPO's fixed divisor all differ.
LENGTHS = (6, 2, 5, 1, 6, 3, 4, 6)
# A micro-batch of the generation batch, as a training step with half the generation batch per step sees it (TRL
# shuffles the batch and splits it): 17 tokens of the batch's 33, so DAPO's divisor (the generation batch's tokens)
# is not BNPO's (the micro-batch's).
MICRO = [0, 1, 4, 5]


def generation_batch(trainer, lengths: tuple[int, ...] | None = None) -> dict:
    """One generation batch scored by the fixed rewards, computed in eval mode (no gradient accumulation).
    `lengths`: completion i ends at lengths[i] tokens (ending_at)."""
    rows = [trainer.train_dataset[i] for i in range(GROUPS)]
    trainer.model.eval()
    torch.manual_seed(0)
    with ending_at(trainer, lengths) if lengths else contextlib.nullcontext():
        batch = trainer._generate_and_score_completions([row for row in rows for _ in range(G)])
    if lengths:
        assert batch["completion_mask"].sum(1).tolist() == list(lengths), batch["completion_mask"]
    return batch


@contextlib.contextmanager
def ending_at(trainer, lengths: tuple[int, ...]):
    """Completion i cut to its first lengths[i] tokens, the last an EOS, as the trainer's generation returns it (a
    completion at least as short is left as it is): everything after (padding, masks, reference log-probs, the
    token count) is the trainer's own."""
    eos = trainer.processing_class.eos_token_id

    def cut(ids):
        return [list(c) if len(c) <= n else list(c[:n - 1]) + [eos] for c, n in zip(ids, lengths, strict=True)]

    generate = trainer._generate_single_turn

    def generate_and_cut(*args, **kwargs):
        made = generate(*args, **kwargs)
        if not isinstance(made, tuple):  # RLOO's: the completions' ids
            return cut(made)
        ids, logprobs = made  # GRPO's: and their sampling log-probs, if the generation kept them
        ids = cut(ids)
        return ids, None if logprobs is None else [lp[:len(c)] for lp, c in zip(logprobs, ids)]

    trainer._generate_single_turn = generate_and_cut
    try:
        yield
    finally:
        del trainer._generate_single_turn


def micro_batch(batch: dict, rows: list[int]) -> dict:
    """The rows of a generation batch a training step gets; what is the whole batch's (its token count) stays."""
    size = batch["completion_mask"].shape[0]
    return {key: value[rows] if isinstance(value, torch.Tensor) and value.dim() and len(value) == size else value
            for key, value in batch.items()}


def policy_logps(model, batch: dict) -> torch.Tensor:
    """log pi_theta(o_t | q, o_<t) of each completion token at the sampling temperature, by a plain forward pass."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with forward_precision():
        logits = model(input_ids=ids, attention_mask=mask).logits
    n = batch["completion_ids"].shape[1]
    logits = logits[:, -n - 1:-1, :].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


@contextlib.contextmanager
def loss_logps(trainer):
    """The per-token log-probs of the completions that the trainer's loss computes from its own forward, with their
    graph, recorded for the block (the list holds each computation's). TRL's GRPO and RLOO trainers (and Unsloth's
    RLOO) compute them in _get_per_token_logps_and_entropies; Unsloth's GRPO loss (unsloth_zoo's
    grpo_accumulated_loss, copied into the generated trainer's module) hands them to UnslothEfficientGRPO, or on its
    other path to grpo_compute_loss_slow."""
    seen: list[torch.Tensor] = []
    module = sys.modules[type(trainer).__module__]
    if hasattr(module, "UnslothEfficientGRPO"):
        with recorded_calls(module, "UnslothEfficientGRPO") as efficient, \
                recorded_calls(module, "grpo_compute_loss_slow") as slow:
            yield seen
        seen += [args[0] for args, _, _ in efficient] + [args[1] for args, _, _ in slow]
    else:
        with recorded_calls(trainer, "_get_per_token_logps_and_entropies") as calls:
            yield seen
        seen += [result[0] for _, _, result in calls]


def only(seen: list[torch.Tensor], batch: dict) -> torch.Tensor:
    assert len(seen) == 1 and seen[0].shape == batch["completion_mask"].shape, [t.shape for t in seen]
    return seen[0]


def trainer_logps(trainer, batch: dict) -> torch.Tensor:
    """The per-token log-probs the trainer's loss computes on this batch (its own forward, no gradient)."""
    with torch.no_grad(), loss_logps(trainer) as seen:
        trainer_loss(trainer, batch)
    return only(seen, batch).detach()


def with_old_logps(trainer, batch: dict, spread: float = 0.0, offsets: torch.Tensor | None = None,
                   edges: tuple[float, ...] = (), margin: float = 0.0, centred: bool = False,
                   pattern: tuple[float, ...] | None = None):
    """The batch with old log-probabilities = the trainer's own current ones (trainer_logps) - shift, so the token
    ratios its loss sees are exp(shift): a fixed random shift per token within +-spread (`centred`: less its
    sequence's mean, so a sequence's geometric-mean ratio is exp(its offset)), or `pattern`, the t-th token's in
    every sequence; plus `offsets` per sequence (to place whole sequences inside or outside the clip range).
    `edges`, `margin`: every token's log-ratio kept `margin` clear of each clip edge (0 in float32: unchanged)."""
    current = trainer_logps(trainer, batch)
    mask = batch["completion_mask"].float()
    if pattern is not None:
        shift = torch.tensor(pattern[:current.shape[1]]).to(current).expand_as(current).clone()
    else:
        noise = torch.rand(current.shape, generator=torch.Generator().manual_seed(1)).to(current.device)
        shift = (noise * 2 - 1) * spread
    if centred:
        shift = (shift - (shift * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask
    if offsets is not None:
        shift = shift + offsets.to(current.device).unsqueeze(1)
    shift = clear_of(shift, edges, margin)
    return {**batch, "old_per_token_logps": current - shift}, shift


def clip_edges(low: float, high: float) -> tuple[float, float]:
    """The clip range [1 - low, 1 + high] as log-ratios."""
    return math.log(1 - low), math.log(1 + high)


def logprob_gap(model, batch: dict) -> PrecisionGap:
    """The policy's per-token log-probs at bf16 and at float32 on this batch (nothing measured in float32)."""
    return PrecisionGap(lambda: {"logps": policy_logps(model, batch)}, batch["completion_mask"].float())


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def gradients(loss: torch.Tensor, model, keep: bool = False) -> list[torch.Tensor]:
    return gradient(loss, trainable(model), keep)


def loss_and_grads(loss: torch.Tensor, model) -> tuple[float, list[torch.Tensor]]:
    return loss.item(), gradients(loss, model)


def assert_same(trl: tuple[float, list], ours: tuple[float, list], magnitude: float = 1.0) -> None:
    """The float32 comparison with the test's own forward. `magnitude`: how many times larger than a mean over tokens
    the loss's terms are (its float32 rounding too)."""
    scale = precision_scale()  # 1 on a CPU
    assert trl[0] == pytest.approx(ours[0], rel=1e-4 * scale, abs=1e-7 * scale * magnitude)
    for a, b in zip(trl[1], ours[1]):
        torch.testing.assert_close(a, b, rtol=1e-3 * scale, atol=1e-7 * scale * magnitude)


def assert_trainer_is_the_formula(loss: torch.Tensor, formula, logps: torch.Tensor, model, magnitude: float = 1.0,
                                  ) -> tuple[float, list[torch.Tensor]]:
    """The trainer's loss and gradient against `formula` of the log-probs its loss computed (logps, with their
    graph): float32 rounding apart, in either precision mode. Returns the trainer's (loss, gradient)."""
    same = formula(logps)
    trainer_grads, formula_grads = gradients(loss, model, keep=True), gradients(same, model)
    assert_loss_is_the_formula("loss", loss.item(), same.item(), float32_tolerance(same.item(), magnitude))
    assert_gradient_is_the_formulas("gradient", trainer_grads, formula_grads, magnitude)
    return loss.item(), trainer_grads


def assert_policy_is_the_tests(trainer_loss_and_grads, formula, logps: torch.Tensor, model, batch: dict,
                               gap: PrecisionGap, magnitude: float = 1.0) -> None:
    """Against the test's own forward pass. In float32: the formula's loss and gradient there (assert_same). In bf16,
    where two forwards differ by their roundings: the trainer's log-probs are the policy's at the sampling
    temperature, on average within twice the measured mean gap (each forward's error is about that)."""
    if not gap.measured:
        assert_same(trainer_loss_and_grads, loss_and_grads(formula(policy_logps(model, batch)), model), magnitude)
        return
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        difference = (logps.detach() - policy_logps(model, batch))[mask].abs().mean().item()
    assert compared("log-probs against the test's forward", difference, gap.mean_tolerance("logps")), (
        difference, str(gap))


def clipped(ratio, advantage, low, high):
    return torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)


def per_sequence_mean(per_token, mask):
    """GRPO's aggregation: each sequence's mean over its tokens, then the mean over sequences."""
    return ((per_token * mask).sum(1) / mask.sum(1)).mean()


def clip_crossings(ratio, advantages, low: float, high: float, mask=None) -> dict[str, int]:
    """How many ratios (tokens where mask) sit below, inside and above the clip range, and how many of those outside
    the clip holds at each edge (min(r A, clip(r) A) takes the clipped side: below with A < 0, above with A > 0)."""
    counted = torch.ones_like(ratio, dtype=torch.bool) if mask is None else mask.bool()
    advantages = advantages.expand_as(ratio)
    below, above = (ratio < 1 - low) & counted, (ratio > 1 + high) & counted
    return {"below": int(below.sum()), "inside": int((counted & ~below & ~above).sum()), "above": int(above.sum()),
            "held below": int((below & (advantages < 0)).sum()), "held above": int((above & (advantages > 0)).sum())}


def held(crossings: dict[str, int]) -> int:
    return crossings["held below"] + crossings["held above"]


def assert_both_sides_of_each_edge(crossings: dict[str, int]) -> None:
    """Ratios below, inside and above the clip range, and the clip holding some at each edge but not all outside it:
    the loss depends on both edges, and on which side of each a ratio is."""
    assert min(crossings.values()) > 0, crossings
    assert held(crossings) < crossings["below"] + crossings["above"], f"the clip must not hold every ratio: {crossings}"
