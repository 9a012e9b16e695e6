"""Names people bring from other tools' configs (Unsloth notebooks, transformers / TRL across versions, the TRL CLI
and open-r1 scripts, axolotl), and what the kit does with each: reads it as the kit's key, accepts it as a no-op
with the reason, or refuses it naming the kit's spelling and meaning. The table is kitcli/recipe/foreign_table.py;
`kit check`, the dry run and the lock print one line for each name met (kitcli/recipe/load.py calls
`translate_foreign` before validation), and `kit import` reads a whole foreign config through `translate`.

A name is translated only where it is not the kit's own (the stage type's trainer config decides for `train:`
keys: `max_completion_length` is GRPOConfig's, and refused only where the config lacks it), except for the values a
record names (`model.dtype: None` is Unsloth's auto). A mapped value goes where the record says; one already there
with another value is a fault naming both, never a silent choice.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from kitcli.recipe.foreign_table import FOREIGN_NAMES, IGNORE, MAP, NONE, REFUSE, ForeignName, same

DEFAULT_SEED = 42  # the recipe's seed when it sets none (kitcli/recipe/schema.py)


# --- value conversions: a record's `convert` names one; a ValueError says the value has no kit spelling -----

DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


def dtype_name(value: Any) -> Any:
    """Unsloth's `dtype: None` (detect), `torch.bfloat16`, `bf16`, ... as model.dtype spells them."""
    if value is None or (isinstance(value, str) and value in NONE):
        return "auto"
    text = str(value).removeprefix("torch.")
    return DTYPES.get(text, value)  # anything else: the schema names the allowed values


def warmup_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError("not a fraction in [0, 1) of the run's steps; for a number of steps set "
                         "train.warmup_steps: N (an integer)")
    return float(value)


def one_config(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise ValueError("a stage reads one dataset configuration; give one as data.config")
    return value


def sampling_params(value: Any) -> dict[str, Any]:
    """vLLM's SamplingParams (Unsloth's GRPOConfig vllm_sampling_params) as GRPOConfig's own sampling fields."""
    if not isinstance(value, dict):
        raise ValueError("not a mapping; give the sampling settings as train keys (temperature, top_p, top_k, min_p)")
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length"}
    unknown = [k for k in value if k not in names and k not in ("seed", "include_stop_str_in_output")]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a sampling setting of the kit (it stops at the tokenizer's EOS "
                         f"or max_completion_length, and samples with temperature, top_p, top_k, min_p, "
                         f"repetition_penalty); remove {'them' if len(unknown) > 1 else 'it'}")
    train = {names[k]: v for k, v in value.items() if k in names}
    if train.get("top_k") == -1:
        train["top_k"] = 0  # vLLM's "no top-k" is -1, TRL's 0
    return train


# axolotl's chat template names where Unsloth's get_chat_template spells them otherwise
TEMPLATE_NAMES = {"qwen_25": "qwen-2.5", "phi_3": "phi-3", "phi_35": "phi-3.5"}


def template_name(value: Any) -> Any:
    return TEMPLATE_NAMES.get(value, value) if isinstance(value, str) else value


CONVERSIONS: dict[str, Callable[[Any], Any]] = {
    "dtype_name": dtype_name, "warmup_fraction": warmup_fraction, "one_config": one_config,
    "sampling_params": sampling_params, "template_name": template_name,
    "prompt_column": lambda column: {column: "prompt"}, "negate": lambda value: not value,
    "true": lambda _: True, "false": lambda _: False, "all_linear": lambda _: "all-linear",
    "group_by_length": lambda _: "group_by_length"}


@dataclass
class Handled:
    """One foreign name met in a recipe and what became of it (`does`: map, ignore or refuse)."""

    where: str  # "stage 'grpo': train.warmup_ratio"
    key: str
    value: Any
    record: ForeignName
    does: str
    line: str  # the note or the fault, without the file
    target: str = ""  # map: where the value went ("train.warmup_steps", "model.name")
    new: Any = None  # map: the value written there


@dataclass
class Place:
    """What a section of the recipe is: its place in the table, the kit's own keys there, and the stage around it."""

    name: str  # one of PLACES
    prefix: str  # how a key here is named in a line ("model.", "stage 'grpo': train.")
    kit_keys: set[str]
    stage: dict | None = None
    stage_type: str | None = None
    stage_fields: set[str] | None = None  # the stage section's keys (None: an unknown type)
    config_fields: set[str] | None = None  # its trainer config's fields (None: an unknown type)
    seed: Any = DEFAULT_SEED
    handled: list[Handled] = field(default_factory=list)


@cache
def records_by_name() -> dict[tuple[str, str], list[ForeignName]]:
    index: dict[tuple[str, str], list[ForeignName]] = {}
    for record in FOREIGN_NAMES:
        for key in record.names():
            for place in record.at():
                index.setdefault((key, place), []).append(record)
    return index


def record_for(key: str, value: Any, place: Place) -> ForeignName | None:
    """The first record for this name, place and value; a record for any value only where the key is not the kit's."""
    for record in records_by_name().get((key, place.name), []):
        if record.values is None and key in place.kit_keys:
            continue
        if record.covers(value):
            return record
    return None


def translate_foreign(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """The recipe with every foreign name handled: (the raw recipe with mapped keys rewritten to the kit's and no-op
    and refused keys removed, notes: one line per key mapped or ignored, faults: one line per key refused). Each
    line names the place (`stage 'grpo': train.warmup_ratio`, `model.fast_inference`, `lora.lora_alpha`) without
    the file (`source`, which the caller puts before it)."""
    translated, handled = translate(raw)
    notes = [h.line for h in handled if h.does != REFUSE]
    faults = [h.line for h in handled if h.does == REFUSE]
    return translated, notes, faults


def translate(raw: Any) -> tuple[Any, list[Handled]]:
    """The recipe with the table applied, and every name it handled, in the recipe's order."""
    if not isinstance(raw, dict):
        return raw, []
    from kitcli.recipe import stage_types
    from kitcli.recipe.schema import LoraSpec, ModelSpec, recipe_model

    recipe = copy.deepcopy(raw)
    specs = stage_types.specs()
    seed = recipe.get("seed", DEFAULT_SEED)
    handled: list[Handled] = []
    sections = [(recipe, Place("top", "", set(recipe_model(specs).model_fields), seed=seed))]
    if isinstance(recipe.get("model"), dict):
        sections.append((recipe["model"], Place("model", "model.", set(ModelSpec.model_fields), seed=seed)))
    if isinstance(recipe.get("lora"), dict):
        sections.append((recipe["lora"], Place("lora", "lora.", set(LoraSpec.model_fields), seed=seed)))
    for section, place in sections:
        handled += translate_section(section, place, recipe)
    stages = recipe.get("stages")
    for index, stage in enumerate(stages if isinstance(stages, list) else []):
        if isinstance(stage, dict):
            handled += translate_stage(stage, index, specs, recipe, seed)
    return recipe, handled


def translate_stage(stage: dict, index: int, specs: dict, recipe: dict, seed: Any) -> list[Handled]:
    from kitcli.recipe.config_fields import config_fields

    label = str(stage.get("name") or stage.get("type") or f"stages[{index}]")
    spec = specs.get(stage.get("type")) if isinstance(stage.get("type"), str) else None
    if spec is not None:
        stage_fields = set(spec.section.model_fields) | {"type"}
        config = set(config_fields(spec.config)) if spec.config else None
    else:  # an unknown type (the schema says so): keys of any stage type are the kit's
        stage_fields, config = None, None
    known_stage = stage_fields or set().union(*(s.section.model_fields for s in specs.values())) | {"type"}
    known_train = config if config is not None else set().union(
        *(config_fields(s.config) for s in specs.values() if s.config))
    refused = set(spec.refused_keys) if spec is not None else set()  # the type's own refusal says more (ORPO's)
    known_stage = known_stage | {key for key in refused if "." not in key}
    known_train = known_train | {key.removeprefix("train.") for key in refused if key.startswith("train.")}
    common = dict(stage=stage, stage_type=stage.get("type"), stage_fields=stage_fields, config_fields=config,
                  seed=seed)
    handled = translate_section(stage, Place("stage", f"stage '{label}': ", known_stage, **common), recipe)
    train = stage.get("train")
    if isinstance(train, dict) and (spec is None or spec.config_name):
        handled += translate_section(train, Place("train", f"stage '{label}': train.", known_train, **common),
                                     recipe)
    return handled


def translate_section(section: dict, place: Place, recipe: dict) -> list[Handled]:
    handled = []
    for key in list(section):
        value = section[key]
        record = record_for(key, value, place)
        if record is None:
            continue
        del section[key]
        handled.append(apply(record, key, value, place, recipe))
    return handled


def apply(record: ForeignName, key: str, value: Any, place: Place, recipe: dict) -> Handled:
    where = f"{place.prefix}{key}"
    why = record.why.replace("{seed}", str(place.seed))
    told = f"{where}: {shown(value)}"
    if record.does == IGNORE:
        return Handled(where, key, value, record, IGNORE, f"{told} ignored: {why} [{record.source}]")
    if record.does == REFUSE:
        return Handled(where, key, value, record, REFUSE, f"{told} is not the kit's: {why} [{record.source}]")
    targets = [t for t in record.targets() if fits(t, place)]
    if not targets:
        has_none = f"a {place.stage_type} stage has no {' or '.join(record.targets())}"
        return Handled(where, key, value, record, REFUSE, f"{told} is not the kit's: {why}; {has_none} "
                                                          f"[{record.source}]")
    if targets[0] == "-":
        return Handled(where, key, value, record, IGNORE, f"{told} ignored: {why} [{record.source}]")
    try:
        new = CONVERSIONS[record.convert](value) if record.convert else value
    except ValueError as error:
        line = f"{told} cannot be read as {targets[0].removeprefix('stage.')}: {error} [{record.source}]"
        return Handled(where, key, value, record, REFUSE, line)
    target = targets[0]
    conflict = write(recipe, place.stage, target, new)
    named = target.removeprefix("stage.")
    if conflict is not None:
        line = f"{told} means {named}: {shown(new)}, but the recipe sets {conflict}; keep one [{record.source}]"
        return Handled(where, key, value, record, REFUSE, line, named, new)
    return Handled(where, key, value, record, MAP, f"{told} read as {named}: {shown(new)}; {why} [{record.source}]",
                   named, new)


def fits(target: str, place: Place) -> bool:
    """Whether the stage this name is in has the place a mapped value would go."""
    if target == "-" or target.startswith(("model.", "lora")):
        return True
    if place.stage is None:
        return False
    if target == "train":
        return True
    if target.startswith("train."):
        return place.config_fields is None or target.removeprefix("train.") in place.config_fields
    name = target.removeprefix("stage.").split(".")[0]
    return place.stage_fields is None or name in place.stage_fields


def write(recipe: dict, stage: dict | None, target: str, new: Any) -> str | None:
    """Put a mapped value where the kit reads it; a different value already there: 'KEY: VALUE' (nothing written)."""
    if target == "lora":  # lora: false
        current = recipe.get("lora")
        if isinstance(current, dict) and current:
            return f"lora: {shown(current)}"
        recipe["lora"] = new
        return None
    if target == "train":  # several train keys at once
        return merge(stage_mapping(stage, "train"), new, "train")
    section, _, key = target.rpartition(".")
    mapping = section_of(recipe, stage, section)
    if isinstance(mapping, str):
        return mapping
    return merge(mapping, {key: new}, section.removeprefix("stage").lstrip("."))


def section_of(recipe: dict, stage: dict | None, section: str) -> dict | str:
    """The mapping a target's section names (made where it is missing), or why there is none."""
    if section == "model":
        if isinstance(recipe.get("model"), str):
            recipe["model"] = {"name": recipe["model"]}
        mapping = stage_mapping(recipe, "model")
    elif section == "lora":
        if recipe.get("lora") is False or recipe.get("lora") == "none":
            return "lora: false (every weight trained)"
        if not isinstance(recipe.get("lora"), dict):
            recipe["lora"] = {}
        mapping = recipe["lora"]
    elif section == "train":
        mapping = stage_mapping(stage, "train")
    elif section == "stage.data":
        if isinstance(stage.get("data"), str):
            stage["data"] = {"path": stage["data"]}
        mapping = stage_mapping(stage, "data")
    else:  # a stage's own key
        mapping = stage
    return mapping if isinstance(mapping, dict) else f"{section.removeprefix('stage.')}: {shown(mapping)}"


def stage_mapping(stage: dict, key: str) -> Any:
    if stage.get(key) is None:
        stage[key] = {}
    return stage[key]


def merge(mapping: dict, new: dict, prefix: str) -> str | None:
    """Add `new`'s keys to `mapping`; the first that is there with another value stops it ('KEY: VALUE')."""
    for key, value in new.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in mapping:
            continue
        current = mapping[key]
        if isinstance(current, dict) and isinstance(value, dict):
            clash = next((k for k in value if k in current and not same(current[k], value[k])), None)
            if clash is not None:
                return f"{name}.{clash}: {shown(current[clash])}"
        elif not same(current, value):
            return f"{name}: {shown(current)}"
    for key, value in new.items():
        if isinstance(mapping.get(key), dict) and isinstance(value, dict):
            mapping[key] = {**mapping[key], **value}
        else:
            mapping[key] = value
    return None


def shown(value: Any, limit: int = 48) -> str:
    """A value as a line shows it: YAML-like, one line, long ones cut."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --- the page ----------------------------------------------------------------------------------------------------

PAGE_HEAD = """# Names from other tools

A recipe copied from an Unsloth notebook, a TRL CLI / open-r1 YAML or an axolotl config brings names the kit spells
otherwise. `kit check`, `kit run --dry-run` and the run's lock print one line for each name below that a recipe
uses: **map** reads it as the kit's key (the line says which), **ignore** drops it because it changes nothing the
kit does (the line says what the kit does instead), **refuse** is a fault naming the kit's spelling, reported with
every other fault of the recipe. A name is read this way only where it is not the kit's own: `max_completion_length`
is GRPOConfig's, and refused only in a stage whose trainer config lacks it. `kit import FILE` turns a whole TRL CLI
or axolotl config into a recipe through the same table ([recipe-format.md](recipe-format.md#names-from-other-tools)).

Places: `top` (the recipe's top level), `model`, `lora`, `stage` (a stage's own keys), `train` (a stage's `train:`).
Where a value decides, a name has one row per meaning (tried in order). Generated from
`kitcli/recipe/foreign_table.py` (tests/test_foreign_names.py checks that this page lists every entry).
"""


def page() -> str:
    """docs/foreign-names.md: every record of the table, in the table's order."""
    rows = ["| name | where | from | the kit | why |", "| --- | --- | --- | --- | --- |"]
    for record in FOREIGN_NAMES:
        names = ", ".join(f"`{name}`" for name in record.names())
        when = "" if record.values is None else " when " + " / ".join(shown(v) for v in record.values)
        kit = f"{record.does} -> `{record.kit}`" if record.kit and record.does == MAP else record.does
        if record.kit and record.does == REFUSE:
            kit += f" (`{record.kit}`)"
        why = record.why.replace("{seed}", "N").replace("|", "/")
        rows.append(f"| {names}{when} | {', '.join(record.at())} | {record.source} | {kit} | {why} |")
    counts = {does: sum(len(r.names()) for r in FOREIGN_NAMES if r.does == does) for does in (MAP, IGNORE, REFUSE)}
    total = (f"\n{len(FOREIGN_NAMES)} entries: {counts[MAP]} names mapped, {counts[IGNORE]} accepted as no-ops, "
             f"{counts[REFUSE]} refused (a name with several meanings counts once for each).\n")
    return PAGE_HEAD + "\n" + "\n".join(rows) + "\n" + total
