"""Helpers shared by tests/test_tools.py and tests/test_tool_stages.py: data, recipes and plugin files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import DATA

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")  # conversational prompts with an answer column
SMALL_GRPO = {"learning_rate": 1e-3, "max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 2,
              "max_completion_length": 24, "logging_steps": 1, "save_steps": 50}


def copy_plugins(folder: Path) -> Path:
    """tests/tool_plugins.py as `my_tools.py` in `folder` (recipes name its tools as my_tools.py:NAME)."""
    shutil.copy(Path(__file__).with_name("tool_plugins.py"), folder / "my_tools.py")
    return folder


def schema_line(schema: dict) -> str:
    """How the tiny template writes a tool: `name(param: type, ...): description param: its description`."""
    function = schema["function"]
    properties = function.get("parameters", {}).get("properties", {})
    signature = ", ".join(f"{name}: {spec['type']}" for name, spec in properties.items())
    described = "".join(f" {name}: {spec['description']}" for name, spec in properties.items() if "description" in spec)
    return f"{function['name']}({signature}): {function.get('description', '')}{described}\n"


def tool_row(name: str = "calculator", role: str = "tool", arguments=None, tools: bool = True) -> dict:
    schema = {"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}
    row = {"messages": [{"role": "user", "content": "What is 12*13?"},
                        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                            "name": name, "arguments": arguments or {"expression": "12*13"}}}]},
                        {"role": role, "name": name, "content": "156"},
                        {"role": "assistant", "content": "156"}]}
    return {**row, "tools": [schema]} if tools else row


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def grpo(**changes) -> dict:
    stage = {"name": "grpo", "type": "grpo", "data": {"path": PROMPTS, "limit": 8}, "rewards": ["exact_match"],
             "tools": ["calculator"], "train": dict(SMALL_GRPO)}
    return {**stage, **changes}
