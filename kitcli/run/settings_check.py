"""`kit check`'s settings: what a recipe sets that its trainer will not use, lengths the model has no positions for,
and the kit's defaults where they differ from the trainer config's own (what a config copied from elsewhere ran).

    unused settings     vLLM settings without use_vllm, dataset_text_field on rows without a text column: warnings
    positions           model.max_seq_length, train.max_length, prompt + completion lengths above the model's
                        max_position_embeddings: warnings
    kit defaults        per stage, each key the recipe leaves unset whose kit default differs from the config
                        class's default (learning_rate 5e-6 against GRPOConfig's 1e-6, beta, loss_type ...): info
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding

# Fields the kit sets for the machine or its own bookkeeping (where checkpoints and logs go): not a method's choice.
BOOKKEEPING = {"use_cpu", "bf16", "fp16", "optim", "output_dir", "seed", "data_seed", "logging_steps",
               "save_strategy", "save_steps", "save_total_limit", "report_to", "disable_tqdm", "dataloader_num_workers",
               "gradient_checkpointing", "log_completions", "logging_first_step"}


def unused_findings(ctx: StageContext, rows: list[dict[str, Any]], values: dict[str, Any]) -> list[Finding]:
    """Keys the trainer accepts but will not read in this configuration."""
    train = declared(ctx.stage, "train") or {}
    found = []
    vllm = sorted(key for key in train if key.startswith("vllm_"))
    if vllm and not values.get("use_vllm"):
        found.append(Finding(ctx.name, "unused settings", "warn", ", ".join(f"train.{key}" for key in vllm),
                             "set without use_vllm, so the trainer never reads them (the kit generates with "
                             "transformers); remove them"))
    if "dataset_text_field" in train and rows and train["dataset_text_field"] not in rows[0]:
        columns = ", ".join(sorted(rows[0]))
        found.append(Finding(ctx.name, "unused settings", "warn", f"train.dataset_text_field "
                                                                  f"{train['dataset_text_field']!r}",
                             f"the rows have no such column ({columns}): TRL reads prompt/completion or messages "
                             f"rows as they are and never reads it; remove it"))
    return found


def max_positions(tokenizer) -> int | None:
    """The model's max_position_embeddings, from the config.json beside its tokenizer (None when not on disk)."""
    config = Path(getattr(tokenizer, "name_or_path", "") or "") / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return value if isinstance(value, int) else None


def position_findings(ctx: StageContext, values: dict[str, Any], tokenizer) -> list[Finding]:
    """Lengths the recipe allows beyond the positions the model was built with."""
    positions = max_positions(tokenizer)
    if positions is None:
        return []
    lengths = {"model.max_seq_length": ctx.model.max_seq_length}
    for key in ("max_length", "max_completion_length"):
        if isinstance(values.get(key), int):
            lengths[f"train.{key}"] = values[key]
    over = {name: n for name, n in lengths.items() if n > positions}
    if not over:
        return []
    listed = ", ".join(f"{name} {n}" for name, n in over.items())
    return [Finding(ctx.name, "positions", "warn", f"{listed} vs max_position_embeddings {positions}",
                    f"longer than the model has positions for: tokens past {positions} get positions it never saw "
                    f"(or an error); set them to {positions} or less")]


def kit_default_findings(ctx: StageContext) -> list[Finding]:
    """The kit's defaults that differ from the config class's own, for the keys the recipe leaves unset: what a
    config written for the trainer itself (TRL's CLI, a notebook) would have run instead."""
    from kitcli.recipe.config_fields import MISSING, config_fields
    from kitcli.training.trl_config import COMMON_DEFAULTS

    spec = ctx.spec
    if spec.config is None:
        return []
    fields, config = config_fields(spec.config), spec.config_name
    kit = {**COMMON_DEFAULTS, **(spec.defaults(ctx, on_gpu=False) if spec.defaults is not None else {})}
    train = declared(ctx.stage, "train") or {}
    differ = [(key, value, fields[key].default) for key, value in kit.items()
              if key in fields and key not in train and key not in BOOKKEEPING
              and fields[key].default is not MISSING and fields[key].default != value]
    if not differ:
        return []
    listed = ", ".join(f"{key} {value!r} ({config}: {default!r})" for key, value, default in sorted(differ))
    return [Finding(ctx.name, "kit defaults", "info", listed,
                    f"the kit's explicit defaults where they differ from {config}'s own; set any of them in train: "
                    f"to run the value you copied")]
