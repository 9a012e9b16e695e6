"""Run a recipe: a run directory with a lock file and one folder per stage; finished stages are skipped,
an interrupted stage resumes from its last checkpoint, `--force` redoes.

Layout of a run directory:
    recipe.lock.yaml        resolved recipe, package versions, seed, dataset fingerprints
    <stage>/config.json     the effective TRL config of the stage
    <stage>/metrics.jsonl   one JSON object per logging step
    <stage>/checkpoints/    trainer checkpoints (for resuming)
    <stage>/adapter/        the LoRA adapter (PEFT format) and tokenizer; `model/` for full fine-tuning
    <stage>/DONE            completion marker: summary metrics and wall time
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from kitcli import __version__
from kitcli.data import fingerprint
from kitcli.errors import KitError
from kitcli.recipe import STAGE_MODULES, Recipe

LOCK_NAME = "recipe.lock.yaml"
DONE_NAME = "DONE"
PACKAGES = ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "datasets",
            "accelerate")


@dataclass
class StageContext:
    recipe: Recipe
    stage: dict[str, Any]
    run_dir: Path
    console: Console
    outputs: dict[str, Path] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.stage["name"]

    @property
    def stage_dir(self) -> Path:
        return self.run_dir / self.name

    @property
    def where(self) -> str:
        return f"{self.recipe.source}: stage '{self.name}'"

    @property
    def model(self) -> dict[str, Any]:
        return self.recipe.data["model"]

    @property
    def seed(self) -> int:
        return self.recipe.data["seed"]

    @property
    def init_dir(self) -> Path | None:
        init = self.stage.get("init")
        return self.outputs[init] if init else None

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)


def stage_module(stage_type: str):
    return importlib.import_module(STAGE_MODULES[stage_type])


def package_versions() -> dict[str, str]:
    versions = {"kit": __version__, "python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def dataset_fingerprints(recipe: Recipe) -> dict[str, str]:
    prints = {}
    for stage in recipe.stages:
        for key in ("data", "eval_data"):
            if key in stage:
                prints[f"{stage['name']}.{key}"] = fingerprint(stage[key])
    return prints


def make_lock(recipe: Recipe) -> dict[str, Any]:
    return {
        "recipe": recipe.data,
        "source": recipe.source,
        "seed": recipe.data["seed"],
        "datasets": dataset_fingerprints(recipe),
        "versions": package_versions(),
        "platform": f"{platform.system()} {platform.machine()}",
        "created": datetime.now().isoformat(timespec="seconds"),
    }


def write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def read_lock(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / LOCK_NAME
    if not path.exists():
        return None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise KitError(f"{path} is not valid YAML; restore it or choose another --output") from None


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{prefix}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (prefix or "recipe")


def same_run(lock: dict[str, Any], fresh: dict[str, Any]) -> str | None:
    """None when `lock` describes the same recipe and data as `fresh`, else the first key that differs."""
    return first_difference({"recipe": lock.get("recipe"), "datasets": lock.get("datasets")},
                            {"recipe": fresh["recipe"], "datasets": fresh["datasets"]})


def choose_run_dir(recipe: Recipe, output: str | None, lock: dict[str, Any]) -> Path:
    """`--output`, else the newest runs/<name>-* holding the same recipe (so re-running resumes), else a new one."""
    if output:
        return Path(output)
    runs = Path("runs")
    pattern = re.compile(re.escape(recipe.name) + r"-\d{8}-\d{6}$")
    if runs.is_dir():
        for candidate in sorted((p for p in runs.iterdir() if pattern.match(p.name)), reverse=True):
            existing = read_lock(candidate)
            if existing and same_run(existing, lock) is None:
                return candidate
    return runs / f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def last_checkpoint(stage_dir: Path) -> Path | None:
    checkpoints = [p for p in (stage_dir / "checkpoints").glob("checkpoint-*")
                   if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").exists()]
    return max(checkpoints, key=lambda p: int(p.name.split("-")[-1])) if checkpoints else None


def stage_done(stage_dir: Path) -> dict[str, Any] | None:
    marker = stage_dir / DONE_NAME
    if not marker.exists():
        return None
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None


def preflight(recipe: Recipe, run_dir: Path, console: Console) -> list[dict[str, Any]]:
    """Validate every stage (data, columns, TRL config fields) before anything trains; returns the
    resolved configuration of each stage. No model is loaded."""
    outputs = {s["name"]: run_dir / s["name"] for s in recipe.stages}
    return [stage_module(stage["type"]).describe(StageContext(recipe, stage, run_dir, console, outputs))
            for stage in recipe.stages]


def dry_run(recipe: Recipe, console: Console) -> None:
    """Print every stage's resolved configuration (the TRL config values after the kit's defaults)."""
    described = preflight(recipe, Path("runs") / f"{recipe.name}-DRYRUN", console)
    header = {k: recipe.data[k] for k in ("name", "seed", "model", "lora")}
    console.print(yaml.safe_dump(header, sort_keys=False).rstrip(), highlight=False, markup=False)
    for index, (stage, resolved) in enumerate(zip(recipe.stages, described), start=1):
        console.print(f"\n# stage {index}/{len(recipe.stages)}: {stage['name']} ({stage['type']})",
                      highlight=False, markup=False)
        console.print(yaml.safe_dump(resolved, sort_keys=False, default_flow_style=None).rstrip(),
                      highlight=False, markup=False)


def run_recipe(recipe: Recipe, *, output: str | None, force: bool, console: Console) -> Path:
    lock = make_lock(recipe)
    run_dir = choose_run_dir(recipe, output, lock)
    preflight(recipe, run_dir, console)
    existing = read_lock(run_dir)
    if existing is not None:
        differs = same_run(existing, lock)
        if differs and not force:
            raise KitError(f"{run_dir} holds a run of a different recipe ({differs} differs); use another --output, "
                           f"or --force to redo it with this recipe")
    elif run_dir.exists() and any(run_dir.iterdir()) and not force:
        raise KitError(f"{run_dir} exists and is not a kit run directory; choose another --output")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / LOCK_NAME, yaml.safe_dump(lock, sort_keys=False))
    console.print(f"run directory: {run_dir}", highlight=False, markup=False)

    outputs: dict[str, Path] = {}
    results: list[tuple[dict[str, Any], dict[str, Any], str]] = []
    total = len(recipe.stages)
    for index, stage in enumerate(recipe.stages, start=1):
        ctx = StageContext(recipe, stage, run_dir, console, outputs)
        done = stage_done(ctx.stage_dir)
        if done is not None and not force:
            console.print(f"stage {index}/{total} {stage['name']} ({stage['type']}): finished earlier, skipping",
                          highlight=False, markup=False)
            results.append((stage, done, "skipped (done)"))
            outputs[stage["name"]] = ctx.stage_dir
            continue
        if force and ctx.stage_dir.exists():
            shutil.rmtree(ctx.stage_dir)
        ctx.stage_dir.mkdir(parents=True, exist_ok=True)
        console.rule(f"stage {index}/{total}: {stage['name']} ({stage['type']})")
        started = time.time()
        summary = stage_module(stage["type"]).run(ctx)
        summary = {**summary, "seconds": round(time.time() - started, 2)}
        write_atomic(ctx.stage_dir / DONE_NAME, json.dumps(summary, indent=2, default=str))
        outputs[stage["name"]] = ctx.stage_dir
        results.append((stage, summary, "ran"))
    print_summary(results, console)
    return run_dir


def print_summary(results, console: Console) -> None:
    table = Table(title="stages")
    for column in ("stage", "type", "status", "seconds", "result"):
        table.add_column(column)
    for stage, summary, status in results:
        table.add_row(stage["name"], stage["type"], status, str(summary.get("seconds", "")), summary.get("headline", ""))
    console.print(table)
    evals = [(stage, summary) for stage, summary, _ in results if stage["type"] == "eval"]
    if len(evals) >= 2:
        table = Table(title="evaluation (held-out)")
        for column in ("eval stage", "model", "exact match", "n"):
            table.add_column(column)
        for stage, summary in evals:
            table.add_row(stage["name"], stage.get("init") or "base", f"{summary.get('exact_match', 0):.3f}",
                          str(summary.get("n", "")))
        console.print(table)
