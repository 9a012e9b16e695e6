"""The fields of the trainer config classes a stage's `train:` block sets, with their types, read without importing
TRL, transformers or torch (so a recipe is checked in a fraction of a second, before anything heavy loads).

TRL's configs are dataclasses: `GRPOConfig(_BaseConfig(TrainingArguments))`. Their source files are parsed with
`ast` (found through `importlib.util.find_spec`, which imports nothing): each field's annotation (`int`,
`float | None`, `list[str]`, `SchedulerType | str`, ...), its default and its help text. Enum annotations are
resolved to their values from transformers' own enum classes. The kit's PPO config is a dataclass of its own.

`check_value(config, name, value, ranges, choices)` returns None when `value` fits the field's type, the choices its
config declares (TRL's `metadata={"choices": ...}`) or the stage's section gives, and the section's range for it,
else what was expected ("a number > 0"). The ranges are the kit's, kept on each stage type's section (TrainingSection's
for TrainingArguments' fields): TRL leaves most of them to fail deep inside a training loop (a batch size of 0) or to
train nothing (negative epochs).
"""

from __future__ import annotations

import ast
import importlib.util
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

MISSING = object()
# Base classes of the stage types' configs read by name -> (package, module file under it): where their own files
# import them from a package's lazy __init__. A stage type's config is found from its StageSpec's `config` path
# ("module:Class", kitcli/recipe/stage_spec.py), and its other bases from the imports of its file.
BASES = {
    "_BaseConfig": ("trl", "trainer/base_config.py"),
    "TrainingArguments": ("transformers", "training_args.py"),
}
ENUM_SOURCES = (("transformers", "trainer_utils.py"), ("transformers", "training_args.py"),
                ("transformers", "debug_utils.py"))


@dataclass(frozen=True)
class ConfigField:
    name: str
    annotation: str
    default: Any
    help: str
    choices: tuple | None = None  # the values its metadata declares (TRL's `metadata={"choices": [...]}`)


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(package)
    return Path(list(spec.submodule_search_locations)[0])


def literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return MISSING


def metadata_entry(call: ast.Call, name: str) -> Any:
    """One entry of a dataclass field's `metadata={...}` (its help text, its declared choices), or MISSING."""
    for keyword in call.keywords:
        if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
            for key, value in zip(keyword.value.keys, keyword.value.values):
                if literal(key) == name:
                    return literal(value)
    return MISSING


def help_text(call: ast.Call) -> str:
    text = metadata_entry(call, "help")
    return text if isinstance(text, str) else ""


@cache
def parse_classes(package: str, relative: str) -> dict[str, tuple[list[str], dict[str, ConfigField]]]:
    """class name -> (its base classes, each as "module:Class" where the file says where it comes from, else its name;
    its own annotated fields) for every class in one source file."""
    tree = ast.parse((package_dir(package) / relative).read_text(encoding="utf-8"))
    module = ".".join([package, *Path(relative).with_suffix("").parts]).removesuffix(".__init__")
    imported = imported_names(tree, module, relative.endswith("__init__.py"))
    classes = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, ConfigField] = {}
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            default, help_, choices = MISSING, "", None
            if isinstance(item.value, ast.Call) and getattr(item.value.func, "id", None) == "field":
                keywords = {k.arg: k.value for k in item.value.keywords}
                if "init" in keywords and literal(keywords["init"]) is False:
                    continue
                if "default" in keywords:
                    default = literal(keywords["default"])
                help_ = help_text(item.value)
                declared = metadata_entry(item.value, "choices")
                choices = tuple(declared) if isinstance(declared, (list, tuple)) else None
            elif item.value is not None:
                default = literal(item.value)
            fields[item.target.id] = ConfigField(item.target.id, ast.unparse(item.annotation), default, help_,
                                                 choices)
        bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
        classes[node.name] = ([base_path(b, module, imported) for b in bases], fields)
    return classes


def imported_names(tree: ast.Module, module: str, package: bool) -> dict[str, str]:
    """name -> the module a file's `from X import name` takes it from (relative imports resolved)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            parts = module.split(".") if package else module.split(".")[:-1]
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            found.update({alias.asname or alias.name: base for alias in node.names})
    return found


def base_path(name: str, module: str, imported: dict[str, str]) -> str:
    """Where a base class is read from: the kit's BASES by name, the module the file imports it from, or the
    file itself."""
    if name in BASES:
        return name
    return f"{imported[name]}:{name}" if name in imported else f"{module}:{name}"


def source_of(config: str) -> tuple[str, str, str]:
    """(package, module file under it, class name) of a config class: "module:Class" (a StageSpec's `config`), or
    the name of one of BASES."""
    if config in BASES:
        return (*BASES[config], config)
    module, _, name = config.partition(":")
    parts = module.split(".")
    relative = "/".join(parts[1:]) + ".py"
    if not (package_dir(parts[0]) / relative).is_file():
        relative = "/".join(parts[1:]) + "/__init__.py"
    return parts[0], relative, name


@cache
def config_fields(config: str) -> dict[str, ConfigField]:
    """Every init field of the config class `config` ("module:Class", e.g. a StageSpec's `config`, or a base class's
    name in BASES), its base classes' first (a subclass's override wins), read from their source files."""
    package, relative, name = source_of(config)
    try:
        bases, own = parse_classes(package, relative)[name]
    except (KeyError, OSError, ModuleNotFoundError):
        return {}  # a base the kit cannot read (object, a compiled class): it adds no fields the kit checks
    fields: dict[str, ConfigField] = {}
    for base in bases:
        fields.update(config_fields(base))
    fields.update(own)
    return fields


@cache
def enum_values() -> dict[str, tuple[str, ...]]:
    """Values of transformers' string enums (SchedulerType, IntervalStrategy, OptimizerNames, ...)."""
    found: dict[str, tuple[str, ...]] = {}
    for package, relative in ENUM_SOURCES:
        for name, (bases, _) in parse_classes(package, relative).items():
            if not any(b.rpartition(":")[2] in ("ExplicitEnum", "Enum", "str") for b in bases):
                continue
            tree = ast.parse((package_dir(package) / relative).read_text(encoding="utf-8"))
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    values = [literal(item.value) for item in node.body if isinstance(item, ast.Assign)]
                    found[name] = tuple(v for v in values if isinstance(v, str))
    return found


# --- types ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TypeSpec:
    """A parsed annotation: `kind` is int, float, bool, str, none, list, dict, any or choice (enum/Literal)."""

    kind: str
    items: tuple = ()  # list: the element type; choice: the values; union: the alternatives


def parse_annotation(annotation: str) -> TypeSpec:
    try:
        node = ast.parse(annotation, mode="eval").body
    except SyntaxError:
        return TypeSpec("any")
    return spec_of(node)


def spec_of(node: ast.AST) -> TypeSpec:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return union(spec_of(node.left), spec_of(node.right))
    if isinstance(node, ast.Constant) and node.value is None:
        return TypeSpec("none")
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted forward reference
        return parse_annotation(node.value)
    if isinstance(node, ast.Name):
        simple = {"int": "int", "float": "float", "bool": "bool", "str": "str", "dict": "dict", "list": "list",
                  "Any": "any", "None": "none"}
        if node.id in simple:
            return TypeSpec(simple[node.id], (TypeSpec("any"),) if node.id == "list" else ())
        if node.id in enum_values():
            return TypeSpec("choice", enum_values()[node.id])
        return TypeSpec("any")  # a class the kit cannot check (e.g. ParallelismConfig): left to the library
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value).split(".")[-1]
        inner = node.slice
        if head in ("Optional",):
            return union(spec_of(inner), TypeSpec("none"))
        if head in ("Union",):
            parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            result = spec_of(parts[0])
            for part in parts[1:]:
                result = union(result, spec_of(part))
            return result
        if head in ("list", "List", "tuple", "Tuple", "Sequence"):
            element = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
            return TypeSpec("list", (spec_of(element),))
        if head in ("dict", "Dict"):
            return TypeSpec("dict")
        if head == "Literal":
            parts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return TypeSpec("choice", tuple(literal(p) for p in parts))
    return TypeSpec("any")


def union(a: TypeSpec, b: TypeSpec) -> TypeSpec:
    parts = (a.items if a.kind == "union" else (a,)) + (b.items if b.kind == "union" else (b,))
    return TypeSpec("union", parts)


def fits(value: Any, spec: TypeSpec) -> bool:
    kind = spec.kind
    if kind == "any":
        return True
    if kind == "union":
        return any(fits(value, part) for part in spec.items)
    if kind == "none":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if kind == "str":
        return isinstance(value, str)
    if kind == "dict":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list) and all(fits(v, spec.items[0]) for v in value)
    if kind == "choice":
        return value in spec.items
    return True


def describe(spec: TypeSpec) -> str:
    kind = spec.kind
    if kind == "union":
        parts = [describe(p) for p in spec.items if p.kind != "any"]
        choices = [p for p in spec.items if p.kind == "choice"]
        if choices and any(p.kind == "str" for p in spec.items):  # `SchedulerType | str`: the enum's values
            parts = [describe(choices[0])] + [describe(p) for p in spec.items if p.kind not in ("choice", "str")]
        return " or ".join(dict.fromkeys(parts)) or "any value"
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "none": "null", "dict": "a mapping", "any": "any value"}.get(kind) or (
        f"a list of {describe(spec.items[0]).removeprefix('a ').removeprefix('an ')}s" if kind == "list"
        else "one of " + ", ".join(map(str, spec.items)))


def narrowed(spec: TypeSpec) -> TypeSpec:
    """`SchedulerType | str` and the like accept the enum's values only (TRL would raise on any other string)."""
    kinds = {p.kind for p in spec.items} if spec.kind == "union" else set()
    if {"choice", "str"} <= kinds:
        return TypeSpec("union", tuple(p for p in spec.items if p.kind != "str"))
    return spec


# --- the kit's ranges and choices -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    low: float | None = None
    low_open: bool = False  # True: value > low; False: value >= low
    high: float | None = None
    high_open: bool = False
    also: tuple = ()  # values allowed outside the range (e.g. max_steps -1: "use num_train_epochs")

    def holds(self, value: float) -> bool:
        if value in self.also:
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def text(self) -> str:
        parts = []
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            parts.append(f"in {left}{self.low:g}, {self.high:g}{right}")
        elif self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        elif self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        if self.also:
            parts.append("or " + " or ".join(map(str, self.also)))
        return " ".join(parts)


POSITIVE, AT_LEAST_ONE, NOT_NEGATIVE = Range(0, True), Range(1), Range(0)
FRACTION, OPEN_FRACTION = Range(0, False, 1, False), Range(0, False, 1, True)
# The ranges of transformers' TrainingArguments fields every trainer config has, which no library declares (TRL
# leaves them to fail deep inside a training loop, or to train nothing). A stage type's section adds its method's
# own (`train_ranges`, `train_choices` on the section: kitcli/recipe/schema.py TrainingSection).
TRAINING_RANGES: dict[str, Range] = {
    "learning_rate": POSITIVE, "per_device_train_batch_size": AT_LEAST_ONE, "per_device_eval_batch_size": AT_LEAST_ONE,
    "gradient_accumulation_steps": AT_LEAST_ONE, "num_train_epochs": POSITIVE, "max_steps": Range(1, also=(-1,)),
    "warmup_ratio": FRACTION, "warmup_steps": NOT_NEGATIVE, "weight_decay": NOT_NEGATIVE, "max_grad_norm": NOT_NEGATIVE,
    "adam_beta1": OPEN_FRACTION, "adam_beta2": OPEN_FRACTION, "adam_epsilon": POSITIVE,
    "logging_steps": POSITIVE, "save_steps": POSITIVE, "eval_steps": POSITIVE, "save_total_limit": AT_LEAST_ONE,
    "dataloader_num_workers": NOT_NEGATIVE, "seed": NOT_NEGATIVE, "max_length": AT_LEAST_ONE,
}


def field_type(config: str, name: str, choices: dict[str, Any] | None = None) -> TypeSpec:
    """A field's type: the choices a stage's section gives it (`choices`: name -> values, or a TypeSpec), else the
    choices its config declares in its metadata, else its annotation."""
    given = (choices or {}).get(name)
    if isinstance(given, TypeSpec):
        return given
    if given is not None:
        return TypeSpec("choice", tuple(given))
    declared = config_fields(config)[name].choices
    if declared is not None:
        return TypeSpec("choice", declared)
    return narrowed(parse_annotation(config_fields(config)[name].annotation))


def check_value(config: str, name: str, value: Any, ranges: dict[str, Range] | None = None,
                choices: dict[str, Any] | None = None) -> str | None:
    """None when `value` is right for field `name` of `config`, else what it must be ("a number > 0", "in [0, 1]"):
    its type, the choices (the section's, or its config's declared ones) and the section's range for it."""
    spec = field_type(config, name, choices)
    bounds = (ranges or {}).get(name)
    if not fits(value, spec):
        return describe(spec) + (f" {bounds.text()}" if bounds is not None else "")
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if bounds is not None and numeric and not bounds.holds(value):
        return bounds.text()
    return None
