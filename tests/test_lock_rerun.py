"""A lock reruns its run: every shipped tiny recipe, shortened by `--set` (which the lock records), run once and
then again with `kit run --from-lock RUN/recipe.lock.yaml` into another directory, gives bit-identical weights
(adapters, full models, merged reward models, critics) and the same DONE files, apart from the wall time.

Marked `long` (make test-long, CI): real `kit run` processes, two per recipe, a few minutes in all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = sorted(p.stem for p in (ROOT / "recipes").glob("tiny-*.yaml"))
# What a DONE file holds that is not the run's outcome: how long it took, where it ran.
VOLATILE = {"seconds", "stage_seconds", "started", "finished", "peak_gpu_memory_gib", "peak_gpu_memory_reserved_gib",
            "eval_seconds", "seconds_per_step", "steps_per_second", "samples_per_second", "train_runtime"}


def shortened(recipe: str) -> list[str]:
    """`--set` flags that make every stage of a shipped recipe a few steps: 4 optimizer steps (a checkpoint at the
    last), 16 rows per batch, 8 held-out rows per evaluation."""
    from kitcli.recipe.load import load_recipe

    flags = []
    for stage in load_recipe(recipe).stages:
        name = f"stages.{stage.name}"
        if stage.type == "eval":
            flags.append(f"{name}.data.limit=8")
            continue
        flags += [f"{name}.train.max_steps=4", f"{name}.train.save_steps=4",
                  f"{name}.train.per_device_train_batch_size=16"]
        if getattr(stage, "eval", None):
            flags += [f"{name}.eval.limit=8", f"{name}.eval.every=4"]
    return flags


def run(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "kitcli", "run", *args, "--quiet"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def weights(run_dir: Path) -> dict[str, bytes]:
    """Every weights file a stage kept (checkpoints left out: they hold the same weights and optimizer states)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*.safetensors"))
            if "checkpoints" not in p.parts}


def outcomes(run_dir: Path) -> dict[str, dict]:
    def without_volatile(value):
        if isinstance(value, dict):
            return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
        if isinstance(value, list):
            return [without_volatile(v) for v in value]
        return value

    def read(done: Path) -> dict:  # paths inside the run directory, as RUN/...
        return json.loads(done.read_text().replace(str(run_dir), "RUN"))

    return {done.parent.name: without_volatile(read(done)) for done in sorted(run_dir.glob("*/DONE"))}


@pytest.mark.long
@pytest.mark.parametrize("recipe", TINY)
def test_a_run_from_its_lock_is_the_same_run(tmp_path, recipe):
    first, again = tmp_path / "first", tmp_path / "again"
    run(recipe, *[arg for flag in shortened(recipe) for arg in ("--set", flag)], "--output", str(first))
    lock = yaml.safe_load((first / "recipe.lock.yaml").read_text())
    assert "<redacted>" not in json.dumps(lock["recipe"])  # no shipped recipe holds a credential
    run("--from-lock", str(first / "recipe.lock.yaml"), "--output", str(again))
    found = weights(first)
    assert found, "the run kept no weights"
    assert found.keys() == weights(again).keys()
    differ = [name for name, data in found.items() if weights(again)[name] != data]
    assert not differ, f"not bit-identical after --from-lock: {differ}"
    assert outcomes(again) == outcomes(first)
    assert yaml.safe_load((again / "recipe.lock.yaml").read_text())["recipe"] == lock["recipe"]
