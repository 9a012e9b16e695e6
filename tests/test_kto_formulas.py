"""KTO's loss (kitcli/stages/kto.py) computed here from scratch on a fixed small batch and compared with what the
KTOTrainer the kit builds computes, on TRL's trainer and on Unsloth's generated one (forced on the CPU).

With sequence log-probabilities summed over the completion's tokens, r = log pi(y | x) - log pi_ref(y | x), and the
reference point z0 = max(0, mean_i (log pi(y'_i | x_i) - log pi_ref(y'_i | x_i))) over mismatched pairs (each prompt
with the completion of the previous row of its batch):
    desirable:   desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - r)))
and the loss is the mean over the batch's rows, with beta and the weights as the recipe sets them (written here).
The loss test checks it twice (docs/conformance.md): on the sequence log-probs the trainer computed in its own
forward passes (recorded from its model: tests/same_forward.py), loss and gradient within float32 rounding, in both
precision modes; and on plain forward passes here, one unpadded sequence at a time, with a separately loaded copy
of the base model as the reference (the stage has no `init:`): in float32 the loss, as before; at the GPU's
precision (its "-bf16" case, conftest.precision) the trainer's sequence log-probs against them, on average within
the gap measured between the test's forwards at bf16 and at float32 (helpers.PrecisionGap). The trainer gets its
batch on the model's device (helpers.trainer_loss). The reference test compares with a constant that holds in any
precision (policy and reference are one computation at the start), so it runs in float32 only.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DATA,
    TINY_MODEL,
    PrecisionGap,
    completion_logprob,
    move_policy,
    precision_scale,
    stage_context,
    trainer_loss,
    write_recipe,
)
from same_forward import (
    assert_gradient_is_the_formulas,
    assert_loss_is_the_formula,
    compared,
    float32_tolerance,
    gradient,
    recorded_forwards,
)
from test_preference_formulas import built_by

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families

BATCH = 8
BETA, DESIRABLE, UNDESIRABLE = 0.3, 1.5, 0.7  # not the defaults: the test sees that train: reaches the loss


def kto_trainer(in_tmp, family: str, **train):
    from kitcli.stages import kto

    stage = {"name": "kto", "type": "kto", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
             "eval_fraction": 0,
             "train": {"beta": BETA, "desirable_weight": DESIRABLE, "undesirable_weight": UNDESIRABLE,
                       "per_device_train_batch_size": BATCH, "max_steps": 1, **train}}
    ctx = stage_context(write_recipe(in_tmp / "r.yaml", [stage]), "kto", in_tmp / "run")
    trainer, loaded, reference = kto.build_trainer(ctx)
    built_by(trainer, family)
    assert "ref" in reference or "starting" in reference, reference
    return trainer


def base_model():
    from kitcli.models.backend import load_policy

    return load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                       dtype="float32", trainable=False, log=lambda _: None).model


def sequence_logps(policy, reference, rows: list[dict]) -> dict[str, torch.Tensor]:
    """log pi and log pi_ref of each row's completion and of its mismatched (KL) completion, one forward pass per
    sequence."""
    policy.eval()
    with torch.no_grad():
        def logps(model, key):
            return torch.stack([completion_logprob(model, row["prompt_ids"], row[key]) for row in rows])

        return {"policy": logps(policy, "completion_ids"), "reference": logps(reference, "completion_ids"),
                "kl_policy": logps(policy, "KL_completion_ids"), "kl_reference": logps(reference, "KL_completion_ids")}


def kl_estimate(policy, reference, kl_policy, kl_reference) -> torch.Tensor:
    """The unclamped KL estimate: the mean log-ratio of the mismatched pairs."""
    return (kl_policy - kl_reference).mean()


def kto_formula(rows: list[dict]):
    def loss(policy, reference, kl_policy, kl_reference):
        z0 = kl_estimate(policy, reference, kl_policy, kl_reference).clamp(min=0)
        r = policy - reference
        desirable = torch.tensor([bool(row["label"]) for row in rows], device=policy.device)
        return torch.where(desirable, DESIRABLE * (1 - torch.sigmoid(BETA * (r - z0))),
                           UNDESIRABLE * (1 - torch.sigmoid(BETA * (z0 - r)))).mean()

    return loss


def by_hand(policy, reference, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the KTO loss, the unclamped KL estimate) from one forward pass per sequence."""
    logps = sequence_logps(policy, reference, rows)
    return kto_formula(rows)(**logps), kl_estimate(**logps)


def kto_loss_and_logps(trainer, rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's KTO loss on these rows (with its gradient), and the sequence log-probs it computed from its own
    forward passes (TRL's KTOTrainer._compute_loss, on the trainer's model: the mismatched pairs' and the
    completions' under the policy, with the graph for the completions, then both under the reference adapter or
    none), each summed over its completion's tokens."""
    batch = trainer.data_collator(rows)
    with recorded_forwards(trainer.model) as forwards:
        loss = trainer_loss(trainer, batch, trainer.model)
    sums = {"": [], "KL_": []}
    for kwargs, output in forwards:
        kind = "KL_" if torch.equal(kwargs["input_ids"].cpu(), batch["KL_input_ids"]) else ""
        mask = batch[f"{kind}completion_mask"][:, 1:].to(output.log_probs.device)
        sums[kind].append((output.log_probs[:, -mask.shape[1]:] * mask).sum(-1))
    assert [len(found) for found in sums.values()] == [2, 2], [len(found) for found in sums.values()]
    (policy, reference), (kl_policy, kl_reference) = sums[""], sums["KL_"]
    return loss, {"policy": policy, "reference": reference, "kl_policy": kl_policy, "kl_reference": kl_reference}


def test_kto_loss_is_the_reference_formula(in_tmp, family, precision):
    trainer = kto_trainer(in_tmp, family)
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    labels = [bool(r["label"]) for r in rows]
    assert any(labels) and not all(labels), "the batch must hold both kinds of rows"
    # the mismatched completions: each row's prompt with the previous row's completion, cyclically in the batch
    assert [r["KL_completion_ids"] for r in rows] == [rows[i - 1]["completion_ids"] for i in range(BATCH)]
    model = trainer.model
    reference = base_model()
    # move the policy until the KL estimate is positive, so that z0 is not just the floor 0
    for seed in range(20):
        move_policy(model, 0.05, seed)
        expected, kl = by_hand(model, reference, rows)
        if kl > 1e-3:
            break
    assert kl > 1e-3, "no perturbation gave a positive KL estimate; the z0 term would be untested"
    loss, logps = kto_loss_and_logps(trainer, rows)
    formula = kto_formula(rows)
    same = formula(**logps)
    tolerance = float32_tolerance(same.item())
    params = [p for p in model.parameters() if p.requires_grad]
    trainer_grads, formula_grads = gradient(loss, params, keep=True), gradient(same, params)
    assert_loss_is_the_formula("loss", loss.item(), same.item(), tolerance)
    assert_gradient_is_the_formulas("gradient", trainer_grads, formula_grads)
    own_kl = kl_estimate(**logps).item()
    assert compared("kl metric", abs(trainer._metrics["eval"]["kl"][-1] - own_kl), float32_tolerance(own_kl))
    # and z0 matters: the same loss with z0 = 0 is another number (by more than three tolerances)
    with torch.no_grad():
        r = logps["policy"] - logps["reference"]
        desirable = torch.tensor(labels, device=r.device)
        without_z0 = torch.where(desirable, DESIRABLE * (1 - torch.sigmoid(BETA * r)),
                                 UNDESIRABLE * (1 - torch.sigmoid(-BETA * r))).mean().item()
    assert own_kl > 1e-3 and abs(same.item() - without_z0) > 3 * tolerance

    gap = PrecisionGap(lambda: sequence_logps(model, reference, rows))
    if not gap.measured:  # the test's own forwards
        assert trainer._metrics["eval"]["kl"][-1] == pytest.approx(kl.item(), rel=1e-4 * precision_scale())
        assert abs(loss.item() - expected.item()) < 1e-5 * precision_scale(), (loss.item(), expected.item())
        with torch.no_grad():
            assert abs(expected.item() - by_hand_without_z0(model, reference, rows)) > 1e-5
        return
    ours = sequence_logps(model, reference, rows)
    for name, value in ours.items():
        difference = (logps[name].detach() - value).abs().mean().item()
        assert compared(f"sequence log-probs {name} against the test's", difference, gap.mean_tolerance(name)), (
            name, difference, str(gap))


def by_hand_without_z0(policy, reference, rows: list[dict]) -> float:
    losses = []
    for row in rows:
        r = (completion_logprob(policy, row["prompt_ids"], row["completion_ids"])
             - completion_logprob(reference, row["prompt_ids"], row["completion_ids"]))
        weight, sign = (DESIRABLE, 1) if row["label"] else (UNDESIRABLE, -1)
        losses.append(weight * (1 - torch.sigmoid(sign * BETA * r)))
    return torch.stack(losses).mean().item()


def test_kto_reference_is_the_starting_policy_not_the_base(in_tmp, family):
    """With `init:`, the frozen reference holds the starting adapter: at the start of the stage every implied reward
    r = log pi - log pi_ref is 0, so every row's loss is weight * (1 - sigmoid(0)) = weight / 2."""
    from kitcli.models.backend import load_policy, save_model

    init_dir = in_tmp / "run" / "sft"
    start = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True,
                        lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
                        dtype="float32", log=lambda _: None)
    move_policy(start.model, 0.3, 0)  # an init adapter far from the base
    save_model(start.model, start.tokenizer, init_dir)
    (init_dir / "DONE").write_text("{}")

    from kitcli.stages import kto

    stages = [{"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl")},
              {"name": "kto", "type": "kto", "init": "sft",
               "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16}, "eval_fraction": 0,
               "train": {"beta": BETA, "desirable_weight": DESIRABLE, "undesirable_weight": UNDESIRABLE,
                         "per_device_train_batch_size": BATCH, "max_steps": 1}}]
    recipe = write_recipe(in_tmp / "r.yaml", stages,
                          lora={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    trainer, _, _ = kto.build_trainer(stage_context(recipe, "kto", in_tmp / "run"))
    built_by(trainer, family)
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    with torch.no_grad():
        loss = trainer_loss(trainer, trainer.data_collator(rows)).item()
    at_start = sum(DESIRABLE / 2 if r["label"] else UNDESIRABLE / 2 for r in rows) / BATCH
    assert loss == pytest.approx(at_start, abs=1e-6 * precision_scale())
    # against the base instead, the loss would differ: the init adapter moved the policy
    expected_vs_base, _ = by_hand(trainer.model, base_model(), rows)
    assert abs(expected_vs_base.item() - at_start) > 1e-4
