"""How a number and a message read wherever a run is shown: the live dashboard, the progress log and the report."""

from __future__ import annotations

from typing import Any


def format_value(value: Any) -> str:
    """A float to four significant digits (scientific outside [1e-3, 1e5)); anything else as str() gives it."""
    if isinstance(value, float):
        return f"{value:.4g}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def message_text(value: Any, limit: int | None = None) -> str:
    """A prompt or completion as one line (the last message's content for conversations), cut at `limit`."""
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content", "")
    elif isinstance(value, dict):
        value = value.get("content", "")
    text = " ".join(str(value).split())
    return text if limit is None else clip(text, limit)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
