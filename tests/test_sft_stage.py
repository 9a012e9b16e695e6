"""The SFT stage on the tiny model: loss falls, adapter changes, the saved adapter loads back, dry-run output."""

from __future__ import annotations

import pytest
import torch
from helpers import DATA, done, metrics, run_cli, write_recipe
from safetensors.torch import load_file

STEPS = 30


def sft_recipe(path, **train):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": STEPS, "learning_rate": 2e-3, "per_device_train_batch_size": 16,
                       "logging_steps": 5, "save_steps": 100, **train}}
    return write_recipe(path, [stage])


@pytest.mark.slow
def test_sft_trains_saves_and_reloads(in_tmp, tiny_model_dir):
    recipe = sft_recipe(in_tmp / "sft.yaml")
    result = run_cli("run", recipe, "--output", in_tmp / "run")
    stage_dir = in_tmp / "run" / "sft"
    losses = [row["loss"] for row in metrics(stage_dir) if "loss" in row]
    assert len(losses) == STEPS // 5
    assert losses[-1] < 0.7 * losses[0], losses
    assert done(stage_dir)["steps"] == STEPS
    assert "\x1b[" not in result.output  # not a terminal: plain lines
    assert "[sft] step 5/30" in result.output

    saved = load_file(str(stage_dir / "adapter" / "adapter_model.safetensors"))
    lora_b = [t for k, t in saved.items() if "lora_B" in k]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # LoRA B starts at zero: every one moved

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, str(stage_dir / "adapter"))
    state = model.state_dict()
    loaded = {k: v for k, v in state.items() if "lora_B" in k}
    assert len(loaded) == len(lora_b)
    # TRL keeps QLoRA adapter weights in bf16; PEFT loads them into the fp32 base's dtype
    assert all(torch.allclose(loaded[k.replace(".weight", ".default.weight")].float(), v.float())
               for k, v in saved.items() if "lora_B" in k)
    assert (stage_dir / "adapter" / "tokenizer.json").exists()

    rerun = run_cli("run", recipe, "--output", in_tmp / "run")
    assert "finished earlier, skipping" in rerun.output


def test_dry_run_prints_resolved_trl_values(in_tmp):
    recipe = sft_recipe(in_tmp / "sft.yaml")
    result = run_cli("run", recipe, "--dry-run", "--set", "stages.sft.train.learning_rate=1e-4")
    assert "SFTConfig:" in result.output
    assert "learning_rate: 0.0001" in result.output
    assert "use_cpu: true" in result.output and "bf16: false" in result.output
    assert "max_steps: 30" in result.output
    assert not (in_tmp / "runs").exists()  # a dry run writes nothing


@pytest.mark.slow
def test_kit_sft_command_runs_one_stage(in_tmp, tiny_model_dir):
    run_cli("sft", "--model", "tiny", "--data", DATA / "arithmetic_sft.jsonl", "--output", in_tmp / "one",
            "--set", "stages.sft.train.max_steps=3", "--set", "lora.r=4", "--set", "model.max_seq_length=128",
            "--set", "model.dtype=float32")
    assert (in_tmp / "one" / "sft" / "adapter" / "adapter_config.json").exists()
    assert (in_tmp / "one" / "recipe.lock.yaml").exists()
