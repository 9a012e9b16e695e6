"""SIGINT / SIGTERM mid-stage: a checkpoint is saved, the process exits 130 with a resume hint, and a re-run
resumes from that checkpoint. Disk is checked before a checkpoint is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import DATA, done, write_recipe
from kitcli.errors import KitError
from kitcli.interrupt import check_free_disk


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_checkpoint_and_resumes(in_tmp, tiny_model_dir, signum):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 40, "save_steps": 1000, "logging_steps": 1, "per_device_train_batch_size": 4}}
    recipe = write_recipe(in_tmp / "r.yaml", [stage])
    run_dir = in_tmp / "run"
    command = [sys.executable, "-m", "kitcli", "run", str(recipe), "--output", str(run_dir)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = run_dir / "sft" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.1)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, out + err
    assert f"stopped by {signal.Signals(signum).name}" in err and "run the same command again to resume" in err
    assert "Traceback" not in err
    checkpoints = sorted((run_dir / "sft" / "checkpoints").glob("checkpoint-*"))
    assert checkpoints, "no checkpoint was saved on the signal"
    step = int(checkpoints[-1].name.split("-")[1])
    assert 3 <= step < 40
    assert not (run_dir / "sft" / "DONE").exists()

    if signum == signal.SIGTERM:
        return  # the resume path is the same for both signals; run it once
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming sft from checkpoint-{step}" in result.stdout
    assert done(run_dir / "sft")["steps"] == 40


def test_disk_check_names_size_and_fix(tmp_path):
    with pytest.raises(KitError, match=r"not enough free disk to save checkpoint-5 .* needs about \d+ MiB"):
        check_free_disk(tmp_path, 1 << 60, "checkpoint-5")
    check_free_disk(tmp_path, 1024, "checkpoint-5")  # plenty of room: no error
