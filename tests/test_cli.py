"""The CLI surface: fast start-up without heavy imports, --help and --version everywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from helpers import run_cli

from kitcli.commands.cli import main

HEAVY = ("torch", "transformers", "trl", "unsloth", "peft", "datasets")


def all_commands(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        yield prefix + (name,)
        if isinstance(command, click.Group):
            yield from all_commands(command, prefix + (name,))


@pytest.mark.parametrize("argv, expected", [
    (["--help"], "Usage: kit"),
    (["recipes", "list"], "tiny-sft"),
    (["rewards", "list"], "exact_match"),
], ids=["help", "recipes-list", "rewards-list"])
def test_commands_that_do_not_train_import_no_heavy_module(argv, expected):
    code = ("import sys, json\n"
            "from kitcli.commands.cli import main\n"
            f"try:\n    main({argv!r}, prog_name='kit')\nexcept SystemExit:\n    pass\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert expected in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_kit_help_imports_neither_pydantic_nor_the_recipe_schema():
    """`kit --help` answers in about 0.1 s: the recipe schema (pydantic, about 0.2 s of imports) loads inside the
    commands that read a recipe, not when the CLI is built."""
    code = ("import sys, json\n"
            "from kitcli.commands.cli import main\n"
            "try:\n    main(['--help'], prog_name='kit')\nexcept SystemExit:\n    pass\n"
            "print(json.dumps([m for m in ('pydantic', 'kitcli.recipe.schema', 'kitcli.recipe.filter_spec') "
            "if m in sys.modules]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_python_dash_m_and_version():
    result = subprocess.run([sys.executable, "-m", "kitcli", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("kit, version ")


@pytest.mark.parametrize("command", list(all_commands(main)), ids=" ".join)
def test_every_command_has_help(command):
    result = run_cli(*command, "--help")
    assert "Usage:" in result.output


def test_recipes_show_prints_yaml_with_header_comment():
    result = run_cli("recipes", "show", "tiny-sft")
    assert result.output.startswith("# Run:")
    assert "stages:" in result.output


def test_recipes_show_unknown_suggests():
    result = run_cli("recipes", "show", "tiny-sf", expect=2)
    assert "tiny-sft" in result.output
    assert "Traceback" not in result.output
