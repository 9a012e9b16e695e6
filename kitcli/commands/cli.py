"""The `kit` command line. Heavy libraries (torch, transformers, trl, unsloth) are imported inside the
commands that train, never at import time, so `kit --help` and the listing commands stay fast."""

from __future__ import annotations

import sys

import click

from kitcli import __version__
from kitcli.commands.chat import chat_command, generate_command
from kitcli.commands.check import check_command
from kitcli.commands.data import data_group
from kitcli.commands.doctor import doctor_command
from kitcli.commands.eval import eval_command, report_command
from kitcli.commands.export import export_command
from kitcli.commands.import_config import import_command
from kitcli.commands.plan import plan_command
from kitcli.commands.rewards import rewards
from kitcli.commands.tools import tools_group
from kitcli.errors import KitError, KitGroup
from kitcli.run.launch import launcher_options

SET_HELP = "Override a recipe value, e.g. stages.sft.train.learning_rate=1e-4 (repeatable)."


def make_console(quiet: bool = False, stderr: bool = False):
    from rich.console import Console

    return Console(quiet=quiet, highlight=False, stderr=stderr)


def no_lock_option(command):
    return click.option("--no-lock", is_flag=True,
                        help="Go on without the run directory's lock where its filesystem has no file locks (some "
                             "network mounts); then make sure yourself that no other kit run writes there.")(command)


def output_options(command):
    """--quiet and --json: how progress is shown (default: a live dashboard on a terminal, plain lines elsewhere)."""
    command = click.option("--json", "as_json", is_flag=True,
                           help="One JSON object per logging step (and a final summary) on stdout; all other "
                                "output goes to stderr.")(command)
    return click.option("--quiet", "-q", is_flag=True,
                        help="No progress or tables; only alarms (stderr) and the run directory at the end.")(command)


@click.group(cls=KitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="kit")
def main() -> None:
    """kit: one-command LoRA post-training recipes (SFT, reward model, DPO, KTO, ORPO, SimPO, GRPO, GSPO, RLOO, PPO,
    distillation) on one GPU."""


@main.command()
@click.argument("recipe", required=False)
@click.option("--from-lock", "from_lock", metavar="LOCK",
              help="Re-run exactly what a run recorded: RUN_DIR/recipe.lock.yaml (same as passing it as RECIPE).")
@click.option("--output", "-o", help="Run directory (default: runs/<name>-<timestamp>, or the newest run of the "
                                      "same recipe, which is then resumed).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--dry-run", is_flag=True, help="Print the resolved configuration of every stage and exit.")
@click.option("--force", is_flag=True, help="Redo every stage that runs, even finished ones.")
@click.option("--until", metavar="STAGE", help="Run the stages up to STAGE (included); later ones are left alone.")
@click.option("--only", metavar="STAGE[,STAGE]", help="Run only these stages; the finished stages they start from are "
                                                      "reused.")
@no_lock_option
@output_options
@launcher_options
def run(recipe: str | None, from_lock: str | None, output: str | None, overrides: tuple[str, ...], dry_run: bool,
        force: bool, until: str | None, only: str | None, no_lock: bool, quiet: bool, as_json: bool,
        launcher: str | None, num_processes: int | None, deepspeed: str | None, fsdp: bool, cpu: bool) -> None:
    """Run a recipe: a shipped name (see `kit recipes list`), a YAML file, or a run's recipe.lock.yaml."""
    from kitcli.recipe.load import load_recipe
    from kitcli.run.launch import LaunchFailed, run_with_launcher
    from kitcli.run.selection import selected_stages

    if (recipe is None) == (from_lock is None):
        raise KitError("give a recipe (a shipped name or a YAML file) or --from-lock RUN_DIR/recipe.lock.yaml, "
                       "not both or neither")
    recipe = recipe or from_lock

    loaded = load_recipe(recipe, list(overrides), collect=True)  # its faults are raised with every other one
    selected = selected_stages(loaded, until, [n.strip() for n in only.split(",") if n.strip()] if only else None)
    if not dry_run:
        part = (["--until", until] if until else []) + (["--only", only] if only else [])
        try:
            run_dir = run_with_launcher(loaded, recipe, launcher=launcher, num_processes=num_processes,
                                        deepspeed=deepspeed, fsdp=fsdp, cpu=cpu, output=output,
                                        overrides=list(overrides), force=force, no_lock=no_lock, quiet=quiet,
                                        as_json=as_json, console=make_console(quiet=quiet, stderr=as_json),
                                        extra=part)
        except LaunchFailed as failed:
            sys.exit(failed.returncode)
        if run_dir is not None:
            return
    execute(loaded, output=output, dry_run=dry_run, force=force, quiet=quiet, as_json=as_json, no_lock=no_lock,
            selected=selected)


@main.command()
@click.option("--model", required=True, help="Hub name, local model directory, or 'tiny'.")
@click.option("--data", required=True, help="Dataset file (JSONL/JSON/CSV/Parquet) or hub name.")
@click.option("--output", "-o", help="Run directory.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a value, e.g. stages.sft.train.max_steps=20 or lora.r=8 (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the resolved configuration and exit.")
@click.option("--force", is_flag=True, help="Redo the stage even if it finished.")
@no_lock_option
@output_options
def sft(model: str, data: str, output: str | None, overrides: tuple[str, ...], dry_run: bool, force: bool,
        no_lock: bool, quiet: bool, as_json: bool) -> None:
    """Run a one-stage SFT recipe without a recipe file."""
    from kitcli.recipe.load import recipe_for_single_stage

    loaded = recipe_for_single_stage("sft", model, data, list(overrides))
    execute(loaded, output=output, dry_run=dry_run, force=force, quiet=quiet, as_json=as_json, no_lock=no_lock)


def output_mode(quiet: bool, as_json: bool) -> str:
    if quiet and as_json:
        raise KitError("--quiet and --json exclude each other; use --json for machine-readable progress, "
                       "--quiet for none")
    return "json" if as_json else "quiet" if quiet else "auto"


def execute(recipe, *, output: str | None, dry_run: bool, force: bool, quiet: bool = False,
            as_json: bool = False, no_lock: bool = False, selected: list[str] | None = None) -> None:
    import contextlib

    from kitcli.display import output as display
    from kitcli.run import runner

    mode = output_mode(quiet, as_json)
    console = make_console(quiet=mode == "quiet", stderr=mode == "json")
    if dry_run:
        from kitcli.run.dry_run import dry_run

        dry_run(recipe, console)
        return
    from kitcli.training.interrupt import StageInterrupted

    stdout = sys.stdout
    # --quiet / --json: stdout carries only what was asked for; libraries' prints go to stderr
    quiet_stdout = contextlib.redirect_stdout(sys.stderr) if mode != "auto" else contextlib.nullcontext()
    try:
        with display.output_mode(mode, json_stream=stdout), quiet_stdout:
            run_dir = runner.run_recipe(recipe, output=output, force=force, console=console, no_lock=no_lock,
                                        selected=selected)
    except StageInterrupted as stop:
        click.echo(f"kit: {stop}", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        click.echo("\nkit: aborted; run the same command again to resume from the last checkpoint", err=True)
        sys.exit(130)
    from kitcli import dist

    if not dist.is_main_process():  # a process of `kit run --launcher`: the main one reports
        return
    if mode == "quiet":
        click.echo(f"done: {run_dir}")
    console.print(f"done: {run_dir}", highlight=False, markup=False)


@main.group()
def recipes() -> None:
    """List and show the shipped recipes."""


@recipes.command("list")
def recipes_list() -> None:
    """List the shipped recipes with their descriptions."""
    import yaml
    from rich.table import Table

    from kitcli.recipe.load import shipped_recipes

    table = Table("name", "stages", "description")
    for name, path in shipped_recipes().items():
        raw = yaml.safe_load(path.read_text()) or {}
        stages = " -> ".join(str(s.get("name")) for s in raw.get("stages", []) if isinstance(s, dict))
        table.add_row(name, stages, str(raw.get("description", "")))
    make_console().print(table)


@recipes.command("show")
@click.argument("name")
def recipes_show(name: str) -> None:
    """Print a shipped recipe's YAML."""
    from kitcli.recipe.load import find_recipe, shipped_recipes

    if name not in shipped_recipes():
        find_recipe(name)  # raises with the closest names
    click.echo(shipped_recipes()[name].read_text(), nl=False)


@recipes.command("schema")
def recipes_schema() -> None:
    """Print the JSON Schema of a recipe (every stage type's keys and train: fields), for an editor."""
    import json

    from kitcli.recipe import stage_types
    from kitcli.recipe.editor_schema import json_schema

    click.echo(json.dumps(json_schema(stage_types.specs()), indent=2))


main.add_command(rewards)
main.add_command(tools_group)
main.add_command(data_group)
main.add_command(check_command)
main.add_command(eval_command)
main.add_command(report_command)
main.add_command(doctor_command)
main.add_command(plan_command)
main.add_command(chat_command)
main.add_command(generate_command)
main.add_command(export_command)
main.add_command(import_command)


if __name__ == "__main__":
    main()
