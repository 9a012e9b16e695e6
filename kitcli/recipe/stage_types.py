"""The stage types a recipe can use: the kit's own, and those installed packages register.

Each stage type is declared once, by the `SPEC` (a `kitcli.recipe.schema.StageSpec`) of its module: its recipe keys,
what it outputs, what it may start from, its metrics and report panels, launcher support and the settings that decide
its memory. Every other module asks this registry. A third-party package adds a stage type the way it adds a
reward: an entry point in the `kit.stages` group naming its StageSpec,

    [project.entry-points."kit.stages"]
    my_stage = "my_package.stage:SPEC"

whose module has `describe(ctx)` and `run(ctx)` like the kit's own (kitcli/stages/sft.py is the shortest).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib import metadata

from kitcli.errors import KitError

ENTRY_POINT_GROUP = "kit.stages"
BUILTIN = ("sft", "reward", "dpo", "kto", "grpo", "gspo", "rloo", "ppo", "eval")


@lru_cache(maxsize=1)
def specs() -> dict:
    """stage type -> StageSpec, the kit's own first."""
    from kitcli.recipe.schema import StageSpec

    found = {name: importlib.import_module(f"kitcli.stages.{name}").SPEC for name in BUILTIN}
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
