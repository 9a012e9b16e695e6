"""`kit check RECIPE`: find what would keep a recipe from learning, before training (kitcli/run/check.py).

    kit check smol-grpo
    kit check smol-grpo --signal 16 --output runs/smol      # also sample the RL stages' starting policies
    kit check my.yaml --strict                               # warnings are errors (exit 2)
"""

from __future__ import annotations

import click

from kitcli.errors import KitError


@click.command("check")
@click.argument("recipe")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe value (repeatable).")
@click.option("--signal", "signal", type=int, default=None, metavar="N",
              help="Also sample each RL stage's starting policy on its first N prompts and measure the reward "
                   "signal (loads the model).")
@click.option("--output", "-o", help="The run directory whose finished stages are the RL stages' starting policies "
                                     "(default: the one `kit run` would use).")
@click.option("--strict", is_flag=True, help="Every warning is an error (exit 2); also `check: strict` in a recipe.")
@click.option("--json", "as_json", is_flag=True, help="The findings (and signal figures) as JSON on stdout.")
def check_command(recipe: str, overrides: tuple[str, ...], signal: int | None, output: str | None, strict: bool,
                  as_json: bool) -> None:
    """Check a recipe against its real tokenizer and data: lengths, batches, chat template, reward signal."""
    import json
    from dataclasses import asdict

    from rich.console import Console

    from kitcli.recipe.load import load_recipe
    from kitcli.run.check import enforce, findings_table
    from kitcli.run.lock import choose_run_dir
    from kitcli.run.preflight import check_before_running, print_notes

    if signal is not None and signal < 1:
        raise KitError(f"--signal {signal}: give the number of prompts to sample (at least 1), e.g. --signal 16")
    loaded = load_recipe(recipe, list(overrides), collect=True)
    console = Console(stderr=as_json, highlight=False)
    run_dir = choose_run_dir(loaded, output)
    from kitcli import libraries

    with libraries.library_output():  # the trainer configs are built as `kit run` builds them (Unsloth's prints)
        checked = check_before_running(loaded, run_dir, console)
    findings = checked.findings
    if checked.faults:  # everything found, then every fault at once
        if not as_json:
            console.print(findings_table(findings, title=f"kit check {loaded.name}"))
        print_notes(loaded, checked, console)
        checked.raise_faults(loaded)
    figures = {}
    if signal:
        from kitcli import libraries
        from kitcli.run.signal_check import check_signal

        with libraries.library_output():
            signal_findings, figures = check_signal(loaded, run_dir, signal, console)
        findings += signal_findings
    if as_json:
        click.echo(json.dumps({"findings": [asdict(f) for f in findings], "signal": figures}, default=str))
    else:
        console.print(findings_table(findings, title=f"kit check {loaded.name}"))
        print_notes(loaded, checked, console)
        for finding in findings:
            if finding.level == "warn":
                console.print(f"warning: {finding.line()}", highlight=False, markup=False, soft_wrap=True)
        warnings = sum(f.level == "warn" for f in findings)
        console.print(f"{len(findings)} checks, {warnings} warnings", highlight=False, markup=False)
    enforce(findings, strict or loaded.check == "strict", loaded.source)
