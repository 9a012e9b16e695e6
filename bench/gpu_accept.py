"""GPU acceptance run: every stage type on the embedded tiny model through the path a GPU runs (Unsloth's CUDA
backend in 4-bit, Unsloth's generated trainers), with the checks that decide whether what trains is what the kit
says, in one command that ends within its budget (8 minutes with the install) on one GPU.

    python bench/wheelhouse.py                               # here: the wheels the GPU machine lacks (.whl/)
    bash bench/offline_run.sh bench/gpu_accept.py            # there (bench/GPU.md): install, run, results in $OUT
    python bench/gpu_accept.py --reduced                     # anywhere: the same run on the CPU, fewer steps

Results are written as they come, under --results ($OUT where it is set, else bench/results): gpu-accept.json
(gpu-accept-reduced.json with --reduced) first and again after each step, then run.log, resume.log and
conformance.log. A step that runs out of its time is recorded as failed and the next one still runs.
1. `kit run` of one recipe with every stage type: eval -> SFT -> eval -> reward model -> DPO -> GRPO (dr_grpo,
   dapo) -> GSPO -> PPO -> eval -> GRPO (grpo, beta 0.04). Per stage: the trainer class and backend it ran on,
   seconds, steps, tokens/s and peak VRAM (torch.cuda.max_memory_allocated, from DONE), and the reference it used.
   Checked: every GRPO stage with a KL penalty logs KL 0 at its first step (its reference is the SFT model it
   starts from), DPO and PPO report a reference that is a frozen copy of the SFT adapter.
2. Kill and resume: the last GRPO stage is run again from the finished run's other stages, killed (SIGKILL) after
   its first checkpoint and resumed; the resumed adapter's distance to the uninterrupted one is recorded beside the
   distance GRPO moved it (0 on a CPU; CUDA kernels need not be deterministic).
3. The conformance tests on Unsloth's trainers (tests/test_rl_formulas.py, test_preference_formulas.py,
   test_trainer_families.py, `-k unsloth`): GRPO variants' advantages and losses, GSPO's sequence ratio, clip and
   old-log-prob gate, DPO and Bradley-Terry losses and reference identities, each against the formula computed
   independently on a fixed batch. --reduced runs one of them, to keep the plumbing working.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import yaml
from common import KIT, RESULTS, ROOT, machine, save

DATA = ROOT / "examples" / "data"
BUDGET_S = 450  # the whole run, on one GPU (bench/offline_run.sh passes what its cap leaves after the install)
# What every child process gets: output as it comes (a command stopped at its limit keeps it), no hub lookups.
CHILD_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def recipe(reduced: bool) -> dict:
    """Every stage type, in the order the checks need (the GRPO stage that is killed and resumed comes last)."""
    steps = 2 if reduced else 20
    rl = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 4, "temperature": 1.0,
          "learning_rate": 2e-4, "logging_steps": 1}
    small_eval = {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 10 if reduced else 100}
    prefs = {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 80 if reduced else 800}
    prompts = str(DATA / "arithmetic_prompts.jsonl")
    generation = {"max_new_tokens": 4, "batch_size": 50, "temperature": 0.0}
    return {
        "name": "gpu-accept", "seed": 0,
        "model": {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True,
                  "dtype": "float32" if reduced else "auto"},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "stages": [
            {"name": "eval-before", "type": "eval", "data": small_eval, "generation": generation},
            {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 3 * steps, "per_device_train_batch_size": 16, "learning_rate": 2e-3,
                       "logging_steps": 5}},
            {"name": "eval-sft", "type": "eval", "init": "sft", "data": small_eval, "generation": generation},
            {"name": "rm", "type": "reward", "init": "sft", "data": prefs,
             "train": {"max_steps": steps, "per_device_train_batch_size": 16, "learning_rate": 1e-3,
                       "logging_steps": 2, "eval_steps": steps}},
            {"name": "dpo", "type": "dpo", "init": "sft", "data": prefs, "eval_fraction": 0,
             "train": {"max_steps": steps, "per_device_train_batch_size": 8, "learning_rate": 5e-5,
                       "logging_steps": 1}},
            {"name": "dr-grpo", "type": "grpo", "variant": "dr_grpo", "init": "sft", "data": prompts,
             "rewards": ["exact_match"], "train": {**rl, "max_steps": steps}},
            {"name": "dapo", "type": "grpo", "variant": "dapo", "init": "sft", "data": prompts,
             "rewards": ["exact_match"], "train": {**rl, "max_steps": steps}},
            {"name": "gspo", "type": "gspo", "init": "sft", "data": prompts, "rewards": ["exact_match"],
             "train": {**rl, "per_device_train_batch_size": 4, "max_steps": 4 if reduced else 16, "save_steps": 4}},
            {"name": "ppo", "type": "ppo", "init": "sft", "reward_model": {"stage": "rm", "weight": 0.1},
             "rewards": ["exact_match"], "data": prompts,
             "train": {"max_steps": steps, "per_device_train_batch_size": 16, "num_mini_batches": 2,
                       "num_ppo_epochs": 2, "response_length": 4, "learning_rate": 2e-4, "logging_steps": 1}},
            {"name": "eval-after", "type": "eval", "init": "ppo", "data": small_eval, "generation": generation},
            {"name": "grpo", "type": "grpo", "variant": "grpo", "init": "sft", "data": prompts,
             "rewards": ["exact_match"], "train": {**rl, "max_steps": 2 * steps, "save_steps": steps}},
        ],
    }


def run_logged(command: list[str], log: Path, deadline: float, env: dict | None = None) -> int | str:
    """Run `command` with its output appended to `log`; its exit status, or "out of time" (then it and its process
    group are killed at `deadline`)."""
    with open(log, "a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, process_group=0,
                                   env={**os.environ, **CHILD_ENV, **(env or {})})
        try:
            return process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            out.write(f"\n[gpu_accept] killed: out of time ({time.strftime('%H:%M:%S')})\n")
            return "out of time"


def kit_run(recipe_path: Path, run_dir: Path, log: Path, deadline: float) -> int | str:
    return run_logged(KIT + ["run", str(recipe_path), "--output", str(run_dir)], log, deadline)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def stage_figures(run_dir: Path, stage: dict) -> dict:
    stage_dir = run_dir / stage["name"]
    done = json.loads((stage_dir / "DONE").read_text()) if (stage_dir / "DONE").exists() else {}
    rows = read_rows(stage_dir / "metrics.jsonl")
    final = [r for r in rows if "train_runtime" in r]
    runtime = final[-1]["train_runtime"] if final else done.get("seconds")
    tokens = max((r.get("num_tokens") or 0 for r in rows), default=0)
    first_kl = next((r["kl"] for r in rows if "kl" in r), None)
    return {"type": stage["type"], "done": bool(done), "trainer": done.get("trainer"), "backend": done.get("backend"),
            "seconds": done.get("seconds"), "steps": done.get("steps"),
            "tokens_per_s": round(tokens / runtime, 1) if tokens and runtime else None,
            "peak_vram_gib": done.get("peak_gpu_memory_gib"), "headline": done.get("headline"),
            "reference": done.get("reference") or next((m for m in done.get("memory", []) if "reference" in m), None),
            "first_kl": first_kl, "rewritten": done.get("rewritten")}


def reference_checks(figures: dict, recipe_data: dict, tolerance: float) -> list[dict]:
    checks = []
    for stage in recipe_data["stages"]:
        got = figures[stage["name"]]
        if stage["type"] == "grpo" and stage.get("variant", "grpo") == "grpo":
            ok = got["first_kl"] is not None and abs(got["first_kl"]) <= tolerance
            checks.append({"check": f"{stage['name']}: first KL is 0 (reference = the SFT model)", "ok": ok,
                           "value": got["first_kl"]})
        if stage["type"] == "dpo":
            checks.append({"check": "dpo: the reference is a frozen copy of the SFT adapter",
                           "ok": bool(got["reference"]) and got["reference"].startswith("frozen 'ref' adapter"),
                           "value": got["reference"]})
        if stage["type"] == "ppo":
            checks.append({"check": "ppo: the reference is a frozen copy of the SFT adapter",
                           "ok": bool(got["reference"]) and "frozen copy of stage 'sft'" in got["reference"],
                           "value": got["reference"]})
    return checks


def adapter_distance(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return float(sum(((x[k].float() - y[k].float()) ** 2).sum() for k in x if k in y) ** 0.5)


def kill_and_resume(work: Path, recipe_path: Path, whole: Path, stage: dict, log: Path, deadline: float) -> dict:
    """The finished run without its last stage, that stage killed after its first checkpoint, then resumed."""
    run_dir = work / "run-resumed"
    shutil.copytree(whole, run_dir, ignore=shutil.ignore_patterns(stage["name"], "report.md", "plots"))
    checkpoint = run_dir / stage["name"] / "checkpoints" / f"checkpoint-{stage['train']['save_steps']}"
    with open(log, "a") as out:
        process = subprocess.Popen(KIT + ["run", str(recipe_path), "--output", str(run_dir)], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=ROOT, process_group=0, env={**os.environ, **CHILD_ENV})
        while not (checkpoint / "trainer_state.json").exists():
            if process.poll() is not None or time.time() > deadline:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                why = "out of time" if time.time() > deadline else "no checkpoint before the stage ended"
                return {"ok": False, "error": why}
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    killed_done = (run_dir / stage["name"] / "DONE").exists()
    status = kit_run(recipe_path, run_dir, log, deadline)
    if status != 0:
        return {"ok": False, "error": f"the resume exited {status}" if isinstance(status, int) else status}
    done = json.loads((run_dir / stage["name"] / "DONE").read_text())
    adapter = Path(stage["name"]) / "adapter" / "adapter_model.safetensors"
    distance = adapter_distance(run_dir / adapter, whole / adapter)
    moved = adapter_distance(whole / adapter, whole / "sft" / "adapter" / "adapter_model.safetensors")
    return {"ok": not killed_done and bool(done.get("resumed_from")), "resumed": done.get("resumed"),
            "distance_to_uninterrupted": distance, "distance_moved_by_the_stage": moved,
            "relative": distance / moved if moved else None}


def conformance(work: Path, reduced: bool, workers: int, log: Path, deadline: float) -> dict:
    """The formula and identity tests on Unsloth's trainers, through pytest (its JUnit report, per test), each
    failure's traceback written to the log as it happens (bench/instant_failures.py)."""
    report = work / "conformance.xml"
    selection = "unsloth and z_score" if reduced else "unsloth"
    tests = ["tests/test_rl_formulas.py", "tests/test_preference_formulas.py", "tests/test_trainer_families.py"]
    parallel = ["-n", str(workers), "--dist", "load"] if workers > 1 else []
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "instant_failures", *parallel,
               "-k", selection, f"--junitxml={report}", *tests]
    started = time.time()
    bench = str(ROOT / "bench")
    status = run_logged(command, log, deadline, env={"PYTHONPATH": os.pathsep.join(
        p for p in (bench, os.environ.get("PYTHONPATH")) if p)})
    cases = []
    if report.exists():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = child.tag
                elif child.tag == "skipped":
                    outcome = "skipped: " + (child.get("message") or "")
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
    failed = [c for c in cases if c["outcome"] in ("failure", "error")]
    return {"ok": status == 0 and bool(cases) and not failed, "exit": status,
            "seconds": round(time.time() - started, 1), "passed": sum(c["outcome"] == "passed" for c in cases),
            "failed": failed, "skipped": [c for c in cases if c["outcome"].startswith("skipped")], "cases": cases}


def environment() -> dict:
    import importlib.metadata as metadata

    import torch

    versions = {}
    for name in ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "accelerate",
                 "datasets"):
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {**machine(), "gpu": gpu, "cuda": torch.version.cuda if gpu else None, "versions": versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the CPU version: fewer steps, one conformance test")
    parser.add_argument("--results", type=Path, default=Path(os.environ.get("OUT") or RESULTS),
                        help="folder for the JSON and the logs (default $OUT, else bench/results)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole run (default {BUDGET_S}; three times that with --reduced)")
    parser.add_argument("--only", choices=["run", "conformance"], default=None,
                        help="run: steps 1-2 (the recipe, its checks, kill and resume); conformance: step 3")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers for the conformance tests (default 4 on a GPU, 1 on a CPU)")
    args = parser.parse_args()
    started = time.time()
    if args.reduced:  # on a CPU, force the classes a GPU runs (tests/test_offline_rehearsal.py)
        os.environ.setdefault("KIT_TRAINERS", "unsloth")
    budget = args.budget_s or BUDGET_S * (3 if args.reduced else 1)
    args.results.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kit-gpu-accept-"))
    try:
        payload = accept(args.reduced, work, args.results, started, budget, args.only, args.workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for check in payload["checks"]:
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']}: {check.get('value')}")
    print(f"resume: {payload['resume']}")
    conf = payload["conformance"]
    print(f"conformance on Unsloth's trainers: {conf.get('passed')} passed, {len(conf.get('failed', []))} failed, "
          f"{len(conf.get('skipped', []))} skipped{'; ' + conf['error'] if conf.get('error') else ''}")
    if payload["run_exit"] not in (0, None):  # why the run failed, where a CI log shows it
        tail = (args.results / "run.log").read_text()[-1500:]
        print(f"the run ended with {payload['run_exit']}; the end of its output:\n{tail}")
    print(f"{'ACCEPTED' if payload['ok'] else 'NOT ACCEPTED'} in {payload['seconds']} s; results: {args.results}")
    sys.exit(0 if payload["ok"] else 1)


def cell(value) -> str:
    return f"{value:8.2f}" if isinstance(value, (int, float)) else f"{'-':>8}"


def print_stage(name: str, figures: dict) -> None:
    print(f"{name:12} {figures['type']:7} {str(figures['trainer']):36} {cell(figures['seconds'])} s  "
          f"{cell(figures['tokens_per_s'])} tok/s  {cell(figures['peak_vram_gib'])} GiB  {figures['headline']}",
          flush=True)


def accept(reduced: bool, work: Path, results: Path, started: float, budget: float, only: str | None = None,
           workers: int | None = None) -> dict:
    """The three steps, each with a deadline that leaves the later ones their share of the budget; the JSON is
    rewritten after each step, so a command stopped at its limit still returns what was measured. On the lent GPU
    the whole takes more than one command (bench/GPU.md): `only` runs steps 1-2 ("run") or step 3 ("conformance")."""
    deadline = started + budget
    payload = {"environment": environment(), "reduced": reduced, "budget_s": budget, "only": only, "stages": {},
               "checks": [], "run_exit": None, "resume": {"ok": False, "error": "not run"},
               "conformance": {"ok": False, "error": "not run"}, "ok": False}
    on_gpu = payload["environment"]["gpu"] is not None
    name = ("gpu-accept-reduced" if reduced else "gpu-accept") + (f"-{only}" if only else "")

    def write() -> None:
        payload["seconds"] = round(time.time() - started, 1)
        save(name, payload, results)

    write()
    if only != "conformance":
        run_steps(payload, reduced, work, results, deadline - (0 if only else 0.35 * budget), write)
    if only != "run":
        payload["conformance"] = conformance(work, reduced, workers or (4 if on_gpu else 1),
                                             results / "conformance.log", deadline)
    payload["ok"] = ((only == "conformance" or (payload["run_exit"] == 0 and payload["resume"]["ok"]
                                                 and all(f["done"] for f in payload["stages"].values())
                                                 and all(c["ok"] for c in payload["checks"])))
                     and (only == "run" or payload["conformance"]["ok"]))
    write()
    return payload


def run_steps(payload: dict, reduced: bool, work: Path, results: Path, deadline: float, write) -> None:
    """Steps 1 and 2: the recipe with every stage type and its checks, then the last GRPO stage killed and resumed
    (the run gets until 3/4 of the time left, the resume the rest)."""
    data = recipe(reduced)
    recipe_path = work / "gpu-accept.yaml"
    recipe_path.write_text(yaml.safe_dump(data, sort_keys=False))
    whole = work / "run"
    run_deadline = time.time() + 0.75 * (deadline - time.time())
    payload["run_exit"] = kit_run(recipe_path, whole, results / "run.log", run_deadline)
    payload["stages"] = {s["name"]: stage_figures(whole, s) for s in data["stages"]}
    for stage_name, figures in payload["stages"].items():
        print_stage(stage_name, figures)
    on_gpu = payload["environment"]["gpu"] is not None
    payload["checks"] = reference_checks(payload["stages"], data, tolerance=1e-3 if on_gpu else 1e-6)
    write()
    if payload["run_exit"] == 0:
        payload["resume"] = kill_and_resume(work, recipe_path, whole, data["stages"][-1], results / "resume.log",
                                            deadline)
    else:
        payload["resume"] = {"ok": False, "error": "the run did not finish"}
    write()


if __name__ == "__main__":
    main()
