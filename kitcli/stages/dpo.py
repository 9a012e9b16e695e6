"""DPO stage: TRL's DPOTrainer on preference pairs, against a frozen reference that is the stage's starting policy.

    kit run tiny-dpo            (eval -> sft -> eval -> dpo -> eval on the embedded tiny model)

Loss (`loss_type: sigmoid`, `beta` 0.1 unless `train: {beta: ...}`), per pair, with sequence log-probabilities
summed over the completion tokens:
    -log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))

The reference. With `init: sft` the reference must be the SFT model, not the raw base. The policy is loaded as the
base plus one LoRA adapter ("default") holding exactly the weights the init stage saved. TRL 1.15's DPOTrainer,
given a PeftModel and no `ref_model`, copies that adapter into a second, frozen adapter named "ref" and computes
the reference log-probs with "ref" active (`use_adapter(model, "ref")`; it disables the adapters, i.e. uses the
base, only when no "ref" adapter exists). So the reference is the starting policy at no extra memory beyond one
adapter. TRL 1.15 has no `model_adapter_name` / `ref_adapter_name` options; `build_trainer` checks after the
trainer is built that "ref" exists, is frozen and equals the starting adapter (and adds it the same way if a
patched trainer skipped it), so a wrong reference cannot pass silently. Without `init`, the fresh adapter is zero
(LoRA B = 0), so "ref" is the base model, as it should be. With full fine-tuning (`lora: false`), TRL loads a
separate frozen copy of the starting model as `ref_model`. The "ref" adapter is removed before saving, so
`adapter/` holds only the trained policy.

Data: `chosen` / `rejected` with an optional `prompt` (standard or conversational; without `prompt`, TRL extracts
the shared prefix of chosen and rejected). An eval split (`eval_data`, or `eval_fraction`, default 0.1, of the
rows) logs eval rewards/accuracies and margins. TRL's metrics go to metrics.jsonl: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/*, logits/*.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli.data.rows import apply_system_prompt, to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, is_peft_model, load_stage_policy, save_model
from kitcli.recipe.config_fields import Range, TypeSpec, union
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages.pairs import PreferenceSection, describe_data, final_evaluation, has_eval, train_eval_rows
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import trainers
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trl_config import build_config, config_dict, config_summary

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft")


class DPOSection(PreferenceSection):
    """Direct preference optimization: TRL's DPOTrainer against a frozen copy of the starting policy."""

    type: Literal["dpo"]
    system_prompt: str | None = Field(None, description="A system message put before every prompt (chat data).")
    train_ranges: ClassVar[dict[str, Range]] = {**PreferenceSection.train_ranges,
                                                "label_smoothing": Range(0, False, 0.5, False)}
    # DPOConfig's loss_type is a str or a list of them (weighted mixtures); TRL declares no choices for either
    train_choices: ClassVar[dict[str, Any]] = {
        "loss_type": union(TypeSpec("choice", DPO_LOSSES), TypeSpec("list", (TypeSpec("choice", DPO_LOSSES),))),
        "f_divergence_type": ("reverse_kl", "js_divergence", "alpha_divergence")}
TRACKED = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def several_passes(train: dict[str, Any]) -> bool:
    """Whether training goes over the data more than once (epochs > 1, no max_steps). Then the reference's
    log-probs are computed once before training instead of at every step: each later pass skips a reference
    forward (bench/defaults.py measures it); with a single pass the precompute costs as much as it saves."""
    return train.get("max_steps", -1) in (-1, None) and float(train.get("num_train_epochs", 1)) > 1


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    evaluating = has_eval(ctx)
    return {
        "learning_rate": 5e-6,
        "beta": 0.1,
        "loss_type": ["sigmoid"],
        "loss_weights": None,
        "label_smoothing": 0.0,
        "f_divergence_type": "reverse_kl",
        "ld_alpha": None,
        "use_weighting": False,
        "max_length": ctx.model.max_seq_length,
        "truncation_mode": "keep_start",
        "padding_free": False,
        "precompute_ref_log_probs": several_passes(ctx.section.train),
        "precompute_ref_batch_size": None,
        "sync_ref_model": False,
        "disable_dropout": True,
        "gradient_checkpointing": cuda_available() if on_gpu is None else on_gpu,
        "pad_to_multiple_of": None,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": 25,
        "per_device_eval_batch_size": 16,
    }


def make_config(ctx: StageContext):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx))


def build_stage_config(ctx: StageContext):
    config = build_config(trainers.config_class(ctx.spec), stage_defaults=stage_defaults(ctx),
                          train=ctx.section.train,
                          where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                          on_gpu=cuda_available())
    if config.sync_ref_model and ctx.lora is not None:
        raise KitError(f"{ctx.where}: train.sync_ref_model does not work with LoRA (the reference is a frozen "
                       f"adapter, not a model to sync); remove it, or use lora: false")
    return config


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    config = make_config(ctx)
    return {"init": ctx.section.init or "base model",
            "reference": f"frozen copy of the starting policy ({ctx.section.init or 'base model'})",
            **describe_data(ctx),
            **config_summary(config, stage_defaults(ctx), ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def build_trainer(ctx: StageContext, config=None):
    """The DPOTrainer this stage trains with, its loaded policy, and how the reference was made."""
    system, path = ctx.section.system_prompt, ctx.section.data.path
    train_rows, eval_rows = (apply_system_prompt(rows, system, ctx.where, path) for rows in train_eval_rows(ctx))
    config = config or make_config(ctx)
    loaded = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    trainer, reference = trainers.build_trainer(
        ctx.spec, loaded, args=config, reference=True, ref_model=None, train_dataset=to_dataset(train_rows),
        eval_dataset=to_dataset(eval_rows) if eval_rows else None, processing_class=loaded.tokenizer,
        log=ctx.log, label=ctx.name, where=ctx.where)
    return trainer, loaded, reference


def run(ctx: StageContext) -> dict[str, Any]:
    config = make_config(ctx)
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    trainer, loaded, reference = build_trainer(ctx, config)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    held_out = attach_held_out(trainer, plan_held_out(ctx), metrics_path, ctx.log)
    train(trainer, resume, ctx.where)
    evaluated = final_evaluation(trainer, metrics_path) if trainer.eval_dataset is not None else {}
    if is_peft_model(loaded.model) and trainers.REFERENCE_ADAPTER in loaded.model.peft_config:
        loaded.model.delete_adapter(trainers.REFERENCE_ADAPTER)  # adapter/ holds the trained policy only
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)

    rows = [row for row in read_metrics(metrics_path) if "loss" in row and "rewards/margins" in row]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    summary: dict[str, Any] = {
        **trainers.trainer_summary(trainer),
        "steps": trainer.state.global_step, "resumed_from": resume.name if resume else None,
        "reference": reference, "beta": trainer.args.beta, "backend": loaded.backend,
        "first_loss": first.get("loss"), "last_loss": last.get("loss"),
        "first": {k: first[k] for k in TRACKED if k in first}, "last": {k: last[k] for k in TRACKED if k in last},
        "eval": {k.removeprefix("eval_"): v for k, v in evaluated.items()
                 if k in ("eval_loss", *(f"eval_{t}" for t in TRACKED))},
    }
    if summary["eval"]:
        e = summary["eval"]
        summary["headline"] = (f"eval reward accuracy {e['rewards/accuracies']:.2f}, margin "
                               f"{e['rewards/margins']:.2f}; loss {first.get('loss', 0):.3f} -> "
                               f"{last.get('loss', 0):.3f}")
    elif rows:
        summary["headline"] = (f"reward accuracy {first['rewards/accuracies']:.2f} -> "
                               f"{last['rewards/accuracies']:.2f}, "
                               f"margin {first['rewards/margins']:.2f} -> {last['rewards/margins']:.2f}")
    return held_out.summarize(summary)


SPEC = StageSpec(
    type="dpo", order=30, module=__name__, section=DPOSection,
    summary="TRL DPOTrainer, sigmoid loss, against a frozen copy of the starting policy",
    output="policy", init_from=("policy",), trainer="trl.trainer.dpo_trainer:DPOTrainer",
    config="trl.trainer.dpo_config:DPOConfig", rows=Rows(shape="pairs"),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
                  reference="always"),
    display=Display(
        metrics=(("loss", "loss"), ("rewards/margins", "margin"), ("rewards/accuracies", "accuracy"),
                 ("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("learning_rate", "lr")),
        panels=(("loss", "loss", ("loss", "eval_loss")),
                ("reward margin", "margin", ("rewards/margins", "eval_rewards/margins")),
                ("reward accuracy", "accuracy", ("rewards/accuracies", "eval_rewards/accuracies")),
                ("implicit rewards", "reward", ("rewards/chosen", "rewards/rejected")))),
    launcher=Launcher("data parallel (TRL DPOTrainer)"),
    defaults=stage_defaults)
