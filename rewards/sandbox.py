"""Run untrusted completion code in a separate, limited process; judge what it computes in this one.

The judge never runs inside the judged. The sandboxed process (rewards/sandbox_harness.py) gets the completion's
code and, for assert tests, only the expressions that need the solution (`add(2, 3)`, never `== 5`); it sends back
their values as plain data. For stdin/stdout tests it gets the input and writes to a pipe this process owns; the
expected output never leaves here. rewards/judge.py then decides each test's verdict here, and the score is the
share of those verdicts that pass: always within [0, 1], whatever the code did to its own interpreter (replaced
builtins, objects that equal everything, forged reports, early exits). What the code controls is the values it
reports, so it scores only where those values are right; see docs/rewards.md for what that still leaves open.

Layers that contain the code itself, from the OS up (`isolation()` probes once which ones hold on this machine;
`kit rewards sandbox` prints it):
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
  the ones that do not depend on the code behaving. The verdicts do not depend on it either.

It contains accidents and reward hacking by a policy (hangs, memory hogs, fork bombs, stray writes, network
calls, tampering with the harness); it is not a boundary against code written to escape the machine.

`run_snippet` runs a piece of code on a given stdin under the same limits and returns its output and exit status
(for tools that let a model run Python).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rewards.judge import AssertCase, IOCase, assert_verdicts, output_matches

HARNESS = Path(__file__).with_name("sandbox_harness.py")
STARTUP_ALLOWANCE = 0.5  # seconds on top of the time limit for each sandbox process to start, under load
EXIT_GRACE = 0.2         # seconds to keep reading after the process exited (a descendant may hold a pipe)
UNSHARE_FLAGS = ["--net", "--pid", "--fork", "--kill-child"]
CHANNEL_BYTES = 4 << 20  # most the parent reads of a process's reports
OUTPUT_BYTES = 1 << 20   # most the parent reads of a program's stdout (more fails the test)
STDERR_BYTES = 4000      # the tail of stderr kept for the detail


@dataclass(frozen=True)
class SandboxLimits:
    time_limit: float = 5.0      # seconds of wall clock (and CPU) for all of a completion's tests
    memory_mb: int = 512         # address space
    max_processes: int = 16      # RLIMIT_NPROC
    max_file_mb: int = 16        # largest file the code may write (RLIMIT_FSIZE)
    network: bool = False
    audit: bool = True           # the in-interpreter audit hook; tests turn it off to check the other layers alone


@dataclass
class SandboxResult:
    status: str                  # passed | failed | error | timeout | memory | crashed | no_tests
    verdicts: list[bool] = field(default_factory=list)  # this process's verdict on each test, in order
    seconds: float = 0.0
    detail: str = ""

    @property
    def passed(self) -> int:
        return sum(self.verdicts)

    @property
    def total(self) -> int:
        return len(self.verdicts)

    def score(self, partial: bool = True) -> float:
        """The share of tests passed (partial), else 1.0 only when all passed; within [0, 1] by construction."""
        if not self.verdicts:
            return 0.0
        return self.passed / self.total if partial else float(all(self.verdicts))


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
        "verdicts": "made outside the sandbox, on the plain data it returns; expected values never enter it",
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




@dataclass
class Finished:
    """What one sandbox process left: its exit, its reports (decoded lines) and the bytes of its stdout/stderr."""

    mode: str
    returncode: int | None
    timed_out: bool
    reports: list[dict]
    stdout: bytes = b""
    stderr: bytes = b""
    overflow: bool = False       # stdout or the channel went past its cap; the process was stopped there
    seconds: float = 0.0

    def report(self, key: str) -> str | None:
        return next((str(r[key]) for r in self.reports if key in r and "test" not in r), None)

    def signal_name(self) -> str | None:
        code = self.returncode
        if code is None or code >= 0:
            return None
        return signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)


def launch(mode: str, code: str, workdir: Path, limits: SandboxLimits, seconds: float, *, tests=None,
           stdin: bytes | None = None, output_cap: int = 0) -> Finished:
    """Start one sandbox process and read its channel (and stdout when `output_cap`) until it ends or `seconds`
    (plus the startup allowance) have passed; kill its process group either way."""
    plan = isolation()
    started = time.monotonic()
    channel_read, channel_write = os.pipe()
    job = {"mode": mode, "code": code, "tests": tests or [], "channel": channel_write, "workdir": str(workdir),
           "network": limits.network, "audit": limits.audit, "time_limit": seconds, "memory_mb": limits.memory_mb,
           "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb,
           "drop_to": list(plan.drop_to) if plan.drop_to else None}
    job_path = workdir / f".job-{secrets.token_hex(8)}.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    prefix = [flag for flag in plan.prefix if not (limits.network and flag == "--net")]
    command = [*prefix, plan.python, "-I", "-S", "-B", str(HARNESS), str(job_path)]
    with contextlib.ExitStack() as stack:
        stack.callback(os.close, channel_write)  # the child holds its own copy
        given = stack.enter_context(tempfile.TemporaryFile()) if stdin is not None else subprocess.DEVNULL
        if stdin is not None:
            given.write(stdin)
            given.seek(0)
        process = subprocess.Popen(command, stdin=given, stdout=subprocess.PIPE if output_cap else subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
                                   close_fds=True, pass_fds=(channel_write,))
    streams = {channel_read: ("channel", CHANNEL_BYTES), process.stderr.fileno(): ("stderr", STDERR_BYTES)}
    if output_cap:
        streams[process.stdout.fileno()] = ("stdout", output_cap)
    try:
        data, timed_out, overflow = collect(process, streams, started + seconds + STARTUP_ALLOWANCE)
    finally:
        kill_group(process)
        os.close(channel_read)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
        job_path.unlink(missing_ok=True)
    return Finished(mode, process.returncode, timed_out, decode_reports(data["channel"]), data.get("stdout", b""),
                    data["stderr"], overflow, time.monotonic() - started)


def collect(process: subprocess.Popen, streams: dict[int, tuple[str, int]],
            deadline: float) -> tuple[dict[str, bytes], bool, bool]:
    """Read the process's pipes until they close or the deadline; the first `cap` bytes of each (the last ones
    of stderr). Returns the bytes by name, whether the deadline passed, and whether stdout overflowed."""
    data = {name: bytearray() for name, _ in streams.values()}
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    timed_out = overflow = False
    exited_at = None
    with selector:
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and process.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > EXIT_GRACE:
                break
            for key, _ in selector.select(timeout=min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                name, cap = streams[key.fd]
                buffer = data[name]
                buffer += chunk
                if name == "stderr":
                    del buffer[:-cap]
                elif len(buffer) > cap:
                    del buffer[cap:]
                    overflow = True
                    return {k: bytes(v) for k, v in data.items()}, False, overflow
    if not timed_out:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    return {k: bytes(v) for k, v in data.items()}, timed_out, overflow


def decode_reports(raw: bytes) -> list[dict]:
    """The channel's JSON lines; a line that is not a JSON object is dropped (the verdicts need none of them)."""
    reports = []
    for line in raw.split(b"\n"):
        try:
            report = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(report, dict):
            reports.append(report)
    return reports


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group (also after a normal exit: no process may outlive it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


# --- running a completion against its tests ---------------------------------------------------------------------

def run_tests(code: str, tests: list[AssertCase | IOCase], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` against `tests` (rewards.judge.parse_tests): the assert tests in one sandbox process, each
    stdin/stdout test in its own; judge every test here. Never raises for anything the code does."""
    if not tests:
        return SandboxResult("no_tests")
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kit-sandbox-"))
    verdicts: dict[int, bool] = {}
    problems: list[str] = []
    runs: list[Finished] = []
    try:
        plan = isolation()
        if plan.drop_to:
            os.chown(workdir, *plan.drop_to)
        os.chmod(workdir, 0o700)
        asserts = [(i, t) for i, t in enumerate(tests) if isinstance(t, AssertCase)]
        if asserts:
            jobs = [{"setup": t.setup, "probes": t.probes} for _, t in asserts]
            runs.append(launch("probes", code, workdir, limits, limits.time_limit, tests=jobs))
            judged = assert_verdicts(runs[-1].reports, [t for _, t in asserts], problems)
            verdicts.update(zip([i for i, _ in asserts], judged))
        for index, case in enumerate(tests):
            if isinstance(case, IOCase) and not any(r.timed_out or r.report("error") for r in runs):
                left = limits.time_limit - (time.monotonic() - started)
                if left > 0:
                    runs.append(launch("program", code, workdir, limits, left, stdin=case.input.encode("utf-8"),
                                       output_cap=max(OUTPUT_BYTES, 2 * len(case.output.encode("utf-8")))))
                    verdicts[index] = judge_program(runs[-1], case, index, problems)
        return summarize([verdicts.get(i, False) for i in range(len(tests))], runs, problems,
                         time.monotonic() - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def judge_program(run: Finished, case: IOCase, index: int, problems: list[str]) -> bool:
    """A stdin/stdout test passes when the program exited 0 within its time and printed the expected lines."""
    if run.timed_out or run.overflow or run.returncode != 0:
        what = ("wall-clock limit reached" if run.timed_out else "printed more than it may" if run.overflow
                else f"exit status {run.returncode}: {last_line(run.stderr)}")
        problems.append(f"test {index}: {what}")
        return False
    if not output_matches(run.stdout.decode("utf-8", "replace"), case.output):
        problems.append(f"test {index}: wrong output")
        return False
    return True


def last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:200] if lines else ""


def summarize(verdicts: list[bool], runs: list[Finished], problems: list[str], seconds: float) -> SandboxResult:
    """How the sandbox ended (for the logs; the score comes from the verdicts alone)."""
    seconds = round(seconds, 3)
    if any(r.timed_out for r in runs) or any(r.signal_name() == "SIGXCPU" for r in runs):
        return SandboxResult("timeout", verdicts, seconds, "wall-clock limit reached")
    memory = next((r.report("memory") for r in runs if r.report("memory")), None)
    if memory:
        return SandboxResult("memory", verdicts, seconds, memory)
    error = next((r.report("error") for r in runs if r.report("error")), None)
    if error:
        return SandboxResult("error", verdicts, seconds, error)
    killed = next((r.signal_name() for r in runs if r.signal_name() and not r.overflow), None)  # not by us
    if killed:
        return SandboxResult("crashed", verdicts, seconds, f"killed by {killed}")
    unfinished = next((r for r in runs if r.mode == "probes" and not r.report("end")), None)
    if unfinished:
        tail = ("its values passed the size limit" if unfinished.overflow else last_line(unfinished.stderr)
                or f"exit status {unfinished.returncode}")
        return SandboxResult("crashed", verdicts, seconds, f"exited before finishing: {tail}")
    status = "passed" if all(verdicts) else "failed"
    return SandboxResult(status, verdicts, seconds, "; ".join(problems[:2]))


def run_batch(codes: list[str], tests: list[list[AssertCase | IOCase]], limits: SandboxLimits = SandboxLimits(),
              workers: int = 2) -> list[SandboxResult]:
    """`run_tests` for many completions, `workers` sandboxes at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda pair: run_tests(pair[0], pair[1], limits), zip(codes, tests)))


# --- running a snippet ------------------------------------------------------------------------------------------

@dataclass
class SnippetResult:
    status: str                  # ok (exit status 0) | error (an exception or another status) | timeout | memory
    stdout: str                  # | crashed (killed by a signal)
    stderr: str
    exit_status: int | None
    seconds: float


def run_snippet(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SnippetResult:
    """Run `code` as a script in the sandbox, on `stdin`, under `limits`: its stdout (the first MiB), the tail of
    its stderr (a traceback when it raised) and its exit status. Never raises for anything the code does."""
    workdir = Path(tempfile.mkdtemp(prefix="kit-sandbox-"))
    try:
        plan = isolation()
        if plan.drop_to:
            os.chown(workdir, *plan.drop_to)
        os.chmod(workdir, 0o700)
        run = launch("program", code, workdir, limits, limits.time_limit, stdin=stdin.encode("utf-8"),
                     output_cap=OUTPUT_BYTES)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    status = ("timeout" if run.timed_out or run.signal_name() == "SIGXCPU" else "memory" if run.report("memory")
              else "crashed" if run.signal_name() else "ok" if run.returncode == 0 else "error")
    return SnippetResult(status, run.stdout.decode("utf-8", "replace"), run.stderr.decode("utf-8", "replace"),
                         run.returncode if run.returncode is not None and run.returncode >= 0 else None,
                         round(run.seconds, 3))
