"""A recipe's faults, one line each: pydantic's validation errors in the kit's words (the file, the stage, the key
path, the value and what was expected), every one of them rather than the first, and the repair that sets a faulty
key aside so that what lies behind it (the rules between stages, the trainer's config) is checked in the same pass.
"""

from __future__ import annotations

import copy
from typing import Any

from kitcli.errors import closest, did_you_mean

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


def fault_lines(error, raw: dict, source: str, model, specs: dict, prefix: tuple = ()) -> list[tuple[tuple, str]]:
    """Every fault of a pydantic ValidationError in the kit's words: (its location, its line), one per place (the
    alternatives of a union at one place are one fault), in the order pydantic found them."""
    errors = misspelled_not_missing(error.errors(include_url=False))

    def place(e) -> tuple:
        full = (*prefix, *e["loc"])
        if e["type"] in ("extra_forbidden", "missing"):  # the last part is the key in question, not a branch
            return (*without_branches(full[:-1], model, specs), full[-1])
        return without_branches(full, model, specs)

    by_field: dict[tuple, list[dict]] = {}  # a union's alternatives fault one field: one line for them all
    for e in errors:
        by_field.setdefault(branch_root((*prefix, *e["loc"]), model, specs), []).append(e)
    lines = []
    for alternatives in by_field.values():
        loc = place(alternatives[0])
        same_place = [e for e in alternatives if place(e) == loc]
        first = same_place[0]
        if len(same_place) > 1 and all(e["type"] in TYPE_WORDS for e in same_place):  # every alternative of a union
            first = {**first, "type": "union", "ctx": {"expected": " or ".join(
                dict.fromkeys(TYPE_WORDS[e["type"]] for e in same_place))}}
        line = one_fault(first, loc, raw, source, model, specs)
        lines.append((tuple(first["loc"]), line))
        context = first.get("ctx") or {}
        for more in context.get("more") or ():  # a validator that found several faults (a stage's train: keys)
            if isinstance(more, dict):  # another place: {"where": "stage 'x'", "message": ...}
                lines.append((tuple(first["loc"]), f"{source}: {more['where']}: {more['message']}"))
            else:
                lines.append((tuple(first["loc"]), place_prefix(line, context["message"]) + more))
    return lines


def misspelled_not_missing(errors: list[dict]) -> list[dict]:
    """A required key written wrong (`datx` for `data`) is one fault, the unknown key's, which names the key meant;
    not a second one saying the key meant is missing."""
    unknown = {(tuple(e["loc"][:-1]), str(e["loc"][-1])) for e in errors if e["type"] == "extra_forbidden"}
    meant = {(parent, match) for parent, key in unknown for match in closest(key, [str(e["loc"][-1]) for e in errors
                                                                                  if e["type"] == "missing"])}
    return [e for e in errors if not (e["type"] == "missing" and (tuple(e["loc"][:-1]), str(e["loc"][-1])) in meant)]


def branch_root(loc: tuple, root, specs: dict) -> tuple:
    """A location up to the first alternative of a union pydantic tried (`list[str]`, `str`, ...): the field whose
    value faulted, whichever alternative said so."""
    kept: list = []
    for part in loc:
        if without_branches((*kept, part), root, specs) == tuple(kept):
            return tuple(kept)
        kept.append(part)
    return tuple(kept)


def place_prefix(line: str, message: str) -> str:
    """The part of a fault's line before its message (`file: stage 'x': `)."""
    return line[: len(line) - len(message)] if line.endswith(message) else line + "; "


def describe_error(error, raw: dict, source: str, model, specs: dict, prefix: tuple = ()) -> str:
    """The first fault of a pydantic ValidationError, in the kit's words."""
    return fault_lines(error, raw, source, model, specs, prefix)[0][1]


def one_fault(first: dict, loc: tuple, raw: dict, source: str, model, specs: dict) -> str:
    """One fault's line: `file: stage 'x': key.path: what is wrong, what was expected`."""
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


# --- setting a fault aside ------------------------------------------------------------------------------------------

def set_aside(raw: dict, error, model, specs: dict, touched: set[int], defaulted: set[int]) -> dict | None:
    """A copy of `raw` without the keys pydantic faulted (an unknown key, a bad value of a key that has a default,
    `train:` keys a validator refused, a reference to no earlier stage), so that validating it again reaches the
    checks behind them; None when some fault cannot be set aside (a required key, a rule between keys), and the
    faults found so far are all there is. The stages it changed are added to `touched`: a rule of a whole stage that
    fails after it (no reward left, say) follows from the fault already named (is_consequence); those where a key
    the stage reads lost its value (a default now in its place) to `defaulted`: their trainer config is not built
    in this pass (an unknown key set aside changes nothing the stage reads)."""
    repaired = copy.deepcopy(raw)
    for e in error.errors(include_url=False):
        loc = tuple(e["loc"])
        context = e.get("ctx") or {}
        stages = {path[1] for path in [loc, *(context.get("unset") or ())]
                  if len(path) > 1 and path[0] == "stages" and isinstance(path[1], int)}
        touched.update(stages)
        unknown_only = (e["type"] == "extra_forbidden" and not misspelled(loc, model, specs)) or (
            e["type"] == "kit" and context.get("keys") and not context.get("values"))
        if not unknown_only:
            defaulted.update(stages)
        if e["type"] == "kit" and context.get("unset"):  # keys a rule between them refused, from the root
            for path in context["unset"]:
                parent = node_at(repaired, tuple(path[:-1]), specs)
                if isinstance(parent, dict):
                    parent.pop(path[-1], None)
            continue
        if e["type"] == "kit" and context.get("keys") and loc and loc[-1] == "train":
            train = node_at(repaired, loc, specs)
            if not isinstance(train, dict):
                return None
            for key in context["keys"]:
                train.pop(key, None)
            continue
        if e["type"] == "missing" or not loc:
            return None
        key_loc = (*without_branches(loc[:-1], model, specs), loc[-1]) if e["type"] == "extra_forbidden" \
            else without_branches(loc, model, specs)
        parent_loc, key = key_loc[:-1], key_loc[-1]
        if e["type"] != "extra_forbidden":
            parent = section_at(model, parent_loc, specs)
            if parent is None or key not in parent.model_fields or parent.model_fields[key].is_required():
                return None
        parent_node = node_at(repaired, parent_loc, specs)
        if not isinstance(parent_node, dict) or key not in parent_node:
            return None
        del parent_node[key]
    return repaired


def misspelled(loc: tuple, model, specs: dict) -> bool:
    """An unknown key close to one of its section's own (`rewrds`): the key meant is left to its default."""
    parent = section_at(model, without_branches(loc[:-1], model, specs), specs)
    return parent is not None and bool(closest(str(loc[-1]), parent.model_fields))


def node_at(raw: Any, loc: tuple, specs: dict) -> Any:
    """The value at a validation location in the raw recipe (the union's tag skipped)."""
    node = raw
    for part in loc:
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_list or (isinstance(node, dict) and part in node):
            node = node[part]
        elif not (isinstance(node, dict) and part in specs):  # else the stage union's tag: skipped
            return None
    return node


def is_consequence(loc: tuple, touched: set[int], specs: dict) -> bool:
    """A fault of a whole stage's rule (its section's own validator, located at the stage's tag) in a stage a repair
    changed: it follows from a key set aside, not from the recipe."""
    return len(loc) == 3 and loc[0] == "stages" and loc[1] in touched and loc[2] in specs
