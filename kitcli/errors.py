"""The one error type for faults a user can cause: printed as one line, exit status 2, no traceback."""

from __future__ import annotations

import difflib

import click


class KitError(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


def closest(word: str, choices, n: int = 1) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)


def did_you_mean(word: str, choices) -> str:
    match = closest(word, choices)
    return f"; did you mean '{match[0]}'?" if match else ""
