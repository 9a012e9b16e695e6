"""Reading back what was written down: JSON lines (a dataset's rows, or a run's own logs) and the first difference
between two recorded settings (a lock's recipe and today's, a checkpoint's trainer settings and today's)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from kitcli.errors import KitError


def read_jsonl(path: Path, *, strict: bool = False) -> list[dict[str, Any]]:
    """Every JSON object of a JSONL file, blank lines skipped.

    strict (a dataset): a line that is not a JSON object is an error naming the file and the line. Otherwise (a log
    the run appends to as it goes): a missing file has no rows and a line cut short by a kill is skipped (a resume
    rewrites it)."""
    if not strict and not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                if not strict:
                    continue
                raise KitError(f"{path}: line {number} is not valid JSON ({error.msg} at column "
                               f"{error.colno})") from None
            if not isinstance(row, dict):
                if not strict:
                    continue
                raise KitError(f"{path}: line {number} must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def first_difference(before: Any, now: Any, *, ignore: Collection[str] = (),
                     path: str = "") -> tuple[str, Any, Any] | None:
    """The first place where two JSON-like values differ, as (dotted path, value before, value now); None if equal.

    Mappings are compared key by key (keys in `ignore` skipped at any depth), lists of one length item by item
    (`key[i]`). A key that one side lacks while the other holds an empty value is no difference: a newer kit added
    that setting with an empty default (e.g. data.chat: false), which changes nothing."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in sorted(set(before) | set(now), key=str):
            if key in ignore:
                continue
            if (key not in before and not now[key]) or (key not in now and not before[key]):
                continue
            found = first_difference(before.get(key), now.get(key), ignore=ignore,
                                     path=f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if isinstance(before, list) and isinstance(now, list) and len(before) == len(now):
        for i, (x, y) in enumerate(zip(before, now)):
            found = first_difference(x, y, ignore=ignore, path=f"{path}[{i}]")
            if found:
                return found
        return None
    return None if before == now else (path or "recipe", before, now)
