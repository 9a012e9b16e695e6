"""Pluggable reward functions: plain callables `fn(prompts, completions, **columns) -> list[float | None]`.
A library of its own. May import: the ground, and of it only kitcli/errors.py and kitcli/rundir.py."""
