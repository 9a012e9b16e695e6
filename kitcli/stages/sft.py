"""SFT stage: TRL's SFTTrainer on prompt/completion, messages or plain text data.

    kit run tiny-sft
    kit sft --model tiny --data examples/data/arithmetic_sft.jsonl --set stages.sft.train.max_steps=20
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kitcli.data.rows import apply_system_prompt, read_rows, require_columns, to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, load_stage_policy, save_model
from kitcli.recipe.schema import TrainingSection
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trainers import build_trainer, trainer_summary
from kitcli.training.trl_config import build_config, config_dict, config_summary

COLUMN_OPTIONS = [["prompt", "completion"], ["messages"], ["text"]]


class SFTSection(TrainingSection):
    """Supervised fine-tuning: TRL's SFTTrainer on prompt/completion, messages or text data."""

    type: Literal["sft"]
    system_prompt: str | None = Field(None, description="A system message put before every prompt (chat data).")


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    return {
        "max_length": ctx.model.max_seq_length,
        "packing": False,
        "completion_only_loss": True,
        "assistant_only_loss": False,
        "dataset_text_field": "text",
        "loss_type": "nll",
        # TRL's SFTConfig turns it on by default; it saves GPU memory but on a CPU only recomputes every forward
        "gradient_checkpointing": cuda_available() if on_gpu is None else on_gpu,
    }


def make_config(ctx: StageContext):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx))


def build_stage_config(ctx: StageContext):
    from kitcli.training.trainers import config_class

    return build_config(config_class(ctx.spec), stage_defaults=stage_defaults(ctx), train=ctx.section.train,
                        where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                        on_gpu=cuda_available())


def load_rows(ctx: StageContext) -> list[dict[str, Any]]:
    spec = ctx.section.data
    rows = read_rows(spec, ctx.where)
    columns = require_columns(rows, COLUMN_OPTIONS, ctx.where, spec.path)
    kept = [*columns, "tools"]  # tools: the function schemas of TRL's tool-calling format, rendered by the template
    return apply_system_prompt([{c: row[c] for c in kept if c in row} for row in rows], ctx.section.system_prompt,
                               ctx.where, spec.path)


def check_assistant_only_loss(ctx: StageContext, rows: list[dict[str, Any]]) -> None:
    """train.assistant_only_loss trains only the tokens the chat template marks with {% generation %} (TRL swaps in
    its training variant of a template it knows). TRL finds conversational rows missing, or a template it cannot
    mark, only once the model has loaded; the kit refuses both before anything loads (the template when the
    tokenizer is on disk: the tiny model, a local directory, a converted GGUF)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    from trl.data_utils import is_conversational

    from kitcli.models.chat_template import with_template_text
    from kitcli.training.tool_use import preflight_tokenizer

    if not is_conversational(rows[0]):
        raise KitError(f"{ctx.where}: train.assistant_only_loss needs conversational rows (messages, or prompt and "
                       f"completion as lists of turns) and '{ctx.section.data.path}' has plain text; set data: "
                       f"{{chat: true}} or assistant_only_loss: false")
    tokenizer = with_template_text(preflight_tokenizer(ctx.model.name), ctx.model.chat_template)
    template = getattr(tokenizer, "chat_template", None)
    if template is None or has_generation_markers(template):
        return  # no template: the rows' own check says so; marked: TRL uses it as it is
    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise KitError(f"{ctx.where}: train.assistant_only_loss: the chat template of '{ctx.model.name}' marks no "
                       f"assistant tokens with {{% generation %}} and TRL has no training variant of it; wrap the "
                       f"assistant's turns in {{% generation %}}...{{% endgeneration %}} in its chat_template.jinja "
                       f"(docs/tools.md) or set assistant_only_loss: false") from None


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    rows = load_rows(ctx)
    config = make_config(ctx)
    if config.assistant_only_loss:
        check_assistant_only_loss(ctx, rows)
    return {"init": ctx.section.init or "base model", "data": ctx.section.data.path, "rows": len(rows),
            **config_summary(config, stage_defaults(ctx), ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def run(ctx: StageContext) -> dict[str, Any]:
    rows = load_rows(ctx)
    config = make_config(ctx)
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    loaded = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir, log=ctx.log)
    trainer, _ = build_trainer(ctx.spec, loaded, args=config, train_dataset=to_dataset(rows),
                               processing_class=loaded.tokenizer, log=ctx.log, label=ctx.name, where=ctx.where)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    held_out = attach_held_out(trainer, plan_held_out(ctx), metrics_path, ctx.log)
    train(trainer, resume, ctx.where)
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)
    losses = [row["loss"] for row in read_metrics(metrics_path) if "loss" in row]
    summary = {**trainer_summary(trainer), "steps": trainer.state.global_step,
               "resumed_from": resume.name if resume else None,
               "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
               "backend": loaded.backend}
    if losses:
        summary["headline"] = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return held_out.summarize(summary)


SPEC = StageSpec(
    type="sft", order=10, module=__name__, section=SFTSection,
    summary="TRL SFTTrainer on prompt/completion, messages or text",
    output="policy", init_from=("policy",), trainer="trl.trainer.sft_trainer:SFTTrainer",
    config="trl.trainer.sft_config:SFTConfig", rows=Rows(shape="text"),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length")),
    display=Display(metrics=(("loss", "loss"), ("mean_token_accuracy", "token_acc"), ("learning_rate", "lr")),
                    panels=(("loss", "loss", ("loss", "eval_loss")),
                            ("token accuracy", "accuracy", ("mean_token_accuracy", "eval_mean_token_accuracy")))),
    launcher=Launcher("data parallel (TRL SFTTrainer)"),
    defaults=stage_defaults)
