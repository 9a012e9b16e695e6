"""Speed and memory at real model shapes: the kit's stage against a hand-written TRL + PEFT + bitsandbytes script
(bench/raw_peft.py, no Unsloth), side by side, alternated, with `kit plan`'s predicted peak next to the measured one.

    python bench/shapes.py --shape qwen3-0.6b --case sft-1024     # on a CUDA machine: one shape, one case
    bash bench/offline_run.sh bench/shapes.py --shape qwen3-0.6b --case grpo-4x256   # the lent GPU (bench/GPU.md)
    python bench/shapes.py --reduced                              # anywhere: the tiny shape, both cases, no GPU columns

One shape and one case per command, so that each fits one 10-minute command on the lent GPU machine (a model is
built once per command; the sides run alternated, --repeat times each). Results are written as they come under
--results ($OUT where it is set): shapes-SHAPE-CASE.json after every run, and each run's output as a log; a run
that fails or outlasts --budget-s is recorded and the command ends with what it measured.

Models are built here with random weights from the architecture table the project ships
(kitcli/plan/architecture.py: hidden size, layers, heads, KV heads, intermediate size, vocabulary, tied embeddings
as the real models have them) and a word-level tokenizer of the same vocabulary size: step time and peak memory do
not depend on trained weights, so no download is needed. Cases: SFT (QLoRA r 16 on every projection, batch 4,
sequences of 1024 and 2048 tokens) and GRPO (4 completions of 256 tokens per prompt, batch 4). Both sides read the
kit run's effective config.json, so the settings are the same; the kit side runs Unsloth (what a GPU runs).

Figures per case: seconds per step (TRL's train_runtime / steps), tokens/s, peak CUDA memory allocated and reserved,
the ratios kit / hand-written, and the planner's predicted peak with its error against the kit's measured peak.
`--reduced` runs in `make test` (tests/test_bench_shapes.py) so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import KIT, RESULTS, ROOT, RunFailed, save, timed

sys.path.insert(0, str(ROOT))

from kitcli.plan.architecture import BUILTIN_ARCHITECTURES  # after the path is set

SHAPES = {"qwen3-0.6b": "qwen3", "qwen3-1.7b": "qwen3", "qwen3-4b": "qwen3", "llama-3.2-1b": "llama"}
REDUCED = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True}
# (name, stage, sequence length or completion length)
CASES = [("sft-1024", "sft", 1024), ("sft-2048", "sft", 2048), ("grpo-4x256", "grpo", 256)]
REDUCED_CASES = [("sft-64", "sft", 64), ("grpo-4x8", "grpo", 8)]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REWARD = '''
def varied(prompts, completions, **kwargs):  # cheap and varied: timing does not need a meaningful reward
    return [(len(c) % 7) / 7 for c in completions]
'''


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer with `vocab_size` entries ("t0", "t1", ... after the special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    from kitcli.models.tiny import CHAT_TEMPLATE

    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def build_model(directory: Path, shape: dict, family: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(shape["vocab_size"])
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig,
                                                                                          LlamaForCausalLM)
    fields = {k: v for k, v in shape.items() if k != "extra_params"}
    config = config_class(**fields, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    with torch.device("cuda" if on_gpu else "cpu"):
        model = model_class(config).to(torch.bfloat16 if on_gpu else torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def words(rng: random.Random, n: int, vocab_size: int) -> str:
    return " ".join(f"t{rng.randrange(len(SPECIALS), vocab_size)}" for _ in range(n))


def write_data(path: Path, stage: str, length: int, vocab_size: int, rows: int = 64) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            row = {"text": words(rng, length, vocab_size)} if stage == "sft" else {"prompt": words(rng, 64, vocab_size)}
            f.write(json.dumps(row) + "\n")


def recipe(model_dir: Path, data: Path, stage: str, length: int, steps: int, on_gpu: bool) -> dict:
    train = {"max_steps": steps, "per_device_train_batch_size": 4, "logging_steps": 1, "save_steps": 10_000,
             "learning_rate": 1e-4}
    if stage == "sft":
        train["max_length"] = length
        body = {"data": str(data)}
    else:
        train.update(num_generations=4, max_completion_length=length, temperature=1.0)
        body = {"data": str(data), "rewards": ["varied.py:varied"], "variant": "grpo"}
    return {"name": "shapes", "seed": 0,
            "model": {"name": str(model_dir), "max_seq_length": max(length, 64) + (64 if stage == "grpo" else 0),
                      "load_in_4bit": on_gpu, "dtype": "auto" if on_gpu else "float32"},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            "stages": [{"name": "x", "type": stage, **body, "train": train}]}


def kit_side(recipe_path: Path, run_dir: Path, log: Path, deadline: float) -> dict:
    timed(KIT + ["run", str(recipe_path), "--output", str(run_dir), "--quiet"], env={**os.environ,
          "HF_HUB_OFFLINE": "1"}, cwd=ROOT, log=log, deadline=deadline)
    done = json.loads((run_dir / "x" / "DONE").read_text())
    rows = [json.loads(line) for line in (run_dir / "x" / "metrics.jsonl").read_text().splitlines() if line]
    runtime = next(r["train_runtime"] for r in reversed(rows) if "train_runtime" in r)
    tokens = max((r.get("num_tokens") or 0 for r in rows), default=0)
    return {"step_s": runtime / max(done["steps"], 1), "tokens_per_s": tokens / runtime if tokens else None,
            "peak_gib": done.get("peak_gpu_memory_gib"), "reserved_gib": done.get("peak_gpu_memory_reserved_gib")}


def raw_side(stage: str, model_dir: Path, data: Path, config: Path, out: Path, four_bit: bool, log: Path,
             deadline: float) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "raw_peft.py"), stage, str(model_dir), str(data), str(config),
               str(out)] + (["--four-bit"] if four_bit else [])
    result = timed(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=ROOT, log=log, deadline=deadline)
    figures = json.loads(result["output"].strip().splitlines()[-1])
    return {"step_s": figures["train_runtime"] / max(figures["steps"], 1),
            "tokens_per_s": figures["tokens"] / figures["train_runtime"] if figures["tokens"] else None,
            "peak_gib": figures["peak_gib"], "reserved_gib": figures["reserved_gib"]}


def planned_peak(recipe_path: Path) -> float:
    from kitcli.commands.plan import plan_recipe
    from kitcli.recipe.load import load_recipe

    plan = plan_recipe(load_recipe(str(recipe_path)), gpu_bytes=None, config_path=None, backend="unsloth")
    return plan["stages"][0]["peak_gib"]


def median(runs: list[dict], key: str):
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def summary(name: str, case: str, kit_runs: list[dict], raw_runs: list[dict], plan: float | None) -> dict:
    kit = {key: median(kit_runs, key) for key in ("step_s", "tokens_per_s", "peak_gib", "reserved_gib")}
    raw = {key: median(raw_runs, key) for key in ("step_s", "tokens_per_s", "peak_gib", "reserved_gib")}
    return {"shape": name, "case": case, "runs": {"kit": len(kit_runs), "trl_peft": len(raw_runs)},
            "kit": kit, "trl_peft": raw,
            "step_time_ratio": ratio(kit["step_s"], raw["step_s"]),
            "tokens_per_s_ratio": ratio(kit["tokens_per_s"], raw["tokens_per_s"]),
            "peak_ratio": ratio(kit["peak_gib"], raw["peak_gib"]), "planned_peak_gib": plan,
            "plan_error_pct": round(100 * (plan - kit["peak_gib"]) / kit["peak_gib"], 1)
            if plan and kit["peak_gib"] else None}


def measure(name: str, shape: dict, family: str, case: tuple, steps: int, repeat: int, work: Path, results: Path,
            deadline: float, write) -> dict:
    """One shape, one case: the kit and the hand-written script alternated, `repeat` runs each; `write(row)` after
    every run, so that what was measured comes back even if the command is stopped."""
    import torch

    case_name, stage, length = case
    on_gpu = torch.cuda.is_available()
    model_dir = work / f"{name}-model"
    build_model(model_dir, shape, family)
    (work / "varied.py").write_text(REWARD)
    data = work / f"{case_name}.jsonl"
    write_data(data, stage, length, shape["vocab_size"])
    recipe_path = work / f"{name}-{case_name}.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(model_dir, data, stage, length, steps, on_gpu), sort_keys=False))
    plan = planned_peak(recipe_path)
    kit_runs, raw_runs, failures = [], [], []
    row = summary(name, case_name, kit_runs, raw_runs, plan)
    for i in range(repeat):  # alternated: kit first, then the hand-written script first, ...
        for side in ("kit", "raw") if i % 2 == 0 else ("raw", "kit"):
            log = results / f"{case_name}-{side}-{i}.log"
            try:
                if side == "kit":
                    kit_runs.append(kit_side(recipe_path, work / f"{case_name}-kit-{i}", log, deadline))
                else:
                    config = work / f"{case_name}-kit-0" / "x" / "config.json"
                    if not config.exists():  # the raw side reads the kit run's effective settings
                        kit_side(recipe_path, work / f"{case_name}-kit-0", log, deadline)
                    raw_runs.append(raw_side(stage, model_dir, data, config, work / f"{case_name}-raw-{i}", on_gpu, log,
                                             deadline))
            except RunFailed as failure:
                failures.append({"side": side, "run": i, "error": str(failure)})
            row = {**summary(name, case_name, kit_runs, raw_runs, plan), "failures": failures}
            write(row)
            if time.time() > deadline:
                return row
    return row


def cell(value, width: int = 8, digits: int = 2) -> str:
    return f"{value:{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the tiny shape, both cases, a few steps (on a CPU)")
    parser.add_argument("--shape", choices=list(SHAPES), help="the model shape (one per command)")
    parser.add_argument("--case", choices=[c[0] for c in CASES], help="the case (one per command)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 10; 2 reduced)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per side, alternated")
    parser.add_argument("--results", type=Path, default=Path(os.environ.get("OUT") or RESULTS),
                        help="folder for the JSON and the logs (default $OUT, else bench/results)")
    parser.add_argument("--budget-s", type=float, default=540, help="stop starting runs after this (default 540)")
    args = parser.parse_args()
    if not args.reduced and not (args.shape and args.case):
        parser.error("give --shape and --case (one of each per command), or --reduced")
    deadline = time.time() + args.budget_s
    args.results.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kit-shapes-"))
    name = "shapes-reduced" if args.reduced else f"shapes-{args.shape}-{args.case}"
    rows: list[dict] = []

    def write(row: dict) -> None:
        save(name, {"steps": args.steps, "repeat": args.repeat, "rows": [*rows, row]}, args.results)

    try:
        if args.reduced:
            for case in REDUCED_CASES:
                rows.append(measure("reduced", REDUCED, "qwen3", case, args.steps or 2, args.repeat, work,
                                    args.results, deadline, write))
        else:
            case = next(c for c in CASES if c[0] == args.case)
            rows.append(measure(args.shape, BUILTIN_ARCHITECTURES[args.shape], SHAPES[args.shape], case,
                                args.steps or 10, args.repeat, work, args.results, deadline, write))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("ratios are kit (Unsloth) / hand-written TRL + PEFT + bitsandbytes; plan error is planned vs kit's peak")
    print(f"{'shape':13} {'case':11} {'s/step kit':>10} {'s/step TRL':>10} {'ratio':>6} {'tok/s ratio':>11} "
          f"{'GiB kit':>8} {'GiB TRL':>8} {'ratio':>6} {'planned':>8} {'error %':>8}")
    for r in rows:
        kit, raw = r["kit"], r["trl_peft"]
        print(f"{r['shape']:13} {r['case']:11} {cell(kit['step_s'], 10, 3)} {cell(raw['step_s'], 10, 3)} "
              f"{cell(r['step_time_ratio'], 6, 3)} {cell(r['tokens_per_s_ratio'], 11, 3)} "
              f"{cell(kit['peak_gib'])} {cell(raw['peak_gib'])} {cell(r['peak_ratio'], 6, 3)} "
              f"{cell(r['planned_peak_gib'])} {cell(r['plan_error_pct'], 8, 1)}")
        for failure in r.get("failures", []):
            print(f"  failed: {failure}")
    print(f"results: {args.results / (name + '.json')}")
    sys.exit(1 if any(r.get("failures") for r in rows) else 0)


if __name__ == "__main__":
    main()
