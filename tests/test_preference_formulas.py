"""The preference losses the kit trains with, checked against the reference formulas on a fixed small batch.

Each test builds the trainer exactly as the stage does (`build_trainer`, after Unsloth's import in conftest), takes
the loss TRL computes on a collated batch, and recomputes it here from log-probabilities / rewards obtained with
plain forward passes, one unpadded sequence at a time:
    DPO:           -log sigmoid(beta * ((pw - rw) - (pl - rl)))
    Bradley-Terry: -log sigmoid(r_chosen - r_rejected)   (+ c * mean((r_chosen + r_rejected)^2) when centering)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    DATA,
    TINY_MODEL,
    completion_logprob,
    forward_precision,
    precision_scale,
    stage_context,
    write_recipe,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds a model, on both families

BATCH = 6


def built_by(trainer, family: str) -> None:
    from kitcli.training.trainers import is_unsloth_class

    assert is_unsloth_class(type(trainer)) == (family == "unsloth"), type(trainer)


def test_dpo_loss_is_the_reference_formula(in_tmp, family):
    from kitcli.models.backend import load_policy
    from kitcli.stages import dpo

    beta = 0.3  # not the default, so the test sees that train.beta reaches the loss
    stage = {"name": "dpo", "type": "dpo", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
             "eval_fraction": 0, "train": {"beta": beta, "max_steps": 1}}
    ctx = stage_context(write_recipe(in_tmp / "r.yaml", [stage]), "dpo", in_tmp / "run")
    trainer, loaded, _ = dpo.build_trainer(ctx)
    built_by(trainer, family)
    model = trainer.model
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference, as training would
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param))
    rows = [trainer.train_dataset[i] for i in range(BATCH)]
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, trainer.data_collator(rows)).item()

    reference = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                            dtype="float32", trainable=False, log=lambda _: None).model  # no init: the base
    model.eval()
    with torch.no_grad():
        losses = []
        for row in rows:
            pw = completion_logprob(model, row["prompt_ids"], row["chosen_ids"])
            pl = completion_logprob(model, row["prompt_ids"], row["rejected_ids"])
            rw = completion_logprob(reference, row["prompt_ids"], row["chosen_ids"])
            rl = completion_logprob(reference, row["prompt_ids"], row["rejected_ids"])
            losses.append(-F.logsigmoid(beta * ((pw - rw) - (pl - rl))))
    expected = torch.stack(losses).mean().item()
    assert abs(expected - 0.6931) > 1e-3  # policy != reference, or the check would be vacuous
    assert abs(trl_loss - expected) < 1e-4 * precision_scale(), (trl_loss, expected)


def test_bradley_terry_loss_is_the_reference_formula(in_tmp, family):
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
            trl_loss = trainer.compute_loss(model, trainer.data_collator(rows)).item()
            with forward_precision():
                chosen, rejected = (
                    torch.stack([model(input_ids=torch.tensor([r[key]], device=model.device)).logits[0, 0]
                                 for r in rows]).float() for key in ("chosen_ids", "rejected_ids"))
        expected = (-F.logsigmoid(chosen - rejected)).mean() + center * ((chosen + rejected) ** 2).mean()
        assert chosen.std() > 0 and not torch.allclose(chosen, rejected)
        assert abs(trl_loss - expected.item()) < 1e-5 * precision_scale(), (name, trl_loss, expected.item())
