"""Recipes: YAML files naming a model, LoRA settings and an ordered list of stages.

Validation here is structural and imports nothing heavy: unknown keys (with a "did you mean"), stage types,
`init` references and model paths. Fields inside a stage's `train:` block are checked against the TRL config
class when the stage builds its config (`kitcli/trl_config.py`).
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

# stage type -> module with build_config(ctx) / run(ctx); types added by later stages register here.
STAGE_MODULES = {
    "sft": "kitcli.stages.sft",
    "reward": "kitcli.stages.reward",
    "dpo": "kitcli.stages.dpo",
    "grpo": "kitcli.stages.grpo",
    "gspo": "kitcli.stages.gspo",
    "ppo": "kitcli.stages.ppo",
    "eval": "kitcli.stages.eval",
}
# Keys each stage type accepts on top of COMMON_STAGE_KEYS.
STAGE_KEYS = {
    "sft": {"data", "train"},
    "reward": {"data", "train", "eval_data", "eval_fraction"},
    "dpo": {"data", "train", "eval_data", "eval_fraction"},
    "grpo": {"data", "train", "variant", "rewards", "reward_model", "system_prompt"},
    "gspo": {"data", "train", "rewards", "reward_model", "allow_on_policy", "system_prompt"},
    "ppo": {"data", "train", "rewards", "reward_model", "eval_data"},
    "eval": {"data", "generation", "rewards"},
}
COMMON_STAGE_KEYS = {"name", "type", "init"}
TOP_LEVEL_KEYS = {"name", "description", "model", "seed", "lora", "stages"}
MODEL_KEYS = {"name", "max_seq_length", "load_in_4bit", "backend", "dtype", "trust_remote_code"}
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}
DATA_KEYS = {"path", "split", "columns", "limit", "config"}
BACKENDS = ("auto", "unsloth", "transformers")
DTYPES = ("auto", "float32", "bfloat16", "float16")

DEFAULT_LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
DEFAULT_MODEL = {
    "max_seq_length": 1024,
    "load_in_4bit": True,
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


def _check_keys(mapping: dict, allowed: set[str], where: str) -> None:
    for key in mapping:
        if key not in allowed:
            raise KitError(f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)} "
                           f"(allowed: {', '.join(sorted(allowed))})")


def validate_recipe(raw: dict, source: str, base_dir: Path) -> Recipe:
    _check_keys(raw, TOP_LEVEL_KEYS, source)
    data: dict[str, Any] = {}
    data["name"] = str(raw.get("name") or Path(source).stem)
    data["description"] = str(raw.get("description", ""))
    seed = raw.get("seed", 42)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise KitError(f"{source}: 'seed' must be an integer, got {seed!r}")
    data["seed"] = seed
    data["model"] = validate_model(raw.get("model"), source, base_dir)
    data["lora"] = validate_lora(raw.get("lora", {}), f"{source}: lora")
    stages = raw.get("stages")
    if not isinstance(stages, list) or not stages:
        raise KitError(f"{source}: 'stages' must be a non-empty list of stages, each with a 'name' and a 'type'")
    data["stages"] = []
    seen: dict[str, str] = {}
    for index, stage in enumerate(stages):
        checked = validate_stage(stage, index, seen, source, base_dir)
        seen[checked["name"]] = checked["type"]
        data["stages"].append(checked)
    return Recipe(data=data, source=source, base_dir=base_dir)


def validate_model(raw: Any, source: str, base_dir: Path) -> dict[str, Any]:
    if raw is None:
        raise KitError(f"{source}: 'model' is missing; give a hub name, a local directory, or 'tiny'")
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, dict) or "name" not in raw:
        raise KitError(f"{source}: 'model' must be a name or a mapping with 'name' (and optional "
                       f"{', '.join(sorted(MODEL_KEYS - {'name'}))})")
    _check_keys(raw, MODEL_KEYS, f"{source}: model")
    model = {**DEFAULT_MODEL, **raw}
    model["name"] = str(model["name"])
    if model["backend"] not in BACKENDS:
        raise KitError(f"{source}: model.backend must be one of {', '.join(BACKENDS)}, got {model['backend']!r}")
    if model["dtype"] not in DTYPES:
        raise KitError(f"{source}: model.dtype must be one of {', '.join(DTYPES)}, got {model['dtype']!r}")
    if not isinstance(model["max_seq_length"], int) or model["max_seq_length"] <= 0:
        raise KitError(f"{source}: model.max_seq_length must be a positive integer, got {model['max_seq_length']!r}")
    model["name"] = resolve_model_name(model["name"], source, base_dir)
    return model


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(("/",))


def resolve_model_name(name: str, source: str, base_dir: Path) -> str:
    """`tiny`, a hub id (`org/name`), or a local directory (made absolute)."""
    if name == "tiny":
        return name
    for candidate in (Path(name).expanduser(), base_dir / name):
        if candidate.is_dir():
            return str(candidate.resolve())
    if looks_like_path(name) or Path(name).expanduser().exists():
        raise KitError(f"{source}: model path '{name}' does not exist; give an existing directory with "
                       f"config.json, a hub name like 'unsloth/Qwen3-4B', or 'tiny'")
    return name


def validate_lora(raw: Any, where: str) -> dict[str, Any] | None:
    """`lora: false` means full fine-tuning; a mapping overrides the LoRA defaults."""
    if raw is False or raw == "none":
        return None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise KitError(f"{where}: expected a mapping with {', '.join(sorted(LORA_KEYS))}, or false for full "
                       f"fine-tuning")
    _check_keys(raw, LORA_KEYS, where)
    lora = {**DEFAULT_LORA, **raw}
    if not isinstance(lora["r"], int) or lora["r"] <= 0:
        raise KitError(f"{where}: r must be a positive integer, got {lora['r']!r}")
    return lora


def validate_stage(stage: Any, index: int, earlier: dict[str, str], source: str, base_dir: Path) -> dict[str, Any]:
    where = f"{source}: stages[{index}]"
    if not isinstance(stage, dict):
        raise KitError(f"{where}: each stage must be a mapping with 'name' and 'type'")
    stage_type = stage.get("type")
    if stage_type is None:
        raise KitError(f"{where}: 'type' is missing; one of {', '.join(STAGE_MODULES)}")
    if stage_type not in STAGE_MODULES:
        raise KitError(f"{where}: unknown stage type '{stage_type}'{did_you_mean(str(stage_type), STAGE_MODULES)} "
                       f"(available: {', '.join(STAGE_MODULES)})")
    name = str(stage.get("name") or stage_type)
    where = f"{source}: stage '{name}'"
    if name in earlier:
        raise KitError(f"{where}: the name is used by an earlier stage; stage names must be unique")
    if "/" in name or name.startswith("."):
        raise KitError(f"{where}: a stage name becomes a folder name; use letters, digits, '-' and '_'")
    _check_keys(stage, COMMON_STAGE_KEYS | STAGE_KEYS[stage_type], where)
    checked = copy.deepcopy(stage)
    checked["name"] = name
    init = stage.get("init")
    if init is not None:
        if init not in earlier:
            later = f"; it must name an earlier stage ({', '.join(earlier) or 'there is none'})"
            raise KitError(f"{where}: init '{init}' is not an earlier stage{did_you_mean(str(init), earlier)}{later}")
        if earlier[init] == "eval":
            raise KitError(f"{where}: init '{init}' is an eval stage, which saves no model; name a training stage")
    if "train" in checked:
        if checked["train"] is None:
            checked["train"] = {}
        if not isinstance(checked["train"], dict):
            raise KitError(f"{where}: 'train' must be a mapping of TRL config fields")
    for key in ("data", "eval_data"):
        if key in checked:
            checked[key] = validate_data_spec(checked[key], f"{where}: {key}", base_dir)
    if "data" not in checked and "data" in STAGE_KEYS[stage_type]:
        raise KitError(f"{where}: 'data' is missing; give a dataset path (JSONL/JSON/CSV/Parquet) or hub name")
    return checked


def validate_data_spec(raw: Any, where: str, base_dir: Path) -> dict[str, Any]:
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, dict) or "path" not in raw:
        raise KitError(f"{where}: expected a dataset path or a mapping with 'path' (and optional "
                       f"{', '.join(sorted(DATA_KEYS - {'path'}))})")
    _check_keys(raw, DATA_KEYS, where)
    columns = raw.get("columns") or {}
    if not isinstance(columns, dict):
        raise KitError(f"{where}: columns must map dataset columns to the names the stage expects, "
                       f"e.g. {{question: prompt}}")
    limit = raw.get("limit")
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise KitError(f"{where}: limit must be a positive integer, got {limit!r}")
    return {"path": resolve_data_path(str(raw["path"]), where, base_dir), "split": raw.get("split", "train"),
            "columns": columns, "limit": limit, "config": raw.get("config")}


DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def kit_source_root() -> Path:
    """The checkout the kit runs from (holds `examples/`), for recipe paths like examples/data/x.jsonl."""
    return Path(__file__).resolve().parent.parent


def resolve_data_path(path: str, where: str, base_dir: Path) -> str:
    """A local file (relative to the recipe, the working directory or the kit's checkout), or a hub dataset id."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        if candidate.is_file():
            return str(candidate)
    else:
        for root in (base_dir, Path.cwd(), kit_source_root()):
            if (root / candidate).is_file():
                return str((root / candidate).resolve())
    if candidate.suffix.lower() in DATA_SUFFIXES or looks_like_path(path) or candidate.exists():
        raise KitError(f"{where}: dataset file '{path}' does not exist (looked relative to {base_dir} and the "
                       f"working directory); give an existing JSONL, JSON, CSV or Parquet file")
    return path  # a hub dataset name, loaded with datasets.load_dataset when online


def recipe_for_single_stage(stage_type: str, model: str, data: str, overrides: list[str]) -> Recipe:
    """The recipe `kit sft --model M --data D` runs: one stage named after its type."""
    raw = {"name": f"{stage_type}-{Path(model).name}", "model": model,
           "stages": [{"name": stage_type, "type": stage_type, "data": data, "train": {}}]}
    raw = apply_overrides(raw, overrides, f"kit {stage_type}")
    return validate_recipe(raw, f"kit {stage_type}", Path.cwd())
