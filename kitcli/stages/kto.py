"""KTO stage: TRL's KTOTrainer on unpaired thumbs-up / thumbs-down data, against a frozen reference that is the
stage's starting policy.

    kit run tiny-kto                                    (eval -> sft -> eval -> kto -> eval on the tiny model)
    kit data to-kto prefs.jsonl -o kto.jsonl            (chosen / rejected pairs -> prompt / completion / label)

The method (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv 2402.01306;
TRL 1.15's `loss_type: kto`). Each row is a prompt x, a completion y and a label: true (desirable, thumbs up) or
false (undesirable). With sequence log-probabilities summed over the completion's tokens, the implied reward is
r(x, y) = log pi_theta(y | x) - log pi_ref(y | x), and the reference point z0 estimates the KL between the policy and
the reference on the batch, from mismatched pairs (each prompt with the completion of the batch's previous row,
y'_i = y_{i-1}), detached and floored at 0:

    z0 = max(0, mean_i (log pi_theta(y'_i | x_i) - log pi_ref(y'_i | x_i)))
    desirable:   loss = desirable_weight   * (1 - sigmoid(beta * (r(x, y) - z0)))
    undesirable: loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r(x, y))))

and the batch's loss is the mean over its rows. The paper's value function is lambda_y * sigmoid(...) and its loss
lambda_y - v(x, y): the same. TRL logs rewards/chosen and rewards/rejected (beta * r, the means over the batch's
desirable and undesirable rows), rewards/margins (their difference) and kl (z0).

Unbalanced data. The two weights counter unequal numbers of desirable (n_D) and undesirable (n_U) rows; the paper
(Eq. 8) recommends desirable_weight * n_D / (undesirable_weight * n_U) in [1, 4/3]. The kit sets both weights to 1.0
and says so when the training rows put the ratio outside that range (with a desirable_weight that brings it back);
with twice as many undesirable rows, e.g., desirable_weight 2.0 (ratio 1.0) to 2.66 (ratio 4/3).

Every field that decides the objective is set by the kit (`--dry-run` prints them; `train:` still wins):

    loss_type kto, beta 0.1, desirable_weight 1.0, undesirable_weight 1.0, max_length model.max_seq_length,
    train_sampling_strategy sequential, precompute_ref_log_probs (true only when training makes several passes over
    the data, as for DPO), sync_ref_model false, disable_dropout true, learning_rate 5e-6

The reference. The policy is the base plus one LoRA adapter ("default") holding exactly the weights `init:` saved;
KTOTrainer copies it into a frozen adapter "ref" and computes the reference log-probs with it.
`kitcli/training/trainers.py` checks, on TRL's trainer and on Unsloth's generated one alike, that "ref" equals the
starting adapter and is frozen (with `init: sft` the reference is the SFT model, not the base). "ref" is not saved in
`adapter/`. With full fine-tuning (`lora: false`) TRL loads a separate frozen copy of the starting model.

Data. Rows with `prompt`, `completion` and a boolean `label` (standard text or conversational messages), or, read
directly, preference pairs with `prompt`, `chosen` and `rejected`: the stage then turns each pair into a desirable
row (prompt, chosen, true) and an undesirable one (prompt, rejected, false), which is what `kit data to-kto` writes
(describe says which format it read). The KL estimate pairs each row with its neighbour in the batch, and TRL reads
the training rows in order (it needs `train_sampling_strategy: sequential`), so the stage shuffles the rows once with
the recipe's seed: a pair's two rows then rarely share a batch slot next to each other, and every batch mixes both
labels. The eval split (`eval_data`, or `eval_fraction`, default 0.1) holds out whole pairs when the data are pairs.
Refused before anything loads, in one line: a row whose label is not true or false (naming the row), training rows
that all have the same label (KTO needs both), and a batch of one row (per_device_train_batch_size 1: the KL estimate
would be the row's own reward).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli.data.rows import apply_system_prompt, read_rows, to_dataset
from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, is_peft_model, load_stage_policy, save_model
from kitcli.recipe.config_fields import POSITIVE, Range
from kitcli.recipe.stage_context import StageContext
from kitcli.recipe.stage_spec import Display, Launcher, Memory, Rows, StageSpec
from kitcli.stages.dpo import several_passes
from kitcli.stages.pairs import PreferenceSection, check_pair, eval_fraction, final_evaluation, has_eval, on_disk
from kitcli.stages.steps import checkpoint_to_resume, plan_held_out
from kitcli.training import trainers
from kitcli.training.checkpoints import record_effective_settings, train
from kitcli.training.held_out import attach_held_out, describe_held_out
from kitcli.training.progress import attach_progress, read_metrics
from kitcli.training.trl_config import build_config, config_dict, config_summary

UNPAIRED = ("prompt", "completion", "label")
PAIRED = ("prompt", "chosen", "rejected")
TRACKED = ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl")
BALANCE = (1.0, 4 / 3)  # the KTO paper's range for desirable_weight * n_D / (undesirable_weight * n_U)


class KTOSection(PreferenceSection):
    """Kahneman-Tversky optimization: TRL's KTOTrainer on thumbs-up / thumbs-down rows (or pairs it unpairs)."""

    type: Literal["kto"]
    system_prompt: str | None = Field(None, description="A system message put before every prompt (chat data).")
    sequences_per_row: ClassVar[int] = 1  # one completion with gradients (the KL pass runs without)
    train_ranges: ClassVar[dict[str, Range]] = {**PreferenceSection.train_ranges, "desirable_weight": POSITIVE,
                                                "undesirable_weight": POSITIVE}


# --- data --------------------------------------------------------------------------------------------------------

def data_format(rows: list[dict[str, Any]], where: str, path: str) -> str:
    """'unpaired' (prompt / completion / label) or 'pairs' (prompt / chosen / rejected), from the first row."""
    present = set(rows[0])
    if {"completion", "label"} & present:
        missing = [c for c in UNPAIRED if c not in present]
        if missing:
            raise KitError(f"{where}: dataset '{path}' has no '{missing[0]}' column; KTO rows need prompt, completion "
                           f"and label (true: desirable, false: undesirable); it has {', '.join(sorted(present))}")
        return "unpaired"
    if {"chosen", "rejected"} <= present:
        if "prompt" not in present:
            raise KitError(f"{where}: dataset '{path}' has chosen/rejected pairs without a prompt column; KTO pairs "
                           f"each completion with its prompt: add a prompt column (or map yours with columns:)")
        return "pairs"
    raise KitError(f"{where}: dataset '{path}' needs columns prompt+completion+label (unpaired; label true or false) "
                   f"or prompt+chosen+rejected (pairs, unpaired by the stage); it has {', '.join(sorted(present))}")


def as_label(value: Any) -> bool | None:
    """A row's label as a bool (JSON true/false, or a numpy bool from a Parquet/CSV column), else None."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    return None


def check_unpaired(rows: list[dict[str, Any]], where: str, path: str) -> list[dict[str, Any]]:
    """Every row has a non-empty prompt and completion of one format and a boolean label."""
    out = []
    for number, row in enumerate(rows, start=1):
        missing = [c for c in UNPAIRED if c not in row]
        if missing:
            raise KitError(f"{where}: row {number} of '{path}' has no '{missing[0]}' (KTO rows need prompt, "
                           f"completion and label)")
        label = as_label(row["label"])
        if label is None:
            raise KitError(f"{where}: row {number} of '{path}' has label {row['label']!r}; a KTO label must be true "
                           f"(desirable, thumbs up) or false (undesirable, thumbs down)")
        check_pair({"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"]}, number,
                   where, path)
        out.append({"prompt": row["prompt"], "completion": row["completion"], "label": label})
    return out


def check_pairs(rows: list[dict[str, Any]], where: str, path: str) -> list[dict[str, Any]]:
    out = []
    for number, row in enumerate(rows, start=1):
        missing = [c for c in PAIRED if c not in row]
        if missing:
            raise KitError(f"{where}: row {number} of '{path}' has no '{missing[0]}' (the first row has prompt, "
                           f"chosen and rejected)")
        check_pair(row, number, where, path)
        out.append({c: row[c] for c in PAIRED})
    return out


def unpair(pairs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each chosen / rejected pair as two KTO rows: (prompt, chosen, true) and (prompt, rejected, false)."""
    rows = []
    for pair in pairs:
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


def as_trained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file's rows as KTO trains on them: pairs unpaired, unpaired rows as they are."""
    return unpair(rows) if rows and "chosen" in rows[0] and "completion" not in rows[0] else rows


def read_kto_rows(ctx: StageContext, key: str = "data") -> tuple[list[dict[str, Any]], str]:
    """(rows checked row by row, 'unpaired' or 'pairs'): prompt / completion / label rows, or pairs (not yet
    unpaired, so that an eval split can hold out whole pairs)."""
    spec = getattr(ctx.section, key)
    where = f"{ctx.where}: {key}"
    rows = read_rows(spec, where)
    found = data_format(rows, where, spec.path)
    checked = check_unpaired(rows, where, spec.path) if found == "unpaired" else check_pairs(rows, where,
                                                                                                spec.path)
    return checked, found


def held_out_split(rows: list[dict[str, Any]], fraction: float, seed: int, where: str):
    """(training rows, held-out rows): a seeded random `fraction` of the rows (of the pairs, for pair data)."""
    if fraction == 0:
        return rows, []
    n_eval = max(1, round(len(rows) * fraction))
    if n_eval >= len(rows):
        raise KitError(f"{where}: eval_fraction {fraction} of {len(rows)} rows leaves nothing to train on; lower it "
                       f"or give eval_data")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held_out = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held_out], [r for i, r in enumerate(rows) if i in held_out]


def shuffled(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The rows in a seeded random order: TRL reads them in order and pairs each with its neighbour for the KL."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows


def train_eval_rows(ctx: StageContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(training rows, eval rows, the data's format), unpaired, shuffled and checked for both labels."""
    rows, found = read_kto_rows(ctx)
    if ctx.section.eval_data is not None:
        eval_rows, eval_found = read_kto_rows(ctx, "eval_data")
        eval_rows = unpair(eval_rows) if eval_found == "pairs" else eval_rows
    else:
        rows, eval_rows = held_out_split(rows, eval_fraction(ctx), ctx.seed, ctx.where)
        eval_rows = unpair(eval_rows) if found == "pairs" else eval_rows
    train_rows = unpair(rows) if found == "pairs" else rows
    labels = {row["label"] for row in train_rows}
    if len(labels) < 2:
        (only,) = labels
        raise KitError(f"{ctx.where}: all {len(train_rows)} training rows of '{ctx.section.data.path}' have label "
                       f"{str(only).lower()}; KTO needs both desirable (label true) and undesirable (label false) "
                       f"examples")
    return shuffled(train_rows, ctx.seed), shuffled(eval_rows, ctx.seed + 1), found


def balance(rows: list[dict[str, Any]], desirable_weight: float, undesirable_weight: float) -> dict[str, Any]:
    """The label counts, the paper's ratio and, when it is outside [1, 4/3], a desirable_weight that brings it back."""
    n_d = sum(1 for row in rows if row["label"])
    n_u = len(rows) - n_d
    if n_d == 0 or n_u == 0:
        return {"desirable": n_d, "undesirable": n_u}
    ratio = desirable_weight * n_d / (undesirable_weight * n_u)
    out: dict[str, Any] = {"desirable": n_d, "undesirable": n_u, "weighted_ratio": round(ratio, 3)}
    if not BALANCE[0] <= ratio <= BALANCE[1]:
        low, high = (undesirable_weight * n_u / n_d * bound for bound in BALANCE)
        out["note"] = (f"desirable_weight {desirable_weight:g} x {n_d} desirable / (undesirable_weight "
                       f"{undesirable_weight:g} x {n_u} undesirable) = {ratio:.2f}, outside the KTO paper's [1, 4/3]; "
                       f"set train.desirable_weight in [{low:.2f}, {high:.2f}] to balance the two kinds of rows")
    return out


# --- the stage ---------------------------------------------------------------------------------------------------

def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    evaluating = has_eval(ctx)
    return {
        "learning_rate": 5e-6,
        "loss_type": "kto",
        "beta": 0.1,
        "desirable_weight": 1.0,
        "undesirable_weight": 1.0,
        "max_length": ctx.model.max_seq_length,
        "train_sampling_strategy": "sequential",  # the KL pairs each row with its neighbour; the stage shuffles
        "precompute_ref_log_probs": several_passes(ctx.section.train),
        "precompute_ref_batch_size": None,
        "sync_ref_model": False,
        "disable_dropout": True,
        "activation_offloading": False,
        "gradient_checkpointing": cuda_available() if on_gpu is None else on_gpu,
        "pad_to_multiple_of": None,
        "eval_strategy": "steps" if evaluating else "no",
        "eval_steps": 25,
        "per_device_eval_batch_size": 16,
    }


def check_settings(ctx: StageContext, config) -> None:
    """What KTOTrainer would refuse (or train wrongly) deep in its __init__, said in the recipe's terms."""
    estimates_kl = config.loss_type != "apo_zero_unpaired"
    batch = config.per_device_train_batch_size
    if estimates_kl and batch < 2:
        raise KitError(f"{ctx.where}: KTO estimates its KL reference point from the other rows of a batch, so "
                       f"train.per_device_train_batch_size must be at least 2, got {batch}")
    if estimates_kl and config.train_sampling_strategy != "sequential":
        raise KitError(f"{ctx.where}: loss_type {config.loss_type!r} pairs each row with its neighbour in the batch "
                       f"for the KL estimate, which needs train.train_sampling_strategy 'sequential' (the stage "
                       f"shuffles the rows itself), got {config.train_sampling_strategy!r}")
    if config.sync_ref_model and ctx.lora is not None:
        raise KitError(f"{ctx.where}: train.sync_ref_model does not work with LoRA (the reference is a frozen "
                       f"adapter, not a model to sync); remove it, or use lora: false")


def make_config(ctx: StageContext):
    """Built once (ctx.trainer_config): the config preflight checked is the one run() trains with."""
    return ctx.trainer_config(lambda: build_stage_config(ctx))


def build_stage_config(ctx: StageContext):
    config = build_config(trainers.config_class(ctx.spec), stage_defaults=stage_defaults(ctx),
                          train=ctx.section.train, where=ctx.where, output_dir=ctx.dir.checkpoints,
                          seed=ctx.seed, on_gpu=cuda_available())
    check_settings(ctx, config)
    return config


def describe_data(ctx: StageContext, config) -> dict[str, Any]:
    spec = ctx.section.data
    out: dict[str, Any] = {"data": spec.path}
    if not on_disk(spec) or (ctx.section.eval_data is not None and not on_disk(ctx.section.eval_data)):
        out["rows"] = "hub dataset, read when the stage runs"
        return out
    train_rows, eval_rows, found = train_eval_rows(ctx)
    conversational = isinstance(train_rows[0]["completion"], list)
    read_as = ("prompt / completion / label rows" if found == "unpaired" else
               "chosen / rejected pairs, read as KTO rows (prompt, chosen, true) and (prompt, rejected, false)")
    out["format"] = read_as + (", conversational" if conversational else ", standard")
    out["rows"] = len(train_rows)
    out["labels"] = balance(train_rows, config.desirable_weight, config.undesirable_weight)
    out["order"] = f"shuffled once with seed {ctx.seed} (TRL reads KTO rows in order; the KL pairs neighbours)"
    out["eval_rows"] = len(eval_rows)
    out["eval"] = (ctx.section.eval_data.path if ctx.section.eval_data is not None
                   else f"{eval_fraction(ctx):g} of the {'pairs' if found == 'pairs' else 'rows'} held out "
                        f"(seed {ctx.seed})")
    return out


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.models.backend import choose_backend, prepare_backend

    if on_disk(ctx.section.data):
        train_eval_rows(ctx)  # the rows' faults first: they need no library
    prepare_backend(choose_backend(ctx.model.backend))
    config = make_config(ctx)
    return {"init": ctx.section.init or "base model",
            "reference": f"frozen copy of the starting policy ({ctx.section.init or 'base model'})",
            **describe_data(ctx, config),
            **config_summary(config, stage_defaults(ctx), ctx.section.train), **describe_held_out(plan_held_out(ctx))}


def build_trainer(ctx: StageContext, config=None):
    """The KTOTrainer this stage trains with, its loaded policy, and how the reference was made."""
    system, path = ctx.section.system_prompt, ctx.section.data.path
    train_rows, eval_rows, _ = train_eval_rows(ctx)
    train_rows, eval_rows = (apply_system_prompt(rows, system, ctx.where, path) for rows in (train_rows, eval_rows))
    config = config or make_config(ctx)
    labels = balance(train_rows, config.desirable_weight, config.undesirable_weight)
    if "note" in labels:
        ctx.log(f"{ctx.name}: note: {labels['note']}")
    loaded = load_stage_policy(ctx.model, lora=ctx.lora, seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    trainer, reference = trainers.build_trainer(
        ctx.spec, loaded, args=config, reference=True, ref_model=None, train_dataset=to_dataset(train_rows),
        eval_dataset=to_dataset(eval_rows) if eval_rows else None, processing_class=loaded.tokenizer,
        log=ctx.log, label=ctx.name, where=ctx.where)
    dropped = len(train_rows) - len(trainer.train_dataset)
    if dropped:
        ctx.log(f"{ctx.name}: {dropped} of {len(train_rows)} training rows have a prompt of max_length "
                f"{config.max_length} tokens or more and were left out")
    if len(trainer.train_dataset) == 0:
        raise KitError(f"{ctx.where}: every training row's prompt is longer than max_length {config.max_length} "
                       f"tokens; raise model.max_seq_length or train.max_length")
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

    rows = [row for row in read_metrics(metrics_path) if "loss" in row and "kl" in row]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    labels = [bool(label) for label in trainer.train_dataset["label"]]
    summary: dict[str, Any] = {
        **trainers.trainer_summary(trainer),
        "steps": trainer.state.global_step, "resumed_from": resume.name if resume else None,
        "reference": reference, "beta": trainer.args.beta, "backend": loaded.backend,
        "labels": balance([{"label": label} for label in labels], trainer.args.desirable_weight,
                          trainer.args.undesirable_weight),
        "first_loss": first.get("loss"), "last_loss": last.get("loss"),
        "first": {k: first[k] for k in TRACKED if k in first}, "last": {k: last[k] for k in TRACKED if k in last},
        "eval": {k.removeprefix("eval_"): v for k, v in evaluated.items()
                 if k in ("eval_loss", *(f"eval_{t}" for t in TRACKED))},
    }
    e = summary["eval"]
    if "rewards/margins" in e:
        summary["headline"] = (f"eval margin {e['rewards/margins']:.3f} (desirable {e['rewards/chosen']:.3f}, "
                               f"undesirable {e['rewards/rejected']:.3f}); loss {first.get('loss', 0):.3f} -> "
                               f"{last.get('loss', 0):.3f}")
    elif rows:
        summary["headline"] = f"loss {first['loss']:.3f} -> {last['loss']:.3f}, kl {last['kl']:.3f}"
    return held_out.summarize(summary)


SPEC = StageSpec(
    type="kto", order=40, module=__name__, section=KTOSection,
    summary="TRL KTOTrainer on thumbs-up / thumbs-down rows (or pairs it unpairs), against the starting policy",
    output="policy", init_from=("policy",), trainer="trl.trainer.kto_trainer:KTOTrainer",
    config="trl.trainer.kto_config:KTOConfig", rows=Rows(shape="pairs", as_trained=as_trained),
    memory=Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "max_length"),
                  reference="always"),
    display=Display(
        metrics=(("loss", "loss"), ("rewards/margins", "margin"), ("rewards/chosen", "desirable"),
                 ("rewards/rejected", "undesirable"), ("kl", "kl"), ("learning_rate", "lr")),
        panels=(("loss", "loss", ("loss", "eval_loss")),
                ("reward margin (desirable - undesirable)", "margin", ("rewards/margins", "eval_rewards/margins")),
                ("implicit rewards", "reward", ("rewards/chosen", "rewards/rejected", "eval_rewards/chosen",
                                                "eval_rewards/rejected")),
                ("KL reference point z0", "KL", ("kl", "eval_kl")))),
    launcher=Launcher("data parallel (TRL KTOTrainer)"),
    defaults=stage_defaults)
