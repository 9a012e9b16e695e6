"""Reward model stage: Bradley–Terry training of a scalar reward head with TRL's RewardTrainer on preference pairs.

    kit run my-rlhf.yaml        (a stage `{type: reward, data: prefs.jsonl, init: sft}`)

The model is the base LM loaded as a sequence-classification model with one output (`score`, a linear head on
the last non-padding token's hidden state), with LoRA on the decoder and the score head trained in full
(`modules_to_save`). The loss is the Bradley–Terry preference loss -log sigmoid(r_chosen - r_rejected), with no
centering term unless `train.center_rewards_coefficient` is set.

Data: `chosen` / `rejected` with an optional `prompt` (standard text or conversational messages; without `prompt`,
chosen and rejected are whole conversations, TRL's implicit-prompt format). An eval split scores accuracy
(share of pairs with r_chosen > r_rejected) and margin (mean r_chosen - r_rejected): `eval_data:` if given, else
`eval_fraction` (default 0.1) of the rows held out at random with the recipe's seed; `eval_fraction: 0` turns it off.

`init: <policy stage>` starts from that stage's LoRA weights (a causal LM and its sequence-classification twin share
the decoder under the same parameter names, so the adapter fits); the score head is new. Outputs:
    <stage_dir>/adapter/   the PEFT adapter (LoRA + score head) and tokenizer
    <stage_dir>/merged/    the adapter merged into a plain AutoModelForSequenceClassification + tokenizer, which
                           later stages (GRPO, PPO) load as their reward model
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from kitcli.data.rows import to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, resolve_model_path, save_model
from kitcli.models.reward_models import load_reward_model, save_merged_reward_model
from kitcli.recipe.config_fields import NOT_NEGATIVE, Range
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages.pairs import PreferenceSection, describe_data, final_evaluation, has_eval, train_eval_rows
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trainers import trainer_summary
from kitcli.training.trl_config import build_config, config_dict, config_summary


class RewardSection(PreferenceSection):
    """A reward model: Bradley-Terry training of a scalar head with TRL's RewardTrainer."""

    type: Literal["reward"]
    train_ranges: ClassVar[dict[str, Range]] = {**PreferenceSection.train_ranges,
                                                "center_rewards_coefficient": NOT_NEGATIVE}


# --- the stage ------------------------------------------------------------------------------------------------------

def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    evaluating = has_eval(ctx)
    return {
        "learning_rate": 1e-4,
        "max_length": ctx.model.max_seq_length,  # pairs longer than this are dropped (logged)
        "center_rewards_coefficient": None,  # pure Bradley-Terry loss; 0.01 adds the mean-zero term
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
    from kitcli.training.trainers import config_class

    return build_config(config_class(ctx.spec), stage_defaults=stage_defaults(ctx), train=ctx.section.train,
                        where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                        on_gpu=cuda_available())


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))  # unsloth before trl, as the run's policy stages need
    config = make_config(ctx)
    return {"init": ctx.section.init or "base model", **describe_data(ctx),
            **config_summary(config, stage_defaults(ctx), ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def reward_base(ctx: StageContext) -> str:
    """The unquantized model the adapter is merged into: the base, or a fully fine-tuned init stage's model."""
    if ctx.init_dir is not None and (ctx.init_dir / "model").is_dir():
        return str(ctx.init_dir / "model")
    return resolve_model_path(ctx.model.name, ctx.seed)


def build_trainer(ctx: StageContext, config=None):
    """The RewardTrainer this stage trains with (and the loaded model), before any step is taken."""
    from kitcli.training.trainers import build_trainer as build

    train_rows, eval_rows = train_eval_rows(ctx)
    config = config or make_config(ctx)
    loaded = load_reward_model(
        ctx.model.name, max_seq_length=ctx.model.max_seq_length, load_in_4bit=ctx.model.load_in_4bit,
        lora=ctx.lora.model_dump() if ctx.lora is not None else None, backend=ctx.model.backend,
        dtype=ctx.model.dtype, seed=ctx.seed, init_from=ctx.init_dir, trust_remote_code=ctx.model.trust_remote_code,
        chat_template=ctx.model.chat_template, log=ctx.log,
    )
    trainer, _ = build(ctx.spec, loaded, args=config, train_dataset=to_dataset(train_rows),
                       eval_dataset=to_dataset(eval_rows) if eval_rows else None, processing_class=loaded.tokenizer,
                       log=ctx.log, label=ctx.name, where=ctx.where)
    dropped = len(train_rows) - len(trainer.train_dataset)
    if dropped:
        ctx.log(f"{ctx.name}: {dropped} of {len(train_rows)} training pairs are longer than max_length "
                f"{config.max_length} tokens and were left out")
    if len(trainer.train_dataset) == 0:
        raise KitError(f"{ctx.where}: every training pair is longer than max_length {config.max_length} tokens; "
                       f"raise model.max_seq_length or train.max_length")
    return trainer, loaded


def eval_figures(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: metrics[f"eval_{k}"] for k in ("loss", "accuracy", "margin") if f"eval_{k}" in metrics}


def run(ctx: StageContext) -> dict[str, Any]:
    config = make_config(ctx)
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    trainer, loaded = build_trainer(ctx, config)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    before = None
    if resume is None and trainer.eval_dataset is not None:
        before = eval_figures(trainer.evaluate())
    elif resume is not None:  # the evaluation before training was logged at step 0 of the interrupted run
        before = next((eval_figures(r) for r in read_metrics(metrics_path) if r.get("step") == 0 and "eval_loss" in r),
                      None)
    train(trainer, resume, ctx.where)
    after = eval_figures(final_evaluation(trainer, metrics_path)) if trainer.eval_dataset is not None else None
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)
    save_merged_reward_model(ctx.stage_dir, base=reward_base(ctx), dtype=ctx.model.dtype,
                             trust_remote_code=ctx.model.trust_remote_code, log=ctx.log)
    losses = [row["loss"] for row in read_metrics(metrics_path) if "loss" in row]
    summary: dict[str, Any] = {
        **trainer_summary(trainer),
        "steps": trainer.state.global_step, "resumed_from": resume.name if resume else None,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "eval_before": before, "eval_after": after, "backend": loaded.backend,
        "merged": str(ctx.dir.merged),
    }
    if after:
        start = f" (before {before['accuracy']:.2f})" if before else ""
        summary["headline"] = f"eval accuracy {after['accuracy']:.2f}{start}, margin {after['margin']:.2f}"
    elif losses:
        summary["headline"] = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return summary


SPEC = StageSpec(
    type="reward", order=20, module=__name__, section=RewardSection,
    summary="TRL RewardTrainer: Bradley-Terry loss on chosen/rejected pairs; saves adapter/ and merged/",
    output="scorer", init_from=("policy", "scorer"), trainer="trl.trainer.reward_trainer:RewardTrainer",
    config="trl.trainer.reward_config:RewardConfig", rows=Rows(shape="pairs"),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length")),
    display=Display(
        metrics=(("loss", "loss"), ("accuracy", "accuracy"), ("margin", "margin"), ("learning_rate", "lr")),
        panels=(("loss", "loss", ("loss", "eval_loss")),
                ("pair accuracy (r_chosen > r_rejected)", "accuracy", ("accuracy", "eval_accuracy")),
                ("margin (r_chosen - r_rejected)", "margin", ("margin", "eval_margin")))),
    launcher=Launcher("data parallel (TRL RewardTrainer); the merged model is written by the main process"),
    defaults=stage_defaults)
