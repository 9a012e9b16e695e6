"""Configs in the shapes people publish, from first `kit check` to a trained stage (issue 51, item 9): an Unsloth
GRPO notebook's settings written as a recipe (loader and LoRA arguments, warmup_ratio, max_prompt_length,
vllm_sampling_params, an 8-bit optimizer, batch 1 with 4 generations, output_dir), and `kit import` of a TRL CLI /
open-r1 YAML and of an axolotl YAML. Each: every fault in the first `kit check` (by count), the fixes its lines
name, then `kit check` clean, the dry run, and a short real run whose adapter moved."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from helpers import DATA, run_cli
from test_import import AXOLOTL_KTO, OPEN_R1_SFT, imported

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
# Unsloth's Qwen3 (4B) GRPO notebook: its from_pretrained, get_peft_model and GRPOConfig arguments, as a user
# pastes them into a recipe, on the tiny model
NOTEBOOK_AS_PUBLISHED = {
    "name": "notebook", "seed": 3407,
    "model": {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True, "fast_inference": True,
              "max_lora_rank": 8, "gpu_memory_utilization": 0.7},
    "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"],
             "use_gradient_checkpointing": "unsloth", "random_state": 3407},
    "stages": [{"name": "grpo", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
                "train": {"learning_rate": 5e-6, "weight_decay": 0.01, "warmup_ratio": 0.1,
                          "lr_scheduler_type": "linear", "optim": "adamw_8bit", "logging_steps": 1,
                          "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "num_generations": 4,
                          "max_prompt_length": 64, "max_completion_length": 8, "max_steps": 2, "save_steps": 2,
                          "report_to": "none", "output_dir": "outputs",
                          "vllm_sampling_params": {"min_p": 0.1, "top_p": 1.0, "top_k": -1, "seed": 3407}}}]}


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error: ")
            and " faults, each on a line" not in line]


def adapter_moved(stage_dir: Path) -> bool:
    """The trained adapter's B matrices are no longer all zero (a fresh LoRA's are)."""
    from safetensors.torch import load_file

    weights = load_file(stage_dir / "adapter" / "adapter_model.safetensors")
    return any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in weights.items())


@pytest.mark.slow
def test_an_unsloth_notebook_recipe_is_fixed_in_one_round_and_trains(tmp_path):
    path = tmp_path / "notebook.yaml"
    path.write_text(yaml.safe_dump(NOTEBOOK_AS_PUBLISHED, sort_keys=False))
    first = run_cli("check", path, expect=2).output
    faults = errors(first)
    assert len(faults) == 3, faults  # the whole list in one round
    assert "train.max_prompt_length" in faults[0] and "train.output_dir is set by the kit" in faults[1]
    assert "does not divide the generation batch of 1 completions" in faults[2]
    assert "per_device_train_batch_size: 4" in faults[2]
    notes = [line for line in first.splitlines() if line.startswith("note: ")]
    assert any("train.warmup_ratio" in line and "warmup_steps" in line for line in notes)

    fixed = copy.deepcopy(NOTEBOOK_AS_PUBLISHED)  # what the three lines say to do, nothing else
    train = fixed["stages"][0]["train"]
    del train["max_prompt_length"], train["output_dir"]
    train["per_device_train_batch_size"] = 4
    path.write_text(yaml.safe_dump(fixed, sort_keys=False))
    clean = run_cli("check", path).output
    assert errors(clean) == []
    assert "train.optim: adamw_8bit needs a GPU" in clean  # what the CPU run changes, once its config is built
    dry = run_cli("run", path, "--dry-run").output
    assert "optim: adamw_torch_fused" in dry and "warmup_steps: 0.1" in dry and "min_p: 0.1" in dry
    run_cli("run", path, "--output", tmp_path / "run", "--quiet")
    done = json.loads((tmp_path / "run" / "grpo" / "DONE").read_text())
    config = json.loads((tmp_path / "run" / "grpo" / "config.json").read_text())
    assert done["steps"] == 2  # (the base model answers nothing right yet: zero advantages, nothing to move)
    assert (config["optim"], config["warmup_steps"], config["min_p"], config["seed"]) == (
        "adamw_torch_fused", 0.1, 0.1, 3407)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["open-r1-sft", "axolotl-kto"])
def test_an_imported_config_checks_clean_and_trains(tmp_path, source):
    config = {"open-r1-sft": OPEN_R1_SFT, "axolotl-kto": AXOLOTL_KTO}[source]
    _, recipe, _ = imported(tmp_path, config)
    assert errors(run_cli("check", recipe).output) == []
    run_cli("run", recipe, "--dry-run")
    run_cli("run", recipe, "--output", tmp_path / "run", "--quiet")
    stage = yaml.safe_load(recipe.read_text())["stages"][0]["name"]
    assert (tmp_path / "run" / stage / "DONE").is_file()
    if (tmp_path / "run" / stage / "adapter").is_dir():
        assert adapter_moved(tmp_path / "run" / stage)
