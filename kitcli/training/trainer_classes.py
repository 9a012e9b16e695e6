"""Which trainer and config classes train a stage: TRL's own, or Unsloth's generated ones.

A stage type's StageSpec names its trainer and config classes ("module:Class": `trl.trainer.*`, `trl.experimental.*`
or a plugin's); this module finds the class this process trains with (kitcli/training/trainers.py builds it).

Two families of trainers exist for one TRL version. On a GPU, `import unsloth` replaces TRL's `GRPOTrainer`,
`DPOTrainer`, `RewardTrainer`, `RLOOTrainer`, `KTOTrainer` (and their configs) with classes it generates from TRL's
source (`unsloth/models/rl.py`): they change defaults, some explicit values and the loss (docs/stages.md). On a CPU
Unsloth leaves TRL's own classes in place. `KIT_TRAINERS=unsloth` makes a CPU process use Unsloth's generated
trainers too (importing `unsloth.models` runs Unsloth's PatchFastRL), which is how the kit's tests check the path a
GPU runs; `KIT_TRAINERS=trl` asks for TRL's own (available only where Unsloth has not replaced them). TRL's own
classes are remembered before Unsloth replaces them: those of every stage type declared in this process
(kitcli/recipe/stage_spec.py `declared_specs`), which the registry declares when it loads.
"""

from __future__ import annotations

import os

from kitcli.errors import KitError
from kitcli.recipe.stage_spec import StageSpec, declared_specs, split_path

FAMILY_ENV = "KIT_TRAINERS"
FAMILIES = ("auto", "trl", "unsloth")
STOCK_MARKER = "trl.trainer.grpo_trainer:GRPOTrainer"  # TRL's own GRPOTrainer captured: TRL's family is available
_stock: dict[str, type] = {}  # "module:Class" -> TRL's own class, captured before Unsloth's patch replaces it


def class_paths() -> list[str]:
    """Every TRL trainer and config class ("module:Class") the stage types declared in this process name, in their
    order: those Unsloth replaces (a plugin's own class and the kit's PPO config are left as they are)."""
    paths = [p for spec in declared_specs() for p in (spec.trainer, spec.config) if p]
    return list(dict.fromkeys(p for p in paths if p.startswith("trl.")))


def import_module(module: str):
    """Import a trainer's module; TRL's experimental ones without their one-time warning."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(module)


def binding(spec: StageSpec) -> tuple[str, str]:
    """(trainer, config) "module:Class" paths of a stage type that trains with a trainer class."""
    if spec.trainer is None or spec.config is None:
        raise KitError(f"stage type '{spec.type}' names no trainer and config classes in its StageSpec "
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

    from kitcli.models.cpu_routes import allow_inductor_pool_aliasing

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
    chosen = family()
    if chosen == "trl" and path in _stock:
        return _stock[path]
    module, name = split_path(path)
    return getattr(import_module(module), name)


def trainer_class(spec: StageSpec) -> type:
    """The trainer class a stage type (its StageSpec) trains with, of this process's family."""
    return lookup(binding(spec)[0])


def config_class(spec: StageSpec) -> type:
    """The config class of a stage type's trainer (its StageSpec's), of this process's family."""
    return lookup(binding(spec)[1])


def is_grpo_trainer(spec: StageSpec) -> bool:
    """Whether the stage trains with (TRL's or Unsloth's) GRPOTrainer, which gets kitcli/training/unsloth_grpo.py."""
    return binding(spec)[0].endswith(":GRPOTrainer")


def describe_class(cls: type) -> str:
    return f"{cls.__name__} ({'Unsloth' if is_unsloth_class(cls) else 'TRL'})"
