"""A stage whose process ended after its final checkpoint and before DONE (a crash in the summary, `kill -9`, a full
disk while saving the adapter): its checkpoint is at max_steps, and transformers' Trainer, resumed there, starts
another step before it checks max_steps whenever the last step falls inside a pass over the data (ending one step
and one checkpoint past max_steps). kitcli/training/checkpoints.py `train()` restores the weights and calls
`end_finished_training` instead, which does only the stage's end work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def finished_steps(checkpoint: Path) -> tuple[int, int] | None:
    """(step, max_steps) when the checkpoint was written at the stage's last step (its trainer_state.json's
    global_step has reached max_steps), else None: the stage had finished training and only its end work is left.
    A checkpoint whose trainer_state.json records no max_steps (a PPO checkpoint of an older kit) is not finished."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    step, last = state.get("global_step"), state.get("max_steps")
    if not isinstance(step, int) or not isinstance(last, int) or last <= 0 or step < last:
        return None
    return step, last


def logged_train_loss(log_history: list[dict[str, Any]]) -> float | None:
    """transformers' end-of-training train_loss (the mean loss over the steps) from the logged losses, each the
    mean over the steps since the log before it: the same number when the last step was logged."""
    total, last = 0.0, 0
    for entry in log_history:
        if "loss" in entry and isinstance(entry.get("step"), int) and entry["step"] > last:
            total += entry["loss"] * (entry["step"] - last)
            last = entry["step"]
    return total / last if last else None


def end_finished_training(trainer, checkpoint: Path) -> None:
    """The end of trainer.train() for a stage whose checkpoint is its last step, without training: the weights are
    the checkpoint's (the adapters restored by the caller, a full model loaded here), `trainer.state` is the
    checkpoint's (global_step, epoch, log_history, total_flos: the stage's summary reads what an uninterrupted run's
    reads), and the callbacks see what an uninterrupted run's end shows them: on_train_begin (the weights check,
    the dashboard from step max_steps), the end-of-training log row (metrics.jsonl, the dashboard's "finished"
    line, trackers), on_train_end. That row differs from an uninterrupted run's in what this process did:
    train_runtime is its own seconds (nothing trained), the speeds (train_samples_per_second,
    train_steps_per_second) are left out, and train_loss is logged_train_loss of the checkpoint's log history (an
    uninterrupted run's value when its last step was logged, as with a logging_steps that divides max_steps).
    The optimizer and scheduler are not loaded: nothing steps them."""
    import time

    from transformers import TrainerState

    started = time.time()
    trainer._load_from_checkpoint(str(checkpoint))  # full fine-tuning; the no-op set by train() with adapters
    state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    # the saved flags are the saving process's; under `kit run --launcher` every process reads this file
    state.is_local_process_zero = trainer.is_local_process_zero()
    state.is_world_process_zero = trainer.is_world_process_zero()
    trainer.state = state
    trainer.model.train()  # where an uninterrupted run leaves it
    trainer.control = trainer.callback_handler.on_train_begin(trainer.args, state, trainer.control)
    row: dict[str, Any] = {"train_runtime": round(time.time() - started, 4), "total_flos": state.total_flos}
    loss = logged_train_loss(state.log_history)
    if loss is not None:
        row["train_loss"] = loss
    trainer.log(row)
    trainer.control = trainer.callback_handler.on_train_end(trainer.args, state, trainer.control)
