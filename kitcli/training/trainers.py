"""Building a stage's trainer the same way for every stage (the classes: kitcli/training/trainer_classes.py).

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
from kitcli.recipe.stage_spec import StageSpec
from kitcli.training import unsloth_grpo
from kitcli.training.trainer_classes import (  # noqa: F401  (the stages, plugins and tests ask for classes here)
    FAMILIES,
    FAMILY_ENV,
    config_class,
    describe_class,
    family,
    is_grpo_trainer,
    is_unsloth_class,
    trainer_class,
)
from kitcli.training.trl_config import canonical, same_value

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


def build_trainer(spec: StageSpec, loaded, *, args, reference: bool = False, log=print, label: str = "",
                  where: str = "", unsloth: Any = None, **kwargs):
    """Construct the trainer class `spec` (a stage type's StageSpec) names around `loaded.model` (a
    backend.LoadedModel) with config `args`. With `reference`, the trainer's KL reference must be the starting policy
    (checked; see ensure_reference). A GRPO trainer gets kitcli/training/unsloth_grpo.py's corrections and record
    (`unsloth`: the stage's typed `unsloth:` section). Returns (trainer, how the reference was made or None)."""
    cls = trainer_class(spec)
    grpo = is_grpo_trainer(spec)
    model = loaded.model
    name = label or spec.type
    pad_change = unsloth_grpo.repair_pad_token(loaded, where or name, log, name) if grpo and is_unsloth_class(cls) \
        else None
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
    log(f"{name}: trainer {describe_class(cls)}")
    where = where or name
    trainer.kit_rewrites = check_trainer_rewrites(trainer, before, getattr(args, "kit_explicit", set()), where, log)
    if grpo:
        trainer.kit_pad_change = pad_change
        unsloth_grpo.attach(trainer, unsloth, where, log, name)
    described = ensure_reference(trainer, start, where) if reference else None
    if described:
        log(f"{name}: reference = {described}")
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
    out: dict[str, Any] = {"trainer": describe_class(type(trainer))}
    if getattr(trainer, "kit_rewrites", None):
        out["rewritten"] = [f"{r['field']}: {r['kit']!r} -> {r['library']!r} ({r['action']})"
                            for r in trainer.kit_rewrites]
    return {**out, **unsloth_grpo.grpo_summary(trainer)}
