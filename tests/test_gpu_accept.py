"""bench/gpu_accept.py's reduced mode: the GPU acceptance run, on the CPU, with Unsloth's generated trainers forced
(the classes a GPU runs), so the prepared command cannot rot while no GPU is lent. It runs every stage type in a
real `kit run`, kills and resumes a GRPO stage, and runs one conformance test through pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_acceptance_reduced_accepts_every_stage_on_unsloths_trainers(tmp_path):
    # CI=1 as on a CI machine: torch then makes its custom-op aliasing check an error (kitcli/backend.py)
    env = {**os.environ, "KIT_TRAINERS": "unsloth", "CI": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_accept.py"), "--reduced", "--results",
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu-accept-reduced.json").read_text())
    stages = payload["stages"]
    assert {s["type"] for s in stages.values()} == {"eval", "sft", "reward", "dpo", "grpo", "gspo", "ppo"}
    assert all(s["done"] for s in stages.values())
    for name in ("rm", "dpo", "dr-grpo", "dapo", "gspo", "grpo"):
        assert stages[name]["trainer"].startswith("Unsloth"), (name, stages[name]["trainer"])
    assert [c["check"] for c in payload["checks"]] == [
        "dpo: the reference is a frozen copy of the SFT adapter",
        "ppo: the reference is a frozen copy of the SFT adapter",
        "grpo: first KL is 0 (reference = the SFT model)"]
    assert all(c["ok"] for c in payload["checks"])
    resume = payload["resume"]
    assert resume["ok"] and resume["distance_to_uninterrupted"] == 0.0 and resume["distance_moved_by_the_stage"] > 0
    assert payload["conformance"]["ok"] and payload["conformance"]["passed"] == 1
    assert "ACCEPTED" in result.stdout
