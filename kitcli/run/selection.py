"""Part of a recipe: `kit run RECIPE --until STAGE` runs the stages up to one, `--only A,B` the ones it names; finished
stages before them are reused and later ones left as they are (kitcli/run/runner.py `run_stages`)."""

from __future__ import annotations

from pathlib import Path

from kitcli.errors import KitError, did_you_mean
from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.rundir import RunDir


def selected_stages(recipe: Recipe, until: str | None = None, only: list[str] | None = None) -> list[str] | None:
    """The stages `kit run --until STAGE` or `--only A,B` runs (None: every stage). An unknown name is one line
    listing the recipe's stages, before anything runs."""
    if until is None and not only:
        return None
    if until is not None and only:
        raise KitError("--until and --only exclude each other: --until runs every stage up to one, --only the "
                       "ones it names")
    names = [s.name for s in recipe.stages]
    for name in [until] if until is not None else only:
        if name not in names:
            option = "--until" if until is not None else "--only"
            raise KitError(f"{option}: {recipe.source} has no stage '{name}'{did_you_mean(name, names)} "
                           f"(its stages: {', '.join(names)})")
    return names[: names.index(until) + 1] if until is not None else [n for n in names if n in only]


def check_selected_inputs(recipe: Recipe, run_dir: Path, selected: list[str]) -> None:
    """Each selected stage's `init:` and `reward_model:` stage is selected too or finished in the run directory."""
    for stage in recipe.stages:
        if stage.name not in selected:
            continue
        reward_model = declared(stage, "reward_model")
        for key, needed in (("init", stage.init), ("reward_model", reward_model.stage if reward_model else None)):
            if needed and needed not in selected and RunDir(run_dir).stage(needed).done() is None:
                raise KitError(f"stage '{stage.name}' starts from stage '{needed}' ({key}:), which has not "
                               f"finished in {run_dir}; run it too: --only {','.join([needed, *selected])} (or "
                               f"--until {stage.name})")
