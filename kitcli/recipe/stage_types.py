"""The stage types a recipe can use: the kit's own, and those installed packages register.

Each stage type is declared once, by the `SPEC` (a `kitcli.recipe.stage_spec.StageSpec`) of its module: its recipe
keys, its trainer and config classes, how its rows reach the model, what it outputs and may start from, its metrics
and report panels, launcher support and the settings that decide its memory. Every other module asks this registry.
The kit's own are the modules of `kitcli/stages/` that define a `SPEC` (a new one is found by adding its module).
A third-party package adds a stage type the way it adds a reward: an entry point in the `kit.stages` group naming
its StageSpec,

    [project.entry-points."kit.stages"]
    my_stage = "my_package.stage:SPEC"

whose module has `describe(ctx)` and `run(ctx)` like the kit's own (kitcli/stages/sft.py is the shortest).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from kitcli.errors import KitError

ENTRY_POINT_GROUP = "kit.stages"


@lru_cache(maxsize=1)
def builtin_specs() -> dict:
    """The kit's own stage types: every module of kitcli/stages/ with a SPEC (shared helpers like pairs.py have
    none), in their `order`."""
    folder = Path(__file__).resolve().parent.parent / "stages"
    found = [getattr(importlib.import_module(f"kitcli.stages.{info.name}"), "SPEC", None)
             for info in pkgutil.iter_modules([str(folder)])]
    return {spec.type: spec for spec in sorted((s for s in found if s is not None), key=lambda s: (s.order, s.type))}


def builtin_types() -> tuple[str, ...]:
    return tuple(builtin_specs())


@lru_cache(maxsize=1)
def specs() -> dict:
    """stage type -> StageSpec, the kit's own first."""
    from kitcli.recipe.stage_spec import StageSpec

    found = dict(builtin_specs())
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        try:
            spec = ep.load()
        except Exception as error:  # noqa: BLE001  (a broken plugin is named, not a traceback)
            raise KitError(f"stage type '{ep.name}' ({ep.value}) fails to load: {type(error).__name__}: {error}") \
                from None
        if not isinstance(spec, StageSpec) or spec.type != ep.name:
            raise KitError(f"entry point '{ep.name}' in {ENTRY_POINT_GROUP} ({ep.value}) is not the StageSpec of a "
                           f"stage type named '{ep.name}'")
        found[ep.name] = spec
    return found


def spec(stage_type: str):
    return specs()[stage_type]


def module(stage_type: str):
    """The module that describes and runs a stage type."""
    return importlib.import_module(spec(stage_type).module)


def types_with_output(*outputs: str) -> tuple[str, ...]:
    return tuple(name for name, s in specs().items() if s.output in outputs)


def is_rl(stage_type: str | None) -> bool:
    """Whether a stage type samples completions as it trains (RL dashboards and alarms)."""
    known = specs().get(stage_type or "")
    return known is not None and known.rl


def is_policy(stage_type: str | None) -> bool:
    """Whether a stage type's output is a policy to generate with (not a scorer, not nothing)."""
    known = specs().get(stage_type or "")
    return known is not None and known.output == "policy"


def spec_output(stage_type: str | None) -> str | None:
    """What a stage type outputs (policy, scorer, none); None for a type no package registers."""
    known = specs().get(stage_type or "")
    return known.output if known is not None else None
