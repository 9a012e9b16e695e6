"""bench/gpu.py's reduced mode, so the GPU benchmark cannot rot on machines without a GPU.

The real run needs CUDA (4-bit kernels, VRAM); here it is the same script, with a tiny random Qwen3 and a few
steps, through both backends (Unsloth's CPU backend and plain transformers + PEFT) in real `kit run` subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.long
def test_gpu_bench_reduced_runs_both_backends(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--reduced", "--results", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "shape: reduced (tiny)" in result.stdout
    payload = json.loads((tmp_path / "gpu-reduced.json").read_text())
    assert [row["stage"] for row in payload["rows"]] == ["sft", "grpo"]
    for row in payload["rows"]:
        for backend in ("unsloth", "transformers"):
            assert row[backend]["step_s"] > 0
        assert row["step_time_ratio"] > 0
