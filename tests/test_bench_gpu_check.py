"""bench/gpu_check.py rehearsed on the CPU, so the GPU check (bench/GPU.md's first command) cannot rot where no GPU is.

On a CPU the script runs its reduced form: DPO and Bradley-Terry, and GRPO with a KL term in CPU bf16 autocast (the
GPU's precision, emulated) and in float32. The steps that need CUDA say "skipped: needs CUDA"; every other step must
end ok with its values, and a step that fails must leave its error text in the JSON and let the others run.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.py"
STEPS = ["dpo: trainer", "dpo: the tests' batch left on the CPU", "dpo: loss, batch on the model's device",
         "bradley_terry: trainer", "bradley_terry: the tests' batch left on the CPU",
         "bradley_terry: loss, batch on the model's device", "grpo_kl: trainer", "grpo_kl/bf16", "grpo_kl/fp32",
         "verdict"]
NEEDS_CUDA = {"dpo: the tests' batch left on the CPU", "bradley_terry: the tests' batch left on the CPU"}
VERDICTS = ("same", "precision only", "a real difference")


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "KIT_TRAINERS": "unsloth",
           "UNSLOTH_COMPILE_LOCATION": str(tmp_path / "unsloth_compiled_cache")}  # its own: no worker shares it
    result = subprocess.run([sys.executable, str(SCRIPT), "--reduced", "--results", str(tmp_path / "out"), *args],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((tmp_path / "out" / "gpu-check-reduced.json").read_text())


def failures(payload: dict) -> str:
    return "\n".join(f"{s['step']}: {s['status']} {s.get('why', '')}\n{s.get('traceback', '')}"
                     for s in payload["steps"] if s["status"] not in ("ok", "skipped: needs CUDA"))


def finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


@pytest.mark.slow
def test_gpu_check_reduced_records_every_step_and_computes_what_a_cpu_can(tmp_path):
    result, payload = run_check(tmp_path, "--budget-s", "500")
    assert payload["reduced"] and payload["finished"] and payload["environment"]["gpu"] is None
    assert payload["environment"]["versions"]["unsloth"] != "not installed"
    steps = {s["step"]: s for s in payload["steps"]}
    assert [s["step"] for s in payload["steps"]] == STEPS
    assert all(steps[name]["status"] == "skipped: needs CUDA" for name in NEEDS_CUDA), payload["steps"]
    assert all(s["status"] == "ok" for name, s in steps.items() if name not in NEEDS_CUDA), failures(payload)
    assert all(isinstance(s["values"], dict) and s["seconds"] >= 0 for s in payload["steps"] if s["status"] == "ok")

    for case, trainer in (("dpo", "UnslothDPOTrainer"), ("bradley_terry", "UnslothRewardTrainer")):
        assert steps[f"{case}: trainer"]["values"]["trainer"] == trainer  # the class a GPU runs
        loss = steps[f"{case}: loss, batch on the model's device"]["values"]
        assert finite(loss["trl_loss"]) and finite(loss["formula_bf16"]) and finite(loss["formula_fp32"]), loss
        assert loss["abs_diff_fp32"] <= loss["tolerance_cpu"], loss  # float32 on a CPU: what the tests check
        assert loss["formula_bf16"] != loss["formula_fp32"], loss  # the bf16 formula really ran under autocast

    assert steps["grpo_kl: trainer"]["values"]["trainer"] == "UnslothGRPOTrainer"
    bf16, fp32 = steps["grpo_kl/bf16"]["values"], steps["grpo_kl/fp32"]["values"]
    assert (bf16["autocast"], fp32["autocast"]) == ("cpu bfloat16", "none (float32)")
    for values in (bf16, fp32):
        gap = values["logp_gap_bf16_vs_fp32_forward"]  # the per-token gap bf16 autocast makes, on the CPU
        assert 0 < gap["mean"] <= gap["max"], gap
        assert values["kl_token_mean"] > 0 and values["kl_sequence_mean"] > 0
        assert values["logged_bucket"] and set(values["logged_bucket"]) <= {"train", "eval"}
        assert isinstance(values["training_after_generation"], bool)
        for scale in (1, 10, 300):
            assert isinstance(values[f"loss_ok_scale{scale}"], bool)
            assert 0 <= values[f"grad_elems_failing_scale{scale}"] <= values["grad_elems"]
        varied = values["kl_metric_varied_lengths"]  # the KL metric averaged both ways, where lengths differ
        assert len(set(varied["lengths"])) > 1 and varied["token_mean"] != varied["sequence_mean"], varied
        assert finite(varied["logged"]) and varied["logged_is_closest_to"] in (
            "token-weighted (TRL)", "per-sequence (Unsloth)"), varied
    # float32 on a CPU is the tests' own precision: the trainer's scorer and loss match the formula's
    assert fp32["logp_gap_trainer_scorer_vs_formula"]["max"] < 1e-4, fp32
    assert fp32["loss_ok_scale1"] and fp32["grad_elems_failing_scale1"] == 0, fp32
    assert any("verify" in line for line in bf16["unsloth_log"]), bf16.get("unsloth_log")  # Unsloth's own lines

    verdicts = steps["verdict"]["values"]
    assert set(verdicts) == {"dpo", "bradley_terry", "grpo_kl"}
    assert all(v.startswith(VERDICTS) for v in verdicts.values()), verdicts
    assert all(f"{case:14} {verdict}" in result.stdout for case, verdict in verdicts.items())
    assert f"gpu check: 0 of {len(STEPS)} steps failed" in result.stdout


@pytest.mark.slow
def test_a_failing_step_keeps_its_text_and_the_others_still_report(tmp_path):
    """With a budget of two seconds the first step is cut by the check's own alarm: it must be recorded as failed
    with its error and traceback, the steps that need it as not run (saying why), the rest as out of time, and the
    verdict still written."""
    _, payload = run_check(tmp_path, "--parts", "pref", "--budget-s", "2")
    steps = {s["step"]: s for s in payload["steps"]}
    assert list(steps) == STEPS[:6] + ["verdict"] and payload["finished"]
    first = steps["dpo: trainer"]
    assert first["status"] == "failed" and first["error"].startswith("OutOfTime: out of time"), first
    assert 'File "' in first["traceback"] and first["traceback"].strip().endswith(first["error"])
    assert isinstance(first["values"], dict)
    for name in ("dpo: the tests' batch left on the CPU", "dpo: loss, batch on the model's device"):
        assert steps[name]["status"] == "not run" and "dpo: trainer" in steps[name]["why"], steps[name]
    assert steps["bradley_terry: trainer"]["status"] == "skipped: out of time"
    assert steps["verdict"]["status"] == "ok"
    assert steps["verdict"]["values"] == {"dpo": "unknown: the loss step did not finish",
                                          "bradley_terry": "unknown: the loss step did not finish"}


def test_every_package_the_check_imports_is_carried_or_on_the_gpu_machine():
    """The lent GPU machine reaches no registry: whatever bench/gpu_check.py imports must be in the wheelhouse
    (bench/wheelhouse.py) or among the target's own packages (bench/gpu-target.txt)."""
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "bench" / "wheelhouse.py")
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    target, absent = wheelhouse.read_target(ROOT / "bench" / "gpu-target.txt")
    carry, left = wheelhouse.select(target, absent, wheelhouse.default_environment())
    there = {name for name, why in left.items() if why in ("on the target", "the target's own")}
    offline = {*carry, *there, "lora-kit"}
    imported = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    local = {p.stem for p in (ROOT / "bench").glob("*.py")}
    distributions = metadata.packages_distributions()
    missing = {}
    for module in sorted(imported - set(sys.stdlib_module_names) - local):
        names = {wheelhouse.canonicalize_name(d) for d in distributions.get(module, [])}
        if not names & offline:
            missing[module] = sorted(names) or "no distribution found"
    assert {"torch", "unsloth", "kitcli", "yaml"} <= imported
    assert not missing, f"imported by bench/gpu_check.py, not on the GPU machine nor in the wheelhouse: {missing}"
