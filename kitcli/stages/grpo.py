"""GRPO stage: TRL's GRPOTrainer with a `variant:` preset, verifiable or learned rewards, and explicit settings.

    kit run tiny-grpo
    kit run recipes/qwen3-4b-grpo.yaml --dry-run

A stage names its rewards (`rewards:`, each a built-in name, `module:function` or `path/to/file.py:function`,
with an optional `weight`) and/or a reward model trained earlier in the recipe (`reward_model: <reward stage>`).
The `variant:` preset fixes every GRPOConfig field that decides the objective (table below); anything in
`train:` still wins, and the effective values are printed by `--dry-run` and written to `config.json`.

    variant   loss_type  scale_rewards  beta  epsilon  epsilon_high  mask_truncated  what it is
    grpo      grpo       group          0.04  0.2      0.2           false           DeepSeekMath: per-sequence mean,
                                                                                      group z-score, KL to the reference
    dr_grpo   dr_grpo    none           0.0   0.2      0.2           false           Dr. GRPO: no 1/|o| and no std
    dapo      dapo       group          0.0   0.2      0.28          true            DAPO: token-level mean,
                                                                                      clip-higher, truncated
                                                                                      completions masked
    bnpo      bnpo       group          0.0   0.2      0.2           false           token mean over the local batch
    cispo     cispo      group          0.0   0.2      5.0           false           CISPO: the token ratio itself is
                                                                                      clipped (at epsilon_high, no
                                                                                      lower bound) and detached as the
                                                                                      weight of A log pi; token mean
    sapo      sapo       group          0.0   0.2      0.2           false           SAPO: a soft gate
                                                                                      4/tau sigmoid(tau (r - 1)) instead
                                                                                      of the clip; per-sequence mean
    vespo     vespo      group          0.0   0.2      0.2           false           VESPO: the sequence ratio w
                                                                                      weights A log pi by a Gamma shape
                                                                                      phi(w) = e^lam w^k e^(-lam w);
                                                                                      token mean

Every preset also sets importance_sampling_level "token" (GSPO, and its LUSPO variant, are the gspo stage type,
`kitcli/stages/gspo.py`), and every stage sets the soft gates' knobs, whichever loss reads them: SAPO's
temperatures sapo_temperature_pos 1.0 / sapo_temperature_neg 1.05 (for positive / other advantages) and VESPO's
vespo_k_pos 2.0, vespo_lambda_pos 3.0, vespo_k_neg 3.0, vespo_lambda_neg 2.0 (the papers' values, as TRL has them).
epsilon is not read by cispo, sapo or vespo; epsilon_high is only CISPO's cap (5.0, ScaleRL's recommendation).
Dr. GRPO's other fix for the difficulty bias is to scale by the whole batch's standard deviation instead of
each group's: `train: {scale_rewards: batch}` on any variant.

Papers: GRPO, Shao et al. 2024, DeepSeekMath (arXiv 2402.03300); Dr. GRPO, Liu et al. 2025 (arXiv 2503.20783);
DAPO, Yu et al. 2025 (arXiv 2503.14476); CISPO, MiniMax 2025, MiniMax-M1 (arXiv 2506.13585), with epsilon_high from
Khatri et al. 2025, ScaleRL (arXiv 2510.13786); SAPO, Soft Adaptive Policy Optimization (arXiv 2511.20347); VESPO,
Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693). TRL's GRPOConfig help texts name them.

`unsloth:` turns Unsloth's speed paths off (sequence packing, shared-prefix attention; kitcli/recipe/unsloth_spec.py);
what its generated trainer changes and the kit corrects is in kitcli/training/unsloth_grpo.py.

The shared pieces below (defaults, group sizes, generation batches, rewards, the trainer) also build RLOO stages
(`kitcli/stages/rloo.py`, whose StageSpec names RLOOTrainer): they keep only the fields the stage's config has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli.data.rows import read_rows, to_dataset, with_system_prompt
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, load_stage_policy, save_model
from kitcli.recipe.config_fields import Range
from kitcli.recipe.schema import RESERVED_TRAIN, declared
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Launcher, Rows, StageSpec
from kitcli.recipe.unsloth_spec import UnslothSpec, unsloth_field
from kitcli.stages.generation_batches import check_group_sizes, check_save_steps, generation_cycle
from kitcli.stages.sampling import RL_DISPLAY, RL_MEMORY, SAMPLING_CHOICES, SAMPLING_RANGES
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import unsloth_grpo
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.filtering import filter_dir, filter_summary, run_filter
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, make_reward_metrics_callback, read_metrics, reward_summary
from kitcli.training.tool_use import ToolsSection, describe_tools, stage_toolbox, tool_defaults, tool_kwargs
from kitcli.training.trainers import config_class, is_grpo_trainer, trainer_summary
from kitcli.training.trl_config import COMMON_DEFAULTS, build_config, config_dict, config_summary
from rewards.registry import check_data

# SAPO's temperatures and VESPO's Gamma weights (their papers' values, as TRL 1.15 has them): every GRPO / GSPO stage
# sets them (only sapo / vespo read them), and the two presets name them.
SOFT_GATES: dict[str, float] = {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
                                "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
# The fields each preset sets; every variant sets all of them, so switching variants never inherits a default.
VARIANTS: dict[str, dict[str, Any]] = {
    "grpo": {"loss_type": "grpo", "scale_rewards": "group", "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.2,
             "mask_truncated_completions": False, "importance_sampling_level": "token"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2,
                "mask_truncated_completions": False, "importance_sampling_level": "token"},
    "dapo": {"loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28,
             "mask_truncated_completions": True, "importance_sampling_level": "token"},
    "bnpo": {"loss_type": "bnpo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2,
             "mask_truncated_completions": False, "importance_sampling_level": "token"},
    # TRL clamps CISPO's weight at epsilon_high itself (not 1 + epsilon_high); ScaleRL recommends 5.0
    "cispo": {"loss_type": "cispo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 5.0,
              "mask_truncated_completions": False, "importance_sampling_level": "token"},
    "sapo": {"loss_type": "sapo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2,
             "mask_truncated_completions": False, "importance_sampling_level": "token",
             "sapo_temperature_pos": SOFT_GATES["sapo_temperature_pos"],
             "sapo_temperature_neg": SOFT_GATES["sapo_temperature_neg"]},
    # VESPO forms its sequence weight itself from the token ratios: TRL wants importance_sampling_level "token"
    "vespo": {"loss_type": "vespo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2,
              "mask_truncated_completions": False, "importance_sampling_level": "token",
              **{k: v for k, v in SOFT_GATES.items() if k.startswith("vespo_")}},
}
DEFAULT_VARIANT = "grpo"
class GRPOSection(ToolsSection):
    """GRPO: TRL's GRPOTrainer with a `variant:` preset of the objective."""

    type: Literal["grpo"]
    variant: Literal[tuple(VARIANTS)] = Field(DEFAULT_VARIANT, description="The objective: " + ", ".join(VARIANTS))
    unsloth: UnslothSpec = unsloth_field()
    reserved: ClassVar[dict[str, str]] = {**RESERVED_TRAIN, "reward_weights": "each reward's weight: gives it"}
    train_ranges: ClassVar[dict[str, Range]] = SAMPLING_RANGES
    train_choices: ClassVar[dict[str, tuple]] = SAMPLING_CHOICES


def base_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    """Generation and training settings shared by GRPO and GSPO stages, all explicit (TRL's and Unsloth's
    defaults differ and move)."""
    on_gpu = cuda_available() if on_gpu is None else on_gpu
    return {
        "learning_rate": 5e-6,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "num_generations": 8,
        "max_completion_length": 256,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "num_iterations": 1,
        "delta": None,
        "multi_objective_aggregation": "sum_then_normalize",
        "use_bias_correction_kl": False,  # DeepSeekMath's KL estimator, not TRL 1.15's reweighted one
        "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0,
        "use_adaptive_entropy": False,
        "off_policy_mask_threshold": None,
        **SOFT_GATES,
        "sync_ref_model": False,
        "disable_dropout": True,  # so the old and current log-probabilities of a sample agree
        "use_vllm": False,  # the kit loads models without Unsloth's fast_inference (vLLM) engine
        "remove_unused_columns": False,  # rewards read dataset columns such as `answer`
        "shuffle_dataset": True,
        "log_completions": False,
        "gradient_checkpointing": on_gpu,
        "logging_steps": 1,
    }


def variant_name(ctx: StageContext) -> str:
    return ctx.section.variant or DEFAULT_VARIANT


def stage_defaults(ctx: StageContext, preset: dict[str, Any], on_gpu: bool | None = None) -> dict[str, Any]:
    """base < preset, then the generation batch: `steps_per_generation` unless `train:` sizes it by
    `generation_batch_size` (TRL takes one or the other). Only the fields the stage's config has (an RLOO stage has
    no GRPO-only fields)."""
    from kitcli.recipe.config_fields import config_fields

    train = ctx.section.train
    known = config_fields(ctx.spec.config)
    defaults = {k: v for k, v in {**base_defaults(ctx, on_gpu), **preset}.items() if k in known}
    if "generation_batch_size" in train:
        defaults.pop("steps_per_generation", None)
    elif "steps_per_generation" not in defaults:
        defaults["steps_per_generation"] = train.get("gradient_accumulation_steps",
                                                     defaults["gradient_accumulation_steps"])
    return defaults


def reward_model_stage(ctx: StageContext) -> str | None:
    """The reward stage whose merged model scores completions, if `reward_model:` names one."""
    return ctx.section.reward_model.stage if ctx.section.reward_model is not None else None


def reward_model_name(ctx: StageContext) -> str | None:
    """The reward model's name: its stage, or its directory's name (TRL logs it as rewards/<name>/mean)."""
    spec = ctx.section.reward_model
    if spec is None:
        return None
    return spec.stage or Path(spec.path).name


def reward_model_weight(ctx: StageContext) -> float:
    return float(ctx.section.reward_model.weight)


def load_reward_functions(ctx: StageContext):
    from rewards.registry import load_rewards

    return load_rewards(ctx.stage.rewards, ctx.recipe.base_dir, f"{ctx.where}: rewards")


def reward_weights(ctx: StageContext, rewards) -> list[float]:
    weights = [r.weight for r in rewards]
    if ctx.section.reward_model is not None:
        weights.append(reward_model_weight(ctx))
    return weights


def load_rows(ctx: StageContext, rewards=()) -> list[dict[str, Any]]:
    spec = ctx.section.data
    method = ctx.section.type.upper()
    rows = read_rows(spec, ctx.where)
    if "prompt" not in rows[0]:
        present = sorted(rows[0])
        likely = [c for c in ("question", "problem", "query", "instruction", "input", "text") if c in present]
        likely += [c for c in present if c not in likely and c not in ("answer", "solution", "completion")]
        hint = f"; map yours with e.g. columns: {{{likely[0]}: prompt}}" if likely else ""
        raise KitError(f"{ctx.where}: dataset '{spec.path}' has no prompt column (it has "
                       f"{', '.join(present)}); {method} samples completions for each prompt{hint}")
    for index, row in enumerate(rows):
        if row["prompt"] in (None, "", []):
            raise KitError(f"{ctx.where}: row {index} of '{spec.path}' has an empty prompt; every {method} row "
                           f"needs a prompt (a string or a list of messages)")
    check_data(rewards, rows, ctx.where, f"'{spec.path}'")  # the columns and rows the rewards need
    system = ctx.section.system_prompt
    return [{**row, "prompt": with_system_prompt(row["prompt"], system)} for row in rows]


def check_loss_settings(values: dict[str, Any], where: str) -> None:
    """Settings TRL accepts with a warning but that do not give the loss asked for."""
    if values.get("loss_type") == "luspo" and values.get("importance_sampling_level") != "sequence":
        raise KitError(f"{where}: loss_type 'luspo' scales GSPO's sequence-level objective by each sequence's "
                       f"length, so it needs importance_sampling_level 'sequence', got "
                       f"{values.get('importance_sampling_level')!r}; use a stage of type gspo with variant: luspo")


def resolved_defaults(ctx: StageContext, preset: dict[str, Any], rewards) -> dict[str, Any]:
    train = ctx.section.train
    if "reward_weights" in train:
        raise KitError(f"{ctx.where}: train.reward_weights is set by the kit from each reward's weight:; "
                       f"give the weights there instead")
    if train.get("use_vllm"):
        import importlib.util

        if importlib.util.find_spec("vllm") is None or not cuda_available():
            raise KitError(f"{ctx.where}: train.use_vllm needs a CUDA GPU and vLLM (pip install vllm, then run "
                           f"`trl vllm-serve` for vllm_mode: server); without it, remove use_vllm (the kit "
                           f"generates with transformers)")
    defaults = stage_defaults(ctx, preset)
    defaults["reward_weights"] = reward_weights(ctx, rewards)
    defaults.update(tool_defaults(ctx.stage, ctx.where))  # tools: max_tool_calling_iterations
    values = {**COMMON_DEFAULTS, **defaults, **train}
    check_loss_settings(values, ctx.where)
    check_group_sizes(values, ctx.where)
    if "save_steps" not in train:  # the kit's default, rounded up to a whole number of generation batches
        cycle = generation_cycle(values)
        defaults["save_steps"] = values["save_steps"] = -(-values["save_steps"] // cycle) * cycle
    check_save_steps(values, ctx.where)
    return defaults


def make_config(ctx: StageContext, defaults: dict[str, Any]):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx, defaults))


def build_stage_config(ctx: StageContext, defaults: dict[str, Any]):
    return build_config(config_class(ctx.spec), stage_defaults=defaults, train=ctx.section.train, where=ctx.where,
                        output_dir=ctx.dir.checkpoints, seed=ctx.seed, on_gpu=cuda_available())


def check_enough_prompts(ctx: StageContext, rows: int, config) -> None:
    """TRL draws whole generation batches of prompts: with fewer prompts than one batch needs it trains nothing."""
    per_batch = config.generation_batch_size // config.num_generations
    if rows < per_batch:
        raise KitError(f"{ctx.where}: the stage would run zero optimizer steps: '{ctx.section.data.path}' has "
                       f"{rows} prompts, fewer than the {per_batch} one generation batch draws "
                       f"(generation batch {config.generation_batch_size} / num_generations {config.num_generations}); "
                       f"give more prompts, or lower per_device_train_batch_size")


def describe_stage(ctx: StageContext, preset: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Validate data, references and rewards and build the trainer's config, without loading a model."""
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    spec = ctx.section.data
    rewards = load_reward_functions(ctx)
    rows: Any = (len(load_rows(ctx, rewards)) if Path(spec.path).is_file()
                 else "hub dataset, read when the stage runs")
    defaults = resolved_defaults(ctx, preset, rewards)
    config = make_config(ctx, defaults)
    if is_grpo_trainer(ctx.spec):  # Unsloth's GRPO trainer: an unrepairable pad token; `unsloth:` keys doing nothing
        unsloth_grpo.preflight(ctx.model, declared(ctx.stage, "unsloth"), ctx.where, ctx.log)
    if isinstance(rows, int):
        check_enough_prompts(ctx, rows, config)
    listed = [f"{r.name} (weight {r.weight:g}, {r.source})" for r in rewards]
    if ctx.section.reward_model is not None:
        stage = reward_model_stage(ctx)
        source = f"of stage '{stage}'" if stage else ctx.section.reward_model.path
        listed.append(f"reward model {source} (weight {reward_model_weight(ctx):g})")
    return {"init": ctx.section.init or "base model", **extra, "data": spec.path, "rows": rows,
            "rewards": listed, **describe_tools(ctx.stage, ctx.model, ctx.recipe.base_dir, ctx.where),
            **config_summary(config, defaults, ctx.section.train),
            **describe_held_out(plan_held_out(ctx))}


def describe(ctx: StageContext) -> dict[str, Any]:
    variant = variant_name(ctx)
    return describe_stage(ctx, VARIANTS[variant], {"variant": variant})


def load_reward_scorer(ctx: StageContext):
    """The sequence-classification reward model (and tokenizer): the merged model a reward stage saved, or the
    directory `reward_model: {path}` names."""
    from kitcli.models.reward_models import load_seq_cls_scorer

    stage = reward_model_stage(ctx)
    path = ctx.output(stage).merged if stage else Path(ctx.section.reward_model.path)
    if not (path / "config.json").exists():
        raise KitError(f"{ctx.where}: reward stage '{stage}' left no merged model in {path}; re-run it with --force")
    model, tokenizer = load_seq_cls_scorer(path, dtype=ctx.model.dtype, log=ctx.log)
    model.config._name_or_path = reward_model_name(ctx)  # TRL logs a reward model as rewards/<name_or_path>/mean
    return model, tokenizer


def filtered_rows(ctx: StageContext, rows: list[dict[str, Any]], rewards, loaded, config) -> list[dict[str, Any]]:
    """The rows after the stage's `filter:` (kitcli/training/filtering.py), or as they are without one."""
    if ctx.stage.filter is None:
        return rows
    toolbox = stage_toolbox(ctx.stage, loaded.tokenizer, config, model_name=ctx.model.name,
                            base_dir=ctx.recipe.base_dir, where=ctx.where)
    kept, _ = run_filter(model=loaded.model, tokenizer=loaded.tokenizer, rows=rows, rewards=rewards, stage=ctx.stage,
                         model_name=ctx.model.name, init_dir=ctx.init_dir, values=config, seed=ctx.seed,
                         where=ctx.where, cache_dir=filter_dir(ctx.stage_dir),
                         needed=config.generation_batch_size // config.num_generations, log=ctx.log, toolbox=toolbox)
    return kept


def build_trainer(ctx: StageContext, preset: dict[str, Any], config=None, kind: str | None = None):
    """Load the policy, the rewards and the data, and build the trainer the stage's StageSpec names (GRPOTrainer, or
    RLOOTrainer for an rloo stage; `kind`, when given, must be the stage's type). Returns (trainer, loaded policy,
    config)."""
    from kitcli.training.trainers import build_trainer as build
    from rewards.guard import RewardStats, guard_rewards

    if kind is not None and kind != ctx.stage.type:
        raise KitError(f"{ctx.where}: a {ctx.stage.type} stage builds its own type's trainer, not {kind}'s")
    rewards = load_reward_functions(ctx)
    rows = load_rows(ctx, rewards)
    config = config or make_config(ctx, resolved_defaults(ctx, preset, rewards))
    check_enough_prompts(ctx, len(rows), config)
    loaded = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    rows = filtered_rows(ctx, rows, rewards, loaded, config)  # `filter:`: the prompts the starting policy can learn
    stats = RewardStats()
    reward_funcs: list[Any] = guard_rewards(rewards, stats)
    processing: list[Any] = [None] * len(reward_funcs)
    if ctx.section.reward_model is not None:
        model, tokenizer = load_reward_scorer(ctx)
        reward_funcs.append(model)
        processing.append(tokenizer)
    trainer, _ = build(ctx.spec, loaded, args=config, reference=config.beta != 0.0, reward_funcs=reward_funcs,
                       train_dataset=to_dataset(rows), processing_class=loaded.tokenizer,
                       reward_processing_classes=processing, log=ctx.log, label=ctx.name, where=ctx.where,
                       unsloth=declared(ctx.stage, "unsloth"),
                       **tool_kwargs(ctx.stage, loaded.tokenizer, ctx.model.name, ctx.recipe.base_dir, ctx.where))
    trainer.add_callback(make_reward_metrics_callback(stats))
    return trainer, loaded, config


def train_stage(ctx: StageContext, preset: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    config = make_config(ctx, resolved_defaults(ctx, preset, load_reward_functions(ctx)))
    metrics_path = ctx.dir.metrics
    resume = checkpoint_to_resume(ctx, config_dict(config))
    trainer, loaded, config = build_trainer(ctx, preset, config)
    record_effective_settings(ctx.dir, trainer)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console, spec=ctx.spec)
    held_out = attach_held_out(trainer, plan_held_out(ctx), metrics_path, ctx.log)
    try:
        train(trainer, resume, ctx.where, stop_every=generation_cycle(vars(config)))
    except KitError as error:  # a reward failed: say which stage, keep the checkpoints
        raise KitError(f"{ctx.where}: {error.message}") from None
    model = loaded.model
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # TRL's frozen copy of the starting adapter; not part of the result
    save_model(model, loaded.tokenizer, ctx.stage_dir)
    return held_out.summarize({**extra, **trainer_summary(trainer), **filter_summary(ctx.stage_dir, ctx.stage.filter),
                               "steps": trainer.state.global_step, "resumed_from": resume.name if resume else None,
                               "backend": loaded.backend, **reward_summary(read_metrics(metrics_path))})


def run(ctx: StageContext) -> dict[str, Any]:
    variant = variant_name(ctx)
    return train_stage(ctx, VARIANTS[variant], {"variant": variant})


SPEC = StageSpec(
    type="grpo", order=60, module=__name__, section=GRPOSection,
    summary="TRL GRPOTrainer with a variant preset: " + ", ".join(VARIANTS),
    output="policy", init_from=("policy",), trainer="trl.trainer.grpo_trainer:GRPOTrainer",
    config="trl.trainer.grpo_config:GRPOConfig", rows=Rows(shape="prompts", read=load_rows), groups=True, rl=True,
    memory=RL_MEMORY, display=RL_DISPLAY,
    launcher=Launcher("data parallel (TRL GRPOTrainer): each process generates its share of the completions"),
    defaults=lambda ctx, on_gpu=None: stage_defaults(ctx, VARIANTS[variant_name(ctx)], on_gpu))
