"""A minimal hand-written TRL script: the same stage as kit runs, without kit.

    python bench/raw_trl.py sft|dpo|grpo CONFIG_JSON OUTPUT_DIR

It loads the tiny model with Unsloth's FastLanguageModel, attaches the same LoRA, reads the same data, and
builds the TRL config from the kit run's `config.json` (the effective values, so the settings are identical).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import unsloth  # noqa: F401  (before trl / transformers, as in kit)
from common import trl_config
from unsloth import FastLanguageModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kitcli.models.tiny import ensure_tiny_model  # noqa: E402  (only to find the cached tiny model directory)

DATA = ROOT / "examples" / "data"
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def rows(name: str, keep: list[str]) -> list[dict]:
    lines = (DATA / name).read_text().splitlines()
    return [{k: json.loads(line)[k] for k in keep} for line in lines if line.strip()]


def exact_match(prompts, completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == a.strip()) for t, a in zip(texts, answer)]


def main() -> None:
    stage, config_path, output_dir = sys.argv[1:4]
    model, tokenizer = FastLanguageModel.from_pretrained(str(ensure_tiny_model()), max_seq_length=128,
                                                         dtype=torch.float32, load_in_4bit=True, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, **LORA, bias="none", use_gradient_checkpointing=False,
                                             random_state=0)
    from datasets import Dataset

    if stage == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=trl_config(SFTConfig, config_path, output_dir),
                             train_dataset=Dataset.from_list(rows("arithmetic_sft.jsonl", ["prompt", "completion"])),
                             processing_class=tokenizer)
    elif stage == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, args=trl_config(DPOConfig, config_path, output_dir),
                             train_dataset=Dataset.from_list(rows("arithmetic_prefs.jsonl",
                                                                  ["prompt", "chosen", "rejected"])),
                             processing_class=tokenizer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=model, reward_funcs=[exact_match],
                              args=trl_config(GRPOConfig, config_path, output_dir),
                              train_dataset=Dataset.from_list(rows("arithmetic_prompts.jsonl", ["prompt", "answer"])),
                              processing_class=tokenizer)
    result = trainer.train()
    print(f"TRAIN_RUNTIME {result.metrics['train_runtime']}")  # the training loop alone, for overhead.py
    model.save_pretrained(str(Path(output_dir) / "adapter"))
    tokenizer.save_pretrained(str(Path(output_dir) / "adapter"))


if __name__ == "__main__":
    main()
