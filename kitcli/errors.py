"""The one error type for faults a user can cause: printed as one line, exit status 2, no traceback."""

from __future__ import annotations

import difflib

import click


class KitError(click.ClickException):
    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"Error: {self.format_message()}", err=True, file=file)


class KitFaults(KitError):
    """Every fault found in one pass over a recipe, one line each (`file: stage 'x': key: what is wrong`), printed
    in the recipe's order (its top level first, then stage by stage), so that a recipe copied from another tool is
    fixed in one round. One fault prints as a KitError does."""

    def __init__(self, lines: list[str], source: str, stages: list[str] = ()) -> None:
        unique = {fault_key(line): line for line in reversed(lines)}  # the first of each, found twice
        self.lines = ordered_by_stage([line for line in lines if unique.get(fault_key(line)) is line], stages)
        self.source = source
        super().__init__("\n".join(self.lines))

    def show(self, file=None) -> None:
        for line in self.lines:
            click.echo(f"Error: {line}", err=True, file=file)
        if len(self.lines) > 1:
            click.echo(f"Error: {self.source}: {len(self.lines)} faults, each on a line above; fix them all, then "
                       f"`kit check {self.source}` again", err=True, file=file)


def fault_key(line: str) -> str:
    """A fault's line without its file, its stage and the key paths before its message: the same fault found by two
    checks (`data: row 1 of ...` and `row 1 of ...`) is reported once."""
    import re

    text = re.sub(r"^.*?stage '[^']+': ", "", line)
    while (stripped := re.sub(r"^[\w.\[\]]+: ", "", text, count=1)) != text:
        text = stripped
    return f"{stage_of(line)}|{text}"


def stage_of(line: str) -> str | None:
    """The stage a fault's line names (`...: stage 'grpo': ...`), None for the recipe's top level."""
    import re

    found = re.search(r"(?:^|: )stage '([^']+)'", line)
    return found.group(1) if found else None


def ordered_by_stage(lines: list[str], stages: list[str]) -> list[str]:
    """The recipe's own faults first, then each stage's in the recipe's order (a stage not listed last), each group
    in the order found."""
    rank = {name: index for index, name in enumerate(stages)}

    def key(line: str) -> int:
        stage = stage_of(line)
        return -1 if stage is None else rank.get(stage, len(rank))

    return sorted(lines, key=key)


def faults_of(error: KitError) -> list[str]:
    """The lines of a KitError: each fault of a KitFaults, else its one message."""
    return list(error.lines) if isinstance(error, KitFaults) else [error.format_message()]


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


def debugging() -> bool:
    """KIT_DEBUG=1: show the traceback of every error (a user error's too, before its line)."""
    import os

    return os.environ.get("KIT_DEBUG", "").lower() not in ("", "0", "false", "no")


def saved_traceback() -> str:
    """The current exception's traceback in a file of its own (a bug seen once in a long run is not lost)."""
    import tempfile
    import traceback

    handle, path = tempfile.mkstemp(prefix="kit-traceback-", suffix=".txt")
    with open(handle, "w", encoding="utf-8") as out:
        out.write(traceback.format_exc())
    return path


class KitGroup(click.Group):
    """The `kit` group: usage errors (bad options, missing arguments) print as one line, exit status 2, like
    every other user error, instead of Click's usage block. Any other exception that gets here is a bug in kit: one
    line naming it and the file that keeps its traceback, exit status 1; KIT_DEBUG=1 shows every traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import sys
        import traceback

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as error:
            if debugging():
                traceback.print_exc()
            path = error.ctx.command_path if error.ctx is not None else "kit"
            click.echo(f"Error: {error.format_message()} (see `{path} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as error:
            if debugging():
                traceback.print_exc()
            error.show()
            sys.exit(error.exit_code)
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(1)
        except Exception as error:  # a bug: one line here, the traceback kept in a file
            if debugging():
                raise
            first = (str(error).strip().splitlines() or [""])[0][:200]
            click.echo(f"Error: internal error in kit: {type(error).__name__}: {first} (a bug; its traceback is in "
                       f"{saved_traceback()}; KIT_DEBUG=1 shows it here; please report it)", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
