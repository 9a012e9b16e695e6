"""Interrupted work resumes: kill -9 a real `kit run` mid-stage, run it again, it finishes from the checkpoint
and does not redo the finished stage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import DATA, done, metrics, write_recipe


def kit(*args):
    return [sys.executable, "-m", "kitcli", *map(str, args)]


def test_kill_mid_stage_then_resume(in_tmp, tiny_model_dir):
    train = {"learning_rate": 1e-3, "per_device_train_batch_size": 8, "logging_steps": 5}
    stages = [
        {"name": "first", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"), "train": {**train, "max_steps": 3}},
        {"name": "second", "type": "sft", "init": "first", "data": str(DATA / "arithmetic_sft.jsonl"),
         "train": {**train, "max_steps": 60, "save_steps": 10}},
    ]
    recipe = write_recipe(in_tmp / "r.yaml", stages)
    run_dir = in_tmp / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(in_tmp / "first.log", "w")
    process = subprocess.Popen(kit("run", recipe, "--output", run_dir), stdout=log, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True)
    checkpoint = run_dir / "second" / "checkpoints" / "checkpoint-20" / "trainer_state.json"
    deadline = time.time() + 240
    while not checkpoint.exists():
        assert process.poll() is None, (in_tmp / "first.log").read_text()
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (run_dir / "second" / "DONE").exists()
    first_done = (run_dir / "first" / "DONE").read_bytes()
    first_adapter = (run_dir / "first" / "adapter" / "adapter_model.safetensors").read_bytes()

    result = subprocess.run(kit("run", recipe, "--output", run_dir), capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stage 1/2 first (sft): finished earlier, skipping" in result.stdout
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resuming second from checkpoint-")]
    assert resumed, result.stdout
    step = int(resumed[0].split("checkpoint-")[1].split()[0])
    assert step >= 20
    assert done(run_dir / "second")["steps"] == 60
    assert done(run_dir / "second")["resumed_from"] == f"checkpoint-{step}"
    assert (run_dir / "first" / "DONE").read_bytes() == first_done
    assert (run_dir / "first" / "adapter" / "adapter_model.safetensors").read_bytes() == first_adapter
    steps = [row["step"] for row in metrics(run_dir / "second") if "loss" in row]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # no step logged twice after the resume
