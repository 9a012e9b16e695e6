"""GPU figures: a randomly initialised model of a real shape (Qwen3-1.7B's config; no download), 4-bit + LoRA,
SFT and GRPO steps through kit with Unsloth versus the same through kit's plain transformers + PEFT +
bitsandbytes backend: step time, tokens per second and peak VRAM, as ratios.

    python bench/gpu.py              # on a CUDA machine: the real shape (finishes within ~8 minutes on an H200)
    python bench/gpu.py --reduced    # anywhere: a tiny shape, a few steps, so the script cannot rot (CPU: no VRAM)

tests/test_bench_gpu.py runs the reduced mode on every `make test`.

Both sides run the same recipe (bench writes it) in their own process; the backend is forced with
KIT_FORCE_BACKEND. Peak VRAM is what kit records in each stage's DONE file (torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml
from common import KIT, RESULTS, ROOT, save, timed

QWEN3_1_7B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "vocab_size": 151936}
REDUCED = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512, "rope_theta": 1000000.0,
           "tie_word_embeddings": True}


def build_model(directory: Path, shape: dict) -> None:
    """A Qwen3 of `shape` with random weights and the tiny tokenizer (its ids fit any vocab this size or larger)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kitcli.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3Config(**{"vocab_size": len(tokenizer), **shape}, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def recipe(model_dir: Path, reduced: bool) -> dict:
    steps = 3 if reduced else 20
    seq = 128 if reduced else 1024
    return {
        "name": "gpu-bench", "seed": 0,
        "model": {"name": str(model_dir), "max_seq_length": seq, "load_in_4bit": True,
                  "dtype": "float32" if reduced else "bfloat16"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "stages": [
            {"name": "sft", "type": "sft", "data": str(ROOT / "examples/data/arithmetic_sft.jsonl"),
             "train": {"max_steps": steps, "per_device_train_batch_size": 4 if reduced else 16,
                       "logging_steps": 1, "save_steps": 10_000}},
            {"name": "grpo", "type": "grpo", "init": "sft",
             "data": str(ROOT / "examples/data/arithmetic_prompts.jsonl"),
             "rewards": ["exact_match"],
             "train": {"max_steps": max(2, steps // 2), "per_device_train_batch_size": 4 if reduced else 16,
                       "num_generations": 4, "max_completion_length": 8 if reduced else 128,
                       "logging_steps": 1, "save_steps": 10_000}},
        ],
    }


def stage_figures(run_dir: Path, stage: str) -> dict:
    done = json.loads((run_dir / stage / "DONE").read_text())
    rows = [json.loads(line) for line in (run_dir / stage / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "train_runtime" in r]
    runtime = final[-1]["train_runtime"] if final else done["seconds"]
    steps = done.get("steps") or max(r.get("step", 0) for r in rows)
    tokens = max((r.get("num_tokens", 0) or 0 for r in rows), default=0)
    return {"step_s": runtime / max(steps, 1), "tokens_per_s": (tokens / runtime) if tokens else None,
            "peak_vram_gib": done.get("peak_gpu_memory_gib")}


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def cell(value, width: int, digits: int) -> str:
    """A table cell; '-' where there is no figure (no VRAM on a CPU, no token count)."""
    return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reduced", action="store_true", help="a tiny shape and a few steps (runs on CPU)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="directory for the JSON (default bench/results)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kit-gpu-bench-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    model_dir = work / "model"
    build_model(model_dir, REDUCED if args.reduced else QWEN3_1_7B)
    recipe_path = work / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(model_dir, args.reduced), sort_keys=False))
    results = {}
    for backend in ("unsloth", "transformers"):
        env = {**os.environ, "KIT_FORCE_BACKEND": backend, "HF_HUB_OFFLINE": "1"}
        run_dir = work / f"run-{backend}"
        results[backend] = {"wall_s": timed(KIT + ["run", str(recipe_path), "--output", str(run_dir), "--quiet"],
                                            env=env, cwd=ROOT)["seconds"],
                            **{stage: stage_figures(run_dir, stage) for stage in ("sft", "grpo")}}
    rows = []
    for stage in ("sft", "grpo"):
        u, t = results["unsloth"][stage], results["transformers"][stage]
        rows.append({"stage": stage, "unsloth": u, "transformers": t,
                     "step_time_ratio": ratio(u["step_s"], t["step_s"]),
                     "tokens_per_s_ratio": ratio(u["tokens_per_s"], t["tokens_per_s"]),
                     "peak_vram_ratio": ratio(u["peak_vram_gib"], t["peak_vram_gib"])})
    print(f"shape: {'reduced (tiny)' if args.reduced else 'Qwen3-1.7B'}; ratios are Unsloth / plain transformers+PEFT")
    print(f"{'stage':6} {'step s U':>9} {'step s T':>9} {'ratio':>6} {'tok/s ratio':>12} {'VRAM U':>7} "
          f"{'VRAM T':>7} {'ratio':>6}")
    for r in rows:
        print(f"{r['stage']:6} {cell(r['unsloth']['step_s'], 9, 3)} {cell(r['transformers']['step_s'], 9, 3)} "
              f"{cell(r['step_time_ratio'], 6, 3)} {cell(r['tokens_per_s_ratio'], 12, 3)} "
              f"{cell(r['unsloth']['peak_vram_gib'], 7, 2)} {cell(r['transformers']['peak_vram_gib'], 7, 2)} "
              f"{cell(r['peak_vram_ratio'], 6, 3)}")
    saved = save("gpu-reduced" if args.reduced else "gpu", {"rows": rows, "results": results}, args.results)
    print(f"results: {saved}")


if __name__ == "__main__":
    main()
