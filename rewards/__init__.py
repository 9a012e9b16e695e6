"""Pluggable reward functions: plain callables `fn(prompts, completions, **columns) -> list[float | None]`."""
