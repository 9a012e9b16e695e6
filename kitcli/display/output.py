"""How progress is shown in this process: the mode the CLI chose (`output_mode`: auto, quiet, json), the stage the
runner runs (`stage_display`), and the JSON lines of `--json` (`emit_json`). kitcli/display/dashboard.py reads them."""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

MODES = ("auto", "quiet", "json")


@dataclass
class Display:
    """How progress is shown in this process (set by the CLI) and which stage runs now (set by the runner)."""

    mode: str = "auto"
    json_stream: Any = None
    stage_index: int | None = None
    stage_total: int | None = None
    spec: Any = None  # the running stage's type: its StageSpec (kitcli/recipe/stage_spec.py)


DISPLAY = Display()


@contextmanager
def output_mode(mode: str, json_stream=None):
    """`auto` (dashboard on a terminal, plain lines elsewhere), `quiet`, or `json` (objects to `json_stream`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    saved = (DISPLAY.mode, DISPLAY.json_stream)
    DISPLAY.mode, DISPLAY.json_stream = mode, json_stream if json_stream is not None else sys.stdout
    try:
        yield DISPLAY
    finally:
        DISPLAY.mode, DISPLAY.json_stream = saved


@contextmanager
def stage_display(index: int, total: int, spec):
    """Stage `index` of `total`, of the type `spec` (its StageSpec), runs in the block."""
    saved = (DISPLAY.stage_index, DISPLAY.stage_total, DISPLAY.spec)
    DISPLAY.stage_index, DISPLAY.stage_total, DISPLAY.spec = index, total, spec
    try:
        yield
    finally:
        DISPLAY.stage_index, DISPLAY.stage_total, DISPLAY.spec = saved


def json_safe(value: Any) -> Any:
    """NaN and infinities as null, so every line is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def emit_json(obj: dict[str, Any]) -> None:
    """One JSON object on its own line, in `--json` mode only."""
    if DISPLAY.mode != "json":
        return
    stream = DISPLAY.json_stream or sys.stdout
    stream.write(json.dumps(json_safe(obj), default=str) + "\n")
    stream.flush()
