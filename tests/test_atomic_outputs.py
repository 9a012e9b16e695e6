"""Stage outputs are written under a temporary name and renamed into place: a crash while saving never leaves a
half-written adapter where a later stage would load it, and an earlier adapter survives."""

from __future__ import annotations

import pytest

from kitcli.models.backend import load_policy, save_model

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}


class CrashingTokenizer:
    """Stands in for a process dying halfway through a save: the model's files are written, then this raises."""

    def save_pretrained(self, directory):
        raise OSError("disk vanished")


def test_crash_during_save_keeps_the_previous_adapter(tmp_path, tiny_model_dir):
    loaded = load_policy("tiny", max_seq_length=64, load_in_4bit=True, lora=LORA, dtype="float32", log=lambda m: None)
    first = save_model(loaded.model, loaded.tokenizer, tmp_path)
    before = (first / "adapter_model.safetensors").read_bytes()
    with pytest.raises(OSError):
        save_model(loaded.model, CrashingTokenizer(), tmp_path)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert (tmp_path / "adapter" / "tokenizer.json").exists()  # the complete earlier save, untouched
    again = save_model(loaded.model, loaded.tokenizer, tmp_path)  # a retry cleans the partial copy
    assert again == first and not (tmp_path / "adapter.tmp").exists()
