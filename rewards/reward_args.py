"""The checks the built-in rewards' factories make of their settings (rewards/builtin.py): one line naming the
setting and what it must be."""

from __future__ import annotations

import re
from typing import Any

from kitcli.errors import KitError


def check_tags(tags: Any) -> list[str]:
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, (list, tuple)) or not tags or not all(isinstance(t, str) and t.strip() for t in tags):
        raise KitError(f"tags must be a non-empty list of tag names such as [think, answer], got {tags!r}")
    bad = [t for t in tags if not re.fullmatch(r"[A-Za-z_][\w.-]*", t)]
    if bad:
        raise KitError(f"tag '{bad[0]}' is not a valid tag name; write the name without brackets, e.g. think")
    return list(tags)


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KitError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value > 0:
        raise KitError(f"{name} must be a number <= 0 (it is a penalty), got {value!r}")
    return float(value)
