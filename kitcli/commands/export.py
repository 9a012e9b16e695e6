"""Export a trained stage: the LoRA adapter, a merged 16-bit model, or GGUF for llama.cpp / Ollama.

    kit export runs/tiny-sft-20261202-101500 --to lora
    kit export runs/tiny-sft-20261202-101500/sft --to merged -o exported/tiny-sft
    kit export runs/tiny-sft-20261202-101500 --to gguf                  (q8_0; loads again as `model: <file>.gguf`)
    kit export runs/qwen3-4b-grpo-20261202-101500 --to gguf --quant q4_k_m
    kit export runs/tiny-grpo-20261202-101500 --stage grpo --step best --to lora   (the best held-out step)

Every exported directory holds a model card (README.md: the recipe, its stages and the evaluation table) and the
stage's tokenizer with its chat template (in the GGUF file itself for `gguf`). It is written under a temporary name
and renamed into place, so a failed export leaves nothing half-written; an existing non-empty directory is replaced
only with --force.

- `lora`: a copy of the stage's PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`).
- `merged`: the base model loaded unquantized (Unsloth's CPU loader cannot merge LoRA into 4-bit weights) with the
  adapter, merged by PEFT's `merge_and_unload` in float32 and saved in 16-bit (`--dtype`): a plain transformers
  checkpoint that generates what the adapter model generates.
- `gguf`: the merged model as one GGUF file. q8_0 (the default, as Unsloth's), q4_0, f16, bf16 and f32 of LLaMA,
  Mistral and Qwen2/3 models are written by the kit itself with the `gguf` package (kitcli/models/gguf_export.py), no
  llama.cpp needed; k-quants (q4_k_m, ...) and other architectures go through llama.cpp's converter and
  `llama-quantize` (unsloth_zoo's `convert_to_gguf`, `quantize_gguf`; see `find_llama_cpp`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import click

from kitcli.commands.chat import PolicyStage, resolve_policy_stage
from kitcli.errors import KitError
from kitcli.models import gguf_export
from kitcli.recipe import stage_types
from kitcli.rundir import RunDir

TARGETS = ("lora", "merged", "gguf")
QUANTS = gguf_export.KIT_QUANTS + ("q4_k_m", "q5_k_m", "q6_k")
DTYPES = ("bfloat16", "float16", "float32")
LLAMA_CPP_INSTALL = (
    "install llama.cpp: `git clone https://github.com/ggml-org/llama.cpp ~/.unsloth/llama.cpp && "
    "cmake -S ~/.unsloth/llama.cpp -B ~/.unsloth/llama.cpp/build && "
    "cmake --build ~/.unsloth/llama.cpp/build --target llama-quantize && "
    "cp ~/.unsloth/llama.cpp/build/bin/llama-quantize ~/.unsloth/llama.cpp/ && "
    "pip install -r ~/.unsloth/llama.cpp/requirements/requirements-convert_hf_to_gguf.txt` "
    "(or point UNSLOTH_LLAMA_CPP_PATH at an existing build)"
)


def llama_cpp_dir() -> Path:
    """Where unsloth_zoo looks for llama.cpp (its LLAMA_CPP_DEFAULT_DIR), without importing it."""
    return Path(os.environ.get("UNSLOTH_LLAMA_CPP_PATH", Path.home() / ".unsloth" / "llama.cpp"))


def llama_cpp_files(folder: Path) -> tuple[Path | None, Path | None]:
    """(convert_hf_to_gguf.py, an executable llama-quantize) in a llama.cpp folder, each None where missing."""
    converter = next((folder / n for n in ("convert_hf_to_gguf.py", "convert-hf-to-gguf.py")
                      if (folder / n).is_file()), None)
    quantizer = next((folder / n for n in ("llama-quantize", "quantize") if (folder / n).is_file()
                      and os.access(folder / n, os.X_OK)), None)
    return converter, quantizer


def find_llama_cpp(why: str) -> tuple[str, str]:
    """(llama-quantize, convert_hf_to_gguf.py) of a usable llama.cpp, or a KitError saying why it is needed and
    what to install. Nothing is downloaded or built here."""
    folder = llama_cpp_dir()
    converter, quantizer = llama_cpp_files(folder)
    if converter is None or quantizer is None:
        missing = " and ".join(n for n, p in (("convert_hf_to_gguf.py", converter), ("llama-quantize", quantizer))
                               if p is None)
        raise KitError(f"this GGUF export needs llama.cpp ({why}), but {folder} has no {missing}; "
                       f"{LLAMA_CPP_INSTALL}; --quant q8_0 or f16 of a LLaMA/Qwen model, and --to merged, work "
                       f"without it")
    import unsloth  # noqa: F401  (unsloth_zoo refuses to import before it)
    from unsloth_zoo.llama_cpp import check_llama_cpp

    try:
        found_quantizer, found_converter = check_llama_cpp(str(folder))
    except RuntimeError as error:
        raise KitError(f"llama.cpp at {folder} is not usable ({str(error).splitlines()[0]}), and this GGUF export "
                       f"needs it ({why}); {LLAMA_CPP_INSTALL}") from None
    return found_quantizer, found_converter


def default_output(policy: PolicyStage, to: str, quant: str | None) -> Path:
    return policy.run_dir / "exports" / f"{policy.name}-{to}{'-' + quant if to == 'gguf' else ''}"


def check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise KitError(f"--output '{out}' is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise KitError(f"'{out}' exists and is not empty; choose another --output, or add --force to replace it")


def stage_tokenizer(policy: PolicyStage):
    """The tokenizer the stage saved (with the chat template it trained with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(policy.saved),
                                         trust_remote_code=policy.model.get("trust_remote_code", False))


def check_exportable(policy: PolicyStage, to: str) -> None:
    if to == "lora" and policy.kind != "adapter":
        raise KitError(f"stage '{policy.name}' is a full fine-tune (model/, no LoRA adapter); export it with "
                       f"--to merged")


def export_lora(policy: PolicyStage, staging: Path) -> dict[str, Any]:
    for item in policy.dir.adapter.iterdir():
        if item.is_file():
            shutil.copy2(item, staging / item.name)
    config = json.loads((staging / "adapter_config.json").read_text())
    return {"format": "PEFT LoRA adapter", "base_model": config.get("base_model_name_or_path"),
            "rank": config.get("r"), "alpha": config.get("lora_alpha")}


def merged_model(policy: PolicyStage, dtype: str, log):
    """The stage's weights as one plain causal LM in `dtype` (LoRA merged in float32 first)."""
    import torch

    from kitcli.models.backend import is_peft_model, load_policy

    model = policy.model
    loaded = load_policy(model["name"], max_seq_length=model["max_seq_length"], load_in_4bit=False, lora=None,
                         backend="transformers", dtype="float32", seed=policy.recipe.get("seed", 42),
                         init_from=policy.stage_dir, trust_remote_code=model.get("trust_remote_code", False),
                         trainable=False, log=log, label=f"stage {policy.name} (unquantized, for merging)")
    merged = loaded.model.merge_and_unload() if is_peft_model(loaded.model) else loaded.model
    merged = merged.to(getattr(torch, dtype))
    merged.config.dtype = dtype
    return merged


def export_merged(policy: PolicyStage, staging: Path, dtype: str, log) -> dict[str, Any]:
    model = merged_model(policy, dtype, log)
    model.save_pretrained(str(staging))
    return {"format": f"merged {dtype} transformers checkpoint ({type(model).__name__})",
            "parameters": sum(p.numel() for p in model.parameters())}


def base_model_type(policy: PolicyStage) -> str | None:
    """The base model's transformers model_type, read without loading it (None where only loading would tell)."""
    from kitcli.models import gguf
    from kitcli.plan.architecture import local_config

    found = local_config(policy.model["name"])
    model_type = found[0].get("model_type") if found else None
    return gguf.ARCHITECTURE_ALIASES.get(model_type, model_type)


def gguf_needs_llama_cpp(policy: PolicyStage, quant: str) -> str | None:
    """Why this GGUF export needs llama.cpp (None if the kit writes it itself), decided before loading."""
    if quant not in gguf_export.KIT_QUANTS:
        return f"--quant {quant} (a k-quant) is made by llama-quantize"
    model_type = base_model_type(policy)
    if model_type is not None and model_type not in gguf_export.WRITABLE:
        return f"the kit writes GGUF for {', '.join(gguf_export.WRITABLE)} models, not '{model_type}'"
    return None


def source_pre_tokenizer(policy: PolicyStage) -> str | None:
    """The llama.cpp pre-tokenizer name of a model that came from a GGUF file (kept as it was)."""
    from kitcli.models import gguf

    source = gguf.source_file(policy.model["name"])
    return (gguf.header(source).get("pre_tokenizer") or None) if source is not None else None


def export_gguf(policy: PolicyStage, staging: Path, quant: str, needs_llama_cpp: str | None, log) -> dict[str, Any]:
    """`needs_llama_cpp`: gguf_needs_llama_cpp's answer, given before loading; the loaded model may add a reason."""
    import torch

    model = merged_model(policy, "float32", log)
    tokenizer = stage_tokenizer(policy)
    merged_dir = staging / "merged"
    tokenizer.save_pretrained(str(merged_dir))
    unhandled = gguf_export.unwritable(model.config, merged_dir)
    reason = needs_llama_cpp or (f"the kit's own GGUF writer does not handle {unhandled}" if unhandled else None)
    if reason is not None:
        return export_gguf_llama_cpp(model.to(torch.bfloat16), merged_dir, policy, staging, quant,
                                     find_llama_cpp(reason))
    target = staging / f"{policy.name}.{quant.upper()}.gguf"
    written = gguf_export.write_gguf(model, tokenizer, merged_dir, target, quant,
                                     name=f"{policy.recipe.get('name', 'kit')}-{policy.name}",
                                     pre_tokenizer=source_pre_tokenizer(policy))
    shutil.rmtree(merged_dir)
    return {"format": f"GGUF ({quant}, written by the kit)", "files": [target.name], **written}


def export_gguf_llama_cpp(model, source: Path, policy: PolicyStage, staging: Path, quant: str,
                          tools: tuple[str, str]) -> dict[str, Any]:
    """llama.cpp's converter on the merged 16-bit checkpoint (saved beside its tokenizer in `source`), then
    llama-quantize for the types the converter does not write."""
    from unsloth_zoo.llama_cpp import convert_to_gguf, quantize_gguf

    quantizer, converter = tools
    model.save_pretrained(str(source))
    first = quant if quant in ("f16", "q8_0", "bf16") else "bf16"  # the rest are made from a bf16 GGUF
    outputs, _ = convert_to_gguf(str(staging / policy.name), str(source), model_dtype="bf16",
                                 quantization_type=first, converter_location=converter)
    files = list(outputs)
    if quant != first:
        target = str(staging / f"{policy.name}.{quant.upper()}.gguf")
        quantize_gguf(outputs[0], target, quant, quantizer_location=quantizer, print_output=False)
        for path in outputs:
            os.remove(path)
        files = [target]
    shutil.rmtree(source)
    return {"format": f"GGUF ({quant}, llama.cpp)", "files": [Path(f).name for f in files]}


# --- the model card --------------------------------------------------------------------------------------------

def stage_results(policy: PolicyStage) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    results = []
    for stage in policy.recipe.get("stages", []):
        results.append((stage, RunDir(policy.run_dir).stage(stage["name"]).done()))
    return results


def model_card(policy: PolicyStage, to: str, details: dict[str, Any]) -> str:
    recipe = policy.recipe
    lora = recipe.get("lora")
    versions = policy.lock.get("versions", {})
    lines = [f"# {recipe.get('name', policy.run_dir.name)}: stage `{policy.name}` ({details['format']})", ""]
    if recipe.get("description"):
        lines += [recipe["description"], ""]
    lines += [f"- base model: `{recipe['model']['name']}`",
              f"- exported stage: `{policy.name}` ({policy.stage.get('type')}) of run `{policy.run_dir.name}`",
              f"- LoRA: r={lora['r']}, alpha={lora['alpha']}, targets {', '.join(lora['target_modules'])}"
              if lora else "- full fine-tuning (no LoRA)",
              f"- seed {recipe.get('seed')}; recipe source `{policy.lock.get('source', '')}`",
              f"- made with kit {versions.get('kit', '?')} (trl {versions.get('trl', '?')}, transformers "
              f"{versions.get('transformers', '?')}, peft {versions.get('peft', '?')}, unsloth "
              f"{versions.get('unsloth', '?')})", ""]
    lines += ["## Stages", "", "| stage | type | init | status | result |", "| --- | --- | --- | --- | --- |"]
    results = stage_results(policy)
    for stage, done in results:
        status = "done" if done is not None else "not run"
        headline = (done or {}).get("headline", "")
        lines.append(f"| {stage['name']} | {stage['type']} | {stage.get('init') or 'base'} | {status} | {headline} |")
    evals = [(stage, done) for stage, done in results if done and stage_types.spec(stage["type"]).evaluates]
    if evals:
        lines += ["", "## Evaluation (held-out)", "", "| eval stage | model | exact match | n |",
                  "| --- | --- | --- | --- |"]
        for stage, done in evals:
            lines.append(f"| {stage['name']} | {stage.get('init') or 'base'} | {done.get('exact_match', 0):.3f} | "
                         f"{done.get('n', '')} |")
    lines += ["", "## Use", ""]
    if to == "lora":
        lines += ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM, "
                  "AutoTokenizer", "", f"base = AutoModelForCausalLM.from_pretrained(\"{recipe['model']['name']}\")",
                  "model = PeftModel.from_pretrained(base, \"path/to/this/folder\")",
                  "tokenizer = AutoTokenizer.from_pretrained(\"path/to/this/folder\")", "```"]
    elif to == "merged":
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  "model = AutoModelForCausalLM.from_pretrained(\"path/to/this/folder\")",
                  "tokenizer = AutoTokenizer.from_pretrained(\"path/to/this/folder\")", "```"]
    else:
        lines += ["```sh", f"llama-cli -m {details['files'][0]} -cnv", "```", "",
                  f"or as the starting model of a kit recipe: `model: path/to/{details['files'][0]}`"]
    lines += ["", "Generated by `kit export`; the run's recipe.lock.yaml holds the full resolved recipe.", ""]
    return "\n".join(lines)


# --- a checkpoint instead of the final weights (--step) ----------------------------------------------------------

CHECKPOINT_STATE = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin")


def chosen_step(policy: PolicyStage, step: str) -> int:
    """`--step best`: the stage's best held-out step (its DONE, from `eval:`); else the number given."""
    done = policy.dir.done() or {}
    if step != "best":
        if not step.isdigit():
            raise KitError(f"--step must be 'best' or a step number, got {step!r}")
        return int(step)
    if done.get("eval_best_step") is None:
        raise KitError(f"stage '{policy.name}' has no held-out evaluation to pick a best step from; add eval: "
                       f"{{data: ..., every: N}} to the stage (docs/stages.md), or give --step N")
    return int(done["eval_best_step"])


def at_step(policy: PolicyStage, step: str, folder: Path) -> tuple[PolicyStage, str]:
    """The stage as it stood at a step: its final weights at its last step, else its checkpoint's, put in `folder`
    as a stage directory (the checkpoint's adapter or model beside the stage's tokenizer). Returns it and a label."""
    import dataclasses

    done = policy.dir.done() or {}
    number = chosen_step(policy, step)
    label = f"step {number}" + (f", best held-out {done.get('eval_metric', 'score')} {done.get('eval_best')}"
                                if step == "best" else "")
    if number == done.get("steps"):
        return policy, label
    if number == 0:
        raise KitError(f"step 0 of stage '{policy.name}' is the model it started from (held-out figures at step 0 "
                       f"are the starting point's); export {policy.stage.get('init') or 'nothing: it is the base'}")
    checkpoint = policy.dir.checkpoints / f"checkpoint-{number}"
    if not (checkpoint / "trainer_state.json").is_file():
        kept = sorted(p.name for p in policy.dir.checkpoints.glob("checkpoint-*")) or ["none"]
        raise KitError(f"stage '{policy.name}' kept no checkpoint of step {number} (kept: {', '.join(kept)}); a "
                       f"checkpoint is saved every train.save_steps: make it divide eval.every to keep every "
                       f"evaluated step's, or give --step with a kept one")
    target = folder / policy.name / policy.dir.saved_model().name
    shutil.copytree(policy.dir.saved_model(), target)
    for item in checkpoint.iterdir():
        if item.is_file() and item.name not in CHECKPOINT_STATE:
            shutil.copy2(item, target / item.name)
    return dataclasses.replace(policy, stage_dir=folder / policy.name), f"{label}, {checkpoint.name}"


# --- the command -----------------------------------------------------------------------------------------------

def run_export(path: str, *, to: str, quant: str | None, output: str | None, force: bool, dtype: str,
               stage: str | None = None, step: str | None = None) -> Path:
    if quant is not None and to != "gguf":
        raise KitError(f"--quant applies to --to gguf only (got --to {to})")
    quant = quant or "q8_0"
    policy = resolve_policy_stage(Path(path) / stage if stage else path, "export")
    if step is not None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kit-export-") as folder:
            stepped, label = at_step(policy, step, Path(folder))
            output = output or f"{default_output(policy, to, quant)}-{'best' if step == 'best' else f'step{step}'}"
            return export_policy(stepped, to=to, quant=quant, output=output, force=force, dtype=dtype, label=label)
    return export_policy(policy, to=to, quant=quant, output=output, force=force, dtype=dtype)


def export_policy(policy: PolicyStage, *, to: str, quant: str, output: str | None, force: bool, dtype: str,
                  label: str | None = None) -> Path:
    out = Path(output) if output else default_output(policy, to, quant)
    check_output(out, force)
    check_exportable(policy, to)
    needs_llama_cpp = gguf_needs_llama_cpp(policy, quant) if to == "gguf" else None
    if needs_llama_cpp:
        find_llama_cpp(needs_llama_cpp)  # before loading anything: a missing llama.cpp fails fast
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)

    def log(message: str) -> None:
        click.echo(message, err=True)

    try:
        if to == "lora":
            details = export_lora(policy, staging)
        elif to == "merged":
            details = export_merged(policy, staging, dtype, log)
        else:
            details = export_gguf(policy, staging, quant, needs_llama_cpp, log)
        if to != "gguf":  # a GGUF file holds its tokenizer
            stage_tokenizer(policy).save_pretrained(str(staging))
        if label:
            details["format"] += f" at {label}"
        (staging / "README.md").write_text(model_card(policy, to, details), encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    click.echo(f"exported stage '{policy.name}' ({details['format']}) to {out}")
    return out


@click.command("export")
@click.argument("run_dir", metavar="RUN_DIR[/STAGE]")
@click.option("--to", "to", type=click.Choice(TARGETS), required=True,
              help="lora: the adapter; merged: a 16-bit transformers model; gguf: for llama.cpp / Ollama.")
@click.option("--quant", type=click.Choice(QUANTS), default=None,
              help="GGUF quantization (default q8_0; k-quants need llama.cpp).")
@click.option("--output", "-o", help="Directory to write (default: RUN_DIR/exports/<stage>-<to>).")
@click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True,
              help="Weights of a merged export.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--stage", default=None, help="The stage to export (as RUN_DIR/STAGE).")
@click.option("--step", default=None, help="A checkpoint's step instead of the final weights, or 'best': the best "
                                           "held-out step of the stage's eval:.")
def export_command(run_dir: str, to: str, quant: str | None, output: str | None, dtype: str, force: bool,
                   stage: str | None, step: str | None) -> None:
    """Export a trained stage as a LoRA adapter, a merged model or GGUF, with tokenizer and model card."""
    run_export(run_dir, to=to, quant=quant, output=output, force=force, dtype=dtype, stage=stage, step=step)
