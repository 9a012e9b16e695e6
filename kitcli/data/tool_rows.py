"""Rows in TRL's tool-calling format, for SFT and DPO: conversations whose assistant turns carry `tool_calls` and
whose `tool` turns carry the results, with a `tools` column holding the JSON schemas of the functions the row may
call (a list, or a JSON string of one: TRL's SFTTrainer and DPOTrainer `json.loads` a string and pass it to the chat
template as `tools=`).

    {"messages": [{"role": "user", "content": "What is 12*13?"},
                  {"role": "assistant", "tool_calls": [{"type": "function",
                      "function": {"name": "calculator", "arguments": {"expression": "12*13"}}}]},
                  {"role": "tool", "name": "calculator", "content": "156"},
                  {"role": "assistant", "content": "156"}],
     "tools": [{"type": "function", "function": {"name": "calculator", "description": "...", "parameters": {...}}}]}

Checked when the data is read (kitcli/data/rows.py): each tool call's shape, and that it calls a function the row's
`tools` column defines. `tool_features` keeps these columns as JSON in the Arrow table: stored as structs, every
row's arguments and schemas would gain the other rows' keys as nulls, which the template would then render.
"""

from __future__ import annotations

import json
from typing import Any

from kitcli.errors import KitError

CONVERSATION_COLUMNS = ("prompt", "completion", "chosen", "rejected", "messages")


def is_tool_call_turn(message: dict[str, Any], at: str) -> bool:
    """Whether `message` is an assistant turn with tool calls (checked: a list of {type: function, function: {name,
    arguments}}); such a turn may have no content."""
    calls = message.get("tool_calls")
    if calls is None:
        return False
    if message.get("role") != "assistant":
        raise KitError(f"{at} has tool_calls in a {message.get('role')} turn; only assistant turns call tools")
    if not isinstance(calls, list) or not calls:
        raise KitError(f"{at} has tool_calls {calls!r:.60}; give a list of calls, each {{type: function, function: "
                       f"{{name: ..., arguments: {{...}}}}}}")
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise KitError(f"{at}, tool_calls[{index}] is {call!r:.80}; a call is {{type: function, function: "
                           f"{{name: ..., arguments: {{...}}}}}}")
        if call.get("type", "function") != "function":
            raise KitError(f"{at}, tool_calls[{index}] has type {call.get('type')!r}; only function calls exist")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            raise KitError(f"{at}, tool_calls[{index}] ({function['name']}) has arguments {arguments!r:.60}; give a "
                           f"mapping of named arguments (or a JSON string of one)")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise KitError(f"{at} has content {content!r:.60}; a tool-calling turn's content is a string or absent")
    return True


def row_tool_names(row: dict[str, Any], number: int, path: str, where: str) -> set[str] | None:
    """The function names the row's `tools` column defines (None when the row has no tools column)."""
    tools = row.get("tools")
    if tools is None:
        return None
    at = f"{where}: row {number} of '{path}', column 'tools'"
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise KitError(f"{at} is a string that is not JSON; give a list of tool schemas") from None
    if not isinstance(tools, list):
        raise KitError(f"{at} holds {type(tools).__name__}; give a list of tool schemas ({{type: function, "
                       f"function: {{name, description, parameters}}}})")
    names = set()
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise KitError(f"{at}[{index}] is {tool!r:.80}; a tool schema is {{type: function, function: {{name, "
                           f"description, parameters}}}}")
        names.add(function["name"])
    return names


def check_tool_names(rows: list[dict[str, Any]], where: str, path: str) -> None:
    """Every tool call names a function its row's `tools` column defines."""
    for number, row in enumerate(rows, start=1):
        defined = row_tool_names(row, number, path, where)
        for key in CONVERSATION_COLUMNS:
            messages = row.get(key)
            if not isinstance(messages, list):
                continue
            for index, message in enumerate(messages):
                for call in message.get("tool_calls") or []:
                    name = call["function"]["name"]
                    if defined is None:
                        raise KitError(f"{where}: row {number} of '{path}', {key}[{index}] calls tool '{name}', but "
                                       f"the row has no tools column; add one listing the schema of each function "
                                       f"the row calls (TRL renders it into the prompt)")
                    if name not in defined:
                        raise KitError(f"{where}: row {number} of '{path}', {key}[{index}] calls tool '{name}', "
                                       f"which the row's tools column does not define (it defines: "
                                       f"{', '.join(sorted(defined)) or 'none'})")


def uses_tools(rows: list[dict[str, Any]]) -> list[str]:
    """The columns to keep as JSON: `tools`, and the conversation columns where some turn calls a tool."""
    columns = ["tools"] if any("tools" in row for row in rows) else []
    for key in CONVERSATION_COLUMNS:
        if any(isinstance(row.get(key), list) and any(isinstance(m, dict) and m.get("tool_calls")
                                                      for m in row[key]) for row in rows):
            columns.append(key)
    return columns


def tool_features(rows: list[dict[str, Any]]):
    """The `datasets` features for rows with tool calls (their tool columns as JSON, the rest inferred), or None."""
    columns = uses_tools(rows)
    if not columns:
        return None
    import datasets

    rest = datasets.Dataset.from_list([{k: v for k, v in row.items() if k not in columns} for row in rows]).features
    return datasets.Features({**rest, **{column: datasets.Json() for column in columns}})
