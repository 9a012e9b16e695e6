"""Chaining: `init:` passes the policy adapter from one stage to the next (SFT -> DPO, SFT -> GRPO, SFT -> GSPO), and
`reward_model:` passes a reward model trained earlier in the recipe to a GRPO stage.

"Stage 2 starts from exactly the weights stage 1 saved" is checked end to end: stage 2 trains real steps with a
learning rate of 1e-30, whose AdamW steps (about 1e-29) are far below float32's resolution at these weights, so its
saved adapter must be bit-identical to stage 1's; a stage that started from a fresh adapter, or from a copy that was
rounded on the way (e.g. to bfloat16), would differ. (A learning rate of 0 is refused: it trains nothing.)
"""

from __future__ import annotations

import pytest
from helpers import DATA, done, metrics, run_cli, write_recipe
from rich.console import Console
from safetensors.torch import load_file

from kitcli.recipe.load import load_recipe
from kitcli.recipe.stage_context import StageContext

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
PREFS = str(DATA / "arithmetic_prefs.jsonl")
RL = {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
      "logging_steps": 1, "save_steps": 50}
FROZEN = {"learning_rate": 1e-30}

STAGES = [
    {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
     "train": {"max_steps": 3, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "save_steps": 50}},
    {"name": "grpo", "type": "grpo", "init": "sft", "data": PROMPTS, "rewards": ["exact_match"],
     "train": {**RL, **FROZEN}},
    {"name": "gspo", "type": "gspo", "init": "sft", "data": PROMPTS, "rewards": ["exact_match"],
     "train": {**RL, **FROZEN, "per_device_train_batch_size": 2, "save_steps": 48}},  # whole generation batches
    {"name": "dpo", "type": "dpo", "init": "sft", "data": PREFS, "eval_fraction": 0,
     "train": {"max_steps": 2, "per_device_train_batch_size": 4, "save_steps": 50, **FROZEN}},
    {"name": "rm", "type": "reward", "data": PREFS, "eval_fraction": 0,
     "train": {"max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "save_steps": 50}},
    {"name": "rlhf", "type": "grpo", "init": "sft", "data": PROMPTS, "reward_model": "rm",
     "train": {**RL, "max_steps": 1}},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    recipe = write_recipe(root / "r.yaml", STAGES)
    run_cli("run", recipe, "--output", root / "run")
    return root / "run"


def adapter(stage_dir):
    return load_file(str(stage_dir / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("stage", ["grpo", "gspo", "dpo"])
def test_stage_starts_from_exactly_the_sft_weights(run, stage):
    assert done(run / stage)["steps"] == 2, "the stage must really train (with a learning rate of 0)"
    sft, after = adapter(run / "sft"), adapter(run / stage)
    assert sft.keys() == after.keys()
    for key in sft:
        # TRL would train a 4-bit model's LoRA in bfloat16; the kit keeps the float32 weights init: passed on.
        assert (after[key].float() == sft[key].float()).all(), f"{stage}: {key} differs from the SFT adapter"
    assert any(v.abs().sum() > 0 for k, v in sft.items() if "lora_B" in k), "SFT must have moved off the fresh adapter"


def test_reward_model_scores_the_grpo_stage(run):
    rows = [row for row in metrics(run / "rlhf") if "reward" in row]
    assert rows and "rewards/rm/mean" in rows[0]  # TRL names a reward model after the reward stage
    assert rows[0]["reward"] == pytest.approx(rows[0]["rewards/rm/mean"])


def test_grpo_holds_exactly_the_merged_reward_model(run):
    from kitcli.stages import grpo

    recipe = load_recipe(str(run.parent / "r.yaml"))
    outputs = {s.name: run / s.name for s in recipe.stages}
    ctx = StageContext(recipe, recipe.stage("rlhf"), run.parent / "rebuilt", Console(quiet=True), outputs)
    trainer, _, _ = grpo.build_trainer(ctx, grpo.VARIANTS["grpo"])
    scorer = trainer.reward_funcs[-1]
    saved = load_file(str(run / "rm" / "merged" / "model.safetensors"))
    state = scorer.state_dict()
    assert saved.keys() <= state.keys()
    for key, value in saved.items():
        assert (state[key].cpu() == value).all(), key
    assert not any(p.requires_grad for p in scorer.parameters())
