"""Shared by the benchmark scripts: timing a command in a subprocess (wall time and peak RSS), results to JSON."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
KIT = [sys.executable, "-m", "kitcli"]


def machine() -> dict:
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(terse=True)}


def timed(command: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run `command`; return wall seconds, the child's peak RSS (MiB) and its exit code."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                               cwd=cwd)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"benchmark command failed ({process.returncode}): {' '.join(command)}\n"
                         f"{output.decode(errors='replace')[-3000:]}")
    return {"seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024, "output": output.decode(errors="replace")}


def save(name: str, payload: dict, directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M:%S"), **payload},
                               indent=2))
    return path


def trl_config(cls, path: str, output_dir: str):
    """A TRL config of class `cls` from a kit run's config.json (the effective values), for the hand-written
    scripts (raw_trl.py, raw_peft.py) that train the same stage without the kit."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in json.loads(Path(path).read_text()).items() if k in names and v != "<redacted>"}
    values.pop("hub_token", None)
    if "steps_per_generation" in values:  # GRPOConfig derives generation_batch_size from it and refuses both
        values.pop("generation_batch_size", None)
    values["output_dir"] = output_dir
    return cls(**values)


def resource_children_maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
