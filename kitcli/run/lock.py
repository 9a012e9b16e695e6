"""A run's lock file (recipe.lock.yaml): what `kit run --from-lock` reruns exactly, and how a run directory is
matched to the recipe it holds (the newest `runs/<name>-*` of the same recipe and data is resumed).

    recipe      the validated recipe, its JSON dump (kitcli/recipe/load.py Recipe.lock_dump; credentials redacted)
    datasets    each dataset file's sha256 (a hub dataset: its name, config and split)
    model_file  the GGUF file a named model comes from, with its sha256
    versions    the packages that train, and the kit's and Python's versions
"""

from __future__ import annotations

import platform
import re
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from kitcli import __version__
from kitcli.data.rows import fingerprint
from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.records import first_difference
from kitcli.rundir import RunDir, redact

PACKAGES = ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "datasets",
            "accelerate")


def package_versions() -> dict[str, str]:
    versions = {"kit": __version__, "python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def dataset_fingerprints(recipe: Recipe) -> dict[str, str]:
    """Every dataset file a stage reads (its data, eval_data, its `eval:`'s held-out rows): its sha256."""
    prints = {}
    for stage in recipe.stages:
        held_out = declared(stage, "eval")  # a training stage's held-out rows (`eval:`)
        for key, data in (("data", declared(stage, "data")), ("eval_data", declared(stage, "eval_data")),
                          ("eval.data", held_out.data if held_out is not None else None)):
            if data is not None:
                prints[f"{stage.name}.{key}"] = fingerprint(data)
    return prints


def make_lock(recipe: Recipe) -> dict[str, Any]:
    """What `kit run --from-lock` reruns exactly: every value of the recipe (`lora: false` kept false, a tokenizer's
    tokens kept; only credentials redacted), and what the kit read or changed (notes)."""
    return {
        "recipe": redact(recipe.lock_dump()),
        **({"notes": list(recipe.notes)} if recipe.notes else {}),
        "source": recipe.source,
        "seed": recipe.seed,
        "datasets": dataset_fingerprints(recipe),
        "model_file": model_file_fingerprint(recipe.model.name),
        "versions": package_versions(),
        "platform": f"{platform.system()} {platform.machine()}",
        "created": datetime.now().isoformat(timespec="seconds"),
    }


def model_file_fingerprint(name: str) -> dict[str, str] | None:
    """The GGUF file a run's model comes from, with its sha256 (None for other models)."""
    from kitcli.models import gguf

    source = None if name == "tiny" else gguf.source_file(name)
    return None if source is None else {"path": str(source), "sha256": gguf.file_sha256(source)}


def same_run(lock: dict[str, Any], fresh: dict[str, Any]) -> str | None:
    """None when `lock` describes the same recipe and data as `fresh`, else the first key that differs."""
    found = first_difference({"recipe": lock.get("recipe"), "datasets": lock.get("datasets"),
                              "model_file": lock.get("model_file")},
                             {"recipe": fresh["recipe"], "datasets": fresh["datasets"],
                              "model_file": fresh.get("model_file")})
    return found[0] if found else None


def choose_run_dir(recipe: Recipe, output: str | None, lock: dict[str, Any] | None = None) -> Path:
    """`--output`, else the newest runs/<name>-* holding the same recipe (so re-running resumes), else a new one.
    `lock` is the recipe's make_lock(); without it, it is made only when an existing run must be compared (it
    hashes the data files, which `kit plan` and the other reading commands need not do otherwise)."""
    if output:
        return Path(output)
    runs = Path("runs")
    pattern = re.compile(re.escape(recipe.name) + r"-\d{8}-\d{6}$")
    if runs.is_dir():
        for candidate in sorted((p for p in runs.iterdir() if pattern.match(p.name)), reverse=True):
            existing = RunDir(candidate).read_lock()
            if existing:
                lock = lock if lock is not None else make_lock(recipe)
                if same_run(existing, lock) is None:
                    return candidate
    return runs / f"{recipe.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def same_resolution(existing: dict[str, Any], lock: dict[str, Any]) -> bool:
    """The existing lock already records this run (recipe, data, resolved stages, versions): leave it as it is."""
    return all(existing.get(key) == lock.get(key) for key in ("recipe", "datasets", "resolved", "versions"))
