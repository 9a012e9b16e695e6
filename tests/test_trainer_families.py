"""The path a GPU runs: every check here runs on TRL's own trainers and on Unsloth's generated ones (forced on the
CPU, conftest.trainer_family), and asserts what the trainer really uses, not what the config says.

- GRPO's KL reference is the policy the stage starts from (the SFT model), not the base: the first logged KL of
  SFT -> GRPO (beta 0.04) is 0 (Unsloth's trainer, left alone, measures it against the base: 4.96 on a real run).
- DPO's reference is the SFT model: the loss equals the formula (beta 0.2, the recipe's) with the SFT model's
  log-probs (the batch on the model's device, as a training step has it; in float32 and at the GPU's precision,
  conftest.precision; test_preference_formulas.assert_dpo_loss_is_the_formula).
- GSPO's old log-probs are computed exactly when training is off-policy (TRL's gate), on both families.
- A value the recipe set explicitly is restored when a config rewrites it (Unsloth: scale_rewards under dr_grpo),
  and refused, in one line with exit status 2, when the trainer rewrites it in __init__.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    DATA,
    TINY_MODEL,
    metrics,
    run_cli,
    stage_context,
    write_recipe,
)
from test_preference_formulas import assert_dpo_loss_is_the_formula

from kitcli.training.trainers import is_unsloth_class

pytestmark = pytest.mark.slow  # every test here builds or trains a model

SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
       "train": {"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 3e-3, "logging_steps": 2}}
PROMPTS = str(DATA / "arithmetic_prompts.jsonl")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir) -> Path:
    """One SFT stage whose adapter is far from zero, to start the later stages from (SFT is TRL's class on both
    families on a CPU: Unsloth cannot rewrite the CPU backend's SFTTrainer)."""
    root = tmp_path_factory.mktemp("families-sft")
    run_cli("run", write_recipe(root / "r.yaml", [SFT]), "--output", root / "run")
    return root / "run"


def assert_family(trainer, family: str) -> None:
    assert is_unsloth_class(type(trainer)) == (family == "unsloth"), type(trainer)


VARIED_REWARD = """
def varied(prompts, completions, **kwargs):  # dense and deterministic: every group has a spread, so the policy moves
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(map(ord, t)) % 10) / 10 for t in texts]
"""


def test_grpo_kl_is_zero_at_the_start_and_grows_as_the_policy_moves(trainer_family, tmp_path):
    """The first logged KL of SFT -> GRPO is 0 (the reference is the SFT model the stage starts from, not the base),
    and once the policy has moved it is not (a reference that followed the live policy would log 0 throughout)."""
    (tmp_path / "varied.py").write_text(VARIED_REWARD)
    grpo = {"name": "grpo", "type": "grpo", "init": "sft", "variant": "grpo", "data": PROMPTS,
            "rewards": ["varied.py:varied"],
            "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "learning_rate": 2e-3,
                      "max_completion_length": 4, "logging_steps": 1, "temperature": 1.0}}
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [SFT, grpo]), "--output", tmp_path / "run")
    assert ("UnslothGRPOTrainer (Unsloth)" if trainer_family == "unsloth" else "GRPOTrainer (TRL)") in result.output
    assert "reference = frozen 'ref' adapter, a copy of the starting adapter" in result.output
    logged = [row for row in metrics(tmp_path / "run" / "grpo") if "kl" in row]
    assert [row["step"] for row in logged] == [1, 2]
    assert abs(logged[0]["kl"]) < 1e-6, logged[0]["kl"]
    assert logged[-1]["kl"] > 1e-4, [row["kl"] for row in logged]


def test_dpo_reference_is_the_sft_model(trainer_family, sft_run, tmp_path, precision):
    from kitcli.models.backend import load_policy
    from kitcli.stages import dpo

    beta = 0.2
    stages = [SFT, {"name": "dpo", "type": "dpo", "init": "sft", "eval_fraction": 0,
                    "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
                    "train": {"beta": beta, "max_steps": 1}}]
    ctx = stage_context(write_recipe(tmp_path / "r.yaml", stages), "dpo", tmp_path / "run",
                        {"sft": sft_run / "sft"})
    trainer, _, reference = dpo.build_trainer(ctx)
    assert_family(trainer, trainer_family)
    assert reference.startswith("frozen 'ref' adapter")
    model = trainer.model
    with torch.no_grad():  # move the policy away from its start, as training would; the reference must stay
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param, generator=torch.Generator().manual_seed(0)))
    rows = [trainer.train_dataset[i] for i in range(6)]
    sft_model = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                            dtype="float32", init_from=sft_run / "sft", trainable=False, log=lambda _: None).model
    assert_dpo_loss_is_the_formula(trainer, model, sft_model, rows, beta)


@pytest.mark.parametrize("stage_type, off_policy", [("gspo", True), ("grpo", False)])
def test_old_log_probs_exactly_when_off_policy(trainer_family, tmp_path, stage_type, off_policy):
    """GSPO's paper settings (4 optimizer steps per generation batch) are off-policy: the trainer stores the
    sampling policy's log-probs as old_per_token_logps. Plain GRPO (one step per batch) is on-policy: it does not,
    and its ratio is exactly 1 (old = current, detached)."""
    from kitcli.stages import grpo, gspo

    stage = {"name": "rl", "type": stage_type, "data": PROMPTS, "rewards": ["exact_match"],
             "train": {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 4}}
    ctx = stage_context(write_recipe(tmp_path / "r.yaml", [stage]), "rl", tmp_path / "run", {})
    preset = gspo.GSPO_PRESET if stage_type == "gspo" else grpo.VARIANTS["grpo"]
    trainer, _, _ = grpo.build_trainer(ctx, preset)
    assert_family(trainer, trainer_family)
    rows = [trainer.train_dataset[i] for i in range(4)]
    trainer.model.train()  # the gate is the training one
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([row for row in rows for _ in range(4)])
    assert (batch.get("old_per_token_logps") is not None) == off_policy


def dry_run_stage(tmp_path: Path, stage: dict) -> dict:
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [stage]), "--dry-run")
    return yaml.safe_load(result.output.split(f"({stage['type']})\n", 1)[1])


def test_a_config_rewrite_of_an_explicit_value_is_restored_and_shown(trainer_family, tmp_path):
    """Unsloth's GRPOConfig sets scale_rewards to 'none' whenever loss_type is dr_grpo; the recipe's explicit
    'group' wins, the dry run and the lock file say what happened, and the trainer uses 'group'."""
    from kitcli.stages import grpo

    stage = {"name": "rl", "type": "grpo", "variant": "dr_grpo", "data": PROMPTS, "rewards": ["exact_match"],
             "train": {"scale_rewards": "group", "per_device_train_batch_size": 4, "num_generations": 4,
                       "max_completion_length": 4}}
    resolved = dry_run_stage(tmp_path, stage)
    assert resolved["GRPOConfig"]["scale_rewards"] == "group"
    rewritten = resolved.get("rewritten by the library", [])
    if trainer_family == "unsloth":
        assert rewritten == ["scale_rewards: 'group' (train) -> 'none'; restored"]
    else:
        assert rewritten == []
    ctx = stage_context(tmp_path / "r.yaml", "rl", tmp_path / "run", {})
    trainer, _, _ = grpo.build_trainer(ctx, grpo.VARIANTS["dr_grpo"])
    assert_family(trainer, trainer_family)
    assert trainer.scale_rewards == "group" and trainer.args.scale_rewards == "group"


def test_a_trainer_rewrite_of_an_explicit_value_is_refused(trainer_family, tmp_path):
    """Unsloth's trainers replace a per_device_eval_batch_size of 8 with the training batch size in __init__; an
    explicit 8 then cannot be honoured and the stage stops before training, naming the stage and the field."""
    stage = {"name": "dpo", "type": "dpo", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 40},
             "eval_fraction": 0.2, "train": {"max_steps": 1, "per_device_train_batch_size": 4,
                                             "per_device_eval_batch_size": 8}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    if trainer_family == "trl":  # TRL's trainer keeps the value: the stage trains with it, and says so
        run_cli("run", recipe, "--output", tmp_path / "run")
        config = json.loads((tmp_path / "run" / "dpo" / "config.json").read_text())  # the built trainer's values
        assert config["per_device_eval_batch_size"] == 8 and "kit_rewritten" not in config
        assert "rewritten" not in json.loads((tmp_path / "run" / "dpo" / "DONE").read_text())
        return
    result = run_cli("run", recipe, "--output", tmp_path / "run", expect=2)
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Traceback" not in result.output
    assert "stage 'dpo'" in last and "changed train.per_device_eval_batch_size from 8 to 4" in last
    assert not (tmp_path / "run" / "dpo" / "metrics.jsonl").exists()  # nothing trained
