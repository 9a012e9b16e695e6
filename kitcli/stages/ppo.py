"""PPO stage: RLHF with a learned critic, GAE and a per-token KL penalty against a frozen reference, as the
reference page's "RLHF with PPO" states it. TRL 1.15 ships no PPO trainer, so the kit has its own small library,
`kitcli/ppo/` (config, models, rollout, losses, trainer, on accelerate); this module glues it to a recipe.

    kit run tiny-ppo
    kit run recipes/qwen3-4b-ppo.yaml --dry-run

One PPO step: sample one response per prompt of a batch (the rollout); score each response (a reward model
trained earlier, `reward_model: <stage>`, and/or reward functions, `rewards:`, as in GRPO); compute the policy's and
the reference's log-probabilities and the critic's values V(s_t); shape the rewards (score at the last token minus
beta * r_t^KL at every token); GAE advantages and returns; then `num_ppo_epochs` passes over `num_mini_batches`
mini-batches update the policy (clipped surrogate) and the critic (clipped value loss).

One copy of the base weights serves every model (docs/ppo.md). Outputs: `adapter/` (the policy, PEFT format),
`critic/` (adapter + value_head.safetensors), `metrics.jsonl`, `checkpoints/checkpoint-N/` every `save_steps`
(kitcli/ppo/checkpoint.py; a re-run resumes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from kitcli.data.rows import read_rows, require_columns, with_system_prompt
from kitcli.display.dashboard import StageDashboard
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, resolve_model_path, save_model
from kitcli.ppo.checkpoint import CHECKPOINT_FILES
from kitcli.ppo.config import PPOConfig, ppo_defaults
from kitcli.recipe.config_fields import AT_LEAST_ONE, FRACTION, NOT_NEGATIVE, POSITIVE, TRAINING_RANGES, Range
from kitcli.recipe.schema import DataSpec, RewardedSection, fail
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Resume, Rows, StageSpec
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import interrupt
from kitcli.training.held_out import HeldOut, describe_held_out, held_out_evaluator
from kitcli.training.progress import read_metrics
from kitcli.training.trl_config import build_config


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    return ppo_defaults()


def make_config(ctx: StageContext) -> PPOConfig:
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx))


def build_stage_config(ctx: StageContext) -> PPOConfig:
    config = build_config(PPOConfig, stage_defaults=ppo_defaults(), train=ctx.section.train,
                          where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed, on_gpu=cuda_available())
    limit = ctx.model.max_seq_length
    if config.response_length >= limit:
        raise KitError(f"{ctx.where}: train.response_length {config.response_length} does not fit "
                       f"model.max_seq_length {limit} (it holds the prompt and the response); lower "
                       f"response_length or raise max_seq_length")
    return config


def reward_source(ctx: StageContext):
    """`reward_model:` as the recipe validated it (kitcli/recipe/schema.py): an earlier reward stage, or a model
    directory."""
    from kitcli.ppo.models import RewardSource

    spec = ctx.section.reward_model
    if spec is None:
        return None
    if spec.stage:
        return RewardSource(weight=float(spec.weight), stage=spec.stage, stage_dir=ctx.outputs[spec.stage])
    return RewardSource(weight=float(spec.weight), path=Path(spec.path))


def load_reward_functions(ctx: StageContext):
    from rewards.registry import load_rewards

    return load_rewards(ctx.stage.rewards, ctx.recipe.base_dir, f"{ctx.where}: rewards")


def load_rows(ctx: StageContext, key: str = "data") -> list[dict[str, Any]]:
    spec = getattr(ctx.section, key)
    rows = read_rows(spec, f"{ctx.where}: {key}")
    require_columns(rows, [["prompt"]], f"{ctx.where}: {key}", spec.path)
    for index, row in enumerate(rows):
        if row.get("prompt") in (None, "", []):
            raise KitError(f"{ctx.where}: row {index} of '{spec.path}' has an empty prompt; every row needs a "
                           f"prompt (a string or a list of messages)")
    system = ctx.section.system_prompt  # the same rule as every stage's (kitcli/data/rows.py)
    return [{**row, "prompt": with_system_prompt(row["prompt"], system)} for row in rows]


def check_rows(ctx: StageContext, rewards, rows: list[dict[str, Any]], config: PPOConfig, key: str = "data") -> None:
    from kitcli.ppo.rollout import check_reward_columns
    from rewards.registry import check_data

    check_reward_columns(rewards, rows, ctx.where, getattr(ctx.section, key).path)
    check_data(rewards, rows, ctx.where, f"'{getattr(ctx.section, key).path}'")
    if key == "data" and len(rows) < config.per_device_train_batch_size:
        raise KitError(f"{ctx.where}: data has {len(rows)} prompts, fewer than train.per_device_train_batch_size "
                       f"{config.per_device_train_batch_size}; lower it or give more prompts")


def load_models(ctx: StageContext):
    from kitcli.ppo.models import setup_models

    return setup_models(ctx.model, ctx.lora, seed=ctx.seed, init_dir=ctx.init_dir,
                        init_name=ctx.section.init, reward=reward_source(ctx), where=ctx.where, log=ctx.log)


def train(ctx: StageContext, config: PPOConfig, models, rows, reward_fns, rewards, eval_rows=None,
          resume: Path | None = None, held_out: HeldOut | None = None) -> dict[str, Any]:
    """The library's PPO loop, logging to this stage's dashboard and checkpointing into its folder."""
    from kitcli.ppo import trainer

    if resume is None:
        ctx.dir.metrics.unlink(missing_ok=True)
    dashboard = StageDashboard(ctx.name, ctx.dir.metrics, ctx.console, spec=ctx.spec)
    return trainer.train(config, models, rows, reward_fns, rewards, dashboard=dashboard,
                         checkpoint_dir=ctx.dir.checkpoints, eval_rows=eval_rows, resume=resume, held_out=held_out)


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model.backend))
    rewards = load_reward_functions(ctx)
    config = make_config(ctx)
    local = Path(ctx.section.data.path).is_file()
    rows: Any = "hub dataset, read when the stage runs"
    if local:
        loaded_rows = load_rows(ctx)
        check_rows(ctx, rewards, loaded_rows, config)
        rows = len(loaded_rows)
    if ctx.section.eval_data is not None and Path(ctx.section.eval_data.path).is_file():
        check_rows(ctx, rewards, load_rows(ctx, "eval_data"), config, "eval_data")
    source = reward_source(ctx)
    if source is not None and source.path is not None and local:
        policy_dir = Path(resolve_model_path(ctx.model.name, ctx.seed))
        if policy_dir.is_dir():
            from transformers import AutoTokenizer

            from kitcli.ppo.models import check_reward_tokenizer

            check_reward_tokenizer(AutoTokenizer.from_pretrained(str(policy_dir)),
                                   AutoTokenizer.from_pretrained(str(source.path)),
                                   isinstance(load_rows(ctx)[0]["prompt"], list), f"'{source.path}'", ctx.where)
    listed = [f"{r.name} (weight {r.weight:g}, {r.source})" for r in rewards]
    if source is not None:
        listed.append(f"reward model {source.name} (weight {source.weight:g})")
    return {"init": ctx.section.init or "base model", "data": ctx.section.data.path, "rows": rows,
            "eval_data": ctx.section.eval_data.path if ctx.section.eval_data is not None else None,
            "rewards": listed, "PPOConfig": dataclasses.asdict(config), **describe_held_out(plan_held_out(ctx))}


def run(ctx: StageContext) -> dict[str, Any]:
    from kitcli.ppo import trainer
    from kitcli.ppo.models import POLICY, check_reward_tokenizer, save_critic
    from kitcli.ppo.rollout import check_prompt_lengths
    from rewards.guard import RewardStats, guard_rewards

    config = make_config(ctx)
    rows = load_rows(ctx)
    rewards = load_reward_functions(ctx)
    check_rows(ctx, rewards, rows, config)
    eval_rows = load_rows(ctx, "eval_data") if ctx.section.eval_data is not None else None
    if eval_rows:
        check_rows(ctx, rewards, eval_rows, config, "eval_data")
    resume = checkpoint_to_resume(ctx, dataclasses.asdict(config))
    models = load_models(ctx)
    if models.reward_model is not None:
        check_reward_tokenizer(models.tokenizer, models.reward_model.tokenizer, isinstance(rows[0]["prompt"], list),
                               f"'{models.reward_model.name}'", ctx.where)
    for key, checked in (("data", rows), ("eval_data", eval_rows)):
        if checked:
            check_prompt_lengths(models.tokenizer, checked, config, ctx.model.max_seq_length, ctx.where,
                                 getattr(ctx.section, key).path)
    held_out = held_out_evaluator(plan_held_out(ctx), ctx.dir.metrics, ctx.log)  # `eval:`: step 0, every N, last
    result = train(ctx, config, models, rows, guard_rewards(rewards, RewardStats()), rewards, eval_rows, resume,
                   held_out)
    if interrupt.requested():
        return result  # the runner reports the stop; the checkpoint resumes it
    save_critic(models, ctx.stage_dir)
    for name in list(models.model.peft_config):
        if name != POLICY:
            models.model.delete_adapter(name)
    save_model(models.model, models.tokenizer, ctx.stage_dir)
    return held_out.summarize(trainer.summarize(result, read_metrics(ctx.dir.metrics), models))


class PPOSection(RewardedSection):
    """RLHF with PPO (the kit's own loop): a critic with GAE, a per-token KL penalty, clipped surrogate."""

    type: Literal["ppo"]
    eval_data: DataSpec | None = Field(None, description="Held-out prompts scored before and after training.")
    train_ranges: ClassVar[dict[str, Range]] = {
        **TRAINING_RANGES, "num_mini_batches": AT_LEAST_ONE, "num_ppo_epochs": AT_LEAST_ONE,
        "response_length": AT_LEAST_ONE, "kl_coef": NOT_NEGATIVE, "kl_target": POSITIVE, "kl_horizon": AT_LEAST_ONE,
        "cliprange": Range(0, True, 1, True), "cliprange_value": POSITIVE, "vf_coef": NOT_NEGATIVE,
        "gamma": FRACTION, "lam": FRACTION, "missing_eos_penalty": NOT_NEGATIVE, "temperature": POSITIVE,
        "top_p": Range(0, True, 1), "top_k": NOT_NEGATIVE}
    train_choices: ClassVar[dict[str, tuple]] = {
        "lr_scheduler_type": ("linear", "cosine", "constant", "constant_with_warmup"),
        "optim": ("adamw_torch", "adamw_torch_fused", "adamw_8bit")}

    @model_validator(mode="after")
    def one_held_out(self):
        if self.eval_data is not None and self.eval is not None:
            raise fail("a PPO stage scores eval_data: before and after training and eval: during it, both as eval/ "
                       "figures; give one of them")
        return self


SPEC = StageSpec(
    type="ppo", order=90, module=__name__, section=PPOSection,
    summary="RLHF with PPO, written in kit: per-token KL to the frozen reference, a critic with GAE",
    output="policy", init_from=("policy",), rl=True, config="kitcli.ppo.config:PPOConfig",
    rows=Rows(shape="prompts", read=load_rows),
    memory=Memory(settings=("per_device_train_batch_size", "num_mini_batches", "response_length"),
                  reference="always"),
    resume=Resume(restores="the policy and critic adapters, the value head, the optimizer, the scheduler, the KL "
                           "coefficient and the RNG states (the data position follows from the step)",
                  files=CHECKPOINT_FILES),
    display=Display(
        metrics=(("objective/scores", "score"), ("rewards/*/mean", "*"), ("objective/kl", "kl"),
                 ("objective/non_score_reward", "non_score"), ("loss/policy", "pg_loss"), ("loss/value", "vf_loss"),
                 ("policy/entropy", "entropy"), ("policy/clipfrac", "clipfrac"), ("policy/approxkl", "approxkl"),
                 ("val/explained_variance", "explained_var"), ("eval/score", "eval_score"),
                 ("eval/exact_match", "eval_exact_match")),
        panels=(("score", "mean score", ("objective/scores", "rewards/*/mean", "objective/rlhf_reward")),
                ("KL to the reference", "KL", ("objective/kl", "policy/approxkl")),
                ("losses", "loss", ("loss/policy", "loss/value")),
                ("entropy", "nats per token", ("policy/entropy",)),
                ("clip fractions", "fraction", ("policy/clipfrac", "val/clipfrac")),
                ("value function", "explained variance", ("val/explained_variance",)),
                ("held-out", "score", ("eval/score", "eval/exact_match")))),
    launcher=Launcher(refusal="kit's PPO loop is a single-process loop (no DDP); run PPO recipes without "
                              "--launcher"),
    defaults=stage_defaults)
