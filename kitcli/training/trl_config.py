"""Turn a stage's `train:` block into a TRL config, field by field, on top of the kit's explicit defaults.

Every hyperparameter a stage relies on is set here or in the stage (never left to TRL's or Unsloth's default,
which differ and move between versions); the effective values are recorded in the stage's `config.json`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kitcli.errors import KitError, did_you_mean
from kitcli.rundir import redact

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


# The package each tracker of transformers' `report_to` needs (pip names).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow",
                    "comet_ml": "comet-ml", "neptune": "neptune", "clearml": "clearml", "dvclive": "dvclive",
                    "swanlab": "swanlab", "codecarbon": "codecarbon", "azure_ml": "azureml-core",
                    "dagshub": "dagshub mlflow", "kubeflow": "kubeflow", "flyte": "flytekit"}


def check_trackers(report_to: Any, where: str) -> None:
    """train.report_to names trackers whose packages are installed; refused before any model loads (transformers
    would raise only when the trainer is built, after the model has loaded). transformers says what is installed."""
    if report_to is None or report_to in ("none", "all", []):
        return
    names = [report_to] if isinstance(report_to, str) else report_to
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise KitError(f"{where}: train.report_to must be a tracker name or a list of them, got {report_to!r}")
    if "none" in names and len(names) > 1:  # transformers reads "none" only as the whole value
        raise KitError(f"{where}: train.report_to {report_to!r}: 'none' turns every tracker off, so it stands alone; "
                       f"give report_to: none, or the trackers without it")
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    available = set(get_available_reporting_integrations()) | {"flyte"}  # flyte's callback checks for itself
    for name in names:
        if name == "none":
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            raise KitError(f"{where}: train.report_to '{name}' is not a tracker transformers knows"
                           f"{did_you_mean(name, INTEGRATION_TO_CALLBACK)} (one of "
                           f"{', '.join(INTEGRATION_TO_CALLBACK)}, or none)")
        if name not in available:
            package = TRACKER_PACKAGES.get(name, name)
            raise KitError(f"{where}: train.report_to '{name}' needs the {package} package, which is not installed; "
                           f"pip install {package} (into the environment kit runs in), or remove report_to")


# Settings that need a package to be installed (the config accepts them either way; the trainer fails once the model
# has loaded): field -> (the module it imports, its pip name). `optim` values are checked in OPTIMIZER_PACKAGES.
NEEDS_PACKAGE = {"use_liger_kernel": ("liger_kernel", "liger-kernel"), "deepspeed": ("deepspeed", "deepspeed")}
OPTIMIZER_PACKAGES = {"galore": ("galore_torch", "galore-torch"), "apollo": ("apollo_torch", "apollo-torch"),
                      "lomo": ("lomo_optim", "lomo-optim"), "schedule_free": ("schedulefree", "schedulefree"),
                      "grokadamw": ("grokadamw", "grokadamw"), "stable_adamw": ("optimi", "torch-optimi")}
# The older forms a config still maps in its own __post_init__ (TRL 1.15's GRPOConfig.scale_rewards: True ->
# "group", False -> "none"): read as the value they stand for before the config is built, so that what the kit
# records (and puts back after a library's rewrite) is the form the trainer reads.
OLDER_FORMS: dict[str, dict[Any, Any]] = {"scale_rewards": {True: "group", False: "none"}}


def gpu_only_optimizer(name: Any) -> bool:
    """An optimizer with no CPU kernels (bitsandbytes' 8-bit and paged states), as Unsloth's CPU backend decides it
    (unsloth_zoo/cpu/trainer.py, normalize_cpu_training_arguments)."""
    text = str(getattr(name, "value", name) or "").lower()
    return any(tag in text for tag in ("8bit", "paged", "bnb"))


def check_packages(values: dict[str, Any], where: str) -> None:
    """A setting whose package is not installed is one line before any model loads (transformers would fail only
    when it builds the trainer, after the model has loaded)."""
    import importlib.util

    wanted = [(f"train.{key}", *NEEDS_PACKAGE[key]) for key in NEEDS_PACKAGE if values.get(key)]
    optim = str(getattr(values.get("optim"), "value", values.get("optim")) or "")
    wanted += [(f"train.optim {optim}", *package) for prefix, package in OPTIMIZER_PACKAGES.items()
               if optim.startswith(prefix)]
    for setting, module, pip_name in wanted:
        if importlib.util.find_spec(module) is None:
            raise KitError(f"{where}: {setting} needs the {pip_name} package, which is not installed; pip install "
                           f"{pip_name} (into the environment kit runs in), or remove the setting")


def check_network(values: dict[str, Any], where: str) -> None:
    """push_to_hub (and hub_model_id with it) uploads to the Hugging Face Hub at every save: offline, or with no way
    to reach it, the first checkpoint would end the run. One line before any model loads."""
    if not values.get("push_to_hub"):
        return
    from kitcli.models.backend import hub_offline

    if hub_offline():
        raise KitError(f"{where}: train.push_to_hub needs the network, and HF_HUB_OFFLINE is set; remove push_to_hub "
                       f"(and hub_model_id), or unset HF_HUB_OFFLINE; `kit export` uploads a finished run later")
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as error:
        raise KitError(f"{where}: train.push_to_hub needs the network, and huggingface.co cannot be reached from "
                       f"here ({error.strerror or error}); remove push_to_hub (and hub_model_id), or run where the "
                       f"Hub can be reached") from None


def cpu_substitutes(values: dict[str, Any], explicit: set[str]) -> list[str]:
    """On a CPU the kit trains in float32 with a CPU optimizer; a GPU recipe's values are replaced, each with a note
    (the dry run, `kit check` and the lock show them): bf16 / fp16 off, an 8-bit or paged optimizer -> torch's fused
    AdamW (what Unsloth's CPU backend would pick)."""
    notes = []
    for key in ("bf16", "fp16"):
        if key in explicit and values.get(key):
            notes.append(f"train.{key}: true is a GPU setting; on this CPU the kit trains in float32 ({key} "
                         f"false)")
    if gpu_only_optimizer(values.get("optim")):
        notes.append(f"train.optim: {values['optim']} needs a GPU (bitsandbytes' 8-bit / paged states); this CPU "
                     f"run uses adamw_torch_fused (a GPU run uses {values['optim']})")
        values["optim"] = "adamw_torch_fused"
    elif str(getattr(values.get("optim"), "value", values.get("optim"))) == "adamw_torch":
        if "optim" in explicit:
            notes.append("train.optim: adamw_torch runs as adamw_torch_fused on a CPU (the same AdamW in torch's "
                         "fused kernel, as Unsloth's CPU backend has it)")
        values["optim"] = "adamw_torch_fused"
    values.update(use_cpu=True, bf16=False, fp16=False)
    return notes


def older_forms(values: dict[str, Any], explicit: set[str]) -> list[str]:
    """Values written in a form the config still maps itself (OLDER_FORMS): read as the value they stand for."""
    notes = []
    for key, forms in OLDER_FORMS.items():
        value = values.get(key)
        if key in values and isinstance(value, bool) and value in forms:
            values[key] = forms[value]
            if key in explicit:
                notes.append(f"train.{key}: {str(value).lower()} is the older form of {forms[value]!r} (as "
                             f"TRL maps it); read as {forms[value]!r}")
    return notes


def reserved_reason(key: str) -> str:
    return {"output_dir": "checkpoints go to the stage folder", "seed": "set the recipe's top-level seed"}.get(
        key, "it is derived from the recipe")


def device_defaults(on_gpu: bool) -> dict[str, Any]:
    """CPU-safe precision without a GPU (and torch's fused AdamW, which Unsloth's CPU backend would choose anyway);
    bf16 and Unsloth's 8-bit AdamW on one."""
    if on_gpu:
        import torch

        bf16 = torch.cuda.is_bf16_supported()
        return {"use_cpu": False, "bf16": bf16, "fp16": not bf16, "optim": "adamw_8bit"}
    return {"use_cpu": True, "bf16": False, "fp16": False, "optim": "adamw_torch_fused"}


def build_config(config_cls, *, stage_defaults: dict[str, Any], train: dict[str, Any], where: str,
                 output_dir: Path, seed: int, on_gpu: bool):
    """Build `config_cls` from COMMON_DEFAULTS < device defaults < stage defaults < the recipe's `train:`.

    Then every value the kit passed is compared with what the config holds: a library that rewrites one (Unsloth's
    generated configs do, e.g. scale_rewards "none" whenever loss_type is dr_grpo) has it put back, and the rewrite
    is recorded in `config.kit_rewrites` (shown by --dry-run, written to the lock file). The resolved values and the
    names the recipe set explicitly travel with the config (`kit_resolved`, `kit_explicit`) for the check after the
    trainer is built (kitcli/training/trainers.py)."""
    check_fields(config_cls, train, where, reserved={"output_dir", "seed"})
    values = {**COMMON_DEFAULTS, **device_defaults(on_gpu), **stage_defaults, **train}
    check_trackers(values.get("report_to"), where)
    values = {k: v for k, v in values.items() if k in config_fields(config_cls)}
    if values.get("report_to") == ["none"]:
        values["report_to"] = "none"  # transformers reads "none" only as the whole value, not as a list's item
    check_packages(values, where)
    check_network(values, where)
    notes = older_forms(values, set(train))
    if not on_gpu:
        notes += cpu_substitutes(values, set(train))
    values.update(output_dir=str(output_dir), seed=seed, data_seed=seed)
    try:
        config = config_cls(**values)
    except (ValueError, TypeError) as error:
        raise KitError(f"{where}: {config_cls.__name__} rejected the train settings: "
                       f"{str(error).splitlines()[0]}") from None
    config.kit_resolved = values
    config.kit_explicit = set(train)
    config.kit_notes = notes
    config.kit_rewrites = restore_rewrites(config, values, set(train), where)
    derive_mixed_precision(config)
    return config


def derive_mixed_precision(config) -> None:
    """mixed_precision from the config's bf16 / fp16 as the kit left them, after restore_rewrites.

    Derived last, because two libraries decide it otherwise: transformers 5 reads ACCELERATE_MIXED_PRECISION into a
    config whose bf16 and fp16 are both off, and Unsloth's CPU backend turns bf16 off on a CPU without native bf16
    (unsloth_zoo/cpu/runtime.py, cpu_bf16_supported) before restore_rewrites puts the kit's value back. Derived
    before the restore, a config would say bf16=True with mixed_precision "no" on such a CPU only."""
    if isinstance(getattr(type(config), "mixed_precision", None), property):  # the kit's PPOConfig derives it
        return
    config.mixed_precision = "bf16" if config.bf16 else "fp16" if config.fp16 else "no"


def canonical(value: Any) -> Any:
    """A config value in the form the kit passes it (enums as their value, lists for tuples)."""
    value = getattr(value, "value", value)
    if isinstance(value, tuple):
        return [canonical(v) for v in value]
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


# Values a config normalises without changing their meaning: (field, as passed) -> accepted forms.
EQUIVALENT = {("report_to", "none"): ([], ["none"], "none")}


def same_value(key: str, passed: Any, held: Any) -> bool:
    held = canonical(held)
    if held == canonical(passed):
        return True
    return isinstance(passed, str) and held in EQUIVALENT.get((key, passed), ())


def restore_rewrites(config, values: dict[str, Any], explicit: set[str], where: str) -> list[dict[str, Any]]:
    """Put back every value the config's own code changed; returns what was rewritten."""
    rewrites = []
    for key, passed in values.items():
        held = getattr(config, key, passed)
        if same_value(key, passed, held):
            continue
        rewrite = {"field": key, "kit": passed, "library": canonical(held),
                   "from": "train" if key in explicit else "kit default"}
        if hasattr(held, "value"):  # an enum the config derived: putting a raw value back could break its users
            if key in explicit:
                raise KitError(f"{where}: {type(config).__name__} changed train.{key} from {passed!r} to "
                               f"{canonical(held)!r}, and the kit cannot put it back; set another value")
            rewrite["action"] = "kept the library's value"
        else:
            setattr(config, key, passed)
            rewrite["action"] = "restored"
        rewrites.append(rewrite)
    return rewrites


CHANGED = "changed from the recipe"  # the key of a stage's notes in its description (the dry run, the lock)


def config_summary(config, stage_defaults: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """What --dry-run and the lock file show of a stage's config: the explicit values, and any rewrite."""
    summary = {type(config).__name__: explicit_values(config, stage_defaults, train)}
    if getattr(config, "kit_notes", None):
        summary[CHANGED] = list(config.kit_notes)
    rewrites = getattr(config, "kit_rewrites", [])
    if rewrites:
        summary["rewritten by the library"] = [
            f"{r['field']}: {r['kit']!r} ({r['from']}) -> {r['library']!r}; {r['action']}" for r in rewrites]
    return summary


def explicit_values(config, stage_defaults: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """The config's effective values for every field the kit or the recipe set (after TRL's __post_init__)."""
    keys = set(COMMON_DEFAULTS) | set(stage_defaults) | set(train) | {"use_cpu", "bf16", "fp16", "mixed_precision",
                                                                       "optim", "seed"}
    out = {}
    for key in sorted(keys):
        if hasattr(config, key):
            value = getattr(config, key)
            out[key] = getattr(value, "value", value)
    return redact(out)


def config_dict(config) -> dict[str, Any]:
    """All fields, JSON-safe, with secrets left out (credentials by name, kitcli/rundir.py)."""
    raw = config.to_dict()
    # to_dict() writes every *_token field as a placeholder ("<EOS_TOKEN>"): record the real eos_token / pad_token,
    # which a rerun or a hand-written TRL script needs; redact() still hides hub_token
    raw.update({key: getattr(config, key) for key in raw if key.endswith("_token") and hasattr(config, key)})
    return redact({k: (v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v))
                   for k, v in raw.items()})
