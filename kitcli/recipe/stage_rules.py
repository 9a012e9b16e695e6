"""The rules of a recipe's stages that no single section can check: keys on a stage type without them, and the
references between stages (unique names; `init:` and `reward_model:` name earlier stages of a type they can use).
Every fault is named, and a faulty reference is set aside for the rest of the check (kitcli/recipe/faults.py).
`fail` makes the kit's one-line fault inside a pydantic validator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic_core import PydanticCustomError

from kitcli.errors import did_you_mean
from kitcli.recipe.stage_spec import StageSpec

if TYPE_CHECKING:
    from kitcli.recipe.schema import StageSection


def fail(message: str, where: str | None = None) -> PydanticCustomError:
    """A fault with the kit's own one-line message (`where` replaces the key path the error is found at)."""
    return PydanticCustomError("kit", "{message}", {"message": message, "where": where})


def stage_name(stage: Any, index: int) -> str:
    if isinstance(stage, dict):
        return str(stage.get("name") or stage.get("type") or f"stages[{index}]")
    return f"stages[{index}]"


def misplaced_keys(stage: dict[str, Any], specs: dict[str, StageSpec], where: str) -> None:
    """`filter:`, `tools:` or `environment:` on a stage type without them: one line naming the types with them."""
    for key in ("filter", "tools", "environment"):
        if key not in stage or key in specs[stage["type"]].section.model_fields:
            continue
        takers = ", ".join(t for t, spec in specs.items() if key in spec.section.model_fields) or "no"
        if key == "filter":
            raise fail(f"filter: keeps prompts by the starting policy's pass rate, so it belongs to a stage that "
                       f"samples completions ({takers}), not to a {stage['type']} stage; remove it", where=where)
        why = specs[stage["type"]].refused_keys.get(key)
        why = f" ({why})" if why else ""
        raise fail(f"{key}: lets the model call tools while it generates, which only {takers} stages support; a "
                   f"{stage['type']} stage cannot use them{why}; remove it", where=where)


def check_stage_references(stages: list[StageSection], specs: dict[str, StageSpec]) -> None:
    """Stage names are unique folder names; `init:` names an earlier stage whose output the stage can start from;
    `reward_model: {stage}` an earlier stage whose output is a scorer. Every fault is named; a faulty `init:` or
    `reward_model:` is set aside for the rest of the check (kitcli/recipe/faults.py)."""
    faults: list[tuple[str, str, list | None]] = []  # (where, message, the key to set aside)
    earlier: dict[str, str] = {}
    for index, stage in enumerate(stages):
        name = stage.name or stage.type
        where = f"stage '{name}'"
        if name in earlier:
            faults.append((where, "the name is used by an earlier stage; stage names must be unique", None))
        if "/" in name or name.startswith("."):
            faults.append((where, "a stage name becomes a folder name; use letters, digits, '-' and '_'", None))
        spec = specs[stage.type]
        if stage.init is not None:
            problem = init_problem(stage, spec, earlier, specs)
            if problem:
                faults.append((where, problem, ["stages", index, "init"]))
        reward_model = getattr(stage, "reward_model", None)
        if reward_model is not None and reward_model.stage is not None:
            problem = reward_model_problem(reward_model.stage, earlier, specs)
            if problem:
                faults.append((where, problem, ["stages", index, "reward_model"]))
        earlier[name] = stage.type
    if faults:
        (where, message, _), rest = faults[0], faults[1:]
        unset = [path for _, _, path in faults]
        raise PydanticCustomError("kit", "{message}", {
            "message": message, "where": where, "more": [{"where": w, "message": m} for w, m, _ in rest],
            "unset": unset if all(unset) else None})


def init_problem(stage: StageSection, spec: StageSpec, earlier: dict[str, str], specs: dict[str, StageSpec]) -> str:
    """What is wrong with a stage's `init:` ('' when nothing is)."""
    if stage.init not in earlier:
        later = f"; it must name an earlier stage ({', '.join(earlier) or 'there is none'})"
        return f"init '{stage.init}' is not an earlier stage{did_you_mean(stage.init, earlier)}{later}"
    source = specs[earlier[stage.init]]
    if source.output == "none":
        return f"init '{stage.init}' is an {source.type} stage, which saves no model; name a training stage"
    if source.output not in spec.init_from:
        allowed = [t for t, s in specs.items() if s.output in spec.init_from]
        extra = " (a reward model goes in reward_model:)" if source.output == "scorer" else ""
        return (f"init '{stage.init}' is a {source.type} stage, whose output is a {source.output}; a "
                f"{stage.type} stage starts from a {' or '.join(spec.init_from)}: name an earlier "
                f"{'/'.join(allowed)} stage{extra}")
    return ""


def reward_model_problem(name: str, earlier: dict[str, str], specs: dict[str, StageSpec]) -> str:
    """What is wrong with a stage's `reward_model: {stage}` ('' when nothing is)."""
    if name not in earlier:
        return (f"reward_model '{name}' is not an earlier stage{did_you_mean(name, earlier)}; name a reward stage "
                f"that runs before this one")
    source = specs[earlier[name]]
    if source.output != "scorer":
        return (f"reward_model '{name}' is a {source.type} stage; name an earlier stage of type reward (a policy to "
                f"start from goes in init:)")
    return ""
