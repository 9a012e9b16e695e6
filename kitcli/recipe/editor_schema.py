"""The recipe's JSON Schema, generated from the same pydantic models that validate it (kitcli/recipe/schema.py),
with each stage type's `train:` fields (kitcli/recipe/config_fields.py): `kit recipes schema` prints it for an
editor's YAML language server."""

from __future__ import annotations

from typing import Any

from kitcli.recipe.schema import recipe_model
from kitcli.recipe.stage_spec import StageSpec


def json_schema(specs: dict[str, StageSpec]) -> dict[str, Any]:
    """The JSON Schema of a recipe, `train:` fields included per stage type: point a YAML language server at it
    and an editor flags an unknown key, a wrong type or a value out of range while you type."""
    schema = recipe_model(specs).model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kit recipe"
    definitions = schema.get("$defs", {})
    for name in ("ModelSpec", "DataSpec", "RewardSpec", "RewardModelSpec", "ToolSpec"):  # each also takes a string
        if name in definitions:
            definitions[name] = {"anyOf": [{"type": "string"}, definitions[name]]}
    if "LoraSpec" in definitions:  # `lora: false` (or none): full fine-tuning
        definitions["LoraSpec"] = {"anyOf": [{"const": False}, {"const": "none"}, definitions["LoraSpec"]]}
    for spec in specs.values():
        section = definitions.get(spec.section.__name__)
        if section is None or "train" not in section.get("properties", {}) or spec.config is None:
            continue
        section["properties"]["train"] = train_schema(spec, section["properties"]["train"].get("description", ""))
    return schema


def train_schema(spec, description: str) -> dict[str, Any]:
    """A stage type's `train:` block (its StageSpec's): its config's fields with their types, choices and the
    section's ranges."""
    from kitcli.recipe.config_fields import config_fields, field_type

    section, config = spec.section, spec.config
    properties = {}
    for name, found in config_fields(config).items():
        if name in section.reserved:
            continue
        entry = type_schema(field_type(config, name, section.train_choices))
        bounds = section.train_ranges.get(name)
        if bounds is not None and entry.get("type") in ("integer", "number"):
            entry.update(range_schema(bounds))
        if found.help:
            entry["description"] = found.help
        properties[name] = entry
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "description": f"{description} ({config})"}


def type_schema(spec) -> dict[str, Any]:
    simple = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "none": "null",
              "dict": "object"}
    if spec.kind in simple:
        return {"type": simple[spec.kind]}
    if spec.kind == "list":
        return {"type": "array", "items": type_schema(spec.items[0])}
    if spec.kind == "choice":
        return {"enum": list(spec.items)}
    if spec.kind == "union":
        return {"anyOf": [type_schema(part) for part in spec.items]}
    return {}


def range_schema(bounds) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if bounds.low is not None and not bounds.also:
        out["exclusiveMinimum" if bounds.low_open else "minimum"] = bounds.low
    if bounds.high is not None:
        out["exclusiveMaximum" if bounds.high_open else "maximum"] = bounds.high
    return out
