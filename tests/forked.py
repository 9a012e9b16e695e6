"""`kit ARGS` as a real process that a test can kill or signal, forked from the test process where that is safe.

A fresh interpreter spends about 7 s importing unsloth, torch, transformers and TRL before `kit run` does anything;
the test process has them imported already, so a child forked from it starts training at once. The child is a real
process of its own (its own session and process group, default signal handlers, its output in files): a SIGKILL
leaves on disk exactly what a killed `kit run` leaves, and SIGINT / SIGTERM reach the kit's own handlers. What it
does not re-do is the import, which is not what these tests check (tests/test_first_screen.py starts fresh
interpreters for that).

Forking is safe only while torch runs on one thread (as under `make test`'s xdist workers, conftest.py): a child
forked from a process with an OpenMP thread team hangs at its first parallel region. Elsewhere (one pytest process
on several threads) the same child routine runs in a fresh interpreter instead (`python tests/forked.py SPEC`)."""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path


def fork_is_safe() -> bool:
    if "torch" not in sys.modules:
        return False  # nothing heavy imported: no time to save
    import torch

    return torch.get_num_threads() == 1 and not torch.cuda.is_initialized()


def run_child(args: list[str], before: list[str] | None) -> int:
    """What the child does: the `before` hook (["module:function", *string args], e.g. to make it die at a chosen
    point), then `kit ARGS`. Returns the exit status."""
    if before:
        module, function = before[0].split(":")
        getattr(importlib.import_module(module), function)(*before[1:])
    from kitcli.commands.cli import main

    sys.argv = ["kit", *args]  # what the run lock records as the holder's command
    try:
        main(args, prog_name="kit", standalone_mode=True)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    return 0


class KitProcess:
    """A `kit` command running in a child process; poll / wait / send_signal / returncode as subprocess.Popen has
    them (a negative returncode is the signal that ended it). `before`: see run_child."""

    def __init__(self, args: list, out: Path, err: Path | None = None, before: list[str] | None = None):
        self.args = [str(a) for a in args]
        self.out, self.err = Path(out), Path(err) if err else Path(out)
        self.returncode: int | None = None
        self.popen: subprocess.Popen | None = None
        out_fd = os.open(self.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err_fd = os.open(self.err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if err else out_fd
        try:
            if fork_is_safe():
                sys.stdout.flush()
                sys.stderr.flush()
                self.pid = os.fork()
                if self.pid == 0:
                    self._forked_child(out_fd, err_fd, before)  # never returns
            else:
                spec = json.dumps({"args": self.args, "before": before})
                self.popen = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.DEVNULL,
                                              stdout=out_fd, stderr=err_fd, start_new_session=True)
                self.pid = self.popen.pid
        finally:
            os.close(out_fd)
            if err_fd != out_fd:
                os.close(err_fd)

    def _forked_child(self, out_fd: int, err_fd: int, before: list[str] | None) -> None:
        code = 1
        try:
            os.setsid()  # its own process group, as subprocess.Popen(start_new_session=True) gives
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115  (the child's own streams, open until it exits)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            faulthandler.disable()  # pytest's points at the test process's captured stderr
            signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter starts with
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = run_child(self.args, before)
        except BaseException:  # noqa: BLE001  (whatever it was, the parent reads it in the log)
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)  # no atexit handlers, no teardown of the test process's state

    def poll(self) -> int | None:
        if self.popen is not None:
            self.returncode = self.popen.poll()
        elif self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 600) -> int:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                self.kill_group()
                raise TimeoutError(f"kit {' '.join(self.args)} still running after {timeout} s:\n{self.output()}")
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL the child's process group (it and anything it started), as a killed `kit run` dies."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while self.poll() is None:
            time.sleep(0.02)

    def output(self) -> str:
        text = self.out.read_text(errors="replace")
        return text if self.err == self.out else text + self.err.read_text(errors="replace")


if __name__ == "__main__":  # the fresh-interpreter form: python tests/forked.py '{"args": [...], "before": [...]}'
    spec = json.loads(sys.argv[1])
    sys.exit(run_child(spec["args"], spec["before"]))
