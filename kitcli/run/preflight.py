"""Everything the kit checks before a run, in one pass and by one code path: `kit check`, `kit run --dry-run` and
`kit run` (before it writes anything) call `check_before_running`, so a recipe one of them passes the others pass.

    the recipe's own faults     unknown keys, values, references between stages (kitcli/recipe/load.py, collected
                                with every faulty key set aside so that the rest is checked too)
    the model                   reachable here (a hub model offline is one line)
    each stage's description    its data, columns and trainer config built as TRL builds it (the stage module's
                                describe(); no model loads)
    kit check's cheap part      lengths, batches, chat template, rewards resolved, held-out rows (kitcli/run/check.py)

Every fault of every stage is collected and raised together (KitFaults: one line each, grouped by stage, exit 2);
warnings are findings, printed, and errors only under `check: strict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from kitcli.errors import KitError, KitFaults, faults_of
from kitcli.models.backend import check_model_reachable
from kitcli.recipe import stage_types
from kitcli.recipe.load import Recipe
from kitcli.recipe.stage_context import StageContext
from kitcli.run.check import check_recipe, enforce
from kitcli.run.findings import Finding


@dataclass
class Checked:
    """What the pass found: each stage's resolved description (None where it faulted), the findings, the faults."""

    described: list[dict[str, Any] | None]
    findings: list[Finding]
    faults: list[str] = field(default_factory=list)
    configs: dict[str, Any] = field(default_factory=dict)  # stage name -> the trainer config its description built

    def raise_faults(self, recipe: Recipe) -> None:
        if self.faults:
            raise KitFaults(self.faults, recipe.source, [s.name for s in recipe.stages])


def describe_stages(recipe: Recipe, run_dir: Path, console: Console, faults: list[str],
                    configs: dict[str, Any] | None = None) -> list[dict | None]:
    """Each stage's resolved configuration (its data read, its trainer config built; no model loads), a stage that
    faults adding its lines to `faults` and None to the list. A stage whose bad value the recipe's own check set aside
    is not described: with a default in its place its config could fault for a reason the recipe does not have (its
    other checks still run; an unknown key set aside changes nothing, and the stage is described). Each trainer
    config a description built goes into `configs`, for kit run to train with."""
    outputs = {s.name: run_dir / s.name for s in recipe.stages}
    described: list[dict | None] = []
    for stage in recipe.stages:
        if stage.name in recipe.defaulted:  # a bad value set aside: its default could fault in its place
            described.append(None)
            continue
        ctx = StageContext(recipe, stage, run_dir, console, outputs)
        try:
            described.append(stage_types.module(stage.type).describe(ctx))
            if configs is not None and ctx.config is not None:
                configs[stage.name] = ctx.config
        except KitError as error:
            faults += faults_of(error)
            described.append(None)
    return described


def check_before_running(recipe: Recipe, run_dir: Path, console: Console, *, loads_model: bool = False) -> Checked:
    """The whole pass, faults collected rather than raised (the caller raises them, after printing what it shows).
    A model that cannot be reached here (a hub model offline) is a fault when the caller will load it (`kit run`),
    and a warning for a check or a dry run, which are how a GPU recipe is checked on a machine without it."""
    faults, configs = list(recipe.faults), {}
    described = describe_stages(recipe, run_dir, console, faults, configs)
    faulted = frozenset(s.name for s, d in zip(recipe.stages, described) if d is None)
    findings = check_recipe(recipe, run_dir=run_dir, console=console, faults=faults, faulted=faulted)
    try:  # this machine's, not the recipe's: named once the recipe has no fault of its own
        check_model_reachable(recipe.model.name)
    except KitError as error:
        if loads_model and not faults:
            faults += faults_of(error)
        elif not loads_model:
            findings.insert(0, Finding("model", "reachable", "warn", recipe.model.name,
                                       f"kit run needs it here: {error.format_message()}"))
    return Checked(described, findings, faults, configs)


def notes(recipe: Recipe, described: list[dict | None]) -> list[str]:
    """One line for every name the kit read as its own or ignored (kitcli/recipe/foreign_names.py), and for every
    value it changed from the recipe (a GPU setting on a CPU, an older form; kitcli/training/trl_config.py)."""
    from kitcli.training.trl_config import CHANGED

    changed = [f"{recipe.source}: stage '{stage.name}': {note}"
               for stage, resolved in zip(recipe.stages, described) for note in (resolved or {}).get(CHANGED, ())]
    return [*recipe.notes, *changed]


def print_notes(recipe: Recipe, checked: Checked, console: Console, *, as_comments: bool = False) -> None:
    prefix = "# " if as_comments else ""
    for note in notes(recipe, checked.described):
        console.print(f"{prefix}note: {note}", highlight=False, markup=False, soft_wrap=True)


def preflight(recipe: Recipe, run_dir: Path, console: Console, *, as_comments: bool = False) -> Checked:
    """What `kit run` and its dry run (`as_comments`) do before the first stage: the pass, its notes and warnings
    printed (as YAML comments in a dry run), every fault raised at once, and under `check: strict` the first
    warning."""
    checked = check_before_running(recipe, run_dir, console, loads_model=not as_comments)
    shown = Checked([None] * len(recipe.stages), []) if as_comments else checked  # a dry run: under each stage
    print_notes(recipe, shown, console, as_comments=as_comments)
    checked.raise_faults(recipe)
    warnings = [f for f in checked.findings if f.level == "warn"]
    prefix = "# " if as_comments else ""
    console.print(f"{prefix}kit check: {len(checked.findings)} checks, {len(warnings)} warnings"
                  f"{'' if warnings else ' (kit check ' + recipe.source + ' shows them all)'}",
                  highlight=False, markup=False, soft_wrap=True)
    for finding in warnings:
        console.print(f"{prefix}  {finding.line()}", highlight=False, markup=False, soft_wrap=True)
    enforce(checked.findings, recipe.check == "strict", recipe.source)
    return checked
