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

import random
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kitcli.data.rows import read_rows, require_columns, to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, resolve_model_path, save_model
from kitcli.models.reward_models import load_reward_model, save_merged_reward_model
from kitcli.recipe.schema import DataSpec, StageSpec, TrainingSection, fail
from kitcli.recipe.stage_context import StageContext
from kitcli.training.checkpoints import resume_checkpoint, train
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trainers import trainer_summary
from kitcli.training.trl_config import build_config, config_dict, config_summary

PAIR_COLUMNS = ["chosen", "rejected"]
DEFAULT_EVAL_FRACTION = 0.1


class PreferenceSection(TrainingSection):
    """A stage trained on preference pairs (reward model, DPO), with an eval split."""

    sequences_per_row: ClassVar[int] = 2  # chosen and rejected go through the model together (kit plan)

    eval_data: DataSpec | None = Field(None, description="Held-out pairs (instead of eval_fraction).")
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description=f"Share of the pairs held out at random (default {DEFAULT_EVAL_FRACTION}; 0: none).")

    @model_validator(mode="after")
    def one_eval_split(self):
        if self.eval_data is not None and self.eval_fraction is not None:
            raise fail("give eval_data or eval_fraction, not both")
        return self


class RewardSection(PreferenceSection):
    """A reward model: Bradley-Terry training of a scalar head with TRL's RewardTrainer."""

    type: Literal["reward"]
    config: ClassVar[str] = "RewardConfig"


# --- preference data (shared with the DPO stage) -----------------------------------------------------------------

def on_disk(spec: dict[str, Any]) -> bool:
    """A local file; anything else is a hub dataset, which describe() must not download."""
    return Path(spec["path"]).is_file()


def check_pair(row: dict[str, Any], number: int, where: str, path: str) -> None:
    """chosen / rejected (and prompt, if present) are all text or all lists of {role, content} messages."""
    def kind(value):
        if isinstance(value, str) and value.strip():
            return "text"
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in value):
            return "messages"
        return None

    kinds = {c: kind(row[c]) for c in ["prompt", *PAIR_COLUMNS] if c in row}
    for column, found in kinds.items():
        if found is None:
            raise KitError(f"{where}: row {number} of '{path}': '{column}' must be non-empty text or a list of "
                           f"{{role, content}} messages, got {str(row[column])[:60]!r}")
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"{c} is {k}" for c, k in kinds.items())
        raise KitError(f"{where}: row {number} of '{path}' mixes formats ({shown}); use all text or all messages")


# Column names other datasets use for the two sides of a pair, to suggest a `columns:` mapping.
LIKE_CHOSEN = ("good", "better", "preferred", "accepted", "positive", "pos", "winner", "response_j", "chosen_response")
LIKE_REJECTED = ("bad", "worse", "dispreferred", "negative", "neg", "loser", "response_k", "rejected_response")


def suggest_pair_mapping(present: set[str], where: str, path: str) -> None:
    """Fail with a `columns:` mapping when the dataset names its pair columns in a recognisable way."""
    chosen = next((c for c in present if c.lower() in LIKE_CHOSEN), None)
    rejected = next((c for c in present if c.lower() in LIKE_REJECTED), None)
    if chosen and rejected:
        raise KitError(f"{where}: dataset '{path}' needs columns chosen+rejected (prompt optional); it has "
                       f"{', '.join(sorted(present))}; map yours with columns: "
                       f"{{{chosen}: chosen, {rejected}: rejected}}")


def preference_rows(ctx: StageContext, key: str = "data") -> list[dict[str, Any]]:
    """Rows with chosen / rejected (and prompt when the dataset has one), checked row by row."""
    spec = ctx.stage[key]
    rows = read_rows(spec, f"{ctx.where}: {key}")
    if not all(c in rows[0] for c in PAIR_COLUMNS):
        suggest_pair_mapping(set(rows[0]), f"{ctx.where}: {key}", spec["path"])
    require_columns(rows, [PAIR_COLUMNS], f"{ctx.where}: {key}", spec["path"])
    columns = (["prompt"] if "prompt" in rows[0] else []) + PAIR_COLUMNS
    for number, row in enumerate(rows, start=1):
        if any(c not in row for c in columns):
            missing = [c for c in columns if c not in row]
            raise KitError(f"{ctx.where}: row {number} of '{spec['path']}' has no '{missing[0]}' (the first row has "
                           f"{', '.join(columns)})")
        check_pair(row, number, ctx.where, spec["path"])
    return [{c: row[c] for c in columns} for row in rows]


def eval_fraction(ctx: StageContext) -> float:
    fraction = ctx.stage.get("eval_fraction", DEFAULT_EVAL_FRACTION)
    if "eval_data" in ctx.stage and "eval_fraction" in ctx.stage:
        raise KitError(f"{ctx.where}: give eval_data or eval_fraction, not both")
    if "eval_data" in ctx.stage:
        return 0.0
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise KitError(f"{ctx.where}: eval_fraction must be a number in [0, 1), e.g. 0.1; got {fraction!r}")
    return float(fraction)


def has_eval(ctx: StageContext) -> bool:
    return "eval_data" in ctx.stage or eval_fraction(ctx) > 0


def train_eval_rows(ctx: StageContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the eval rows: `eval_data`, or a seeded random `eval_fraction` of `data`."""
    rows = preference_rows(ctx)
    if "eval_data" in ctx.stage:
        return rows, preference_rows(ctx, "eval_data")
    fraction = eval_fraction(ctx)
    if fraction == 0:
        return rows, []
    n_eval = max(1, round(len(rows) * fraction))
    if n_eval >= len(rows):
        raise KitError(f"{ctx.where}: eval_fraction {fraction} of {len(rows)} rows leaves nothing to train on; "
                       f"lower it or give eval_data")
    order = list(range(len(rows)))
    random.Random(ctx.seed).shuffle(order)
    held_out = set(order[:n_eval])
    return ([r for i, r in enumerate(rows) if i not in held_out], [r for i, r in enumerate(rows) if i in held_out])


def final_evaluation(trainer, metrics_path: Path) -> dict[str, Any]:
    """The eval metrics after the last step: the ones logged at that step, else a fresh evaluation."""
    logged = [row for row in read_metrics(metrics_path) if "eval_loss" in row]
    if logged and logged[-1]["step"] == trainer.state.global_step:
        return logged[-1]
    return trainer.evaluate()


def describe_data(ctx: StageContext) -> dict[str, Any]:
    """What dry-run shows about the data, without downloading a hub dataset."""
    out: dict[str, Any] = {"data": ctx.stage["data"]["path"]}
    if not on_disk(ctx.stage["data"]) or ("eval_data" in ctx.stage and not on_disk(ctx.stage["eval_data"])):
        out["rows"] = "hub dataset, read when the stage runs"
        out["eval"] = (ctx.stage["eval_data"]["path"] if "eval_data" in ctx.stage
                       else f"{eval_fraction(ctx):g} of the rows held out")
        return out
    train_rows, eval_rows = train_eval_rows(ctx)
    out["format"] = ("conversational" if isinstance(train_rows[0]["chosen"], list) else "standard") + \
        ("" if "prompt" in train_rows[0] else ", implicit prompt")
    out["rows"] = len(train_rows)
    out["eval_rows"] = len(eval_rows)
    out["eval"] = (ctx.stage["eval_data"]["path"] if "eval_data" in ctx.stage
                   else f"{eval_fraction(ctx):g} of the rows held out (seed {ctx.seed})")
    return out


# --- the stage ------------------------------------------------------------------------------------------------------

def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    evaluating = has_eval(ctx)
    return {
        "learning_rate": 1e-4,
        "max_length": ctx.model["max_seq_length"],  # pairs longer than this are dropped (logged)
        "center_rewards_coefficient": None,  # pure Bradley-Terry loss; 0.01 adds the mean-zero term
        "disable_dropout": True,
        "gradient_checkpointing": cuda_available() if on_gpu is None else on_gpu,
        "pad_to_multiple_of": None,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": 25,
        "per_device_eval_batch_size": 16,
    }


def make_config(ctx: StageContext):
    from kitcli.training.trainers import config_class

    return build_config(config_class("reward"), stage_defaults=stage_defaults(ctx), train=ctx.stage.get("train", {}),
                        where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                        on_gpu=cuda_available())


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model["backend"]))  # unsloth before trl, as the run's policy stages need
    config = make_config(ctx)
    return {"init": ctx.stage.get("init") or "base model", **describe_data(ctx),
            **config_summary(config, stage_defaults(ctx), ctx.stage.get("train", {}))}


def reward_base(ctx: StageContext) -> str:
    """The unquantized model the adapter is merged into: the base, or a fully fine-tuned init stage's model."""
    if ctx.init_dir is not None and (ctx.init_dir / "model").is_dir():
        return str(ctx.init_dir / "model")
    return resolve_model_path(ctx.model["name"], ctx.seed)


def build_trainer(ctx: StageContext, config=None):
    """The RewardTrainer this stage trains with (and the loaded model), before any step is taken."""
    from kitcli.training.trainers import build_trainer as build

    train_rows, eval_rows = train_eval_rows(ctx)
    config = config or make_config(ctx)
    loaded = load_reward_model(
        ctx.model["name"], max_seq_length=ctx.model["max_seq_length"], load_in_4bit=ctx.model["load_in_4bit"],
        lora=ctx.recipe.data["lora"], backend=ctx.model["backend"], dtype=ctx.model["dtype"], seed=ctx.seed,
        init_from=ctx.init_dir, trust_remote_code=ctx.model["trust_remote_code"], log=ctx.log,
    )
    trainer, _ = build("reward", loaded, args=config, train_dataset=to_dataset(train_rows),
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
    resume = resume_checkpoint(ctx, metrics_path, config_dict(config))
    trainer, loaded = build_trainer(ctx, config)
    attach_progress(trainer, ctx.name, metrics_path, ctx.console)
    before = None
    if resume is None and trainer.eval_dataset is not None:
        before = eval_figures(trainer.evaluate())
    elif resume is not None:  # the evaluation before training was logged at step 0 of the interrupted run
        before = next((eval_figures(r) for r in read_metrics(metrics_path) if r.get("step") == 0 and "eval_loss" in r),
                      None)
    train(trainer, resume, ctx.where)
    after = eval_figures(final_evaluation(trainer, metrics_path)) if trainer.eval_dataset is not None else None
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)
    save_merged_reward_model(ctx.stage_dir, base=reward_base(ctx), dtype=ctx.model["dtype"],
                             trust_remote_code=ctx.model["trust_remote_code"], log=ctx.log)
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
    type="reward", module=__name__, section=RewardSection,
    summary="TRL RewardTrainer: Bradley-Terry loss on chosen/rejected pairs; saves adapter/ and merged/",
    output="scorer", init_from=("policy", "scorer"), trainer="reward",
    metrics=(("loss", "loss"), ("accuracy", "accuracy"), ("margin", "margin"), ("learning_rate", "lr")),
    panels=(("loss", "loss", ("loss", "eval_loss")),
            ("pair accuracy (r_chosen > r_rejected)", "accuracy", ("accuracy", "eval_accuracy")),
            ("margin (r_chosen - r_rejected)", "margin", ("margin", "eval_margin"))),
    launcher="data parallel (TRL RewardTrainer); the merged model is written by the main process",
    memory_settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
    defaults=stage_defaults)
