"""TRL trainers' progress, shown by the kit's dashboard (kitcli/display/dashboard.py): `attach_progress(trainer, name,
metrics_path, console, spec=SPEC)` replaces transformers' own printer and tqdm callbacks, so a metrics dict is shown
once, in one format, and written to the stage's metrics.jsonl. Also the metrics files themselves: read, and cut back
to a checkpoint's step on resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console

from kitcli.display.conversation import call_counts, tool_turns
from kitcli.display.dashboard import SAMPLES_SHOWN, StageDashboard
from kitcli.display.formatting import message_text
from kitcli.records import read_jsonl
from kitcli.rundir import StageDir


def samples_from_trainer(trainer, count: int = SAMPLES_SHOWN) -> list[dict[str, Any]]:
    """The last `count` completions TRL's GRPOTrainer keeps for logging (`trainer._logs`), with their rewards, and
    for a completion that called tools its turns (kitcli/display/conversation.py) and its calls and failures."""
    logs = getattr(trainer, "_logs", None)
    if not isinstance(logs, dict) or not logs.get("completion"):
        return []
    prompts, completions = list(logs.get("prompt", [])), list(logs["completion"])
    rewards = {name: list(values) for name, values in dict(logs.get("rewards", {})).items()}
    weights = getattr(trainer, "reward_weights", None)
    names = list(rewards)
    samples = []
    for index in range(max(0, len(completions) - count), len(completions)):
        scores = {name: rewards[name][index] for name in names if index < len(rewards[name])}
        sample = {"prompt": message_text(prompts[index]) if index < len(prompts) else "",
                  "completion": scored_text(completions[index]), "rewards": scores}
        turns = tool_turns(completions[index])  # a completion with tool turns keeps them (stages with tools:)
        if turns is not None:
            sample["turns"] = turns
            sample["tool_calls"], sample["tool_failures"] = call_counts(turns)
        if weights is not None and len(scores) == len(weights):
            total = [float(w) * s for w, s in zip(weights.tolist(), scores.values()) if s is not None and
                     math.isfinite(s)]
            sample["reward"] = sum(total) if total else None
        samples.append(sample)
    return samples


def scored_text(completion: Any) -> str:
    """A completion's text as the rewards read it (newlines and spaces kept: format rewards score them): the string,
    or a conversation's last message's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        completion = completion[-1].get("content") or ""
    return completion if isinstance(completion, str) else message_text(completion)


def recorded_metric(trainer, key: str) -> float:
    """The last value a TRL trainer recorded in memory for `key` (its `_metrics`, before `log()` averages and clears
    them), from whichever bucket it went to. TRL and Unsloth pick "train" or "eval" by the model's training flag at
    the moment they record, and on a GPU Unsloth's generation (`for_training`) can leave the model in training mode
    inside an evaluation: the bucket the model's flag names now is read first, then the other."""
    buckets = ("train", "eval") if trainer.model.training else ("eval", "train")
    for bucket in buckets:
        values = trainer._metrics.get(bucket, {}).get(key)
        if values:
            return values[-1]
    raise KeyError(f"{type(trainer).__name__} recorded no {key!r} (buckets: "
                   f"{ {b: sorted(trainer._metrics.get(b, {})) for b in buckets} })")


# --- metrics files ------------------------------------------------------------------------------------------

def read_metrics(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def scored_values(values: list[Any]) -> list[float]:
    """The finite numbers among logged values: TRL logs a reward that scored no sample of a step (every score None)
    as NaN, which metrics.jsonl holds as null."""
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def quarter_mean(values: list[float | None], first: bool) -> float | None:
    """Mean of the first (or last) quarter of the logs that hold a score (one log of a few groups is noisy); None
    when no log does."""
    values = scored_values(values)
    if not values:
        return None
    n = max(1, len(values) // 4)
    chosen = values[:n] if first else values[-n:]
    return sum(chosen) / len(chosen)


def reward_summary(logged: list[dict[str, Any]]) -> dict[str, Any]:
    """What DONE says of an RL stage's rewards: the total's and each reward's mean over the first and the last
    quarter of the logs (None for a reward that scored no sample), a warning for each reward that never scored, and
    the headline."""
    rewards = [row["reward"] for row in logged if "reward" in row]
    summary: dict[str, Any] = {"reward_first": quarter_mean(rewards, first=True),
                               "reward_last": quarter_mean(rewards, first=False)}
    for key in sorted({k for row in logged for k in row if k.startswith("rewards/") and k.endswith("/mean")}):
        values = [row[key] for row in logged if key in row]
        summary[f"{key}_first"] = quarter_mean(values, first=True)
        summary[f"{key}_last"] = quarter_mean(values, first=False)
    warnings = unscored_rewards(logged)
    if warnings:
        summary["warnings"] = warnings
    if summary["reward_first"] is not None:
        summary["headline"] = (f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f} "
                               f"(mean of first/last quarter of {len(rewards)} logs)")
    return summary


def unscored_rewards(logged: list[dict[str, Any]]) -> list[str]:
    """A warning for each reward that scored no sample over the whole stage (its logged mean always null), with why:
    every call raised under on_error: skip (the last error), or it returned None."""
    warnings = []
    keys = [k for row in logged for k in row if k.startswith("rewards/") and k.endswith("/mean")]
    for key in dict.fromkeys(keys):
        if scored_values([row.get(key) for row in logged if key in row]):
            continue
        name = key[len("rewards/"):-len("/mean")]
        skipped = sum(row.get(f"reward_skipped/{name}", 0) for row in logged)
        errors = [row[f"reward_error/{name}"] for row in logged if f"reward_error/{name}" in row]
        why = (f"all {skipped} samples were skipped under on_error: skip (last error: {errors[-1]}); fix the "
               f"function" if errors else "it returned None (no score) for every sample; check that it reads the "
                                          "right columns")
        warnings.append(f"reward '{name}' scored no sample in the whole stage, so it gave no signal: {why} "
                        f"(`kit rewards test` scores a few samples)")
    return warnings


def truncate_metrics(path: Path, last_step: int, drop_end: bool = False) -> None:
    """On resume from checkpoint N, drop lines logged after step N (they will be logged again), in metrics.jsonl
    and the stage's alarms.jsonl / completions.jsonl; `drop_end` also drops the Trainer's end-of-training row
    (train_runtime), which a stage resumed at its final checkpoint logs again."""
    stage = StageDir(path.parent)
    for target in (path, stage.alarms, stage.completions):
        if target == path or target.exists():
            kept = [row for row in read_metrics(target) if row.get("step", 0) <= last_step
                    and not (drop_end and "train_runtime" in row)]
            target.write_text("".join(json.dumps(row) + "\n" for row in kept))


# --- TRL trainers -------------------------------------------------------------------------------------------

def make_progress_callback(stage_name: str, metrics_path: Path, console: Console, label: str = "", *,
                           trainer=None, spec=None, index: int | None = None, total: int | None = None,
                           mode: str | None = None, json_stream=None):
    """A transformers callback that drives a StageDashboard (`spec`: the stage type's StageSpec, whose metrics it
    shows). `trainer` (optional) is read for recent sample completions (GRPO keeps them in `trainer._logs`)."""
    from transformers import TrainerCallback

    dashboard = StageDashboard(stage_name, metrics_path, console, spec=spec, index=index, total=total, mode=mode,
                               json_stream=json_stream, label=label)

    class KitProgress(TrainerCallback):
        """Shows progress and appends every logged metrics dict (with step and time) to metrics.jsonl."""

        def __init__(self) -> None:
            self.dashboard = dashboard

        def on_train_begin(self, args, state, control, **kwargs):
            dashboard.begin(state.max_steps, state.global_step)

        def on_step_end(self, args, state, control, **kwargs):
            dashboard.advance(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:  # under `kit run --launcher`, the main process writes metrics
                return
            samples = samples_from_trainer(trainer) if trainer is not None else None
            dashboard.log(state.global_step, dict(logs or {}), epoch=state.epoch, samples=samples)

        def on_train_end(self, args, state, control, **kwargs):
            dashboard.end(state.global_step)

    return KitProgress()


def attach_progress(trainer, stage_name: str, metrics_path: Path, console: Console, **options) -> None:
    """Replace transformers' printer and tqdm callbacks with the kit's display (options: make_progress_callback's
    keyword arguments)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(make_progress_callback(stage_name, metrics_path, console, trainer=trainer, **options))


def make_reward_metrics_callback(stats):
    """A TRL callback that adds per-reward seconds and skipped samples (rewards.guard's RewardStats) to each logged
    metrics dict, before the progress callback writes it to metrics.jsonl."""
    from transformers import TrainerCallback

    class RewardMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None:
                logs.update(stats.pop_metrics())

    return RewardMetrics()
