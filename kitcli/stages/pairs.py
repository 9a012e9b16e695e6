"""Preference pairs, shared by the stages that train on them (reward model, DPO) and read them (KTO's pair check):
the recipe section with its eval split, reading and checking chosen / rejected rows, the seeded train / eval split,
the final evaluation and what --dry-run shows of the data."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from kitcli.data.rows import read_rows, require_columns
from kitcli.errors import KitError
from kitcli.recipe.config_fields import POSITIVE, TRAINING_RANGES, Range
from kitcli.recipe.schema import DataSpec, TrainingSection, fail
from kitcli.recipe.stage_context import StageContext
from kitcli.training.progress import read_metrics

PAIR_COLUMNS = ["chosen", "rejected"]
DEFAULT_EVAL_FRACTION = 0.1


class PreferenceSection(TrainingSection):
    """A stage trained on preference pairs (reward model, DPO), with an eval split."""

    sequences_per_row: ClassVar[int] = 2  # chosen and rejected go through the model together (kit plan)
    # every preference loss scales a log-ratio by beta: 0 would train nothing (or divide by it: SimPO's gamma)
    train_ranges: ClassVar[dict[str, Range]] = {**TRAINING_RANGES, "beta": POSITIVE}

    eval_data: DataSpec | None = Field(None, description="Held-out pairs (instead of eval_fraction).")
    eval_fraction: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description=f"Share of the pairs held out at random (default {DEFAULT_EVAL_FRACTION}; 0: none).")

    @model_validator(mode="after")
    def one_eval_split(self):
        if self.eval_data is not None and self.eval_fraction is not None:
            raise fail("give eval_data or eval_fraction, not both")
        return self


# --- preference data ------------------------------------------------------------------------------------------------

def on_disk(spec: Any) -> bool:
    """A local file (a DataSpec, or its dict); anything else is a hub dataset, which describe() must not
    download."""
    return Path(spec["path"] if isinstance(spec, dict) else spec.path).is_file()


def check_pair(row: dict[str, Any], number: int, where: str, path: str) -> None:
    """chosen / rejected (and prompt, if present) are all text or all lists of {role, content} messages."""
    def kind(value):
        if isinstance(value, str) and value.strip():
            return "text"
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and ("content" in m or
                                                      "tool_calls" in m) for m in value):  # a tool call may have none
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
    spec = getattr(ctx.section, key)
    rows = read_rows(spec, f"{ctx.where}: {key}")
    if not all(c in rows[0] for c in PAIR_COLUMNS):
        suggest_pair_mapping(set(rows[0]), f"{ctx.where}: {key}", spec.path)
    require_columns(rows, [PAIR_COLUMNS], f"{ctx.where}: {key}", spec.path)
    columns = (["prompt"] if "prompt" in rows[0] else []) + PAIR_COLUMNS
    for number, row in enumerate(rows, start=1):
        if any(c not in row for c in columns):
            missing = [c for c in columns if c not in row]
            raise KitError(f"{ctx.where}: row {number} of '{spec.path}' has no '{missing[0]}' (the first row has "
                           f"{', '.join(columns)})")
        check_pair(row, number, ctx.where, spec.path)
    return [{c: row[c] for c in [*columns, "tools"] if c in row} for row in rows]  # tools: the schemas TRL renders


def eval_fraction(ctx: StageContext) -> float:
    fraction = ctx.section.eval_fraction if ctx.section.eval_fraction is not None else DEFAULT_EVAL_FRACTION
    if ctx.section.eval_data is not None and ctx.section.eval_fraction is not None:
        raise KitError(f"{ctx.where}: give eval_data or eval_fraction, not both")
    if ctx.section.eval_data is not None:
        return 0.0
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise KitError(f"{ctx.where}: eval_fraction must be a number in [0, 1), e.g. 0.1; got {fraction!r}")
    return float(fraction)


def has_eval(ctx: StageContext) -> bool:
    return ctx.section.eval_data is not None or eval_fraction(ctx) > 0


def train_eval_rows(ctx: StageContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training rows and the eval rows: `eval_data`, or a seeded random `eval_fraction` of `data`."""
    rows = preference_rows(ctx)
    if ctx.section.eval_data is not None:
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
    out: dict[str, Any] = {"data": ctx.section.data.path}
    if not on_disk(ctx.section.data) or (ctx.section.eval_data is not None and not on_disk(ctx.section.eval_data)):
        out["rows"] = "hub dataset, read when the stage runs"
        out["eval"] = (ctx.section.eval_data.path if ctx.section.eval_data is not None
                       else f"{eval_fraction(ctx):g} of the rows held out")
        return out
    train_rows, eval_rows = train_eval_rows(ctx)
    out["format"] = ("conversational" if isinstance(train_rows[0]["chosen"], list) else "standard") + \
        ("" if "prompt" in train_rows[0] else ", implicit prompt")
    out["rows"] = len(train_rows)
    out["eval_rows"] = len(eval_rows)
    out["eval"] = (ctx.section.eval_data.path if ctx.section.eval_data is not None
                   else f"{eval_fraction(ctx):g} of the rows held out (seed {ctx.seed})")
    return out
