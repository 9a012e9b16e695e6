"""Run untrusted completion code in a separate, limited process; judge what it computes in this one.

The judge never runs inside the judged. The sandboxed process (rewards/sandbox_harness.py) gets the completion's
code and, for assert tests, only the expressions that need the solution (`add(2, 3)`, never `== 5`); it sends back
their values as plain data. For stdin/stdout tests it gets the inputs; each test runs in a fresh child forked for
it, writing to a pipe this process owns and reads; the expected output never leaves here. rewards/judge.py then
decides each test's verdict here, and the score is the share of those verdicts that pass: always within [0, 1],
whatever the code did to its own interpreter (replaced builtins, objects that equal everything, forged reports,
early exits). What the code controls is the values it
reports, so it scores only where those values are right; see docs/rewards.md for what that still leaves open.

Layers that contain the code itself, from the OS up (rewards/isolation.py probes once which ones hold on this
machine; `kit rewards sandbox` prints it):
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

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rewards.isolation import isolation
from rewards.judge import AssertCase, IOCase, assert_verdicts, output_matches

HARNESS = Path(__file__).with_name("sandbox_harness.py")
STARTUP_ALLOWANCE = 0.5  # seconds on top of the time limit for each sandbox process to start, under load
EXIT_GRACE = 0.2         # seconds to keep reading after the process exited (a descendant may hold a pipe)
CHANNEL_BYTES = 4 << 20  # most the parent reads of a process's reports
OUTPUT_BYTES = 1 << 20   # most the parent reads of a program's stdout (more fails the test)
PROGRAM_TESTS = 24       # stdin/stdout tests per sandbox process (a pipe each; RLIMIT_NOFILE is 64)
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


@dataclass
class Finished:
    """What one sandbox process left: its exit, its reports (decoded lines), each program test's stdout (read by
    this process from a pipe of its own) and the tail of its stderr."""

    mode: str
    returncode: int | None
    timed_out: bool
    reports: list[dict]
    outputs: list[bytes] = field(default_factory=list)
    stderr: bytes = b""
    overflowed: set[str] = field(default_factory=set)  # streams that passed their cap ("channel", "stdout 3")
    seconds: float = 0.0

    def report(self, key: str) -> str | None:
        return next((str(r[key]) for r in self.reports if key in r and "test" not in r), None)

    def exit_status(self, test: int) -> int | None:
        """The exit status the process reported for program test `test`, None unless reported exactly once."""
        found = [r.get("exit") for r in self.reports if r.get("test") == test and "exit" in r]
        return found[0] if len(found) == 1 and type(found[0]) is int else None

    def signal_name(self) -> str | None:
        code = self.returncode
        if code is None or code >= 0:
            return None
        return signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)


def launch(mode: str, code: str, workdir: Path, limits: SandboxLimits, seconds: float,
           tests: list[dict] | list[tuple[str, int]]) -> Finished:
    """Start one sandbox process and read what it sends until it ends or `seconds` (plus the startup allowance)
    have passed; kill its process group either way. `tests`: for "probes", each test's setup and probes; for
    "program", each stdin/stdout test's (input, most bytes of output to read)."""
    plan = isolation()
    started = time.monotonic()
    channel_read, channel_write = os.pipe()
    pipes = [os.pipe() for _ in tests] if mode == "program" else []
    job_tests = [{"input": given, "stdout": w} for (given, _), (_, w) in zip(tests, pipes)] if pipes else tests
    job = {"mode": mode, "code": code, "tests": job_tests, "channel": channel_write, "workdir": str(workdir),
           "network": limits.network, "audit": limits.audit, "time_limit": seconds, "memory_mb": limits.memory_mb,
           "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb,
           "drop_to": list(plan.drop_to) if plan.drop_to else None}
    job_path = workdir / f".job-{secrets.token_hex(8)}.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    prefix = [flag for flag in plan.prefix if not (limits.network and flag == "--net")]
    command = [*prefix, plan.python, "-I", "-S", "-B", str(HARNESS), str(job_path)]
    try:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
                                   close_fds=True, pass_fds=(channel_write, *[w for _, w in pipes]))
    finally:
        for fd in (channel_write, *[w for _, w in pipes]):
            os.close(fd)  # the child holds its own copies
    streams = {channel_read: ("channel", CHANNEL_BYTES), process.stderr.fileno(): ("stderr", STDERR_BYTES)}
    streams.update({r: (f"stdout {i}", cap) for i, ((r, _), (_, cap)) in enumerate(zip(pipes, tests))})
    try:
        data, timed_out, overflowed = collect(process, streams, started + seconds + STARTUP_ALLOWANCE)
    finally:
        kill_group(process)
        for fd, (name, _) in streams.items():
            if name != "stderr" and name not in overflowed:
                os.close(fd)
        process.stderr.close()
        job_path.unlink(missing_ok=True)
    return Finished(mode, process.returncode, timed_out, decode_reports(data["channel"]),
                    [data[f"stdout {i}"] for i in range(len(pipes))], data["stderr"], overflowed,
                    time.monotonic() - started)


def collect(process: subprocess.Popen, streams: dict[int, tuple[str, int]],
            deadline: float) -> tuple[dict[str, bytes], bool, set[str]]:
    """Read the process's pipes until they close or the deadline: the first `cap` bytes of each (the last ones of
    stderr). A program's stdout past its cap is closed (its writer fails, its test fails); the channel past its
    cap ends the reading. Returns the bytes by name, whether the deadline passed, and the streams closed early."""
    data = {name: bytearray() for name, _ in streams.values()}
    overflowed: set[str] = set()
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    timed_out = False
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
                name, cap = streams[key.fd]
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = data[name]
                buffer += chunk
                if name == "stderr":
                    del buffer[:-cap]
                elif len(buffer) > cap:
                    del buffer[cap:]
                    overflowed.add(name)
                    if name == "channel":
                        return {k: bytes(v) for k, v in data.items()}, False, overflowed
                    selector.unregister(key.fd)
                    os.close(key.fd)
    if not timed_out:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    return {k: bytes(v) for k, v in data.items()}, timed_out, overflowed


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
    """Run `code` against `tests` (rewards.judge.parse_tests) in sandbox processes: one for the assert tests, one
    for up to PROGRAM_TESTS stdin/stdout tests (each in a fresh child of it); judge every test here. Never raises
    for anything the code does."""
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
            runs.append(launch("probes", code, workdir, limits, limits.time_limit, jobs))
            judged = assert_verdicts(runs[-1].reports, [t for _, t in asserts], problems)
            verdicts.update(zip([i for i, _ in asserts], judged))
        programs = [(i, t) for i, t in enumerate(tests) if isinstance(t, IOCase)]
        for first in range(0, len(programs), PROGRAM_TESTS):
            left = limits.time_limit - (time.monotonic() - started)
            if left <= 0 or any(r.timed_out or r.report("error") for r in runs):
                break
            chunk = programs[first:first + PROGRAM_TESTS]
            inputs = [(t.input, max(OUTPUT_BYTES, 2 * len(t.output.encode("utf-8")))) for _, t in chunk]
            runs.append(launch("program", code, workdir, limits, left, inputs))
            for number, (index, case) in enumerate(chunk):
                verdicts[index] = judge_program(runs[-1], number, case, index, problems)
        return summarize([verdicts.get(i, False) for i in range(len(tests))], runs, problems,
                         time.monotonic() - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def judge_program(run: Finished, number: int, case: IOCase, index: int, problems: list[str]) -> bool:
    """A stdin/stdout test passes when its child exited 0 and printed the expected lines (on the pipe this process
    read), within the time limit."""
    status = run.exit_status(number)
    if status != 0 or f"stdout {number}" in run.overflowed:
        what = ("printed more than it may" if f"stdout {number}" in run.overflowed
                else "wall-clock limit reached" if status is None and run.timed_out
                else "did not finish" if status is None else f"exit status {status}: {last_line(run.stderr)}")
        problems.append(f"test {index}: {what}")
        return False
    if not output_matches(run.outputs[number].decode("utf-8", "replace"), case.output):
        problems.append(f"test {index}: wrong output")
        return False
    return True


def last_line(data: bytes) -> str:
    lines = data.decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:200] if lines else ""


def summarize(verdicts: list[bool], runs: list[Finished], problems: list[str], seconds: float) -> SandboxResult:
    """How the sandbox ended (for the logs; the score comes from the verdicts alone)."""
    seconds = round(seconds, 3)
    cpu_spent = any(r.signal_name() == "SIGXCPU" or -signal.SIGXCPU in (x.get("exit") for x in r.reports)
                    for r in runs)  # RLIMIT_CPU, in the sandbox process or a program's child
    if any(r.timed_out for r in runs) or cpu_spent:
        return SandboxResult("timeout", verdicts, seconds, "time limit reached (wall clock or CPU)")
    memory = next((r.report("memory") for r in runs if r.report("memory")), None)
    if memory:
        return SandboxResult("memory", verdicts, seconds, memory)
    error = next((r.report("error") for r in runs if r.report("error")), None)
    if error:
        return SandboxResult("error", verdicts, seconds, error)
    killed = next((r.signal_name() for r in runs if r.signal_name() and "channel" not in r.overflowed), None)
    if killed:
        return SandboxResult("crashed", verdicts, seconds, f"killed by {killed}")
    unfinished = next((r for r in runs if r.mode == "probes" and not r.report("end")), None)
    if unfinished:
        tail = ("its values passed the size limit" if "channel" in unfinished.overflowed
                else last_line(unfinished.stderr) or f"exit status {unfinished.returncode}")
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
        run = launch("program", code, workdir, limits, limits.time_limit, [(stdin, OUTPUT_BYTES)])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    status_code = run.exit_status(0)
    # RLIMIT_CPU can fire before the wall clock on a quiet machine, in the sandbox process or the program's child
    cpu_spent = run.signal_name() == "SIGXCPU" or status_code == -signal.SIGXCPU
    status = ("timeout" if run.timed_out or cpu_spent else "error" if run.report("error")
              else "crashed" if status_code is None or status_code < 0 else "ok" if status_code == 0 else "error")
    if status == "error" and "MemoryError" in last_line(run.stderr):
        status = "memory"
    return SnippetResult(status, run.outputs[0].decode("utf-8", "replace"), run.stderr.decode("utf-8", "replace"),
                         status_code if status_code is not None and status_code >= 0 else None, round(run.seconds, 3))
