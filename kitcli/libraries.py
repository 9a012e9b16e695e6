"""Third-party chatter off the screen and into the run directory's `libraries.log`.

Importing torch, bitsandbytes and Unsloth prints deprecation warnings, a "Failed to load CPU gemm_4bit_forward"
notice and Unsloth's banner before the kit has said anything; loading a model and building a trainer print more.
None of it tells a user what to do, so the kit runs those calls inside `library_output()`: Python-level stdout,
stderr, warnings and the torch loggers that print on import go to a buffer, which the runner writes to
`<run>/libraries.log` (`library_log`). The kit's own lines are printed outside these blocks. `KIT_SHOW_LIBRARY_OUTPUT=1`
shows everything as it comes. Output that a C extension writes to the file descriptors directly is not caught.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

SHOW_ENV = "KIT_SHOW_LIBRARY_OUTPUT"
# Loggers that print on import: torch's pytree deprecation notices, bitsandbytes' CPU kernel notice.
NOISY_LOGGERS = ("torch.utils._pytree", "bitsandbytes", "bitsandbytes.cextension", "unsloth", "unsloth_zoo")

_buffer = io.StringIO()
_target: Path | None = None


def showing() -> bool:
    return os.environ.get(SHOW_ENV, "").strip().lower() in ("1", "true", "yes")


def _sink():
    return open(_target, "a", encoding="utf-8") if _target is not None else contextlib.nullcontext(_buffer)


@contextlib.contextmanager
def library_output() -> Iterator[None]:
    """Run a block whose third-party output should not reach the screen (kept for `libraries.log`)."""
    if showing():
        yield
        return
    with _sink() as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        saved = []
        for name in NOISY_LOGGERS:
            logger = logging.getLogger(name)
            saved.append((logger, logger.handlers[:], logger.propagate))
            logger.handlers, logger.propagate = [handler], False
        shown = warnings.showwarning

        def to_sink(message, category, filename, lineno, file=None, line=None):
            sink.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = to_sink
        try:
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
        finally:
            warnings.showwarning = shown
            for logger, handlers, propagate in saved:
                logger.handlers, logger.propagate = handlers, propagate
            sink.flush()


def library_log(path: Path) -> None:
    """From now on library output goes to `path` (what was caught before the run directory existed first)."""
    global _target
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(_buffer.getvalue())
    _buffer.seek(0)
    _buffer.truncate()
    _target = path


def quiet_torch_loggers() -> None:
    """Torch configures its own log handlers when it is imported: keep the noisy ones quiet from then on too."""
    if showing() or "torch" not in sys.modules:
        return
    for name in NOISY_LOGGERS[:1]:
        logging.getLogger(name).setLevel(logging.ERROR)
