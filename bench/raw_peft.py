"""The hand-written baseline of bench/shapes.py: one SFT or GRPO stage with TRL + PEFT + bitsandbytes, no Unsloth
and no kit, with the settings of a kit run (its config.json), on the same model directory and data.

    python bench/raw_peft.py sft|grpo MODEL_DIR DATA_JSONL CONFIG_JSON OUTPUT_DIR [--four-bit]

What a QLoRA user writes from the TRL and PEFT docs: the model in 4-bit NF4 with double quantization and bf16
compute (on a GPU; 16-bit where bitsandbytes cannot train in 4-bit), LoRA r 16 / alpha 32 on every projection,
gradient checkpointing as the config says. (On a CPU, the reduced mode, it borrows one function of the kit: TRL's
log-prob kernel runs on CUDA only.) Prints one JSON line: train_runtime, steps, tokens and peak CUDA memory
(allocated and reserved).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import trl_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def varied(prompts, completions, **kwargs):  # the same cheap reward as the kit side (bench/shapes.py)
    return [(len(c) % 7) / 7 for c in completions]


def main() -> None:
    stage, model_dir, data, config_path, output_dir = sys.argv[1:6]
    four_bit = "--four-bit" in sys.argv
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    on_gpu = torch.cuda.is_available()
    if not on_gpu:  # TRL 1.15 computes log-probs with a CUDA-only Triton kernel; on a CPU use the kit's torch version
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from kitcli.models.backend import route_trl_fused_head_off_gpu

        route_trl_fused_head_off_gpu()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype) if four_bit else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, quantization_config=quantization,
                                                 device_map={"": 0} if on_gpu else None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config_values = json.loads(Path(config_path).read_text())
    if four_bit:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=bool(config_values.get("gradient_checkpointing")))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    if stage == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=trl_config(SFTConfig, config_path, output_dir),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    else:
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=model, reward_funcs=[varied], args=trl_config(GRPOConfig, config_path, output_dir),
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    tokens = max((row.get("num_tokens", 0) or 0 for row in trainer.state.log_history), default=0)
    print(json.dumps({"train_runtime": result.metrics["train_runtime"], "steps": trainer.state.global_step,
                      "tokens": tokens,
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                      "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_gpu else None}))


if __name__ == "__main__":
    main()
