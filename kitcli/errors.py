"""The one error type for faults a user can cause: printed as one line, exit status 2, no traceback."""

from __future__ import annotations

import difflib

import click


class KitError(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


def closest(word: str, choices, n: int = 1) -> list[str]:
    """The nearest names by spelling; failing that, names that are a prefix of the word or start with it
    (`rank` -> `r`, `dropout_rate` -> `dropout`)."""
    choices = [str(c) for c in choices]
    found = difflib.get_close_matches(word, choices, n=n, cutoff=0.5)
    if found:
        return found
    prefixed = [c for c in choices if word.startswith(c) or c.startswith(word)]
    return sorted(prefixed, key=len, reverse=True)[:n]


def did_you_mean(word: str, choices) -> str:
    match = closest(word, choices)
    return f"; did you mean '{match[0]}'?" if match else ""


class KitGroup(click.Group):
    """The `kit` group: usage errors (bad options, missing arguments) print as one line, exit status 2, like
    every other user error, instead of Click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import sys

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as error:
            path = error.ctx.command_path if error.ctx is not None else "kit"
            click.echo(f"Error: {error.format_message()} (see `{path} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as error:
            error.show()
            sys.exit(error.exit_code)
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
