"""The reference-free preference losses the kit trains with (ORPO, SimPO), recomputed here from the model's logits.

Each test builds the trainer exactly as the stage does (`build_trainer`), moves the LoRA policy off its start (a
fresh adapter has B = 0, and the check must see the adapter), takes the loss the trainer computes on a collated
batch (helpers.trainer_loss, as a training step calls it) and recomputes it. With lp = a completion's log-probability
averaged over its tokens (w: chosen, l: rejected):
    ORPO:  NLL(prompt + chosen, token mean over the batch) - beta * mean(log sigmoid(log odds ratio)),
           log odds ratio = (lp_w - lp_l) - (log(1 - exp(lp_w)) - log(1 - exp(lp_l)))
    SimPO: mean(-log sigmoid(beta * (lp_w - lp_l) - simpo_gamma))
with beta and gamma as the recipe sets them (written here). Twice (docs/conformance.md): on the lp_w, lp_l and NLL
the trainer computed in its own forward (its concatenated_forward, recorded: tests/same_forward.py), within the
rounding of the formula's arithmetic (SimPO's is bf16 at the GPU's precision), in both modes; and on plain forward
passes here, one unpadded sequence at a time: in float32 the loss, as before; at the GPU's precision (the "-bf16"
cases, conftest.precision) the trainer's values against them, on average within the measured gap
(helpers.PrecisionGap). On both trainer families (TRL's own classes and Unsloth's generated ones,
conftest.trainer_family).
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
from same_forward import arithmetic_tolerance, assert_loss_is_the_formula, compared, recorded_calls

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


def token_logps(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p of every token after the first, one unpadded sequence: from the logits in float32, and at their own
    precision, as TRL's ORPO and CPO trainers take them (selective_log_softmax on the model's logits: bf16 ones under
    bf16 autocast; the same in float32)."""
    tensor = torch.tensor([ids], device=model.device)
    with forward_precision():
        logits = model(input_ids=tensor).logits[0, :-1]
    targets = tensor[0, 1:, None]
    exact = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets)[:, 0]
    return exact, torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0]


def sequence_values(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Per row: lp_w and lp_l (averaged over the completion's tokens, after the prompt: at the logits' precision, as
    TRL does) and the summed log-probs of every token of prompt + chosen but the first (ORPO's NLL targets, from
    float32 ones: TRL's cross-entropy upcasts)."""
    out = {"lp_w": [], "lp_l": [], "whole_w": []}
    with torch.no_grad():
        for row in rows:
            prompt = len(row["prompt_input_ids"])
            for side, key in (("w", "chosen_input_ids"), ("l", "rejected_input_ids")):
                ids = row[key]
                assert ids[:prompt] == row["prompt_input_ids"]  # the whole sequence starts with the prompt
                exact, as_trained = token_logps(model, ids)
                out[f"lp_{side}"].append(as_trained[prompt - 1:].mean().float())  # (averaged at that precision too)
                if side == "w":
                    out["whole_w"].append(exact.sum())
    return {name: torch.stack(values) for name, values in out.items()}


def values_here(model, rows: list[dict]) -> dict[str, torch.Tensor]:
    """lp_w, lp_l and ORPO's NLL (every token of prompt + chosen but the first, a mean over the batch's tokens) from
    this test's forwards."""
    values = sequence_values(model, rows)
    tokens = sum(len(row["chosen_input_ids"]) - 1 for row in rows)
    return {"lp_w": values["lp_w"], "lp_l": values["lp_l"], "nll": -values["whole_w"].sum() / tokens}


def orpo_formula(beta: float):
    def loss(lp_w, lp_l, nll, rounded=lambda value: value):
        log_odds = (lp_w - lp_l) - (torch.log(-torch.expm1(lp_w)) - torch.log(-torch.expm1(lp_l)))
        return nll - beta * F.logsigmoid(log_odds).mean()

    return loss


def simpo_formula(beta: float, gamma: float):
    """-log sigmoid(beta (lp_w - lp_l) - gamma), as TRL's CPOTrainer computes it (beta ((lp_w - lp_l) - gamma / beta),
    in the precision of its inputs), each result passed through `rounded` (same_forward.rounding_tolerance)."""
    def loss(lp_w, lp_l, nll, rounded=lambda value: value):
        margin = rounded(rounded(lp_w - lp_l) - gamma / beta)
        return -rounded(rounded(F.logsigmoid(rounded(beta * margin))).mean())

    return loss


def assert_loss_is_the_formulas(trainer, formula, upcast: bool, reads: tuple[str, ...]) -> None:
    """The trainer's loss on BATCH rows equals `formula` of its own lp_w, lp_l and NLL (its concatenated_forward's;
    `upcast`: the trainer computes the loss in float32 whatever their precision, else in theirs; `reads`: those the
    formula reads) within the
    rounding of the formula's arithmetic; and of this test's values, in float32 within float32 rounding (in bf16:
    the trainer's values against them, on average within the measured gap); the policy moved off its SFT start
    and far from the base."""
    model = trainer.model
    move_policy(model, 0.1, seed=0)  # off the SFT adapter it starts from
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    model.eval()
    with torch.no_grad(), recorded_calls(trainer, "concatenated_forward") as calls:
        trl_loss = trainer_loss(trainer, trainer.data_collator(rows), model).item()
    lp_w, lp_l, *_, nll = calls[0][2][:5]
    own = {"lp_w": lp_w, "lp_l": lp_l, "nll": nll}
    same = formula(**{name: value.float() for name, value in own.items()}).item()
    tolerance = arithmetic_tolerance(formula, own, torch.float32 if upcast else lp_w.dtype)
    assert_loss_is_the_formula("loss", trl_loss, same, tolerance)

    gap = PrecisionGap(lambda: values_here(model, rows))
    ours = values_here(model, rows)
    expected = formula(**ours).item()
    with model.disable_adapter():
        on_base = formula(**values_here(model, rows)).item()
    assert abs(expected - on_base) > 1e-3, (expected, on_base)  # the adapter counts
    if not gap.measured:
        assert abs(trl_loss - expected) < 1e-4 * precision_scale(), (trl_loss, expected)
        return
    for name in reads:
        difference = (own[name].float() - ours[name]).abs().mean().item()
        assert compared(f"{name} against the test's", difference, gap.mean_tolerance(name)), (name, difference)


def test_orpo_loss_is_the_reference_formula(in_tmp, sft_run, family, gpu_precision_here):
    trainer = built_trainer(in_tmp, sft_run, family, "orpo", {"beta": ORPO_BETA})
    assert trainer.beta == ORPO_BETA
    assert_loss_is_the_formulas(trainer, orpo_formula(ORPO_BETA), upcast=True, reads=("lp_w", "lp_l", "nll"))


def test_simpo_loss_is_the_reference_formula(in_tmp, sft_run, family, gpu_precision_here):
    trainer = built_trainer(in_tmp, sft_run, family, "simpo", {"beta": SIMPO_BETA, "simpo_gamma": SIMPO_GAMMA})
    assert (trainer.loss_type, trainer.cpo_alpha, trainer.beta, trainer.simpo_gamma) == \
        ("simpo", 0.0, SIMPO_BETA, SIMPO_GAMMA)
    assert_loss_is_the_formulas(trainer, simpo_formula(SIMPO_BETA, SIMPO_GAMMA), upcast=False, reads=("lp_w", "lp_l"))
