"""Run untrusted completion code against test cases in a separate, limited process.

Layers, from the OS up (`isolation()` probes once which ones hold on this machine; `kit rewards sandbox` prints it):
- a separate process in its own session, killed with its whole process group at the wall-clock limit;
- `unshare --net --pid --fork --kill-child` where it works (Linux, as root or with user namespaces): no network
  interfaces but a down loopback, and every process the code starts dies with it;
- resource limits set before the code runs: RLIMIT_CPU (time), RLIMIT_AS (memory), RLIMIT_NPROC (processes),
  RLIMIT_FSIZE (file size), RLIMIT_NOFILE, no core files;
- run as `nobody` when the kit runs as root (root ignores RLIMIT_NPROC and may write anywhere), with an
  interpreter that `nobody` can read;
- a fresh temporary directory as working directory and HOME, removed afterwards; an isolated interpreter
  (`python -I -S -B`: no environment variables, no user or site packages, no bytecode writes);
- inside the interpreter, an audit hook that refuses writes outside that directory, new processes, ctypes and,
  unless allowed, sockets. It holds wherever Python runs, but code in C could get around it; the OS layers are
  the ones that do not depend on the code behaving.

It contains accidents and reward hacking by a policy (hangs, memory hogs, fork bombs, stray writes, network
calls); it is not a boundary against code written to escape it.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).with_name("sandbox_harness.py")
STARTUP_ALLOWANCE = 0.5  # seconds on top of time_limit for the interpreter to start, under load
UNSHARE_FLAGS = ["--net", "--pid", "--fork", "--kill-child"]


@dataclass(frozen=True)
class SandboxLimits:
    time_limit: float = 5.0      # seconds of wall clock (and CPU) for all of a completion's tests
    memory_mb: int = 512         # address space
    max_processes: int = 16      # RLIMIT_NPROC
    max_file_mb: int = 16        # largest file the code may write (RLIMIT_FSIZE)
    network: bool = False
    audit: bool = True           # the in-interpreter audit hook; tests turn it off to check the OS layers alone


@dataclass
class SandboxResult:
    status: str                  # passed | failed | error | timeout | memory | crashed | no_tests
    passed: int = 0
    total: int = 0
    seconds: float = 0.0
    detail: str = ""

    def score(self, partial: bool = True) -> float:
        if self.status in ("timeout", "memory", "crashed", "error") or self.total == 0:
            return 0.0
        if partial:
            return self.passed / self.total
        return float(self.passed == self.total)


@dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox do; `layers` says in words which limit holds by which means."""

    prefix: tuple[str, ...] = ()
    drop_to: tuple[int, int] | None = None
    python: str = sys.executable
    layers: dict[str, str] = field(default_factory=dict)


def readable_by_others(path: Path) -> bool:
    """Whether an unprivileged user can reach and read `path` (every parent directory searchable)."""
    try:
        path = path.resolve()
        for parent in path.parents:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def interpreter_for_others() -> str | None:
    """A Python 3 interpreter whose executable and standard library `nobody` can read."""
    candidates = [sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        real = Path(candidate).resolve()
        stdlib = real.parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        libs = [p for p in real.parent.parent.glob("lib/python3*") if p.is_dir()]
        if readable_by_others(real) and any(readable_by_others(p / "os.py") for p in [stdlib, *libs]):
            return str(real)
    return None


def nobody_ids() -> tuple[int, int]:
    try:
        import pwd

        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except (ImportError, KeyError):
        return 65534, 65534


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once per process which isolation layers work here."""
    layers = {
        "time": "wall-clock kill of the process group at the limit, plus RLIMIT_CPU",
        "memory": "RLIMIT_AS" + ("" if sys.platform.startswith("linux") else " (not enforced by every OS, e.g. macOS)"),
        "file size": "RLIMIT_FSIZE",
        "working directory": "fresh temporary directory, removed afterwards",
        "interpreter": "isolated python -I -S -B",
        "audit hook": "refuses writes outside the directory, new processes, ctypes and sockets (in-interpreter)",
    }
    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if unshare:
        attempts = [[unshare, *UNSHARE_FLAGS]] if is_root else []
        attempts.append([unshare, "--user", "--map-root-user", *UNSHARE_FLAGS])
        for attempt in attempts:
            try:
                probe = subprocess.run([*attempt, sys.executable, "-I", "-S", "-c", "pass"], capture_output=True,
                                       timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if probe.returncode == 0:
                prefix = tuple(attempt)
                break
    if prefix:
        layers["network"] = "network namespace (unshare --net): no interface but a down loopback"
        layers["processes"] = "PID namespace (unshare --pid --kill-child): every process dies with the sandbox"
    else:
        layers["network"] = "audit hook only (unshare is not available here)"
        layers["processes"] = "process-group kill; forks refused by the audit hook"
    drop_to = None
    python = sys.executable
    if is_root:
        other = interpreter_for_others()
        if other:
            drop_to, python = nobody_ids(), other
            layers["user"] = f"runs as nobody (uid {drop_to[0]}) with {other}"
            layers["processes"] += "; RLIMIT_NPROC (enforced for nobody)"
            layers["files"] = ("only the temporary directory and world-writable places (/tmp) are writable by "
                               "nobody; the audit hook refuses those too")
        else:
            layers["user"] = "runs as root: no interpreter readable by nobody was found"
            layers["processes"] += "; RLIMIT_NPROC does not bind root"
            layers["files"] = "audit hook only (root may write anywhere)"
    else:
        layers["user"] = "runs as the current user"
        layers["processes"] += "; RLIMIT_NPROC (counts all of this user's processes)"
        layers["files"] = "the current user's permissions, plus the audit hook"
    return Isolation(prefix=prefix, drop_to=drop_to, python=python, layers=layers)


def normalize_tests(value: Any) -> list[dict[str, str]]:
    """Test cases from a dataset column: assert statements (`"assert f(2) == 4"`), or stdin/stdout pairs
    (`{"input": "2\\n", "output": "4\\n"}`, or APPS-style `{"inputs": [...], "outputs": [...]}`), as a list,
    one item, or a JSON string of either."""
    if value is None:
        return []
    if isinstance(value, str):
        stripped = value.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return normalize_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        return [{"kind": "assert", "code": value}] if stripped else []
    if isinstance(value, dict):
        if "inputs" in value and "outputs" in value:
            pairs = zip(value["inputs"], value["outputs"])
            return [{"kind": "io", "input": str(i), "output": str(o)} for i, o in pairs]
        if "input" in value and "output" in value:
            return [{"kind": "io", "input": str(value["input"]), "output": str(value["output"])}]
        raise ValueError(f"a test case mapping needs input and output (or inputs and outputs), got keys "
                         f"{', '.join(sorted(map(str, value)))}")
    if isinstance(value, (list, tuple)):
        return [case for item in value for case in normalize_tests(item)]
    raise ValueError(f"test cases must be strings or input/output mappings, got {type(value).__name__}")


def run_tests(code: str, tests: list[dict[str, str]], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` then each test case in a fresh sandbox process; never raises for anything the code does."""
    if not tests:
        return SandboxResult("no_tests")
    plan = isolation()
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="kit-sandbox-"))
    try:
        nonce = secrets.token_hex(8)
        job = {"code": code, "tests": tests, "nonce": nonce, "workdir": str(workdir), "network": limits.network,
               "audit": limits.audit, "time_limit": limits.time_limit, "memory_mb": limits.memory_mb,
               "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb,
               "drop_to": list(plan.drop_to) if plan.drop_to else None}
        job_path = workdir / f".job-{nonce}.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        if plan.drop_to:
            os.chown(workdir, *plan.drop_to)
        os.chmod(workdir, 0o700)
        out_path, err_path = workdir.with_name(workdir.name + ".out"), workdir.with_name(workdir.name + ".err")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        prefix = [flag for flag in plan.prefix if not (limits.network and flag == "--net")]
        command = [*prefix, plan.python, "-I", "-S", "-B", str(HARNESS), str(job_path)]
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=workdir,
                                       env=env, start_new_session=True, close_fds=True)
            timed_out = False
            try:
                process.wait(timeout=limits.time_limit + STARTUP_ALLOWANCE)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                kill_group(process)
        output = out_path.read_bytes()[: 1 << 20].decode("utf-8", "replace")
        errors = err_path.read_bytes()[-2000:].decode("utf-8", "replace")
        out_path.unlink(missing_ok=True)
        err_path.unlink(missing_ok=True)
        return interpret(output, errors, nonce, len(tests), process.returncode, timed_out,
                         time.perf_counter() - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group (also after a normal exit: no process may outlive it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def interpret(output: str, errors: str, nonce: str, total: int, returncode: int, timed_out: bool,
              seconds: float) -> SandboxResult:
    events = []
    for line in output.splitlines():
        if line.startswith(nonce + " "):
            _, kind, text = line.split(" ", 2)
            events.append((kind, json.loads(text)))
    kinds = {kind for kind, _ in events}
    failures = [text for kind, text in events if kind == "fail"]
    seconds = round(seconds, 3)
    if timed_out:
        return SandboxResult("timeout", total=total, seconds=seconds, detail="wall-clock limit reached")
    if "memory" in kinds:
        return SandboxResult("memory", total=total, seconds=seconds, detail=dict(events)["memory"])
    if "error" in kinds:
        return SandboxResult("error", total=total, seconds=seconds, detail=dict(events)["error"])
    if "done" not in kinds:
        if returncode is not None and returncode < 0:
            name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
            status = "timeout" if name == "SIGXCPU" else "crashed"
            return SandboxResult(status, total=total, seconds=seconds, detail=f"killed by {name}")
        tail = errors.strip().splitlines()[-1:] or [f"exit status {returncode}"]
        return SandboxResult("crashed", total=total, seconds=seconds, detail=f"exited before finishing: {tail[0]}")
    passed = int(dict(events)["done"].split()[0])
    status = "passed" if passed == total else "failed"
    return SandboxResult(status, passed=passed, total=total, seconds=seconds, detail="; ".join(failures[:2]))
