"""The preference losses the kit trains with, checked against the reference formulas on a fixed small batch.

Each test builds the trainer exactly as the stage does (`build_trainer`, after Unsloth's import in conftest), takes
the loss TRL computes on a collated batch, and recomputes it:
    DPO:           -log sigmoid(beta * ((pw - rw) - (pl - rl)))
    Bradley-Terry: -log sigmoid(r_chosen - r_rejected)   (+ c * mean((r_chosen + r_rejected)^2) when centering)
with beta, c as the recipe sets them (written here, not read from the trainer). Twice (docs/conformance.md): from
the sequence log-probs / rewards the trainer computed in the same forward (recorded from its model's forward
passes: tests/same_forward.py), loss and (DPO) gradient within the rounding of the formula's arithmetic, in both
precision modes; and from plain forward passes here, one unpadded sequence at a time: in float32 the loss, as
before; at the GPU's precision (the "-bf16" cases, conftest.precision) the trainer's values against them, on
average within the gap measured between the test's forwards at bf16 and at float32 (helpers.PrecisionGap).
The trainer gets its batch on the model's device (helpers.trainer_loss: on_device, as a training step does), which
the last test shows matters.
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
from same_forward import (
    arithmetic_tolerance,
    assert_gradient_is_the_formulas,
    assert_loss_is_the_formula,
    compared,
    float32_tolerance,
    gradient,
    recorded_forwards,
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


def sequence_sums(forward, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs from one of the trainer's forward passes (TRL's fused head: the log-prob
    of every token after the first, 0 where no label), summed over each completion's tokens."""
    mask = batch["completion_mask"][:, 1:]
    logps = forward[1].log_probs[:, -mask.shape[1]:]
    return (logps * mask).sum(1).chunk(2)


def dpo_loss_and_logps(trainer, rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's DPO loss on these rows (with its gradient), and the sequence log-probs it computed from its own
    forward passes: the policy's (with their graph), then the reference's (TRL's DPOTrainer._compute_loss, on the
    trainer's model: the reference is an adapter of it, or none)."""
    batch = trainer.data_collator(rows)
    with recorded_forwards(trainer.model) as forwards:
        loss = trainer_loss(trainer, batch, trainer.model)
    assert len(forwards) == 2, f"the policy's forward and the reference's, not {len(forwards)}"
    (pw, pl), (rw, rl) = (sequence_sums(forward, batch) for forward in forwards)
    return loss, {"pw": pw, "pl": pl, "rw": rw, "rl": rl}


def assert_dpo_loss_is_the_formula(trainer, model, reference, rows: list[dict], beta: float) -> None:
    """The trainer's DPO loss and gradient equal the formula with `beta` on the sequence log-probs of its own forward
    (float32 rounding apart), and in float32 the formula over these rows with `reference` as pi_ref, one unpadded
    sequence at a time (in bf16: the trainer's sequence log-probs within the measured gap of those); and the policy
    has moved off its start (log 2 = 0.6931, the loss at the start), or the check would be vacuous."""
    formula = dpo_formula(beta)
    loss, logps = dpo_loss_and_logps(trainer, rows)
    same = formula(**logps)
    params = [p for p in model.parameters() if p.requires_grad]
    trainer_grads, formula_grads = gradient(loss, params, keep=True), gradient(same, params)
    assert_loss_is_the_formula("loss", loss.item(), same.item(), float32_tolerance(same.item()))
    assert_gradient_is_the_formulas("gradient", trainer_grads, formula_grads)

    model.eval()
    gap = PrecisionGap(lambda: dpo_sequence_logps(model, reference, rows))
    ours = dpo_sequence_logps(model, reference, rows)
    expected = formula(**ours).item()
    assert abs(expected - 0.6931) > 1e-3, expected
    if not gap.measured:
        assert abs(loss.item() - expected) < 1e-4 * precision_scale(), (loss.item(), expected)
        return
    for name, value in ours.items():
        difference = (logps[name].detach() - value).abs().mean().item()
        assert compared(f"sequence log-probs {name} against the test's", difference, gap.mean_tolerance(name)), (
            name, difference, str(gap))


def test_dpo_loss_is_the_reference_formula(in_tmp, family, precision):
    from kitcli.models.backend import load_policy

    beta = 0.3  # not the default, so the test sees that train.beta reaches the loss
    trainer = dpo_trainer(in_tmp, family, beta)
    model = trainer.model
    torch.manual_seed(0)
    # move the policy away from the reference, as training would (0.1: the loss leaves log 2 by 0.18)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    reference = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                            dtype="float32", trainable=False, log=lambda _: None).model  # no init: the base
    assert_dpo_loss_is_the_formula(trainer, model, reference, rows, beta)


def off_centre(model, batch: dict, by: float) -> None:
    """Move the reward head (score) so that every reward rises by about `by`: a direction of the pooled hidden
    states' mean, the rewards' common part. Off-centre rewards are what the centering term pulls back; at the
    fresh head's (|r| < 0.25) the term is 4e-4, under a bf16 loss's spacing (4e-3)."""
    head = model.get_submodule("base_model.model.score.modules_to_save.default")
    seen = []
    hook = head.register_forward_hook(lambda module, args, output: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(**on_device({k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}, model))
    finally:
        hook.remove()
    mean = seen[0].float().flatten(0, -2).mean(0)
    with torch.no_grad():
        head.weight.add_((by * mean / mean.dot(mean)).to(head.weight))


def bradley_terry(center: float):
    """The Bradley-Terry loss with centering coefficient `center`, each operation's result passed through `rounded`
    (same_forward.rounding_tolerance: the trainer computes it in bf16 under autocast), in the trainer's order."""
    def loss(chosen, rejected, rounded=lambda value: value):
        value = -rounded(rounded(F.logsigmoid(rounded(chosen - rejected))).mean())
        if center:
            squares = rounded(rounded(chosen + rejected) ** 2)
            value = rounded(value + rounded(center * rounded(squares.mean())))
        return value

    return loss


def test_bradley_terry_loss_is_the_reference_formula(in_tmp, family, precision):
    """Without and with centering (c = 0.01, the coefficient its paper and TRL recommend), on rewards moved off-centre
    (off_centre): the centering term is then about 0.7, far above the rounding of a bf16 loss (its tolerance 0.05)."""
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
        batch = trainer.data_collator(rows)
        model.eval()
        off_centre(model, batch, 2.5)
        with torch.no_grad(), recorded_forwards(model) as forwards:
            loss = trainer_loss(trainer, batch, model)
        formula = bradley_terry(center)
        # the trainer's own rewards (bf16 under autocast), and its loss computed from them in their precision
        chosen, rejected = forwards[0][1].logits.squeeze(-1).chunk(2)
        own = {"chosen": chosen, "rejected": rejected}
        same = formula(chosen.float(), rejected.float()).item()
        tolerance = arithmetic_tolerance(formula, own, loss.dtype)
        assert_loss_is_the_formula(f"loss {name}", loss.float().item(), same, tolerance)
        if center:  # the term shows: a trainer without it would miss by more than three tolerances
            assert abs(same - bradley_terry(0.0)(chosen.float(), rejected.float()).item()) > 3 * tolerance

        def rewards(model=model, rows=rows) -> dict[str, torch.Tensor]:
            with torch.no_grad(), forward_precision():
                return {name: torch.stack([model(input_ids=torch.tensor([r[key]], device=model.device)).logits[0, 0]
                                           for r in rows]).float()
                        for name, key in (("chosen", "chosen_ids"), ("rejected", "rejected_ids"))}

        gap = PrecisionGap(rewards)
        ours = rewards()
        assert ours["chosen"].std() > 0 and not torch.allclose(ours["chosen"], ours["rejected"])
        if not gap.measured:
            expected = formula(**ours)
            assert abs(loss.item() - expected.item()) < 1e-5 * precision_scale(), (name, loss.item(), expected.item())
            continue
        for side, value in ours.items():
            difference = (own[side].float() - value).abs().mean().item()
            assert compared(f"rewards {side} {name} against the test's", difference, gap.mean_tolerance(side)), (
                name, side, difference, str(gap))


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
