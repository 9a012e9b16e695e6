"""Clean stops: the first Ctrl-C (SIGINT) or SIGTERM asks the running stage to save a checkpoint and stop after
the current step; a second Ctrl-C aborts at once. Also checks free disk before each checkpoint is written."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

from kitcli.errors import KitError

_requested: list[str] = []
DISK_MARGIN_BYTES = 50 * 1024 * 1024


def requested() -> str | None:
    """The signal name if a stop was asked for, else None."""
    return _requested[0] if _requested else None


def reset() -> None:
    _requested.clear()


def _handle(signum, frame) -> None:
    name = signal.Signals(signum).name
    if _requested and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _requested.append(name)
    print(f"\nkit: {name} received; saving a checkpoint after this step and stopping "
          f"(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)


def install_handlers() -> None:
    reset()
    signal.signal(signal.SIGINT, _handle)
    signal.signal(signal.SIGTERM, _handle)


def restore_handlers() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def checkpoint_bytes(model) -> int:
    """What a checkpoint of `model` needs on disk: trainable weights plus two AdamW moments, in fp32."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable * 4 * 3


def check_free_disk(directory: Path, needed: int, what: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed + DISK_MARGIN_BYTES:
        raise KitError(f"not enough free disk to save {what} in {directory}: needs about "
                       f"{(needed + DISK_MARGIN_BYTES) / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free; free some space "
                       f"or lower save_total_limit")


def make_stop_callback(checkpoint_dir: Path, every: int = 1):
    """A TrainerCallback: on a stop request, save a checkpoint and end training; check disk before every save.
    `every`: stop only at a step that is a multiple of it (GRPO's generation cycle, so the checkpoint resumes
    exactly: completions generated for later steps are not saved)."""
    from transformers import TrainerCallback

    class StopAndDiskCallback(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if requested() and state.global_step % every == 0:
                control.should_save = True
                control.should_training_stop = True
            if control.should_save and model is not None:
                check_free_disk(checkpoint_dir, checkpoint_bytes(model), f"checkpoint-{state.global_step}")
            return control

    return StopAndDiskCallback()


class StageInterrupted(Exception):
    """Raised by the runner after a stage returned because a stop was requested."""
