"""Turn a stage's `train:` block into a TRL config, field by field, on top of the kit's explicit defaults.

Every hyperparameter a stage relies on is set here or in the stage (never left to TRL's or Unsloth's default,
which differ and move between versions); the effective values are recorded in the stage's `config.json`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, did_you_mean

# Shared by every trainer-based stage; a stage adds its own on top and the recipe's `train:` wins.
COMMON_DEFAULTS: dict[str, Any] = {
    "learning_rate": 2e-4,
    "num_train_epochs": 1,
    "max_steps": -1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "logging_steps": 5,
    "save_strategy": "steps",
    "save_steps": 50,
    "save_total_limit": 2,
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
}


def config_fields(config_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls) if f.init}


def check_fields(config_cls, train: dict[str, Any], where: str, reserved: set[str] = frozenset()) -> None:
    names = config_fields(config_cls)
    for key in train:
        if key in reserved:
            raise KitError(f"{where}: train.{key} is set by the kit ({reserved_reason(key)}); remove it")
        if key not in names:
            raise KitError(f"{where}: train.{key} is not a {config_cls.__name__} field"
                           f"{did_you_mean(key, names)}")


def reserved_reason(key: str) -> str:
    return {"output_dir": "checkpoints go to the stage folder", "seed": "set the recipe's top-level seed"}.get(
        key, "it is derived from the recipe")


def device_defaults(on_gpu: bool) -> dict[str, Any]:
    """CPU-safe precision without a GPU; bf16 and Unsloth's 8-bit AdamW on one."""
    if on_gpu:
        import torch

        bf16 = torch.cuda.is_bf16_supported()
        return {"use_cpu": False, "bf16": bf16, "fp16": not bf16, "optim": "adamw_8bit"}
    return {"use_cpu": True, "bf16": False, "fp16": False, "optim": "adamw_torch"}


def build_config(config_cls, *, stage_defaults: dict[str, Any], train: dict[str, Any], where: str,
                 output_dir: Path, seed: int, on_gpu: bool):
    """Build `config_cls` from COMMON_DEFAULTS < device defaults < stage defaults < the recipe's `train:`."""
    check_fields(config_cls, train, where, reserved={"output_dir", "seed"})
    values = {**COMMON_DEFAULTS, **device_defaults(on_gpu), **stage_defaults, **train}
    values = {k: v for k, v in values.items() if k in config_fields(config_cls)}
    if not on_gpu:
        values.update(use_cpu=True, bf16=False, fp16=False)
    values.update(output_dir=str(output_dir), seed=seed, data_seed=seed)
    try:
        return config_cls(**values)
    except (ValueError, TypeError) as error:
        raise KitError(f"{where}: {config_cls.__name__} rejected the train settings: "
                       f"{str(error).splitlines()[0]}") from None


def explicit_values(config, stage_defaults: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """The config's effective values for every field the kit or the recipe set (after TRL's __post_init__)."""
    keys = set(COMMON_DEFAULTS) | set(stage_defaults) | set(train) | {"use_cpu", "bf16", "fp16", "optim", "seed"}
    out = {}
    for key in sorted(keys):
        if hasattr(config, key):
            value = getattr(config, key)
            out[key] = getattr(value, "value", value)
    from kitcli.runner import redact

    return redact(out)


def config_dict(config) -> dict[str, Any]:
    """All fields, JSON-safe, with secrets left out."""
    from kitcli.runner import redact

    raw = config.to_dict()
    return redact({k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
                   for k, v in raw.items()})
