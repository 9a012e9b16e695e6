"""The reference-free preference losses the kit trains with (ORPO, SimPO), recomputed here from the model's logits.

Each test builds the trainer exactly as the stage does (`build_trainer`), moves the LoRA policy off its start (a
fresh adapter has B = 0, and the check must see the adapter), takes the loss the trainer computes on a collated
batch (helpers.trainer_loss, as a training step calls it) and recomputes it from plain forward passes, one unpadded
sequence at a time. With lp = a completion's log-probability averaged over its tokens (w: chosen, l: rejected):
    ORPO:  NLL(prompt + chosen, token mean over the batch) - beta * mean(log sigmoid(log odds ratio)),
           log odds ratio = (lp_w - lp_l) - (log(1 - exp(lp_w)) - log(1 - exp(lp_l)))
    SimPO: mean(-log sigmoid(beta * (lp_w - lp_l) - simpo_gamma))
on both trainer families (TRL's own classes and Unsloth's generated ones, conftest.trainer_family) and in both
precision modes (conftest.precision; in bf16 with tolerances measured by helpers.PrecisionGap).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DATA,
    SFT_8_STEPS,
    PrecisionGap,
    forward_precision,
    move_policy,
    precision_scale,
    run_cli,
    stage_context,
    trainer_loss,
    write_recipe,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families

BATCH = 6
ORPO_BETA = 0.3  # not the stage's default (0.1): the test sees that train.beta reaches the loss
SIMPO_BETA, SIMPO_GAMMA = 1.5, 0.7  # not the defaults (2.0, 1.0)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    """A short SFT run the stages start from (`init: sft`): its completions are likely enough (averaged log-probs
    near -1, not the -6 of a random policy over 320 tokens) that ORPO's log(1 - p) terms count in the loss."""
    root = tmp_path_factory.mktemp("sft")
    run_cli("run", write_recipe(root / "r.yaml", [SFT_8_STEPS]), "--output", root / "run")
    return root / "run"


@pytest.fixture
def gpu_precision_here(precision, monkeypatch):
    """helpers.emulate_gpu_precision for these stage modules too: in the bf16 case their configs get the GPU's
    dtype settings (build_config with on_gpu=True), as the modules it lists do (both build theirs in
    kitcli/stages/reference_free.py)."""
    from kitcli.stages import reference_free

    if precision == "bf16" and not torch.cuda.is_available():
        build = reference_free.build_config
        monkeypatch.setattr(reference_free, "build_config",
                            lambda *a, _build=build, **kw: _build(*a, **{**kw, "on_gpu": True}))
    return precision


def built_trainer(in_tmp, sft_run, family: str, stage_type: str, train: dict):
    from kitcli.recipe import stage_types
    from kitcli.training.trainers import is_unsloth_class

    stage = {"name": stage_type, "type": stage_type, "init": "sft", "eval_fraction": 0,
             "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16}, "train": {"max_steps": 1, **train}}
    ctx = stage_context(write_recipe(in_tmp / "r.yaml", [SFT_8_STEPS, stage]), stage_type, sft_run)
    trainer, _ = stage_types.module(stage_type).build_trainer(ctx)
    assert is_unsloth_class(type(trainer)) == (family == "unsloth"), type(trainer)
    assert getattr(trainer, "ref_model", None) is None and "ref" not in trainer.model.peft_config
    return trainer


def token_logps(model, ids: list[int]):
    """log p of every token after the first, one unpadded sequence."""
    tensor = torch.tensor([ids], device=model.device)
    with forward_precision():
        logits = model(input_ids=tensor).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, tensor[0, 1:, None])[:, 0]


def sequence_values(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Per row: lp_w and lp_l (averaged over the completion's tokens, after the prompt) and the summed log-probs of
    every token of prompt + chosen but the first (ORPO's NLL targets)."""
    out = {"lp_w": [], "lp_l": [], "whole_w": []}
    with torch.no_grad():
        for row in rows:
            prompt = len(row["prompt_input_ids"])
            for side, key in (("w", "chosen_input_ids"), ("l", "rejected_input_ids")):
                ids = row[key]
                assert ids[:prompt] == row["prompt_input_ids"]  # the whole sequence starts with the prompt
                logps = token_logps(model, ids)
                out[f"lp_{side}"].append(logps[prompt - 1:].mean())
                if side == "w":
                    out["whole_w"].append(logps.sum())
    return {name: torch.stack(values) for name, values in out.items()}


def orpo_formula(beta: float, nll_tokens: int):
    def loss(lp_w, lp_l, whole_w):
        log_odds = (lp_w - lp_l) - (torch.log(-torch.expm1(lp_w)) - torch.log(-torch.expm1(lp_l)))
        return -whole_w.sum() / nll_tokens - beta * F.logsigmoid(log_odds).mean()

    return loss


def simpo_formula(beta: float, gamma: float):
    def loss(lp_w, lp_l, whole_w):
        return (-F.logsigmoid(beta * (lp_w - lp_l) - gamma)).mean()

    return loss


def assert_loss_is_the_formula(trainer, formula_for) -> None:
    """The trainer's loss on BATCH rows equals `formula_for(rows)` of the recomputed values (float32 rounding plus,
    in bf16, the measured gap), with the policy moved off its SFT start and far from the base."""
    model = trainer.model
    move_policy(model, 0.1, seed=0)  # off the SFT adapter it starts from
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    model.eval()
    with torch.no_grad():
        trl_loss = trainer_loss(trainer, trainer.data_collator(rows), model).item()
    formula = formula_for(rows)
    gap = PrecisionGap(lambda: sequence_values(model, rows))
    expected = formula(**sequence_values(model, rows)).item()
    with model.disable_adapter():
        on_base = formula(**sequence_values(model, rows)).item()
    tolerance = 1e-4 * precision_scale() + gap.value_tolerance(formula)
    assert abs(expected - on_base) > max(1e-3, tolerance), (expected, on_base, tolerance)  # the adapter counts
    assert abs(trl_loss - expected) < tolerance, (trl_loss, expected, tolerance, str(gap))


def test_orpo_loss_is_the_reference_formula(in_tmp, sft_run, family, gpu_precision_here):
    trainer = built_trainer(in_tmp, sft_run, family, "orpo", {"beta": ORPO_BETA})
    assert trainer.beta == ORPO_BETA

    def formula_for(rows):
        tokens = sum(len(row["chosen_input_ids"]) - 1 for row in rows)  # every attended token but the first
        return orpo_formula(ORPO_BETA, tokens)

    assert_loss_is_the_formula(trainer, formula_for)


def test_simpo_loss_is_the_reference_formula(in_tmp, sft_run, family, gpu_precision_here):
    trainer = built_trainer(in_tmp, sft_run, family, "simpo", {"beta": SIMPO_BETA, "simpo_gamma": SIMPO_GAMMA})
    assert (trainer.loss_type, trainer.cpo_alpha, trainer.beta, trainer.simpo_gamma) == \
        ("simpo", 0.0, SIMPO_BETA, SIMPO_GAMMA)
    assert_loss_is_the_formula(trainer, lambda rows: simpo_formula(SIMPO_BETA, SIMPO_GAMMA))
