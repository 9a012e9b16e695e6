"""VRAM planner: an estimate of each stage's peak GPU memory, from the model's config alone.

    kit plan my-grpo.yaml --gpu-memory 12GB
    kit plan tiny-sft --json

No model is loaded and no GPU is needed. The architecture (hidden size, layers, heads, KV heads, intermediate size,
vocabulary) comes from `config.json` in a local model directory, the Hugging Face hub cache, the hub itself when
online, or, offline, a built-in table of popular architectures (`BUILTIN_ARCHITECTURES`).

What is counted, per stage (all bytes; docs/vram.md derives each term and compares with published figures):
    weights            decoder linears in 4-bit NF4 (0.5 byte + quantisation constants) or 16-bit; embeddings,
                       LM head and norms stay 16-bit
    LoRA               adapter parameters (fp32), their gradients (fp32) and the optimizer state (by optimizer)
    activations        what backward keeps per token: every layer without gradient checkpointing; one layer plus
                       each layer's input with it; one layer plus a small buffer with Unsloth's offloaded
                       checkpointing (layer inputs go to CPU RAM)
    logits             vocabulary-sized rows: bf16 logits, their fp32 copy and gradient with transformers;
                       a fixed-size chunk with Unsloth's chunked cross entropy
    KV cache           generation: completions generated at once x (prompt + completion) x layers x 2 x KV width
    other models       reference (a full copy when fully fine-tuning; none with LoRA, whose reference is the base
                       with the adapter off), reward model (16-bit, merged), PPO critic
    vLLM               vllm_gpu_memory_utilization x GPU memory when `use_vllm` runs colocated
    overhead           CUDA context, cuBLAS workspace, allocator slack, 4-bit dequantisation buffer

Peak = what stays resident (weights, adapters, optimizer, other models, vLLM) + the larger of the generation phase
and the training phase (they do not overlap).

The package: `architecture.py` reads the model's config, `settings.py` resolves what a stage does (from the
registry's stage types), `estimate.py` is the memory model and `fit.py` what to change to fit a GPU; this module is
the command.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError
from kitcli.plan.architecture import BUILTIN_ARCHITECTURES, Architecture, find_architecture, normalise_name
from kitcli.plan.estimate import Component, Estimate, GiB, MiB, estimate
from kitcli.plan.fit import Change, fit, set_flag
from kitcli.plan.settings import Settings, stage_settings, tool_note

__all__ = ["BUILTIN_ARCHITECTURES", "Architecture", "Change", "Component", "Estimate", "GiB", "MiB", "Settings",
           "detect_gpu", "estimate", "find_architecture", "fit", "normalise_name", "parse_memory", "plan_command",
           "plan_recipe", "replace", "stage_settings"]


# --- GPU memory ------------------------------------------------------------------------------------------------

def parse_memory(text: str) -> float:
    """`12GB`, `12GiB`, `12 G`, `24000MB`, `80` (GB) -> bytes. GPU makers' "GB" are binary (a 12GB card has
    12 GiB), so GB and GiB both mean 1024^3 here."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*", str(text).lower())
    if not match or float(match.group(1)) <= 0:
        raise KitError(f"--gpu-memory '{text}' is not a memory size; write it like 12GB, 24GiB or 80000MB")
    unit = (match.group(2) or "gb")[0]
    return float(match.group(1)) * {"g": GiB, "m": MiB, "t": 1024 * GiB}[unit]


def detect_gpu() -> tuple[float, str] | None:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), props.name
    except Exception:  # noqa: BLE001  (no usable torch / driver: planning still works from --gpu-memory)
        return None
    return None


# --- the command -----------------------------------------------------------------------------------------------

def planned_backend(model, requested: str | None) -> str:
    """The backend `kit plan` plans for: `--backend`, KIT_FORCE_BACKEND, the recipe's model.backend."""
    import importlib.util

    choice = requested or os.environ.get("KIT_FORCE_BACKEND") or model.backend
    if choice == "transformers":
        return "transformers"
    return "unsloth" if importlib.util.find_spec("unsloth") is not None else "transformers"


TRUNCATED_NOTE = 0.05  # a measured share of cut completions worth planning longer ones for


def measured_truncation(arch: Architecture, settings: Settings, stage_dir: Path,
                        gpu_bytes: float | None) -> dict[str, Any] | None:
    """What a run's filter measured of the starting policy's completions (`<stage>/filter/summary.json`): the share
    cut at max_completion_length and, when that share is not small, the peak at twice the length measured."""
    from kitcli.training.filtering import SUMMARY_NAME, filter_dir  # the recipe schema: not for `kit --help`

    path = filter_dir(stage_dir) / SUMMARY_NAME
    if not settings.rl or not path.is_file():
        return None
    record = json.loads(path.read_text())
    if "truncated_share_before" not in record or "max_completion_length" not in record:
        return None
    cap, share = int(record["max_completion_length"]), float(record["truncated_share_before"])
    entry: dict[str, Any] = {"source": str(path), "truncated_share": share, "max_completion_length": cap}
    if share >= TRUNCATED_NOTE:
        longer = 2 * cap
        result = estimate(arch, replace(settings, completion_len=longer, seq_len=settings.prompt_len + longer),
                          gpu_bytes)
        entry["longer"] = {"max_completion_length": longer, "peak_gib": round(result.peak / GiB, 2)}
        if gpu_bytes:
            entry["longer"]["fits"] = result.peak <= gpu_bytes
    return entry


def measured_text(measured: dict[str, Any]) -> str:
    text = (f"measured: {measured['truncated_share']:.0%} of the starting policy's sampled completions reached "
            f"max_completion_length {measured['max_completion_length']} ({measured['source']})")
    longer = measured.get("longer")
    if longer:
        fits = "" if "fits" not in longer else (": fits" if longer["fits"] else ": does not fit")
        text += (f"; to let them finish, max_completion_length {longer['max_completion_length']} would peak at "
                 f"{longer['peak_gib']:.2f} GiB{fits}")
    return text


def plan_recipe(recipe, *, gpu_bytes: float | None, config_path: str | None, backend: str | None,
                run_dir: Path | None = None) -> dict[str, Any]:
    arch = find_architecture(recipe.model.name, config_path)
    chosen = planned_backend(recipe.model, backend)
    stages = []
    for stage in recipe.stages:
        settings = stage_settings(recipe, stage, chosen)
        result = estimate(arch, settings, gpu_bytes)
        entry: dict[str, Any] = {
            "stage": stage.name, "type": stage.type, "peak_gib": round(result.peak / GiB, 2),
            "components": [{"name": c.name, "phase": c.phase, "gib": round(c.bytes / GiB, 3), "note": c.note}
                           for c in result.components],
            "settings": asdict(settings),
        }
        note = tool_note(settings)
        if note:
            entry["tools"] = note
        measured = None if run_dir is None else measured_truncation(arch, settings, run_dir / stage.name, gpu_bytes)
        if measured:
            entry["measured"] = measured
        if gpu_bytes:
            entry["fits"] = result.peak <= gpu_bytes
            if not entry["fits"]:
                changes, _, fitted = fit(arch, settings, gpu_bytes)
                entry["suggestion"] = {"changes": [asdict(c) for c in changes],
                                       "set": [set_flag(stage.name, c) for c in changes],
                                       "peak_gib": round(fitted.peak / GiB, 2), "fits": fitted.peak <= gpu_bytes}
        stages.append(entry)
    return {"model": recipe.model.name, "architecture": asdict(arch),
            "parameters_b": round(arch.total_params / 1e9, 3), "backend": chosen,
            "gpu_gib": round(gpu_bytes / GiB, 2) if gpu_bytes else None, "stages": stages}


def print_plan(plan: dict[str, Any], gpu_name: str | None, console) -> None:
    from rich.table import Table

    arch = plan["architecture"]
    console.print(f"model {plan['model']}: {plan['parameters_b']:.2f}B parameters, {arch['num_hidden_layers']} "
                  f"layers, hidden {arch['hidden_size']}, vocabulary {arch['vocab_size']} (config from "
                  f"{arch['source']}); backend {plan['backend']}", highlight=False, markup=False)
    if plan["gpu_gib"]:
        console.print(f"GPU: {gpu_name or 'given'} with {plan['gpu_gib']:.1f} GiB", highlight=False, markup=False)
    else:
        console.print("GPU: none detected here; pass --gpu-memory 24GB to check a card", highlight=False,
                      markup=False)
    for entry in plan["stages"]:
        table = Table(title=f"stage {entry['stage']} ({entry['type']})", title_justify="left")
        for column, justify in (("component", "left"), ("phase", "left"), ("GiB", "right")):
            table.add_column(column, justify=justify)
        for c in entry["components"]:
            if c["gib"] == 0 and not c["note"] and "reference" not in c["name"]:
                continue
            table.add_row(c["name"] + (f" ({c['note']})" if c["note"] else ""), c["phase"], f"{c['gib']:.2f}")
        table.add_row("peak (resident + larger phase)", "", f"{entry['peak_gib']:.2f}", style="bold")
        console.print(table)
        if entry.get("tools"):
            console.print(f"  {entry['tools']}", highlight=False, markup=False, soft_wrap=True)
        if entry.get("measured"):
            console.print(f"  {measured_text(entry['measured'])}", highlight=False, markup=False, soft_wrap=True)
        if "fits" in entry:
            spare = plan["gpu_gib"] - entry["peak_gib"]
            if entry["fits"]:
                console.print(f"  fits: {entry['peak_gib']:.2f} of {plan['gpu_gib']:.1f} GiB ({spare:.2f} spare)",
                              highlight=False, markup=False)
            else:
                suggestion = entry["suggestion"]
                verdict = "fits" if suggestion["fits"] else "still does not fit"
                console.print(f"  does not fit: {entry['peak_gib']:.2f} of {plan['gpu_gib']:.1f} GiB",
                              highlight=False, markup=False)
                for change in suggestion["changes"]:
                    console.print(f"    {change['key']}: {change['old']} -> {change['new']}", highlight=False,
                                  markup=False)
                if suggestion["set"]:
                    console.print(f"    {' '.join(suggestion['set'])}", highlight=False, markup=False, soft_wrap=True)
                console.print(f"    new estimate {suggestion['peak_gib']:.2f} GiB: {verdict}", highlight=False,
                              markup=False)
    summary = Table(title="summary")
    for column in ("stage", "type", "peak GiB", "fits"):
        summary.add_column(column)
    for entry in plan["stages"]:
        fits = "" if "fits" not in entry else ("yes" if entry["fits"] else
                                                f"no (-> {entry['suggestion']['peak_gib']:.2f} GiB with changes)")
        summary.add_row(entry["stage"], entry["type"], f"{entry['peak_gib']:.2f}", fits)
    console.print(summary)


def run_plan(recipe_name: str, overrides: list[str], gpu_memory: str | None, config_path: str | None,
             backend: str | None, as_json: bool, console, output: str | None = None) -> None:
    from kitcli.recipe.load import load_recipe
    from kitcli.run.lock import choose_run_dir

    recipe = load_recipe(recipe_name, overrides)
    run_dir = choose_run_dir(recipe, output)
    gpu_name = None
    gpu_bytes = parse_memory(gpu_memory) if gpu_memory else None
    if gpu_bytes is None:
        detected = detect_gpu()
        if detected:
            gpu_bytes, gpu_name = detected
    plan = plan_recipe(recipe, gpu_bytes=gpu_bytes, config_path=config_path, backend=backend, run_dir=run_dir)
    if as_json:
        click.echo(json.dumps(plan, indent=2))
        return
    print_plan(plan, gpu_name, console)


@click.command("plan")
@click.argument("recipe")
@click.option("--gpu-memory", metavar="SIZE", help="GPU memory to plan for, e.g. 12GB, 24GB, 80GB (default: the "
                                                  "GPU of this machine, if any).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe value, e.g. stages.grpo.train.num_generations=4 (repeatable).")
@click.option("--config", "config_path", metavar="PATH",
              help="The model's config.json (or its folder), when kit cannot find it.")
@click.option("--backend", type=click.Choice(["unsloth", "transformers"]), default=None,
              help="Plan for this backend (default: the recipe's; Unsloth when installed).")
@click.option("--output", "-o", help="A run directory whose RL stages' filters measured their completions (default: "
                                     "the one `kit run` would use); their cut share is planned for.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(recipe: str, gpu_memory: str | None, overrides: tuple[str, ...], config_path: str | None,
                 backend: str | None, output: str | None, as_json: bool) -> None:
    """Estimate each stage's peak GPU memory and whether it fits; suggest settings when not."""
    from rich.console import Console

    run_plan(recipe, list(overrides), gpu_memory, config_path, backend, as_json, Console(highlight=False), output)
