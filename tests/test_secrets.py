"""Tokens (HF_TOKEN, WANDB_API_KEY, a hub_token in a recipe) never reach logs, lock files, configs or metrics."""

from __future__ import annotations

import json

import pytest
from helpers import DATA, run_cli, write_recipe

HF = "hf_kitTestSecretValue0123456789"
WANDB = "wandb-kit-secret-0123456789abcdef"
HUB = "hf_recipeHubTokenSecret987"


@pytest.mark.slow
def test_tokens_stay_out_of_every_file_and_the_output(in_tmp, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 2, "logging_steps": 1, "hub_token": HUB, "eos_token": "<|im_end|>"}}
    recipe = write_recipe(in_tmp / "r.yaml", [stage])
    result = run_cli("run", recipe, "--output", in_tmp / "run")
    dry = run_cli("run", recipe, "--dry-run")
    texts = {"output": result.output, "dry-run": dry.output}
    for path in (in_tmp / "run").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".yaml", ".md", ".txt", "") :
            texts[str(path)] = path.read_text(errors="replace")
    assert len(texts) > 5
    for where, text in texts.items():
        for secret in (HF, WANDB, HUB):
            assert secret not in text, f"{secret} leaked into {where}"
    assert "<redacted>" in (in_tmp / "run" / "recipe.lock.yaml").read_text()
    # ... while the settings a rerun needs are recorded as they were (TrainingArguments.to_dict() writes every
    # *_token field as a placeholder, "<EOS_TOKEN>")
    config = json.loads((in_tmp / "run" / "sft" / "config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["hub_token"] == "<redacted>"
