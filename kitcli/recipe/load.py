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
from typing import TYPE_CHECKING, Any

import yaml

from kitcli.errors import KitError, closest, did_you_mean

if TYPE_CHECKING:
    from kitcli.recipe.schema import DataSpec, LoraSpec, ModelSpec

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
    """A validated recipe: `typed` is the recipe's pydantic model (kitcli/recipe/schema.py), with defaults filled in,
    the recipe's and every stage's name set, paths resolved; `source` is where it came from. It is what travels:
    stages, checks and the lock read it by attribute (`recipe.model.max_seq_length`, `stage.data.path`)."""

    typed: Any  # the model recipe_model(specs) built (a schema `Recipe`)
    source: str
    base_dir: Path = field(default_factory=Path.cwd)
    notes: list[str] = field(default_factory=list)  # foreign names read as the kit's or ignored, one line each
    faults: list[str] = field(default_factory=list)  # found with `collect=True`: the recipe is the one repaired
    defaulted: set[str] = field(default_factory=set)  # stages whose faulty values the repair left to a default

    @property
    def name(self) -> str:
        return self.typed.name

    @property
    def seed(self) -> int:
        return self.typed.seed

    @property
    def model(self) -> ModelSpec:
        return self.typed.model

    @property
    def lora(self) -> LoraSpec | None:
        """The LoRA settings every stage trains with; None for full fine-tuning (`lora: false`)."""
        return self.typed.lora

    @property
    def check(self) -> str | None:
        return self.typed.check

    @property
    def stages(self) -> list:
        """The stages in order, each its type's section (kitcli/stages/<type>.py), its `name` set."""
        return self.typed.stages

    def stage(self, name: str):
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def lock_dump(self) -> dict[str, Any]:
        """The recipe as its lock file records it (kitcli/run/runner.py make_lock): the model's JSON dump, with
        `lora: false` for full fine-tuning, which load_recipe reads back as this same recipe."""
        dumped = self.typed.model_dump(mode="json")
        if dumped["lora"] is None:
            dumped["lora"] = False
        return dumped


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


def load_recipe(name_or_path: str, overrides: list[str] = (), *, collect: bool = False) -> Recipe:
    """The validated recipe. Every fault of it is one line of a KitFaults (exit 2); with `collect`, a recipe whose
    faults could all be set aside comes back repaired with them in `faults`, so that a caller checks the rest
    (each stage's trainer config, data and rewards) and reports everything at once (kitcli/run/preflight.py)."""
    path = find_recipe(name_or_path)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise KitError(f"{path}: a recipe must be a YAML mapping with 'name', 'model' and 'stages'")
    if is_lock(raw):
        if not isinstance(raw["recipe"], dict):
            raise KitError(f"{path}: the lock file's 'recipe' is not a mapping; the file is damaged")
        warn_version_drift(raw.get("versions") or {}, path)
        raw, lock_notes = without_redacted(raw["recipe"], str(path))  # paths in it are absolute already
    else:
        lock_notes = []
    raw = apply_overrides(raw, overrides, str(path))
    recipe = validate_recipe(raw, str(path), path.resolve().parent, collect=collect)
    recipe.notes[:0] = lock_notes
    return recipe


def without_redacted(raw: Any, source: str, place: str = "") -> tuple[Any, list[str]]:
    """A lock's recipe without the credentials it did not store (`<redacted>`): the rerun reads them where the first
    run could have (the environment: HF_TOKEN), and a note says so."""
    from kitcli.rundir import REDACTED

    if isinstance(raw, list):
        pairs = [without_redacted(item, source, f"{place}[{index}]") for index, item in enumerate(raw)]
        return [item for item, _ in pairs], [note for _, notes in pairs for note in notes]
    if not isinstance(raw, dict):
        return raw, []
    kept, notes = {}, []
    for key, value in raw.items():
        where = f"{place}.{key}" if place else str(key)
        if value == REDACTED:
            notes.append(f"{source}: {where} is a credential the lock does not store; the rerun goes without it "
                         f"(give it through the environment, e.g. HF_TOKEN)")
            continue
        kept[key], more = without_redacted(value, source, where)
        notes += more
    return kept, notes


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


def validate_recipe(raw: dict, source: str, base_dir: Path, *, collect: bool = False) -> Recipe:
    """The recipe as the kit runs it: foreign names read as the kit's (kitcli/recipe/foreign_names.py), every key
    checked (kitcli/recipe/schema.py), defaults filled in, paths resolved. Every fault is found: a faulty key is set
    aside and the rest validated again (kitcli/recipe/faults.py), so the rules behind it are checked too."""
    from pydantic import ValidationError

    from kitcli.errors import KitFaults
    from kitcli.recipe import stage_types
    from kitcli.recipe.faults import fault_lines, is_consequence, set_aside
    from kitcli.recipe.foreign_names import translate_foreign
    from kitcli.recipe.schema import recipe_model

    specs = stage_types.specs()
    model = recipe_model(specs)
    raw, notes, foreign = translate_foreign(raw, source)
    faults = [f"{source}: {line}" for line in foreign]
    attempt, typed, touched, defaulted = raw, None, set(), set()
    for _ in range(MAX_REPAIRS):
        try:
            typed = model.model_validate(attempt, context={"base_dir": base_dir})
            break
        except ValidationError as error:
            faults += [line for loc, line in fault_lines(error, attempt, source, model, specs)
                       if line not in faults and not is_consequence(loc, touched, specs)]
            attempt = set_aside(attempt, error, model, specs, touched, defaulted)
            if attempt is None:
                break
    stage_names = [str(s.get("name") or s.get("type")) for s in raw.get("stages") or [] if isinstance(s, dict)] \
        if isinstance(raw, dict) else []
    if typed is None or (faults and not collect):
        raise KitFaults(faults, source, stage_names)
    return Recipe(typed=named(typed, source), source=source, base_dir=base_dir,
                  notes=[f"{source}: {line}" for line in notes], faults=faults,
                  defaulted={stage_names[i] for i in defaulted if i < len(stage_names)})


MAX_REPAIRS = 8  # validation passes, each setting aside the keys the one before faulted


def named(typed, source: str):
    """The validated recipe with its names set: the recipe's (default: its file's name) and each stage's (default:
    its type)."""
    typed.name = typed.name or Path(source).stem
    for stage in typed.stages:
        stage.name = stage.name or stage.type
    return typed


def validate_model(raw: Any, source: str, base_dir: Path) -> dict[str, Any]:
    """A `model:` value on its own (`kit eval MODEL`): the same checks as in a recipe."""
    from pydantic import ValidationError

    from kitcli.recipe.faults import describe_error
    from kitcli.recipe.schema import ModelSpec

    try:
        return ModelSpec.model_validate(raw, context={"base_dir": base_dir}).model_dump()
    except ValidationError as error:
        raise KitError(describe_error(error, {"model": raw}, source, None, {}, prefix=("model",))) from None


def validate_data_spec(raw: Any, where: str, base_dir: Path) -> DataSpec:
    """A dataset value on its own (`kit eval --data`): the same checks as in a recipe."""
    from pydantic import ValidationError

    from kitcli.recipe.faults import describe_error
    from kitcli.recipe.schema import DataSpec

    try:
        return DataSpec.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as error:
        raise KitError(describe_error(error, {"data": raw}, where, None, {}, prefix=("data",))) from None


def recipe_for_single_stage(stage_type: str, model: str, data: str, overrides: list[str]) -> Recipe:
    """The recipe `kit sft --model M --data D` runs: one stage named after its type."""
    raw = {"name": f"{stage_type}-{Path(model).name}", "model": model,
           "stages": [{"name": stage_type, "type": stage_type, "data": data, "train": {}}]}
    raw = apply_overrides(raw, overrides, f"kit {stage_type}")
    return validate_recipe(raw, f"kit {stage_type}", Path.cwd())
