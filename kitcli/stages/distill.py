"""Distill stage: TRL's DistillationTrainer, on-policy distillation of a frozen teacher into the LoRA student.

    kit run tiny-distill            (sft, the teacher -> distill the base model from it, held-out exact match of both)

The method (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
arXiv 2306.13649). The student (the stage's LoRA policy) samples one completion per prompt and learns, at every
token it generated, the teacher's next-token distribution. With z_s, z_t the two models' logits at that position, T
the temperature (`train.temperature`, the same one the student samples with) and beta (`train.beta`):

    p_s = softmax(z_s / T),  p_t = softmax(z_t / T),  m = (1 - beta) p_s + beta p_t
    beta 0:        KL(p_t || p_s)                                 forward KL: cover every mode of the teacher
    beta 1:        KL(p_s || p_t)                                 reverse KL: mode seeking
    otherwise:     beta KL(p_t || m) + (1 - beta) KL(p_s || m)    beta 0.5: the Jensen-Shannon divergence
    loss = (sum of the divergence over the batch's completion tokens) / (completion tokens in the batch)

(no T^2 rescale; the gradient reaches the student only). A generation batch is per_device_train_batch_size x
gradient_accumulation_steps prompts, sampled once per optimizer step.

The teacher. `teacher: {stage: NAME}` is an earlier policy stage of the recipe (its adapter on the recipe's base
model, e.g. an SFT or GRPO stage); `teacher: {model: NAME_OR_PATH}` a model as `model.name` takes one (`tiny`, a
local directory or .gguf file, a hub name). It loads through the one loader (kitcli/models/backend.py) with the
recipe's `model:` settings (4-bit on a GPU), frozen (no gradient, eval mode), beside the student. Both must mean the
same thing by every token id: the tokenizers are compared (vocabulary and ids) before any model loads and again once
loaded. Refused in one line naming the stage and key, before any model loads: a teacher stage that is not an earlier
policy stage (or has not finished when the stage starts), a model that does not exist, tokenizers that differ,
`train.beta` outside [0, 1], the trainer's own teacher fields in `train:` (`teacher_model_name_or_path`, ...).

On a CPU. TRL computes the divergence with a Triton kernel (trl/kernels/chunked_divergence.py) that runs on CUDA and
XPU only, and neither Unsloth's CPU backend nor transformers reroutes it; off those devices the kit computes it with
`torch_divergence` below, the kernel's contract in plain torch (as kitcli/models/backend.py does for TRL's fused
log-probs). Unsloth generates its own DistillationTrainer (on a GPU, or forced with KIT_TRAINERS=unsloth) with TRL's
loss unchanged: only a padding-mask wrapper around the backbone call and its precision handling are its own.

Every field that decides the objective or the sampling is set by the kit (`--dry-run` prints them; `train:` wins):
beta 1.0 (TRL's default), temperature 1.0, top_p 1.0, top_k 0, max_completion_length 256, learning_rate 5e-6.
TRL's metrics go to metrics.jsonl: loss (the divergence), entropy (the student's, nats per token),
completions/mean_length, completions/clipped_ratio, num_tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from kitcli.data.rows import to_dataset
from kitcli.errors import KitError, did_you_mean
from kitcli.models.backend import cuda_available, load_stage_policy, save_model
from kitcli.recipe.config_fields import AT_LEAST_ONE, FRACTION, NOT_NEGATIVE, POSITIVE, TRAINING_RANGES, Range
from kitcli.recipe.schema import RESERVED_TRAIN, Section, TrainingSection, base_dir_of, fail, resolve_model_name
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages.grpo import load_rows
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import trainers
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trl_config import build_config, config_dict, config_summary

DIVERGENCES = {0.0: "forward KL(teacher || student)", 0.5: "Jensen-Shannon divergence",
               1.0: "reverse KL(student || teacher)"}
THE_TEACHER = "the teacher is the stage's teacher: key"


class TeacherSpec(Section):
    """The frozen model the student learns from: an earlier stage's policy, or a model."""

    stage: str | None = Field(None, description="An earlier stage of the recipe whose policy (its adapter on the "
                                                "recipe's base model) teaches.")
    model: str | None = Field(None, description="A model name or path, as model.name takes one: `tiny`, a local "
                                                "directory or .gguf file, a hub name.")

    @model_validator(mode="before")
    @classmethod
    def mapping(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            raise fail(f"expected {{stage: NAME}} (an earlier stage) or {{model: NAME_OR_PATH}}, got {raw!r}")
        return raw

    @model_validator(mode="after")
    def one_source(self, info: ValidationInfo) -> TeacherSpec:
        if (self.stage is None) == (self.model is None):
            raise fail("give one of stage (an earlier stage of this recipe) or model (a model name or path), not "
                       "both or neither")
        if self.model is not None:
            try:
                self.model = resolve_model_name(self.model, base_dir_of(info))
            except PydanticCustomError as error:  # its message, at this key (not the recipe's model:)
                raise fail(error.message()) from None
        return self


class DistillSection(TrainingSection):
    """On-policy distillation: TRL's DistillationTrainer, the student samples and learns the teacher's next-token
    distribution."""

    type: Literal["distill"]
    teacher: TeacherSpec = Field(description="The frozen teacher: {stage: NAME} or {model: NAME_OR_PATH}.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")
    train_ranges: ClassVar[dict[str, Range]] = {
        **TRAINING_RANGES, "max_completion_length": AT_LEAST_ONE, "temperature": POSITIVE, "top_p": Range(0, True, 1),
        "top_k": NOT_NEGATIVE, "beta": FRACTION}
    train_reasons: ClassVar[dict[str, str]] = {
        "beta": "it picks the divergence: 0 forward KL, 0.5 Jensen-Shannon, 1 reverse KL"}
    reserved: ClassVar[dict[str, str]] = {
        **RESERVED_TRAIN, "teacher_model_name_or_path": THE_TEACHER, "teacher_model_revision": THE_TEACHER,
        "teacher_model_init_kwargs": f"{THE_TEACHER}, loaded with the recipe's model: settings",
        "model_init_kwargs": "the student is loaded by the kit from model:",
        "max_tool_calling_iterations": "the kit gives this stage no tools"}


# --- the teacher --------------------------------------------------------------------------------------------------

def teacher_stage_type(ctx: StageContext) -> str:
    """The type of the earlier stage `teacher.stage` names; refused unless it is an earlier stage that trains a
    policy."""
    name = ctx.section.teacher.stage
    names = [s.name for s in ctx.recipe.stages]
    earlier = {s.name: s.spec for s in ctx.recipe.stages[:names.index(ctx.name)]}
    if name not in earlier:
        raise KitError(f"{ctx.where}: teacher.stage '{name}' is not an earlier stage{did_you_mean(name, earlier)}; "
                       f"name a stage that runs before this one and trains a policy "
                       f"({', '.join(earlier) or 'there is none'})")
    source = earlier[name]
    if source.output != "policy":
        policies = [n for n, spec in earlier.items() if spec.output == "policy"]
        raise KitError(f"{ctx.where}: teacher.stage '{name}' is a stage of type {source.type}, whose output is "
                       f"{'no model' if source.output == 'none' else 'a ' + source.output}; the teacher is a policy: "
                       f"name an earlier policy stage ({', '.join(policies) or 'there is none'})")
    return source.type


def teacher_name(ctx: StageContext) -> str:
    """The model the teacher is (or is an adapter on): for `kit plan`, messages and DONE."""
    spec = ctx.section.teacher
    return spec.model if spec.model is not None else ctx.model.name


def describe_teacher(ctx: StageContext) -> str:
    spec = ctx.section.teacher
    if spec.stage is not None:
        return f"stage '{spec.stage}' ({teacher_stage_type(ctx)}: its adapter on {ctx.model.name}), frozen"
    return f"model {spec.model}, frozen"


def tokenizer_difference(student, teacher) -> str | None:
    """How two tokenizers disagree on what a token id means (None when they agree): the divergence compares the two
    distributions id by id, so both vocabularies must map every token to the same id."""
    a, b = student.get_vocab(), teacher.get_vocab()
    for token, index in sorted(a.items(), key=lambda item: item[1]):
        if b.get(token) != index:
            theirs = "has no such token" if token not in b else f"gives it id {b[token]}"
            return f"the student's token {token!r} is id {index} and the teacher {theirs}"
    extra = sorted(set(b) - set(a), key=b.get)
    if extra:
        return f"the teacher has {len(extra)} tokens the student has not (e.g. {extra[0]!r}, id {b[extra[0]]})"
    return None


def check_tokenizers(ctx: StageContext, student, teacher) -> None:
    difference = tokenizer_difference(student, teacher)
    if difference is not None:
        raise KitError(f"{ctx.where}: teacher: its tokenizer differs from the student's ({difference}); the "
                       f"divergence compares next-token distributions id by id, so the teacher must share the "
                       f"student's vocabulary: name a teacher built on {ctx.model.name}'s tokenizer")


def preflight_tokenizers(ctx: StageContext) -> str:
    """The two tokenizers compared before any model loads, where both are on disk; what was checked, in words."""
    from kitcli.training.tool_use import preflight_tokenizer

    if ctx.section.teacher.model is None or ctx.section.teacher.model == ctx.model.name:
        return "the student's own (the same base model)"
    student, teacher = preflight_tokenizer(ctx.model.name), preflight_tokenizer(ctx.section.teacher.model)
    if student is None or teacher is None:
        return "not on disk yet: compared when the teacher loads"
    check_tokenizers(ctx, student, teacher)
    return "the same vocabulary as the student's"


def teacher_dir(ctx: StageContext) -> Path | None:
    """The teacher stage's output, which must have finished before this stage starts (None for a model teacher)."""
    name = ctx.section.teacher.stage
    if name is None:
        return None
    teacher_stage_type(ctx)
    if name not in ctx.outputs or ctx.output(name).done() is None:
        raise KitError(f"{ctx.where}: teacher.stage '{name}' has not finished in {ctx.run_dir}; run it too: "
                       f"--only {name},{ctx.name} (or --until {ctx.name})")
    return ctx.outputs[name]


def load_teacher(ctx: StageContext, student):
    """The teacher, frozen, loaded as the student is (the recipe's model: settings) and checked against it."""
    source = teacher_dir(ctx)
    model = ctx.model if ctx.section.teacher.model is None else \
        ctx.model.model_copy(update={"name": ctx.section.teacher.model})
    loaded = load_stage_policy(model, lora=None, seed=ctx.seed, init_from=source, trainable=False, log=ctx.log,
                               label=f"{ctx.name} teacher")
    loaded.model.eval()
    check_tokenizers(ctx, student.tokenizer, loaded.tokenizer)
    sizes = [m.model.config.get_text_config().vocab_size for m in (student, loaded)]
    if sizes[0] != sizes[1]:
        raise KitError(f"{ctx.where}: teacher: its vocabulary has {sizes[1]} rows against the student's {sizes[0]}; "
                       f"the divergence needs the same vocabulary")
    return loaded


# --- the divergence off the GPU -------------------------------------------------------------------------------------

def torch_divergence(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                     beta: float, temperature: float = 1.0, student_logit_scale: float = 1.0,
                     student_final_logit_softcapping: float | None = None, teacher_logit_scale: float = 1.0,
                     teacher_final_logit_softcapping: float | None = None):
    """TRL's `ChunkedDivergenceFunction` (per-token divergence [N], the student's entropy [N]) in plain torch.

    As the kernel does: each model's hidden states and head are rounded to the dtype its forward ran in (the
    autocast dtype under mixed precision) and projected in float32; scale, softcap, then 1 / temperature; the
    gradient reaches the student only. It materialises the [tokens, vocabulary] logits: fine at CPU sizes."""
    import torch

    device = student_hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    def rounded(value):  # the value in the forward's dtype, its gradient in float32 (no straight-through rounding)
        if value is None or dtype is None:
            return None if value is None else value.float()
        return value.float() + (value.to(dtype).float() - value.float()).detach()

    def logits(hidden, weight, bias, scale, softcap):
        z = torch.nn.functional.linear(rounded(hidden), rounded(weight), rounded(bias)) * scale
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        return torch.log_softmax(z / temperature, dim=-1)

    with torch.autocast(device, enabled=False):
        log_s = logits(student_hidden, student_weight, student_bias, student_logit_scale,
                       student_final_logit_softcapping)
        with torch.no_grad():
            log_t = logits(teacher_hidden, teacher_weight, teacher_bias, teacher_logit_scale,
                           teacher_final_logit_softcapping)
        p_s, p_t = log_s.exp(), log_t.exp()
        if beta == 0.0:
            divergence = (p_t * (log_t - log_s)).sum(-1)
        elif beta == 1.0:
            divergence = (p_s * (log_s - log_t)).sum(-1)
        else:
            log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta), log_t + math.log(beta)]), dim=0)
            divergence = beta * (p_t * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)
        entropy = -(p_s * log_s).sum(-1).detach()
    return divergence, entropy


def route_divergence_off_gpu() -> None:
    """Keep TRL's divergence kernel on CUDA / XPU and send every other device to `torch_divergence`. TRL's loss
    imports the kernel class from its module at each call (TRL's trainer and Unsloth's generated one alike), so
    replacing the module's attribute reroutes both. Idempotent."""
    from trl.kernels import chunked_divergence

    kernel = chunked_divergence.ChunkedDivergenceFunction
    if getattr(kernel, "_kit_dispatch", False):
        return

    class DeviceDispatch:
        _kit_dispatch = True
        kernel_class = kernel

        @staticmethod
        def apply(student_hidden, *args):
            if student_hidden.device.type in ("cuda", "xpu"):
                return kernel.apply(student_hidden, *args)
            return torch_divergence(student_hidden, *args)

    chunked_divergence.ChunkedDivergenceFunction = DeviceDispatch


# --- the stage ------------------------------------------------------------------------------------------------------

def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    """Every setting that decides the objective or the sampling, explicit (TRL's and Unsloth's defaults differ)."""
    on_gpu = cuda_available() if on_gpu is None else on_gpu
    return {
        "learning_rate": 5e-6,
        "beta": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "max_completion_length": 256,
        "generation_kwargs": None,
        "chat_template_kwargs": None,
        "pad_to_multiple_of": None,
        "disable_dropout": True,
        "use_vllm": False,  # the kit loads models without Unsloth's fast_inference (vLLM) engine
        "remove_unused_columns": False,
        "shuffle_dataset": True,
        "log_completions": False,
        "gradient_checkpointing": on_gpu,
        "logging_steps": 1,
    }


def make_config(ctx: StageContext):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx))


def build_stage_config(ctx: StageContext):
    return build_config(trainers.config_class(ctx.spec), stage_defaults=stage_defaults(ctx),
                        train=ctx.section.train, where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                        on_gpu=cuda_available())


def divergence_name(beta: float) -> str:
    return DIVERGENCES.get(float(beta), f"generalised Jensen-Shannon divergence, beta {beta:g}")


def describe(ctx: StageContext) -> dict[str, Any]:
    """What --dry-run prints: the teacher and its tokenizer checked, the prompts, the config; no model loads."""
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    teacher = describe_teacher(ctx)
    tokenizer = preflight_tokenizers(ctx)
    config = make_config(ctx)
    rows: Any = len(load_rows(ctx)) if Path(ctx.section.data.path).is_file() else "hub dataset, read when it runs"
    return {"init": ctx.section.init or "base model", "teacher": teacher, "teacher tokenizer": tokenizer,
            "divergence": f"{divergence_name(config.beta)} at temperature {config.temperature:g}",
            "data": ctx.section.data.path, "rows": rows,
            **config_summary(config, stage_defaults(ctx), ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def build_trainer(ctx: StageContext, config=None):
    """The DistillationTrainer this stage trains with, the loaded student and the loaded teacher."""
    config = config or make_config(ctx)
    rows = load_rows(ctx)
    teacher_dir(ctx)  # a teacher stage that has not finished is refused before anything loads
    student = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir,
                                log=ctx.log)
    teacher = load_teacher(ctx, student)
    if not cuda_available():
        route_divergence_off_gpu()
    trainer, _ = trainers.build_trainer(ctx.spec, student, args=config, teacher_model=teacher.model,
                                        train_dataset=to_dataset(rows), processing_class=student.tokenizer,
                                        log=ctx.log, label=ctx.name, where=ctx.where)
    return trainer, student, teacher


def run(ctx: StageContext) -> dict[str, Any]:
    config = make_config(ctx)
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    trainer, student, teacher = build_trainer(ctx, config)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    held_out = attach_held_out(trainer, plan_held_out(ctx), metrics_path, ctx.log)
    train(trainer, resume, ctx.where)
    save_model(student.model, student.tokenizer, ctx.stage_dir)
    rows = [row for row in read_metrics(metrics_path) if "loss" in row and "entropy" in row]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    summary = {**trainers.trainer_summary(trainer), "steps": trainer.state.global_step,
               "resumed_from": resume.name if resume else None, "backend": student.backend,
               "teacher": describe_teacher(ctx), "teacher_loaded": teacher.summary("teacher"),
               "divergence": divergence_name(trainer.beta), "beta": trainer.beta, "temperature": trainer.temperature,
               "first_loss": first.get("loss"), "last_loss": last.get("loss"),
               "first_length": first.get("completions/mean_length"),
               "last_length": last.get("completions/mean_length")}
    if rows:
        summary["headline"] = f"divergence {first['loss']:.4f} -> {last['loss']:.4f} ({divergence_name(trainer.beta)})"
    return held_out.summarize(summary)


SPEC = StageSpec(
    type="distill", order=75, module=__name__, section=DistillSection,
    summary="TRL DistillationTrainer: the student samples and learns a frozen teacher's next-token distribution "
            "(generalised JSD: forward KL, JSD, reverse KL)",
    output="policy", init_from=("policy",), trainer="trl.trainer.distillation_trainer:DistillationTrainer",
    config="trl.trainer.distillation_config:DistillationConfig", rows=Rows(shape="prompts", read=load_rows), rl=True,
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length"),
                  reference="never", frozen_model=teacher_name),
    refused_keys={"tools": "the kit gives TRL's DistillationTrainer no tools yet"},
    display=Display(
        metrics=(("loss", "divergence"), ("entropy", "entropy"), ("completions/mean_length", "length"),
                 ("completions/clipped_ratio", "clipped"), ("learning_rate", "lr")),
        panels=(("divergence to the teacher", "divergence per token", ("loss",)),
                ("student entropy", "nats per token", ("entropy",)),
                ("completion length", "tokens", ("completions/mean_length", "completions/min_length",
                                                 "completions/max_length")),
                ("truncated completions (hit max_completion_length)", "fraction", ("completions/clipped_ratio",)))),
    launcher=Launcher(refusal="distillation has not been run under a launcher yet; run it as one process"),
    defaults=stage_defaults)
