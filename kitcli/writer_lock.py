"""One writer per run directory: `kit run` holds an OS lock (flock) on RUN_DIR/.writer.lock (kitcli/rundir.py's
layout), which the OS releases when the process ends, however it ends; the commands that only read a run ask who
holds it."""

from __future__ import annotations

import errno
import json
import os
import time
from typing import TYPE_CHECKING, Any

from kitcli.errors import KitError

if TYPE_CHECKING:
    from pathlib import Path

    from kitcli.rundir import RunDir

NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)  # what flock says where a filesystem has none
READ_ONLY = (errno.EACCES, errno.EPERM, errno.EROFS)


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "another kit run (it is writing its details)"
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}: "
            f"`{holder.get('command', '?')}`")


def in_use(run: RunDir, holder: dict[str, Any]) -> KitError:
    return KitError(f"{run.path} is in use by another kit run ({describe_holder(holder)}); wait for it to finish or "
                    f"stop it, or choose another --output")


def read_holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_holder(run: RunDir) -> dict[str, Any] | None:
    """The details of the `kit run` that holds the run directory ({} while it writes them), None when none does (or
    the filesystem has no locks). Takes nothing: a shared lock, tried and dropped at once."""
    import fcntl

    try:
        fd = os.open(run.writer_lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(fd)
        os.close(fd)
        return None if holder.get("pid") == os.getpid() else holder  # this process's own run (its report)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)  # closing drops the shared lock
    return None


class WriterLock:
    """The exclusive lock of one `kit run` on its run directory: an flock on RUN_DIR/.writer.lock, which holds the
    holder's pid, host, start time and command for the message the next one gets. The OS drops it when the process
    ends (a kill -9 leaves no stale lock). `take(create=False)` takes it only if the file is there (a run directory
    that a run already wrote: refused at once while another run holds it); `take(create=True)` creates the
    directory and the file, just before the first write."""

    def __init__(self, run: RunDir, *, no_lock: bool = False, log=None):
        self.run, self.no_lock, self.log = run, no_lock, log
        self.fd: int | None = None
        self.lockless = False  # the filesystem has no locks
        self.unlocked = False  # ... and --no-lock says to go on without one

    @property
    def path(self) -> Path:
        return self.run.writer_lock

    def take(self, *, create: bool) -> None:
        import fcntl

        if self.fd is not None or self.unlocked:
            return
        if self.run.path.is_dir() and not os.access(self.run.path, os.W_OK):
            raise self.read_only("not writable")
        created = create and not self.run.path.exists()
        if create:
            try:
                self.run.path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise KitError(f"cannot create the run directory {self.run.path} ({error.strerror or error}); "
                               f"choose another --output") from None
        for _ in range(3):  # the file may be replaced between open and flock: then lock the new one
            try:
                fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            except FileNotFoundError:
                if create:
                    continue
                return
            except OSError as error:
                if error.errno in READ_ONLY:
                    raise self.read_only(error.strerror) from None
                raise
            try:
                self.flock(fd, fcntl)
            except BaseException:
                os.close(fd)
                if created and self.lockless:  # refused on a filesystem without locks: leave nothing behind
                    self.path.unlink(missing_ok=True)
                    self.run.path.rmdir()
                raise
            if self.unlocked:
                os.close(fd)
                return
            if self.same_file(fd):
                self.fd = fd
                self.write_holder()
                return
            os.close(fd)
        raise KitError(f"{self.path} keeps being replaced while kit tries to lock it; make sure no other program "
                       f"writes to {self.run.path}")

    def flock(self, fd: int, fcntl) -> None:
        for attempt in range(10):  # a reader's probe holds a shared lock for a moment: try again shortly
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if attempt == 9:
                    raise in_use(self.run, read_holder(fd)) from None
                time.sleep(0.05)
            except OSError as error:
                if error.errno not in NO_LOCKS:
                    raise
                self.lockless = True
                if not self.no_lock:
                    raise KitError(f"{self.run.path} is on a filesystem without file locks (flock: {error.strerror})"
                                   f", so kit cannot make sure that only one `kit run` writes there; add --no-lock to "
                                   f"go on without the lock, and make sure yourself that no other run uses it") \
                        from None
                self.unlocked = True
                if self.log is not None:
                    self.log(f"kit: --no-lock: {self.run.path} has no file locks (flock: {error.strerror}); going on "
                             f"without the lock: make sure no other kit run writes there")
                return

    def same_file(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    def write_holder(self) -> None:
        import shlex
        import socket
        import sys
        from datetime import datetime

        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now().astimezone().isoformat(timespec="seconds"),
                  "command": shlex.join(["kit", *sys.argv[1:]])}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(holder) + "\n").encode(), 0)

    def read_only(self, why: str | None) -> KitError:
        return KitError(f"the run directory {self.run.path} is read-only ({why}); `kit run` writes its checkpoints, "
                        f"adapters and metrics there: make it writable, or choose another --output (kit report, "
                        f"eval, chat and export read it as it is)")

    def check(self, next_step: str) -> None:
        """Still ours? The lock file deleted (or replaced) by hand lets a second `kit run` take a new lock on the
        same directory, so this run stops at the next stage boundary rather than write beside it."""
        if self.fd is None or self.same_file(self.fd):
            return
        other = lock_holder(self.run)
        now = f" ({describe_holder(other)} holds a new one)" if other is not None else ""
        raise KitError(f"{self.path} was deleted while this run held it{now}, so another `kit run` may write to "
                       f"{self.run.path} too; this run stops before {next_step} (the finished stages are kept): "
                       f"make sure no other kit run uses {self.run.path}, then run the same command again to go on")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the OS drops the lock; the file stays (deleting it would race the next taker)
            self.fd = None
