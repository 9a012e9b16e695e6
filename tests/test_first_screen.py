"""The first screen of a run: the kit speaks first, and what torch, bitsandbytes and Unsloth print on import and on
loading goes to the run directory's libraries.log instead (a real `kit run` in a fresh process, so the libraries
are imported for real)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import DATA, write_recipe

pytestmark = pytest.mark.slow  # a fresh process imports torch and Unsloth


def test_library_chatter_goes_to_the_run_directory(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "ev", "type": "eval",
                                                 "data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 4},
                                                 "generation": {"max_new_tokens": 2}}])
    env = {k: v for k, v in os.environ.items() if k != "KIT_SHOW_LIBRARY_OUTPUT"}
    result = subprocess.run([sys.executable, "-m", "kitcli", "run", str(recipe), "--output", str(tmp_path / "run")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    screen = result.stdout + result.stderr
    assert screen.startswith("kit: checking test's 1 stages"), screen[:300]
    for noise in ("Unsloth 2026", "_pytree", "register_constant", "Unsloth (CPU):"):
        assert noise not in screen, noise
    log = (tmp_path / "run" / "libraries.log").read_text()
    assert "Unsloth" in log and "no GPU found" in log  # kept, not lost
    assert "evaluated model: backend unsloth-cpu" in screen  # the kit's own line about the load stays


def test_show_library_output_shows_it(tmp_path):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl")}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    result = subprocess.run([sys.executable, "-m", "kitcli", "run", str(recipe), "--dry-run"], capture_output=True,
                            text=True, env={**os.environ, "KIT_SHOW_LIBRARY_OUTPUT": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no GPU found" in result.stdout + result.stderr
