"""Model loading: the tiny model through Unsloth's CPU backend, the transformers override, one log line."""

from __future__ import annotations

import json

import pytest
import torch

from kitcli.models import tiny
from kitcli.models.backend import choose_backend, load_policy

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def test_tiny_model_is_cached_and_has_chat_template(tiny_model_dir):
    assert tiny.ensure_tiny_model(seed=0) == tiny_model_dir  # second call reuses the cache
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert [tokenizer.decode([t]) for t in tokenizer("12")["input_ids"]] == ["1", "2"]  # digits split


def test_every_machine_gets_the_shipped_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    """The weights a run trains from are the shipped file (not rebuilt per CPU), copied byte for byte."""
    assert tiny.file_sha256(tiny.ASSETS / "model.safetensors") == tiny.TINY_SHA256
    assert tiny.file_sha256(tiny_model_dir / "model.safetensors") == tiny.TINY_SHA256
    # the shipped tokenizer is what its recipe builds (deterministic on any machine)
    built = json.loads(tiny.build_tokenizer().backend_tokenizer.to_str())
    shipped = json.loads((tiny.ASSETS / "tokenizer.json").read_text())
    for part in ("model", "added_tokens", "pre_tokenizer", "decoder"):  # vocabulary, merges, splitting
        assert built[part] == shipped[part], part
    # a fresh KIT_HOME gets a copy at once, without building anything
    monkeypatch.setenv("KIT_HOME", str(tmp_path / "home"))
    fresh = tiny.ensure_tiny_model()
    assert fresh.parent == tmp_path / "home" / "models"
    assert tiny.file_sha256(fresh / "model.safetensors") == tiny.TINY_SHA256


def test_the_shipped_tiny_model_is_pretrained(tiny_model_dir):
    """Its loss on the pretraining text is far below a fresh random model's: it is a language model, not noise."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(123)
    docs = [tiny.pretraining_text(rng).rstrip("\n") + tokenizer.eos_token for _ in range(16)]
    batch = tokenizer(docs, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    shipped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fresh = tiny.build_model(len(tokenizer), tokenizer, seed=0)
    with torch.no_grad():
        trained_loss = shipped(**batch, labels=labels).loss.item()
        random_loss = fresh(**batch, labels=labels).loss.item()
    assert trained_loss < 0.5 * random_loss, (trained_loss, random_loss)


def test_tiny_build_is_deterministic_for_a_seed():
    tokenizer_a, tokenizer_b = tiny.build_tokenizer(), tiny.build_tokenizer()
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab()
    a = tiny.build_model(len(tokenizer_a), tokenizer_a, seed=3).state_dict()
    b = tiny.build_model(len(tokenizer_b), tokenizer_b, seed=3).state_dict()
    c = tiny.build_model(len(tokenizer_b), tokenizer_b, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_load_policy_through_unsloth_cpu_backend(tiny_model_dir):
    lines = []
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=LORA, dtype="float32", log=lines.append)
    assert loaded.backend == "unsloth-cpu"
    assert loaded.load_in_4bit is True
    assert type(loaded.model).__name__.startswith("PeftModel")
    assert 0 < loaded.trainable_params < loaded.total_params
    assert len(lines) == 1 and "backend unsloth-cpu" in lines[0] and "4-bit yes" in lines[0]
    assert "trainable" in lines[0] and "device cpu" in lines[0]


def test_backend_override_to_transformers(tiny_model_dir):
    lines = []
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=LORA, backend="transformers",
                         dtype="float32", log=lines.append)
    assert loaded.backend == "transformers"
    assert loaded.load_in_4bit is False  # bitsandbytes 4-bit training is a CUDA path in the transformers backend
    assert "backend transformers" in lines[0]


def test_full_finetuning_trains_every_parameter(tiny_model_dir):
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=None, dtype="float32", log=lambda m: None)
    assert loaded.trainable_params == loaded.total_params
    assert loaded.load_in_4bit is False


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_cpu_training_does_not_recompute_activations(tiny_model_dir, lora):
    """On CPU the kit's trainers run without gradient checkpointing (the activations fit in memory), so the model
    must not recompute them either: Unsloth's loader enabled it for full fine-tuning whatever the trainer said."""
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=lora, dtype="float32",
                         log=lambda m: None)
    assert loaded.backend == "unsloth-cpu"
    assert not loaded.model.is_gradient_checkpointing


def test_reward_models_on_cpu_use_transformers():
    assert choose_backend("auto", task="seq_cls") == "transformers"


@pytest.mark.gpu
def test_unsloth_4bit_on_cuda(tiny_model_dir):
    """Needs CUDA: the Unsloth GPU path with bitsandbytes 4-bit."""
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=LORA, log=lambda m: None)
    assert loaded.backend == "unsloth-gpu" and loaded.load_in_4bit
