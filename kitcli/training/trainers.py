"""Which trainer classes train a stage, and building one the same way for every stage.

A stage type's StageSpec names its trainer and config classes ("module:Class": `trl.trainer.*`, `trl.experimental.*`
or a plugin's); this module finds the class this process trains with.

Two families of trainers exist for one TRL version. On a GPU, `import unsloth` replaces TRL's `GRPOTrainer`,
`DPOTrainer`, `RewardTrainer`, `RLOOTrainer`, `KTOTrainer` (and their configs) with classes it generates from TRL's
source (`unsloth/models/rl.py`): they change defaults, some explicit values and the loss (docs/stages.md). On a CPU
Unsloth leaves TRL's own classes in place. `KIT_TRAINERS=unsloth` makes a CPU process use Unsloth's generated
trainers too (importing `unsloth.models` runs Unsloth's PatchFastRL), which is how the kit's tests check the path a
GPU runs; `KIT_TRAINERS=trl` asks for TRL's own (available only where Unsloth has not replaced them).

`build_trainer` is the one way a stage makes a trainer: it keeps the trainable weights in the dtype they were
loaded in (TRL casts a 4-bit model's LoRA weights to bfloat16, which on a float32 CPU run rounds the weights
`init:` passed on and loses small AdamW steps), keeps training in float32 when the kit's config asks for no mixed
precision (Unsloth's trainers otherwise switch to fp16 autocast, on a CPU too), and says which class it built.
"""

from __future__ import annotations

import os
from typing import Any

from kitcli import libraries
from kitcli.errors import KitError
from kitcli.training.trl_config import canonical, same_value

FAMILY_ENV = "KIT_TRAINERS"
FAMILIES = ("auto", "trl", "unsloth")
STOCK_MARKER = "trl.trainer.grpo_trainer:GRPOTrainer"  # TRL's own GRPOTrainer captured: TRL's family is available
_stock: dict[str, type] = {}  # "module:Class" -> TRL's own class, captured before Unsloth's patch replaces it


def class_paths() -> list[str]:
    """Every trainer and config class ("module:Class") the stage types name."""
    from kitcli.recipe import stage_types

    paths = [p for spec in stage_types.specs().values() for p in (spec.trainer, spec.config) if p]
    return list(dict.fromkeys(p for p in paths if not p.startswith("kitcli.")))


def import_module(module: str):
    """Import a trainer's module; TRL's experimental ones without their one-time warning."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


def binding(stage_type: str) -> tuple[str, str]:
    """(trainer, config) "module:Class" paths of a stage type that trains with a trainer class."""
    from kitcli.recipe import stage_types

    spec = stage_types.spec(stage_type)
    if spec.trainer is None or spec.config is None:
        raise KitError(f"stage type '{stage_type}' names no trainer and config classes in its StageSpec "
                       f"(trainer=, config=); it trains with its own loop")
    return spec.trainer, spec.config


def is_unsloth_class(cls: type) -> bool:
    return cls.__name__.startswith("Unsloth") or bool(getattr(cls, "_unsloth_patched_rl_config", False))


def requested_family() -> str:
    family = os.environ.get(FAMILY_ENV, "auto").strip().lower() or "auto"
    if family not in FAMILIES:
        raise KitError(f"{FAMILY_ENV}={os.environ[FAMILY_ENV]!r}: expected one of {', '.join(FAMILIES)}")
    return family


def capture_stock() -> None:
    """Remember TRL's own classes while they are still TRL's (on a CPU, before any forced patch)."""
    from kitcli.recipe.stage_spec import split_path

    for path in class_paths():
        module, name = split_path(path)
        cls = getattr(import_module(module), name)
        if path not in _stock and not is_unsloth_class(cls):
            _stock[path] = cls


def unsloth_patched() -> bool:
    import trl

    return is_unsloth_class(trl.GRPOTrainer)


def use_unsloth_trainers() -> None:
    """Replace TRL's trainers by Unsloth's generated ones in this process, as `import unsloth` does on a GPU."""
    import unsloth  # noqa: F401  (before trl, as always)

    from kitcli.models.backend import allow_inductor_pool_aliasing

    allow_inductor_pool_aliasing()
    if unsloth_patched():
        return
    capture_stock()
    from unsloth.models import rl  # importing unsloth.models runs PatchFastRL: every TRL trainer but SFT on a CPU

    if not unsloth_patched():  # UNSLOTH_ALLOW_CPU=1 makes PatchFastRL a no-op; patch the trainers one by one
        patch_one_by_one(rl)


def patch_one_by_one(rl) -> None:
    """Unsloth's PatchFastRL for the trainers the stage types name, in its order: TRL's experimental modules are
    imported first (so one subclassing SFTTrainer keeps TRL's base), then `trl.trainer.*` and `trl.experimental.*`
    are patched; a plugin's own trainer is left as it is."""
    from kitcli.recipe.stage_spec import split_path

    modules = list(dict.fromkeys(split_path(p)[0] for p in class_paths() if p.endswith("Trainer")))
    experimental = {m.split(".")[2]: import_module(m) for m in modules if m.startswith("trl.experimental.")}
    for module in modules:
        if module.startswith("trl.trainer."):
            rl._patch_trl_rl_trainers(module.rsplit(".", 1)[1])
    for name, module in experimental.items():
        rl._patch_trl_experimental_trainer(name, module)


def family() -> str:
    """'unsloth' or 'trl': whose classes this process trains with."""
    requested = requested_family()
    if requested == "unsloth":
        use_unsloth_trainers()
        return "unsloth"
    if requested == "trl" or not unsloth_patched():
        if not _stock:
            capture_stock()
        if requested == "trl" and STOCK_MARKER not in _stock:
            raise KitError(f"{FAMILY_ENV}=trl: TRL's own trainers are not available in this process (Unsloth "
                           f"replaced them when it was imported, as it does on a GPU); unset {FAMILY_ENV}")
        return "trl" if STOCK_MARKER in _stock else "unsloth"
    return "unsloth"


def lookup(path: str) -> type:
    """The class at `path` ("module:Class", e.g. trl.trainer.dpo_config:DPOConfig) of the family this process
    trains with. A trainer Unsloth does not rewrite here (SFT on a CPU, a plugin's) is the one its module holds."""
    from kitcli.recipe.stage_spec import split_path

    chosen = family()
    if chosen == "trl" and path in _stock:
        return _stock[path]
    module, name = split_path(path)
    return getattr(import_module(module), name)


def trainer_class(stage_type: str) -> type:
    return lookup(binding(stage_type)[0])


def config_class(stage_type: str) -> type:
    return lookup(binding(stage_type)[1])


def is_grpo_trainer(stage_type: str) -> bool:
    """Whether the stage trains with (TRL's or Unsloth's) GRPOTrainer, which gets kitcli/training/unsloth_grpo.py."""
    return binding(stage_type)[0].endswith(":GRPOTrainer")


def describe_class(cls: type) -> str:
    return f"{cls.__name__} ({'Unsloth' if is_unsloth_class(cls) else 'TRL'})"


# --- building ---------------------------------------------------------------------------------------------------

REFERENCE_ADAPTER = "ref"  # the name TRL gives the frozen copy of the starting adapter (DPO, GRPO with beta > 0, ...)


def trainable_weights(model) -> dict[str, Any]:
    """A copy of the trainable weights of a LoRA model (nothing for full fine-tuning, whose copy would be the
    whole model)."""
    if not hasattr(model, "peft_config"):
        return {}
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def restore_dtype(model, start: dict[str, Any]) -> None:
    """Undo TRL's cast of a 4-bit model's LoRA weights to bfloat16 (the QLoRA recipe for bf16 GPUs): put back the
    weights as loaded."""
    for name, parameter in model.named_parameters():
        if name in start and parameter.dtype != start[name].dtype:
            parameter.data = start[name].clone()


def build_trainer(stage_type: str, loaded, *, args, reference: bool = False, log=print, label: str = "",
                  where: str = "", unsloth: dict[str, Any] | None = None, **kwargs):
    """Construct the stage's trainer around `loaded.model` (a backend.LoadedModel) with config `args`. With
    `reference`, the trainer's KL reference must be the starting policy (checked; see ensure_reference). A GRPO
    trainer gets kitcli/training/unsloth_grpo.py's corrections and record (`unsloth`: the stage's `unsloth:`
    mapping). Returns (trainer, how the reference was made or None)."""
    from kitcli.training import unsloth_grpo

    cls = trainer_class(stage_type)
    grpo = is_grpo_trainer(stage_type)
    model = loaded.model
    pad_change = unsloth_grpo.repair_pad_token(loaded, where or label or stage_type, log, label or stage_type) \
        if grpo and is_unsloth_class(cls) else None
    if not args.bf16 and not args.fp16:
        # Unsloth's trainers turn a config with no mixed precision into fp16 autocast unless the model says the
        # caller asked for float32 (its `_unsloth_user_float32`): stay in float32 as the config says.
        model._unsloth_user_float32 = True
    start = trainable_weights(model)
    # accelerate, and Unsloth's loss at every step, read the precision from the environment (Unsloth's default when
    # it is unset is fp16 autocast, on a CPU too): say the config's, for this process's current trainer.
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    before = {key: canonical(getattr(args, key, None)) for key in getattr(args, "kit_resolved", {})}
    with libraries.library_output():
        trainer = cls(model=model, args=args, **kwargs)
    if loaded.dtype == "float32":
        restore_dtype(trainer.model, start)
    log(f"{label or stage_type}: trainer {describe_class(cls)}")
    where = where or label or stage_type
    trainer.kit_rewrites = check_trainer_rewrites(trainer, before, getattr(args, "kit_explicit", set()), where, log)
    if grpo:
        trainer.kit_pad_change = pad_change
        unsloth_grpo.attach(trainer, unsloth, where, log, label or stage_type)
    described = ensure_reference(trainer, start, where) if reference else None
    if described:
        log(f"{label or stage_type}: reference = {described}")
    return trainer, described


def ensure_reference(trainer, start: dict[str, Any], where: str) -> str:
    """Make sure the trainer's KL reference is exactly the policy the stage starts from.

    With LoRA the reference is a frozen adapter "ref" holding a copy of the starting adapter: TRL's DPO, KTO, RLOO
    and GRPO (beta > 0) make it and use it whenever it exists; Unsloth's generated GRPO trainer deletes that block
    and would fall back to the base with adapters disabled (not the SFT model a stage with `init:` starts from), so
    the kit adds it the way TRL does. Then every reference tensor must equal the starting weights exactly and be
    frozen. With full fine-tuning the trainer holds a frozen copy of the starting model (`ref_model`)."""
    import torch

    model = trainer.model
    if not hasattr(model, "peft_config"):
        if getattr(trainer, "ref_model", None) is None:
            raise KitError(f"{where}: the trainer has no reference model for full fine-tuning; this TRL/Unsloth "
                           f"version builds the reference differently than kit expects")
        return f"frozen copy of the starting model ({trainer.ref_model.config._name_or_path})"
    added = REFERENCE_ADAPTER not in model.peft_config
    if added:
        active = model.active_adapter
        model.add_adapter(REFERENCE_ADAPTER, model.peft_config[active])
        with torch.no_grad():
            for name, param in model.named_parameters():
                if f".{active}." in name:
                    copy = model.get_parameter(name.replace(f".{active}.", f".{REFERENCE_ADAPTER}."))
                    copy.copy_(start.get(name, param))
        model.set_adapter(active)
        for name, param in model.named_parameters():
            if f".{REFERENCE_ADAPTER}." in name:
                param.requires_grad_(False)
    parameters = dict(model.named_parameters())
    policy_names = [name for name in start if ".default." in name]
    for name in policy_names:
        ref = parameters.get(name.replace(".default.", f".{REFERENCE_ADAPTER}."))
        if ref is None or ref.requires_grad or not torch.equal(ref.detach(), start[name].to(ref.dtype)):
            raise KitError(f"{where}: the reference adapter does not equal the starting policy at {name}; this "
                           f"TRL/Unsloth version builds the reference differently than kit expects")
    if getattr(trainer, "ref_model", None) is not None:
        raise KitError(f"{where}: the trainer loaded a separate reference model beside the reference adapter; this "
                       f"TRL/Unsloth version builds the reference differently than kit expects")
    how = "added by kit (this trainer would have used the base model)" if added else "made by the trainer"
    return f"frozen '{REFERENCE_ADAPTER}' adapter, a copy of the starting adapter ({len(policy_names)} tensors; {how})"


# Fields TRL's trainers copy from the config in __init__ (self.x = args.x) and read from there afterwards, so a
# trainer that rewrote one there would train with it whatever its config says. config field -> trainer attribute.
CACHED = {name: name for name in (
    "beta", "epsilon_high", "loss_type", "scale_rewards", "importance_sampling_level", "num_iterations",
    "num_generations", "max_completion_length", "mask_truncated_completions", "temperature", "top_p", "top_k",
    "min_p", "repetition_penalty", "multi_objective_aggregation", "off_policy_mask_threshold",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "normalize_advantages", "reward_clip_range",
    "label_smoothing", "use_weighting", "f_divergence_type", "ld_alpha", "shuffle_dataset", "use_vllm")}
CACHED["epsilon"] = "epsilon_low"


def check_trainer_rewrites(trainer, before: dict[str, Any], explicit: set[str], where: str,
                           log=print) -> list[dict[str, Any]]:
    """Compare every value the kit resolved with what the built trainer will use (its config after __init__, and
    the copies it keeps). A trainer that changed a value the recipe set explicitly is refused (its __init__ has
    used it already, so it cannot be put back); a changed kit default is logged and recorded."""
    rewrites = []
    for key, value in before.items():
        held = getattr(trainer.args, key, value)
        if key in CACHED and hasattr(trainer, CACHED[key]) and not isinstance(getattr(trainer, CACHED[key]), type):
            cached = getattr(trainer, CACHED[key])
            if not same_value(key, value, cached):
                held = cached
        if same_value(key, value, held):
            continue
        if key in explicit:
            raise KitError(f"{where}: {type(trainer).__name__} changed train.{key} from {value!r} to "
                           f"{canonical(held)!r} when it was built; the kit cannot train what the recipe says. "
                           f"Set another value, or remove train.{key} to accept the trainer's")
        rewrite = {"field": key, "kit": value, "library": canonical(held), "from": "kit default",
                   "action": f"kept {type(trainer).__name__}'s value"}
        log(f"{where}: note: {type(trainer).__name__} changed {key} from {value!r} to {canonical(held)!r}")
        rewrites.append(rewrite)
    return rewrites


def trainer_summary(trainer) -> dict[str, Any]:
    """What a stage's DONE summary says about its trainer: the class, what it changed of the kit's values, and for
    GRPO / GSPO the kl metric's definition, a pad token the kit replaced and Unsloth's speed paths."""
    from kitcli.training.unsloth_grpo import grpo_summary

    out: dict[str, Any] = {"trainer": describe_class(type(trainer))}
    if getattr(trainer, "kit_rewrites", None):
        out["rewritten"] = [f"{r['field']}: {r['kit']!r} -> {r['library']!r} ({r['action']})"
                            for r in trainer.kit_rewrites]
    return {**out, **grpo_summary(trainer)}
