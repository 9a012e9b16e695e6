"""Shared by the benchmark scripts: timing a command in a subprocess (wall time and peak RSS), results to JSON."""

from __future__ import annotations

import json
import os
import platform
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
KIT = [sys.executable, "-m", "kitcli"]


def machine() -> dict:
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(terse=True)}


class RunFailed(SystemExit):
    """A timed command that failed or ran out of time (a SystemExit, so scripts that do not catch it end with it)."""


def timed(command: list[str], env: dict | None = None, cwd: Path | None = None, log: Path | None = None,
          deadline: float | None = None) -> dict:
    """Run `command`; return wall seconds, the child's peak RSS (MiB) and its output. With `log`, the output is also
    written there as it comes; with `deadline` (a time.time()), the command and its process group are killed then."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or os.environ.copy(),
                               cwd=cwd, process_group=0)
    timer = None
    if deadline is not None:
        timer = threading.Timer(max(0.0, deadline - time.time()), os.killpg, (process.pid, signal.SIGKILL))
        timer.start()
    chunks = []
    with open(log, "ab") if log else open(os.devnull, "wb") as sink:
        for line in process.stdout:
            chunks.append(line)
            sink.write(line)
            sink.flush()
    _, status, usage = os.wait4(process.pid, 0)
    if timer:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    output = b"".join(chunks).decode(errors="replace")
    if process.returncode != 0:
        why = "out of time" if deadline is not None and time.time() >= deadline else f"exit {process.returncode}"
        raise RunFailed(f"benchmark command failed ({why}): {' '.join(command)}\n{output[-3000:]}")
    return {"seconds": seconds, "peak_rss_mib": usage.ru_maxrss / 1024, "output": output}


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
