"""Recipes: YAML files naming a model, LoRA settings and an ordered list of stages.

Loading reads the YAML (or a run's lock file), applies `--set` overrides and validates the whole recipe against
its typed model (kitcli/recipe/schema.py, with the stage types of kitcli/recipe/stage_types.py) before anything
heavy is imported:
every key, type and range, `train:` against the stage's trainer config, and the references between stages. The
first fault becomes one line naming the file, the key path, the value and what was expected.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kitcli.errors import KitError, closest, did_you_mean

DEFAULT_LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
DEFAULT_MODEL = {
    "max_seq_length": 1024,
    "load_in_4bit": None,  # 4-bit on a GPU, 16-bit on a CPU (kitcli/models/backend.py: four_bit)
    "backend": "auto",
    "dtype": "auto",
    "trust_remote_code": False,
}


@dataclass
class Recipe:
    """A validated recipe: `data` is the resolved dict (defaults filled in), `source` where it came from."""

    data: dict[str, Any]
    source: str
    base_dir: Path = field(default_factory=Path.cwd)

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def stages(self) -> list[dict[str, Any]]:
        return self.data["stages"]

    def stage(self, name: str) -> dict[str, Any]:
        for stage in self.stages:
            if stage["name"] == name:
                return stage
        raise KeyError(name)


class RecipeLoader(yaml.SafeLoader):
    """The safe loader, reading `1e-4` as a float (YAML 1.1 wants `1.0e-4`, which nobody writes)."""


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=RecipeLoader)


def shipped_recipes_dir() -> Path:
    return Path(str(resources.files("recipes")))


def shipped_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(shipped_recipes_dir().glob("*.yaml"))}


def find_recipe(name_or_path: str) -> Path:
    """A path to an existing file, or the name of a shipped recipe."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    if name_or_path in shipped:
        return shipped[name_or_path]
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        raise KitError(f"recipe file '{name_or_path}' does not exist; give a path to a YAML file "
                       f"or a shipped recipe name (see `kit recipes list`)")
    names = closest(name_or_path, shipped, n=3)
    hint = f" Did you mean {', '.join(repr(n) for n in names)}?" if names else ""
    raise KitError(f"no recipe named '{name_or_path}'.{hint} Shipped recipes: {', '.join(shipped)} "
                   f"(or give a path to a YAML file)")


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise KitError(f"cannot read recipe file '{path}': {error.strerror}") from None
    try:
        return parse_yaml(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise KitError(f"{path}: not valid YAML{where}: {problem}") from None


def load_recipe(name_or_path: str, overrides: list[str] = ()) -> Recipe:
    path = find_recipe(name_or_path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise KitError(f"{path}: a recipe must be a YAML mapping with 'name', 'model' and 'stages'")
    if is_lock(raw):
        if not isinstance(raw["recipe"], dict):
            raise KitError(f"{path}: the lock file's 'recipe' is not a mapping; the file is damaged")
        warn_version_drift(raw.get("versions") or {}, path)
        raw = raw["recipe"]  # the resolved recipe a run recorded: paths are absolute already
    raw = apply_overrides(raw, overrides, str(path))
    return validate_recipe(raw, str(path), path.resolve().parent)


def is_lock(raw: dict) -> bool:
    """A run's recipe.lock.yaml (resolved recipe + versions), which `kit run` accepts like a recipe."""
    return "recipe" in raw and "versions" in raw


def warn_version_drift(locked: dict[str, str], path: Path) -> None:
    import sys
    from importlib import metadata

    for name, version in locked.items():
        if name in ("kit", "python"):
            continue
        try:
            here = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            here = "not installed"
        if str(here) != str(version):
            print(f"kit: warning: {path} was recorded with {name} {version}; this environment has {here}",
                  file=sys.stderr)


def apply_overrides(raw: dict, overrides: list[str], source: str) -> dict:
    """Apply `--set a.b.c=value` overrides; `stages.NAME` addresses a stage by its name."""
    data = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise KitError(f"--set '{item}': expected KEY=VALUE, e.g. stages.sft.train.learning_rate=1e-4")
        key, text = item.split("=", 1)
        try:
            value = parse_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            raise KitError(f"--set '{item}': the value is not valid YAML; quote it") from None
        parts = key.strip().split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = _stage_by_name(node, part, item, source)
                continue
            if not isinstance(node, dict):
                raise KitError(f"--set '{item}': '{'.'.join(parts[:i])}' is not a mapping in {source}")
            if part == "model" and i == 0 and isinstance(node.get(part), str):
                node[part] = {"name": node[part]}  # `model: tiny` shorthand
            if part in ("data", "eval_data") and isinstance(node.get(part), str):
                node[part] = {"path": node[part]}  # `data: file.jsonl` shorthand
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if isinstance(node, list):
            raise KitError(f"--set '{item}': name a key inside the stage, e.g. stages.sft.train.max_steps=10")
        if not isinstance(node, dict):
            raise KitError(f"--set '{item}': the parent of '{last}' is not a mapping in {source}")
        node[last] = value
    return data


def _stage_by_name(stages: list, name: str, item: str, source: str) -> dict:
    names = [s.get("name") for s in stages if isinstance(s, dict)]
    for stage in stages:
        if isinstance(stage, dict) and stage.get("name") == name:
            return stage
    if name.isdigit() and int(name) < len(stages):
        return stages[int(name)]
    raise KitError(f"--set '{item}': no stage named '{name}' in {source}{did_you_mean(name, names)} "
                   f"(stages: {', '.join(map(str, names))})")


def validate_recipe(raw: dict, source: str, base_dir: Path) -> Recipe:
    """The recipe as the kit runs it: every key checked (kitcli/recipe/schema.py), defaults filled in, paths
    resolved."""
    from pydantic import ValidationError

    from kitcli.recipe import stage_types
    from kitcli.recipe.schema import recipe_model

    specs = stage_types.specs()
    model = recipe_model(specs)
    try:
        typed = model.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as error:
        raise KitError(describe_error(error, raw, source, model, specs)) from None
    return Recipe(data=normalized(typed, raw, source), source=source, base_dir=base_dir)


def normalized(typed, raw: dict, source: str) -> dict[str, Any]:
    """The plain dict stages read: model and lora complete, each stage as written with its name, data and
    reward_model in their full form."""
    data: dict[str, Any] = {"name": typed.name or Path(source).stem, "description": typed.description,
                            "seed": typed.seed, "model": typed.model.model_dump(),
                            "lora": typed.lora.model_dump() if typed.lora is not None else None, "stages": []}
    if typed.check is not None:  # only when set: a lock written before the key existed stays the same run
        data["check"] = typed.check
    for stage, given in zip(typed.stages, raw["stages"]):
        checked = copy.deepcopy(given)
        checked["name"] = stage.name or stage.type
        for key in ("data", "eval_data", "reward_model", "generation", "filter"):
            value = getattr(stage, key, None)
            if value is not None:
                checked[key] = value.model_dump()
        if "train" in checked:
            checked["train"] = dict(stage.train)
        data["stages"].append(checked)
    return data


def validate_model(raw: Any, source: str, base_dir: Path) -> dict[str, Any]:
    """A `model:` value on its own (`kit eval MODEL`): the same checks as in a recipe."""
    from pydantic import ValidationError

    from kitcli.recipe.schema import ModelSpec

    try:
        return ModelSpec.model_validate(raw, context={"base_dir": base_dir}).model_dump()
    except ValidationError as error:
        raise KitError(describe_error(error, {"model": raw}, source, None, {}, prefix=("model",))) from None


def validate_data_spec(raw: Any, where: str, base_dir: Path) -> dict[str, Any]:
    """A dataset value on its own (`kit eval --data`): the same checks as in a recipe."""
    from pydantic import ValidationError

    from kitcli.recipe.schema import DataSpec

    try:
        return DataSpec.model_validate(raw, context={"base_dir": base_dir}).model_dump()
    except ValidationError as error:
        raise KitError(describe_error(error, {"data": raw}, where, None, {}, prefix=("data",))) from None


# --- one line per fault -------------------------------------------------------------------------------------------

TYPE_WORDS = {"int_type": "an integer", "int_parsing": "an integer", "float_type": "a number",
              "float_parsing": "a number", "bool_type": "true or false", "bool_parsing": "true or false",
              "string_type": "a string", "dict_type": "a mapping", "list_type": "a list", "model_type": "a mapping",
              "model_attributes_type": "a mapping", "none_required": "null"}
MISSING_HINTS = {"data": "give a dataset path (JSONL/JSON/CSV/Parquet) or hub name", "name": "give its name",
                 "path": "give a path"}


def section_at(root, loc: tuple, specs: dict):
    """The pydantic model a location points into (None for a scalar), e.g. ('stages', 0, 'sft', 'data') ->
    DataSpec; a stage type in the location is the union's tag and stands for that type's section."""
    import typing

    from pydantic import BaseModel

    def inner_model(annotation):
        for candidate in (annotation, *typing.get_args(annotation)):
            for inner in (candidate, *typing.get_args(candidate)):
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    return inner
        return None

    current = root
    for part in loc:
        if isinstance(part, int):
            continue
        if current is not None and part in current.model_fields:
            current = inner_model(current.model_fields[part].annotation)
        elif part in specs:  # the tag of the stage union
            current = specs[part].section
        else:
            return None
    return current


def without_branches(loc: tuple, root, specs: dict) -> tuple:
    """A location without the tags pydantic adds for the alternatives of a union (`list[str]`, `str`, ...)."""
    kept: list = []
    for part in loc:
        if isinstance(part, str) and part not in specs and root is not None:
            parent = section_at(root, tuple(kept), specs)
            if parent is not None and part not in parent.model_fields:
                continue
            if parent is None and kept and not isinstance(kept[-1], int) and ("[" in part or part in TYPE_NAMES):
                continue
        kept.append(part)
    return tuple(kept)


TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_is_integer(root, loc: tuple, specs: dict) -> bool | None:
    """Whether the field at `loc` is declared an int (True), a float (False), or unknown (None)."""
    parent = section_at(root, loc[:-1], specs) if root is not None else None
    if parent is None or loc[-1] not in parent.model_fields:
        return None
    text = str(parent.model_fields[loc[-1]].annotation)
    return "int" in text and "float" not in text


def describe_error(error, raw: dict, source: str, model, specs: dict, prefix: tuple = ()) -> str:
    """The first fault of a pydantic ValidationError, in the kit's words."""
    errors = error.errors(include_url=False)
    first = errors[0]

    def place(e) -> tuple:
        full = (*prefix, *e["loc"])
        if e["type"] in ("extra_forbidden", "missing"):  # the last part is the key in question, not a branch
            return (*without_branches(full[:-1], model, specs), full[-1])
        return without_branches(full, model, specs)

    loc = place(first)
    same_place = [e for e in errors if place(e) == loc]
    if len(same_place) > 1 and all(e["type"] in TYPE_WORDS for e in same_place):  # every alternative of a union
        first = {**first, "type": "union", "ctx": {"expected": " or ".join(
            dict.fromkeys(TYPE_WORDS[e["type"]] for e in same_place))}}
    kind, context, given = first["type"], first.get("ctx") or {}, first.get("input")
    where: list[str] = []
    path = list(loc)
    if path[:1] == ["stages"] and len(path) >= 2 and isinstance(path[1], int):
        stages = raw.get("stages") or []
        stage = stages[path[1]] if path[1] < len(stages) else {}
        where.append(f"stage '{stage_label(stage, path[1])}'")
        path = path[2:]
        if path and isinstance(stage, dict) and path[0] == stage.get("type"):
            path = path[1:]  # the union's tag
    if kind == "kit":
        message = context["message"]
        if context.get("where") is not None:
            place = context["where"] if not where or context["where"].startswith("stage") else where[0]
            return f"{source}: {place}: {message}" if place else f"{source}: {message}"
        section = section_at(model, tuple(loc[:-1]), specs) if model is not None else None
        if path and section is not None and path[-1] in section.model_fields and \
                section_at(model, tuple(loc), specs) is None:
            path = path[:-1]  # a scalar field's own message names it
        place = ": ".join([*where, ".".join(map(str, path))] if path else where)
        return f"{source}: {place}: {message}" if place else f"{source}: {message}"
    dotted = ".".join(str(p) for p in path)
    if kind == "extra_forbidden":
        parent = section_at(model, tuple(loc[:-1]), specs) if model is not None else None
        allowed = sorted(parent.model_fields) if parent is not None else []
        key = str(loc[-1])
        noun = "generation key" if parent is not None and parent.__name__ == "GenerationSpec" else "key"
        place = ": ".join([*where, ".".join(map(str, path[:-1]))] if path[:-1] else where)
        message = (f"unknown {noun} '{key}'{did_you_mean(key, allowed)}" +
                   (f" (allowed: {', '.join(allowed)})" if allowed else ""))
        return f"{source}: {place}: {message}" if place else f"{source}: {message}"
    if kind == "missing":
        key = str(loc[-1])
        place = ": ".join([*where, ".".join(map(str, path[:-1]))] if path[:-1] else where)
        hint = f"; {MISSING_HINTS[key]}" if key in MISSING_HINTS else ""
        message = f"'{key}' is missing{hint}"
        return f"{source}: {place}: {message}" if place else f"{source}: {message}"
    subject = f"'{dotted}'" if len(path) == 1 and not where else dotted
    expected = expectation(kind, context, given, field_is_integer(model, loc, specs))
    message = f"{subject} must be {expected}, got {given!r}"
    return f"{source}: {': '.join(where)}: {message}" if where else f"{source}: {message}"


def stage_label(stage: Any, index: int) -> str:
    if isinstance(stage, dict):
        return str(stage.get("name") or stage.get("type") or f"stages[{index}]")
    return f"stages[{index}]"


def expectation(kind: str, context: dict, given: Any, integer: bool | None = None) -> str:
    if kind == "union":
        return context["expected"]
    if kind in TYPE_WORDS:
        return TYPE_WORDS[kind]
    if kind == "literal_error":
        expected = str(context.get("expected", ""))
        return "one of " + expected.replace("' or '", ", ").replace("', '", ", ").replace("'", "")
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(iter(v for k, v in context.items() if k in ("gt", "ge", "lt", "le")))
        if integer is None:
            integer = isinstance(given, int) and not isinstance(given, bool)
        if integer and ((kind == "greater_than" and bound == 0) or (kind == "greater_than_equal" and bound == 1)):
            return "a positive integer"
        symbol = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        return f"{'an integer' if integer else 'a number'} {symbol} {bound:g}"
    if kind == "too_short":
        return "non-empty"
    return kind.replace("_", " ")


def recipe_for_single_stage(stage_type: str, model: str, data: str, overrides: list[str]) -> Recipe:
    """The recipe `kit sft --model M --data D` runs: one stage named after its type."""
    raw = {"name": f"{stage_type}-{Path(model).name}", "model": model,
           "stages": [{"name": stage_type, "type": stage_type, "data": data, "train": {}}]}
    raw = apply_overrides(raw, overrides, f"kit {stage_type}")
    return validate_recipe(raw, f"kit {stage_type}", Path.cwd())
