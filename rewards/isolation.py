"""Which isolation layers the code sandbox (rewards/sandbox.py) gets on this machine: probed once per process,
printed by `kit rewards sandbox`. `unshare` for network and PID namespaces where Linux allows it (root, or
unprivileged user namespaces), and, when the kit runs as root, a drop to `nobody` with an interpreter that
`nobody` can read.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNSHARE_FLAGS = ["--net", "--pid", "--fork", "--kill-child"]


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
