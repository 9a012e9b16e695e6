"""bench/shapes.py --reduced: the real-shape speed and memory comparison (kit against a hand-written TRL + PEFT +
bitsandbytes script, with kit plan's prediction) runs end to end on a tiny shape, so the script cannot rot before a
GPU runs it. On a CPU there are no memory columns; the step times of a 2-step tiny run say nothing about speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.long
def test_shapes_bench_reduced_compares_both_sides(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "shapes.py"), "--reduced", "--repeat", "1",
                             "--results", str(tmp_path)], cwd=ROOT / "bench", capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "shapes-reduced.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["sft-64", "grpo-4x8"]
    for row in rows:
        for side in ("kit", "trl_peft"):
            assert row[side]["step_s"] > 0 and row[side]["tokens_per_s"] > 0, row
        assert row["step_time_ratio"] > 0 and row["planned_peak_gib"] > 0
    assert "ratios are kit (Unsloth) / hand-written TRL + PEFT + bitsandbytes" in result.stdout
