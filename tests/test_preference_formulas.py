"""The preference losses the kit trains with, checked against the reference formulas on a fixed small batch.

Each test builds the trainer exactly as the stage does (`build_trainer`, after Unsloth's import in conftest), takes
the loss TRL computes on a collated batch, and recomputes it here from log-probabilities / rewards obtained with
plain forward passes, one unpadded sequence at a time:
    DPO:           -log sigmoid(beta * ((pw - rw) - (pl - rl)))
    Bradley-Terry: -log sigmoid(r_chosen - r_rejected)   (+ c * mean((r_chosen + r_rejected)^2) when centering)
The trainer gets its batch on the model's device (helpers.trainer_loss: on_device, as a training step does), which
the last test shows matters. The losses also run at the GPU's precision (the "-bf16" cases, conftest.precision),
with tolerances derived from the gap between the test's forwards at bf16 and at float32 (helpers.PrecisionGap).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DATA,
    TINY_MODEL,
    PrecisionGap,
    completion_logprob,
    forward_precision,
    on_device,
    precision_scale,
    stage_context,
    trainer_loss,
    write_recipe,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families

BATCH = 6


def built_by(trainer, family: str) -> None:
    from kitcli.training.trainers import is_unsloth_class

    assert is_unsloth_class(type(trainer)) == (family == "unsloth"), type(trainer)


def dpo_trainer(in_tmp, family: str, beta: float):
    from kitcli.stages import dpo

    stage = {"name": "dpo", "type": "dpo", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
             "eval_fraction": 0, "train": {"beta": beta, "max_steps": 1}}
    ctx = stage_context(write_recipe(in_tmp / "r.yaml", [stage]), "dpo", in_tmp / "run")
    trainer, _, _ = dpo.build_trainer(ctx)
    built_by(trainer, family)
    return trainer


def dpo_sequence_logps(policy, reference, rows: list[dict]) -> dict[str, torch.Tensor]:
    """log pi and log pi_ref of each row's chosen and rejected completion, one unpadded sequence at a time."""
    with torch.no_grad():
        def logps(model, key):
            return torch.stack([completion_logprob(model, row["prompt_ids"], row[key]) for row in rows])

        return {"pw": logps(policy, "chosen_ids"), "pl": logps(policy, "rejected_ids"),
                "rw": logps(reference, "chosen_ids"), "rl": logps(reference, "rejected_ids")}


def dpo_formula(beta: float):
    def loss(pw, pl, rw, rl):
        return (-F.logsigmoid(beta * ((pw - rw) - (pl - rl)))).mean()

    return loss


def assert_dpo_loss_is_the_formula(trl_loss: float, model, reference, rows: list[dict], beta: float) -> None:
    """The trainer's DPO loss equals the formula over these rows with `reference` as pi_ref, within float32 rounding
    plus (in bf16) the measured precision gap; and the policy has moved off its start (log 2 = 0.6931, the loss at
    the start), or the check would be vacuous, in bf16 too."""
    model.eval()
    formula = dpo_formula(beta)
    gap = PrecisionGap(lambda: dpo_sequence_logps(model, reference, rows))
    expected = formula(**dpo_sequence_logps(model, reference, rows)).item()
    tolerance = 1e-4 * precision_scale() + gap.value_tolerance(formula)
    assert abs(expected - 0.6931) > max(1e-3, tolerance), (expected, tolerance)
    assert abs(trl_loss - expected) < tolerance, (trl_loss, expected, tolerance, str(gap))


def test_dpo_loss_is_the_reference_formula(in_tmp, family, precision):
    from kitcli.models.backend import load_policy

    beta = 0.3  # not the default, so the test sees that train.beta reaches the loss
    trainer = dpo_trainer(in_tmp, family, beta)
    model = trainer.model
    torch.manual_seed(0)
    # move the policy away from the reference, as training would: far enough that the loss leaves log 2 by more
    # than the bf16 tolerance (0.05 moved it by 0.005 against a tolerance of 0.047; 0.1 moves it by 0.18)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    with torch.no_grad():
        trl_loss = trainer_loss(trainer, trainer.data_collator(rows), model).item()

    reference = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                            dtype="float32", trainable=False, log=lambda _: None).model  # no init: the base
    assert_dpo_loss_is_the_formula(trl_loss, model, reference, rows, beta)


def test_bradley_terry_loss_is_the_reference_formula(in_tmp, family, precision):
    from kitcli.stages import reward

    prefs = {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16}
    stages = [{"name": "rm", "type": "reward", "data": prefs, "eval_fraction": 0, "train": {"max_steps": 1}},
              {"name": "rm-centered", "type": "reward", "data": prefs, "eval_fraction": 0,
               "train": {"max_steps": 1, "center_rewards_coefficient": 0.01}}]
    recipe = write_recipe(in_tmp / "r.yaml", stages)
    for name, center in (("rm", 0.0), ("rm-centered", 0.01)):
        trainer, loaded = reward.build_trainer(stage_context(recipe, name, in_tmp / "run"))
        built_by(trainer, family)
        model = trainer.model
        assert model.config.pad_token_id == loaded.tokenizer.pad_token_id == \
            loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        rows = [trainer.train_dataset[i] for i in range(BATCH)]
        model.eval()
        with torch.no_grad():
            trl_loss = trainer_loss(trainer, trainer.data_collator(rows), model).item()

        def rewards(model=model, rows=rows) -> dict[str, torch.Tensor]:
            with torch.no_grad(), forward_precision():
                return {name: torch.stack([model(input_ids=torch.tensor([r[key]], device=model.device)).logits[0, 0]
                                           for r in rows]).float()
                        for name, key in (("chosen", "chosen_ids"), ("rejected", "rejected_ids"))}

        def formula(chosen, rejected, center=center):
            return (-F.logsigmoid(chosen - rejected)).mean() + center * ((chosen + rejected) ** 2).mean()

        gap = PrecisionGap(rewards)
        chosen, rejected = rewards().values()
        expected = formula(chosen, rejected)
        assert chosen.std() > 0 and not torch.allclose(chosen, rejected)
        tolerance = 1e-5 * precision_scale() + gap.value_tolerance(formula)
        assert abs(trl_loss - expected.item()) < tolerance, (name, trl_loss, expected.item(), tolerance, str(gap))


class ForwardReached(Exception):
    """Raised by the hook below once it has seen what the trainer hands the model."""


def test_a_batch_reaches_the_trainer_on_the_models_device(in_tmp, family, monkeypatch):
    """The fixture bug behind three of the H200's eleven failures (the DPO and Bradley-Terry losses, DPO reference =
    SFT): a collated batch is on the CPU and a GPU model on CUDA, and a test that calls trainer.compute_loss itself
    hands the batch over where it is (a training step moves it, Trainer._prepare_inputs; nothing does here). On a
    CPU: the model says it is on the meta device (its `device`; its 4-bit base weights cannot move there) and a
    forward pre-hook records the devices of the tensors the trainer hands it, then stops the call. Without
    helpers.on_device they are the CPU's, not the model's; with it (helpers.trainer_loss, what the loss tests call)
    every tensor of the batch is on the model's device."""
    trainer = dpo_trainer(in_tmp, family, beta=0.3)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(BATCH)])
    model = trainer.model
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("meta")), raising=False)
    assert model.device.type == "meta"
    seen: list[set[str]] = []

    def record(module, args, kwargs):
        seen.append({t.device.type for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)})
        raise ForwardReached

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with pytest.raises(ForwardReached):
            trainer.compute_loss(model, batch)  # as the loss tests called it
        assert seen[-1] == {"cpu"}, seen  # not the model's device: on a GPU, the CPU batch against a CUDA model

        moved = on_device(batch, model)
        assert moved.keys() == batch.keys()
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert value.device.type == "cpu" and moved[key].device.type == "meta", key
                assert moved[key].shape == value.shape and moved[key].dtype == value.dtype, key
            else:
                assert moved[key] == value, key
        with pytest.raises(ForwardReached):
            trainer_loss(trainer, batch, model)
        assert seen[-1] == {"meta"}, seen
    finally:
        hook.remove()
