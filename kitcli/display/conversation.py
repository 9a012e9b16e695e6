"""A tool-calling conversation as the dashboard, the report and `kit chat` show it.

TRL's GRPOTrainer hands a multi-turn completion over as messages: an assistant turn with `tool_calls`, one `tool`
turn per call (a failed call's content is `{'error': ...}`), the assistant's next turn, and so on; the eval stage and
`kit chat --tools` keep the same turns (kitcli/models/tool_loop.py). `tool_turns` keeps a completion's turns in a
small JSON-ready form when it has tool turns; the rest render them.
"""

from __future__ import annotations

import json
from typing import Any

from kitcli.display.formatting import clip


def has_tool_turns(completion: Any) -> bool:
    return isinstance(completion, list) and any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                                for m in completion)


def tool_turns(completion: Any) -> list[dict[str, Any]] | None:
    """The turns of a completion that called a tool (role, content, and each call's name and arguments); None for a
    completion without tool turns."""
    if not has_tool_turns(completion):
        return None
    turns = []
    for message in completion:
        turn: dict[str, Any] = {"role": message.get("role", "assistant"), "content": str(message.get("content") or "")}
        if message.get("role") == "tool" and message.get("name"):
            turn["name"] = message["name"]
        calls = [call.get("function", call) for call in message.get("tool_calls") or []]
        if calls:
            turn["tool_calls"] = [{"name": c.get("name", "?"), "arguments": c.get("arguments") or {}} for c in calls]
        turns.append(turn)
    return turns


def is_failure(turn: dict[str, Any]) -> bool:
    """A tool turn answering a failed call: TRL writes `str({'error': message})` (so does the kit's eval loop)."""
    return turn.get("role") == "tool" and str(turn.get("content", "")).startswith("{'error'")


def call_counts(turns: list[dict[str, Any]]) -> tuple[int, int]:
    """(tool calls, failed calls) in a conversation's turns."""
    calls = sum(len(t.get("tool_calls") or []) for t in turns)
    return calls, sum(is_failure(t) for t in turns)


def call_text(call: dict[str, Any]) -> str:
    arguments = call.get("arguments")
    if isinstance(arguments, dict):
        arguments = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())
    return f"{call.get('name', '?')}({arguments or ''})"


def turn_parts(turn: dict[str, Any]) -> list[tuple[str, str]]:
    """(who, what) lines of one turn: the assistant's text, each call it makes, a tool's answer."""
    if turn.get("role") == "tool":
        label = "tool " + turn.get("name", "") + (" (failed)" if is_failure(turn) else "")
        return [(label.strip(), " ".join(str(turn.get("content", "")).split()))]
    parts = []
    content = " ".join(str(turn.get("content", "")).split())
    if content or not turn.get("tool_calls"):
        parts.append((turn.get("role", "assistant"), content))
    parts += [("call", call_text(call)) for call in turn.get("tool_calls") or []]
    return parts


def turns_line(turns: list[dict[str, Any]], limit: int | None = None) -> str:
    """One line: `call f(x="1"); -> 17; 177` (calls, tool answers, the assistant's text)."""
    pieces = []
    for turn in turns:
        for who, what in turn_parts(turn):
            pieces.append(f"call {what}" if who == "call" else f"-> {what}" if who.startswith("tool") else what)
    text = "; ".join(p for p in pieces if p)
    return text if limit is None else clip(text, limit)


def turns_markdown(turns: list[dict[str, Any]], limit: int = 300) -> list[str]:
    """A conversation as a markdown list, one line per assistant text, call and tool answer."""
    lines = []
    for turn in turns:
        for who, what in turn_parts(turn):
            shown = clip(what, limit).replace("`", "'")
            lines.append(f"- **{who}**: `{shown}`" if who == "call" else f"- **{who}**: {shown or '(empty)'}")
    return lines
