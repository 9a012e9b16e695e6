"""The code-execution sandbox against an infinite loop, a sleep, a memory hog, a fork (bomb), writing outside its
directory and a network attempt, each contained within its time limit; with the audit hook and, where this
machine allows, with the OS layers alone (audit=False). And run_snippet, the sandbox for tools: output, traceback,
exit status. (Its judging, against code that games it: tests/test_rewards_hacks.py.)"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import run_cli

from rewards.builtin import code_exec
from rewards.guard import RewardStats, guard_reward
from rewards.isolation import isolation
from rewards.judge import parse_tests
from rewards.registry import LoadedReward
from rewards.sandbox import STARTUP_ALLOWANCE, SandboxLimits, run_snippet, run_tests

LIMIT = 1.0
WITH_HOOK = SandboxLimits(time_limit=LIMIT, memory_mb=256)
OS_ONLY = SandboxLimits(time_limit=LIMIT, memory_mb=256, audit=False)
PASSES = parse_tests(["assert True"])


@pytest.fixture(autouse=True)
def own_sandbox_dir(tmp_path, monkeypatch):
    """The sandbox's working directories go under this test's tmp_path, so sandbox_processes() sees only this
    test's sandboxes, not those another pytest-xdist worker runs at the same time."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def contained(code: str, limits: SandboxLimits = WITH_HOOK, tests=PASSES):
    started = time.perf_counter()
    result = run_tests(code, tests, limits)
    elapsed = time.perf_counter() - started
    assert elapsed < limits.time_limit + STARTUP_ALLOWANCE + 0.5, f"took {elapsed:.2f}s: {result}"
    assert not sandbox_processes(), "a sandbox process outlived its run"
    return result


def sandbox_processes() -> list[str]:
    """Command lines of live processes running the sandbox harness (none may outlive a run)."""
    time.sleep(0.05)
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except (OSError, IndexError):
            continue
        if "sandbox_harness.py" in cmdline and f"{tempfile.gettempdir()}/kit-sandbox-" in cmdline and state != "Z":
            found.append(cmdline)
    return found


def test_passing_and_failing_code():
    assert run_tests("def f(x): return x + 1", parse_tests(["assert f(1) == 2"]), WITH_HOOK).status == "passed"
    result = run_tests("def f(x): return x", parse_tests(["assert f(1) == 2", "assert f(0) == 0"]), WITH_HOOK)
    assert (result.status, result.passed, result.total, result.score()) == ("failed", 1, 2, 0.5)


def test_a_program_passes_a_stdin_stdout_test_only_when_it_also_exits_0():
    """The right output is not enough: a program that then raises (or exits 3) fails its test."""
    tests = parse_tests([{"input": "2 3", "output": "5"}])
    honest = "import sys\nprint(sum(map(int, sys.stdin.read().split())))"
    assert run_tests(honest, tests, WITH_HOOK).score() == 1.0
    for ending in ("raise ValueError('after the answer')", "raise SystemExit(3)"):
        result = run_tests(f"{honest}\n{ending}", tests, WITH_HOOK)
        assert result.score() == 0.0 and "exit status" in result.detail, (ending, result.detail)


def test_run_snippet_returns_output_traceback_and_status():
    ok = run_snippet("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="2 3\n", limits=WITH_HOOK)
    assert (ok.status, ok.stdout, ok.stderr, ok.exit_status) == ("ok", "5\n", "", 0)
    failed = run_snippet("def f():\n    return 1 / 0\nprint('before')\nf()", limits=WITH_HOOK)
    assert (failed.status, failed.stdout, failed.exit_status) == ("error", "before\n", 1)
    assert failed.stderr.startswith("Traceback") and 'File "<completion>", line 2, in f' in failed.stderr
    assert failed.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "sandbox_harness" not in failed.stderr  # the harness's own frames are left out
    assert (run_snippet("raise SystemExit(3)").status, run_snippet("raise SystemExit(3)").exit_status) == ("error", 3)
    syntax = run_snippet("def f(:\n    pass")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr
    refused = run_snippet("import os\nos.system('true')", limits=WITH_HOOK)
    assert refused.status == "error" and "os.system is not allowed" in refused.stderr


def test_a_program_that_prints_too_much_fails_without_waiting():
    started = time.perf_counter()
    result = run_tests("while True:\n    print('x' * 1000)", parse_tests([{"input": "", "output": "x"}]),
                       SandboxLimits(time_limit=5.0))
    assert result.score() == 0.0 and "printed more than it may" in result.detail
    assert time.perf_counter() - started < 3.0  # stopped at the cap, not at the 5 s limit


@pytest.mark.slow
def test_a_hang_keeps_the_tests_passed_before_it_and_the_snippet_times_out():
    code = "def f(x):\n    while x > 1:\n        pass\n    return x"
    result = contained(code, tests=parse_tests(["assert f(1) == 1", "assert f(2) == 2", "assert f(0) == 0"]))
    assert (result.status, result.verdicts, result.score()) == ("timeout", [True, False, False], 1 / 3)
    started = time.perf_counter()
    hang = run_snippet("print('started', flush=True)\nwhile True:\n    pass", limits=WITH_HOOK)
    assert (hang.status, hang.stdout, hang.exit_status) == ("timeout", "started\n", None)
    assert time.perf_counter() - started < LIMIT + STARTUP_ALLOWANCE + 0.5


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)",
                                  "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: pass"])
@pytest.mark.slow
def test_hang_is_killed_at_the_time_limit(code):
    result = contained(code)
    assert result.status == "timeout" and result.score() == 0.0


@pytest.mark.parametrize("code", ["x = bytearray(4 * 1024 ** 3)", "x = []\nwhile True:\n    x.append(' ' * 2 ** 20)"])
def test_memory_hog_fails_fast(code):
    if not sys.platform.startswith("linux"):
        pytest.skip("RLIMIT_AS is not enforced by every OS (macOS ignores it)")
    result = contained(code, OS_ONLY)  # RLIMIT_AS, no help from the hook
    assert result.status == "memory" and result.score() == 0.0


def test_fork_is_refused_by_the_hook():
    result = contained("import os\nos.fork()")
    assert result.score() == 0.0 and "os.fork is not allowed" in result.detail
    result = contained("import subprocess\nsubprocess.run(['true'])")
    assert result.score() == 0.0 and "not allowed" in result.detail


@pytest.mark.slow
def test_fork_bomb_is_contained_by_the_os():
    plan = isolation()
    if not plan.prefix and plan.drop_to is None and os.geteuid() == 0:
        pytest.skip("root without a PID namespace or a user to drop to: only the audit hook stops a fork bomb")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = contained(bomb, OS_ONLY)
    assert result.status == "timeout" and result.score() == 0.0


def test_writing_outside_its_directory(tmp_path):
    target = tmp_path / "escape.txt"
    code = f"open({str(target)!r}, 'w').write('x')"
    result = contained(code)
    assert result.score() == 0.0 and "outside the work directory" in result.detail
    assert not target.exists()
    assert contained("open('inside.txt', 'w').write('x')\nassert open('inside.txt').read() == 'x'").score() == 1.0
    assert contained("import os\nos.remove(os.path.expanduser('~/../../etc/hostname'))").score() == 0.0
    if isolation().drop_to is None:
        pytest.skip("without a user to drop to, only the audit hook keeps writes inside (see kit rewards sandbox)")
    result = contained(code, OS_ONLY)
    assert result.score() == 0.0 and "Permission denied" in result.detail
    assert not target.exists()


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    yield server
    server.close()


def reached(server: socket.socket) -> bool:
    try:
        connection, _ = server.accept()
    except TimeoutError:
        return False
    connection.close()
    return True


@pytest.mark.slow
def test_network_is_refused(listener):
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'hi')"
    assert contained(code).score() == 0.0
    assert not reached(listener)
    if not isolation().prefix:
        pytest.skip("no network namespace here: only the audit hook refuses sockets (see kit rewards sandbox)")
    result = contained(code, OS_ONLY)
    assert result.score() == 0.0 and "unreachable" in result.detail.lower()
    assert not reached(listener)


def test_network_when_allowed(listener):
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'hi')"
    result = contained(code, SandboxLimits(time_limit=LIMIT, network=True))
    assert result.score() == 1.0, result.detail
    assert reached(listener)


@pytest.mark.slow
def test_a_bad_batch_never_stops_training(caplog):
    reward = LoadedReward(fn=code_exec(time_limit=LIMIT, workers=4), name="code_exec")
    guarded = guard_reward(reward, RewardStats())
    completions = ["```python\ndef f(x): return x\n```", "while True: pass", "import os\nos._exit(3)",
                   "import ctypes\nctypes.string_at(0)", "import os\nwhile True: os.fork()", ""]
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rewards"):
        scores = guarded(["q"] * len(completions), completions, tests=[["assert f(1) == 1"]] * len(completions))
    assert time.perf_counter() - started < 2 * (LIMIT + STARTUP_ALLOWANCE) + 1
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert "sample 1 timeout" in caplog.text and "sample 2 crashed" in caplog.text


def test_sandbox_command_says_which_limits_hold():
    output = run_cli("rewards", "sandbox").output
    for name in ("time", "memory", "network", "processes", "files"):
        assert name in output


def test_the_cpu_limit_firing_before_the_wall_clock_is_a_timeout():
    """On a quiet machine RLIMIT_CPU (SIGXCPU) can end a busy loop before the wall-clock kill; the code lowers its own
    CPU limit (audit hook off, which would refuse setrlimit) so the CPU limit fires first here on any machine."""
    code = ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\n"
            "print('started', flush=True)\nwhile 1: pass")
    limits = SandboxLimits(time_limit=5.0, audit=False)
    snippet = run_snippet(code, limits=limits)
    assert (snippet.status, snippet.stdout, snippet.exit_status) == ("timeout", "started\n", None)
    result = run_tests(code, parse_tests([{"input": "", "output": "started"}]), limits)
    assert (result.status, result.verdicts) == ("timeout", [False])
