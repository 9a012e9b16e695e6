"""`kit tools`: list the tools a GRPO / GSPO stage can give its model, and call one by hand.

    kit tools list
    kit tools test calculator --args '{"expression": "12*(3+4)/5"}'
    kit tools test search_file --setup '{"path": "notes.txt"}' --args '{"query": "alpha"}'
    kit tools test my_tools.py:lookup --args '{"key": "x"}' --schema

A call goes through the same guard as in training (tools/registry.py): bad arguments, an exception or a timeout is
printed as the message the model would read, and counts as a tool failure (exit status 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError


def console():
    from rich.console import Console

    return Console(highlight=False)


def json_object(text: str | None, option: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise KitError(f"{option} is not valid JSON ({error.msg}); give an object, e.g. {option} "
                       f"'{{\"expression\": \"1+2\"}}'") from None
    if not isinstance(value, dict):
        raise KitError(f"{option} must be a JSON object of named arguments, got {type(value).__name__}")
    return value


@click.group("tools")
def tools_group() -> None:
    """List and try the tools a model can call during GRPO / GSPO."""


@tools_group.command("list")
def tools_list() -> None:
    """List the tools a recipe can name.

    Name, the parameters the model fills in, the args a factory takes (in the recipe), where it comes from, and what
    it does."""
    from rich.table import Column, Table

    from tools.registry import ENTRY_POINT_GROUP, tool_catalog

    table = Table(Column("name", no_wrap=True), "parameters", "args", "from", "what it does")
    for row in tool_catalog():
        table.add_row(row["name"], row["parameters"], row["args"], row["source"], row["doc"])
    out = console()
    out.print(table)
    out.print(f"Also: module:function, or path/to/file.py:function (relative to the recipe). Packages add tools "
              f"through the '{ENTRY_POINT_GROUP}' entry-point group.", markup=False)


@tools_group.command("test")
@click.argument("tool")
@click.option("--args", "call_args", metavar="JSON", help="The call's arguments as a JSON object, as the model would "
                                                          "give them, e.g. '{\"expression\": \"1+2\"}'.")
@click.option("--setup", metavar="JSON", help="A tool factory's args, as in the recipe's args:, e.g. "
                                              "'{\"path\": \"notes.txt\"}'.")
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds the call may take.")
@click.option("--schema", is_flag=True, help="Also print the JSON schema the model sees.")
def tools_test(tool: str, call_args: str | None, setup: str | None, timeout: float, schema: bool) -> None:
    """Call one tool with arguments and print what the model would read.

    TOOL is a name (see `kit tools list`), module:function or path/to/file.py:function."""
    from tools.registry import ToolError, load_tool

    where = "kit tools test"
    arguments = json_object(call_args, "--args")
    loaded = load_tool({"name": tool, "args": json_object(setup, "--setup"), "timeout": timeout}, Path.cwd(), where)
    out = console()
    if schema:
        click.echo(json.dumps(loaded.schema, indent=2))
    try:
        result = loaded.fn(**arguments)
    except ToolError as failure:
        out.print(f"tool failure: {failure}", markup=False)
        raise SystemExit(1) from None
    out.print(str(result), markup=False)
