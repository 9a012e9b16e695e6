"""One writer per run directory: `kit run` holds an OS lock on RUN_DIR/.writer.lock from before its first write to
its end; a second `kit run` on the directory is refused at once (exit 2, one line naming the holder) and changes
nothing; the commands that only read a run still work and say that it is still going. Bad input: the lock file
deleted by hand, a filesystem without locks (--no-lock), a read-only run directory."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from forked import KitProcess
from helpers import DATA, fails, run_cli, write_recipe

from kitcli.commands.cli import main
from kitcli.errors import KitError
from kitcli.rundir import RunDir, WriterLock, lock_holder

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
       "train": {"max_steps": 6, "learning_rate": 2e-3, "per_device_train_batch_size": 8, "logging_steps": 2,
                 "save_steps": 100}}
# Holds a run directory's lock from another process, as a running `kit run` does, until its stdin closes.
HOLDER = ("import sys; from pathlib import Path; from kitcli.rundir import RunDir, WriterLock; "
          "lock = WriterLock(RunDir(Path(sys.argv[1]))); "
          "lock.take(create=True); print('held', flush=True); sys.stdin.read()")


def kit(*args) -> list[str]:
    return [sys.executable, "-m", "kitcli", *map(str, args)]


def hold(run_dir: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=ENV)
    assert process.stdout.readline().strip() == "held"
    return process


def wait_for_holder(process: KitProcess, run_dir: Path, log: Path, seconds: float = 120) -> dict:
    deadline = time.time() + seconds
    while time.time() < deadline:
        holder = lock_holder(RunDir(run_dir))
        if holder:
            return holder
        assert process.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"no lock on {run_dir} after {seconds} s:\n{log.read_text()}")


def hold_stages(gate: str) -> None:
    """In the first `kit run` (tests/forked.py): start no stage until the file `gate` exists, so the second run
    meets a run that holds the directory (a forked run takes the lock and trains its 6 steps in about a second)."""
    from kitcli.run import runner

    run_stage, deadline = runner.run_stage, time.time() + 120

    def gated(ctx):
        while not os.path.exists(gate) and time.time() < deadline:
            time.sleep(0.02)
        return run_stage(ctx)

    runner.run_stage = gated


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Two real `kit run` processes on one directory (the second started while the first holds it, held at its first
    stage until then), and a lone run of the same recipe in another directory."""
    tmp = tmp_path_factory.mktemp("raced")
    recipe = write_recipe(tmp / "r.yaml", [SFT], name="raced")
    shared, lone, log = tmp / "shared", tmp / "lone", tmp / "first.log"
    gate = tmp / "go"
    first = KitProcess(["run", recipe, "--output", shared, "--quiet"], log, before=["test_run_lock:hold_stages", gate])
    holder = wait_for_holder(first, shared, log)
    started = time.time()
    second = subprocess.run(kit("run", recipe, "--output", shared, "--quiet"), capture_output=True, text=True,
                            env=ENV)  # a fresh interpreter: the refusal comes before any library loads
    refused_in = time.time() - started
    first_alive = first.poll() is None  # the refusal must have met a running first run, or it proves nothing
    gate.touch()
    assert first.wait(timeout=300) == 0, log.read_text()
    run_cli("run", recipe, "--output", lone, "--quiet")  # in this process: the same code, the same bytes
    return {"shared": shared, "lone": lone, "holder": holder, "second": second, "refused_in": refused_in,
            "first_alive": first_alive, "first_pid": first.pid, "tmp": tmp}


@pytest.mark.slow
def test_second_run_is_refused_and_the_first_ends_as_a_lone_run_would(raced):
    second = raced["second"]
    assert raced["first_alive"], "the first run ended before the second was refused; see hold_stages"
    assert second.returncode == 2, second.stdout + second.stderr
    output = second.stdout + second.stderr
    assert "Traceback" not in output
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    holder = raced["holder"]
    assert holder["pid"] == raced["first_pid"]
    for part in (f"is in use by another kit run (pid {raced['first_pid']} on {holder['host']}",
                 f"started {holder['started']}", f"`kit run {raced['tmp'] / 'r.yaml'} --output {raced['shared']}"):
        assert part in lines[0], lines[0]
    assert raced["refused_in"] < 30  # at once: before any library or model loads
    ran, alone = raced["shared"] / "sft" / "adapter", raced["lone"] / "sft" / "adapter"
    assert (ran / "adapter_model.safetensors").read_bytes() == (alone / "adapter_model.safetensors").read_bytes()
    assert (raced["shared"] / "sft" / "metrics.jsonl").read_text().count("\n") == \
        (raced["lone"] / "sft" / "metrics.jsonl").read_text().count("\n")


@pytest.mark.slow
def test_reading_commands_work_while_a_run_holds_the_directory_and_say_so(raced):
    run_dir = raced["shared"]
    holder = hold(run_dir)
    try:
        note = f"the run is still going (pid {holder.pid} on "
        report = run_cli("report", run_dir)
        assert note in report.output and "report:" in report.output
        export = run_cli("export", run_dir, "--to", "lora", "--output", raced["tmp"] / "exported")
        assert note in export.output and (raced["tmp"] / "exported" / "adapter_model.safetensors").is_file()
        evaluated = run_cli("eval", run_dir, "--data", DATA / "arithmetic_eval.jsonl", "--limit", "2")
        assert note in evaluated.output and "exact match" in evaluated.output
        chat = CliRunner().invoke(main, ["chat", str(run_dir)], input="What is 2 plus 3?\n")
        assert chat.exit_code == 0 and note in chat.output, chat.output
        refused = fails("run", raced["tmp"] / "r.yaml", "--output", run_dir)
        assert f"is in use by another kit run (pid {holder.pid} on " in refused
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert note not in run_cli("report", run_dir).output  # released: no note


def test_the_lock_is_exclusive_and_names_its_holder(tmp_path):
    first = WriterLock(RunDir(tmp_path / "run"))
    first.take(create=True)
    try:
        assert lock_holder(RunDir(tmp_path / "run")) is None  # this process's own lock is not another run
        with pytest.raises(KitError, match=rf"is in use by another kit run \(pid {os.getpid()} on .*started .*`kit"):
            WriterLock(RunDir(tmp_path / "run")).take(create=False)
    finally:
        first.release()
    again = WriterLock(RunDir(tmp_path / "run"))
    again.take(create=False)  # released: the next run takes it
    again.release()


def test_a_deleted_lock_file_stops_the_run_at_the_next_stage_boundary(tmp_path):
    run_dir = tmp_path / "run"
    plugin = tmp_path / "deleter.py"
    plugin.write_text(f"import os\n\ndef delete_lock(completions, **kwargs):\n"
                      f"    if os.path.exists({str(run_dir / '.writer.lock')!r}):\n"
                      f"        os.remove({str(run_dir / '.writer.lock')!r})\n"
                      f"    return [0.0] * len(completions)\n")
    evaluate = {"type": "eval", "data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 2},
                "generation": {"max_new_tokens": 4}}
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "first", **evaluate,
                                                 "rewards": [f"{plugin}:delete_lock"]},
                                                {"name": "second", **evaluate}])
    line = fails("run", recipe, "--output", run_dir)
    assert f"{run_dir / '.writer.lock'} was deleted while this run held it" in line
    assert "stops before stage 'second'" in line and "run the same command again" in line
    assert (run_dir / "first" / "DONE").is_file() and not (run_dir / "second").exists()


def test_a_filesystem_without_locks_needs_no_lock(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "ev", "type": "eval", "generation": {"max_new_tokens": 4},
                                                 "data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 2}}])
    line = fails("run", recipe, "--output", tmp_path / "run")
    assert "is on a filesystem without file locks (flock: No locks available)" in line and "--no-lock" in line
    assert not (tmp_path / "run").exists()  # refused before anything was written
    result = run_cli("run", recipe, "--output", tmp_path / "run", "--no-lock")
    assert "--no-lock: " in result.output and "going on without the lock" in result.output
    assert (tmp_path / "run" / "ev" / "DONE").is_file()


def read_only_kit_run(run_dir: Path, *args) -> subprocess.CompletedProcess:
    """`kit run ... --output RUN_DIR` with RUN_DIR read-only: a read-only bind mount where the tests run as root
    (which file modes do not stop), its modes otherwise."""
    if os.geteuid() != 0:
        run_dir.chmod(0o555)
        return subprocess.run(kit("run", *args, "--output", run_dir), capture_output=True, text=True, env=ENV)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to mount a read-only directory as root")
    script = 'mount -o bind,ro "$1" "$1" && shift && exec "$@"'
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(run_dir),
                             *kit("run", *args, "--output", run_dir)], capture_output=True, text=True, env=ENV)
    if "mount" in result.stderr and "Error:" not in result.stderr:
        pytest.skip(f"cannot mount read-only here: {result.stderr.strip()}")
    return result


def test_a_read_only_run_directory_is_refused_in_one_line(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [SFT])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = read_only_kit_run(run_dir, recipe)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert output.strip().splitlines() == [f"Error: the run directory {run_dir} is read-only (not writable); `kit run` "
                                           f"writes its checkpoints, adapters and metrics there: make it writable, "
                                           f"or choose another --output (kit report, eval, chat and export read it "
                                           f"as it is)"], output
    assert list(run_dir.iterdir()) == []


def test_a_launch_is_refused_before_its_processes_start(tmp_path):
    """Under --launcher the main process locks; the parent refuses a held directory before starting any."""
    recipe = write_recipe(tmp_path / "r.yaml", [SFT])
    holder = hold(tmp_path / "run")
    try:
        line = fails("run", recipe, "--output", tmp_path / "run", "--launcher", "accelerate", "--num-processes", "2",
                     "--cpu")
        assert f"is in use by another kit run (pid {holder.pid} on " in line
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".writer.lock"]
