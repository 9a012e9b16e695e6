"""Reference-free preference stages (ORPO, SimPO), shared: the recipe section that refuses what only a reference
would use, the pair checks, and building and running the trainer. Each stage type keeps its own module (orpo.py,
simpo.py: its formula, defaults and StageSpec); this one has no SPEC.

Both train the policy alone on chosen / rejected pairs: no frozen reference adapter, no reference model, no
reference log-probs to precompute. A recipe that names one (a `ref_adapter`, a reference model, a `train:` field of
DPO's reference) is refused in one line before anything loads, and so is a pair whose chosen or rejected is empty.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

from kitcli.data.rows import apply_system_prompt, to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, load_stage_policy, save_model
from kitcli.recipe.schema import fail
from kitcli.recipe.stage_context import StageContext
from kitcli.stages.pairs import (
    PAIR_COLUMNS,
    PreferenceSection,
    describe_data,
    final_evaluation,
    has_eval,
    on_disk,
    preference_rows,
    train_eval_rows,
)
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import trainers
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trl_config import build_config, config_dict, config_summary

NO_REFERENCE = "it is reference-free: its loss reads the policy alone, with no reference model or adapter"
# Keys that only a stage with a reference reads: stage keys, and `train:` fields of DPO / KTO's configs.
REFERENCE_KEYS = ("ref_adapter", "ref_model", "reference", "reference_model")
REFERENCE_TRAIN_KEYS = ("precompute_ref_log_probs", "precompute_ref_batch_size", "ref_model_init_kwargs",
                        "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "ref_adapter_name",
                        "model_adapter_name")
REFUSED = {**{k: NO_REFERENCE for k in REFERENCE_KEYS}, **{f"train.{k}": NO_REFERENCE for k in REFERENCE_TRAIN_KEYS}}
TRACKED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


class ReferenceFreeSection(PreferenceSection):
    """A preference stage trained without a reference (ORPO, SimPO)."""

    method: ClassVar[str] = "this method"  # its name in messages

    @model_validator(mode="before")
    @classmethod
    def no_reference(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
        for key in [k for k in REFERENCE_KEYS if k in raw] + [f"train.{k}" for k in REFERENCE_TRAIN_KEYS
                                                                if k in train]:
            raise fail(f"{key} does not apply to {cls.method}: {NO_REFERENCE}; remove it (DPO and KTO train against a "
                       f"reference)")
        return raw


def check_not_empty(rows: list[dict[str, Any]], ctx: StageContext, key: str = "data") -> None:
    """A chosen or rejected whose text is empty (a message list included) would train on nothing but its template."""
    def text(value) -> str:
        if isinstance(value, list):
            return "".join(str(m.get("content") or "") + str(m.get("tool_calls") or "") for m in value
                           if isinstance(m, dict))
        return str(value)

    for number, row in enumerate(rows, start=1):
        for column in PAIR_COLUMNS:
            if not text(row.get(column, "")).strip():
                raise KitError(f"{ctx.where}: row {number} of '{getattr(ctx.section, key).path}': '{column}' is empty; "
                               f"every pair needs a non-empty chosen and rejected (drop the row or fill it)")


def checked_rows(ctx: StageContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and eval pairs (pairs.train_eval_rows), none with an empty side (rows numbered as in their
    file), the system prompt applied."""
    for key in ("data", "eval_data"):
        if getattr(ctx.section, key) is not None:
            check_not_empty(preference_rows(ctx, key), ctx, key)
    train_rows, eval_rows = train_eval_rows(ctx)
    system, path = ctx.section.system_prompt, ctx.section.data.path
    return tuple(apply_system_prompt(rows, system, ctx.where, path) for rows in (train_rows, eval_rows))


def common_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    """The settings ORPO and SimPO share (each stage adds its objective's)."""
    evaluating = has_eval(ctx)
    return {
        "learning_rate": 5e-6,
        "max_length": ctx.model.max_seq_length,
        "max_completion_length": None,
        "disable_dropout": True,
        "generate_during_eval": False,
        "gradient_checkpointing": cuda_available() if on_gpu is None else on_gpu,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": 25,
        "per_device_eval_batch_size": 16,
    }


def make_config(ctx: StageContext, defaults: dict[str, Any]):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx, defaults))


def build_stage_config(ctx: StageContext, defaults: dict[str, Any]):
    """The stage's trainer config: its type's config class from the kit's, the stage's and `train:` settings."""
    return build_config(trainers.config_class(ctx.spec), stage_defaults=defaults, train=ctx.section.train,
                        where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed, on_gpu=cuda_available())


def describe(ctx: StageContext, defaults: dict[str, Any]) -> dict[str, Any]:
    """What --dry-run prints: the pairs checked row by row (a local file), the config, the held-out evaluation."""
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    config = make_config(ctx, defaults)
    if on_disk(ctx.section.data):
        checked_rows(ctx)
    return {"init": ctx.section.init or "base model", "reference": "none (reference-free)", **describe_data(ctx),
            **config_summary(config, defaults, ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def build_trainer(stage_type: str, ctx: StageContext, config):
    """The stage's trainer around its loaded policy (no reference: none is made or checked)."""
    train_rows, eval_rows = checked_rows(ctx)
    loaded = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    trainer, _ = trainers.build_trainer(
        ctx.spec, loaded, args=config, train_dataset=to_dataset(train_rows),
        eval_dataset=to_dataset(eval_rows) if eval_rows else None, processing_class=loaded.tokenizer,
        log=ctx.log, label=ctx.name, where=ctx.where)
    if getattr(trainer, "ref_model", None) is not None:
        raise KitError(f"{ctx.where}: the {stage_type} trainer loaded a reference model; this TRL/Unsloth version "
                       f"builds it differently than kit expects")
    return trainer, loaded


def run(stage_type: str, ctx: StageContext, config, tracked: tuple[str, ...], objective: dict[str, Any]):
    """Train, evaluate on the held-out pairs, save the adapter; the DONE summary (`objective`: the stage's own
    settings, e.g. beta and simpo_gamma)."""
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    trainer, loaded = build_trainer(stage_type, ctx, config)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    held_out = attach_held_out(trainer, plan_held_out(ctx), metrics_path, ctx.log)  # `eval:` as it trains
    train(trainer, resume, ctx.where)
    evaluated = final_evaluation(trainer, metrics_path) if trainer.eval_dataset is not None else {}
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)

    rows = [row for row in read_metrics(metrics_path) if "loss" in row and "rewards/margins" in row]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    summary: dict[str, Any] = {
        **trainers.trainer_summary(trainer),
        "steps": trainer.state.global_step, "resumed_from": resume.name if resume else None,
        "reference": "none (reference-free)", **objective, "backend": loaded.backend,
        "first_loss": first.get("loss"), "last_loss": last.get("loss"),
        "first": {k: first[k] for k in tracked if k in first}, "last": {k: last[k] for k in tracked if k in last},
        "eval": {k.removeprefix("eval_"): v for k, v in evaluated.items()
                 if k in ("eval_loss", *(f"eval_{t}" for t in tracked))},
    }
    if summary["eval"].get("rewards/accuracies") is not None:
        e = summary["eval"]
        summary["headline"] = (f"eval reward accuracy {e['rewards/accuracies']:.2f}, margin "
                               f"{e['rewards/margins']:.3f}; loss {first.get('loss', 0):.3f} -> "
                               f"{last.get('loss', 0):.3f}")
    elif rows:
        summary["headline"] = (f"reward accuracy {first['rewards/accuracies']:.2f} -> "
                               f"{last['rewards/accuracies']:.2f}, margin {first['rewards/margins']:.3f} -> "
                               f"{last['rewards/margins']:.3f}")
    return held_out.summarize(summary)
