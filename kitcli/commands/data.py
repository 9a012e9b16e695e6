"""`kit data`: convert a dataset into the format a stage reads.

    kit data to-kto examples/data/arithmetic_prefs.jsonl -o prefs_kto.jsonl

`to-kto` turns preference pairs (prompt / chosen / rejected) into KTO's unpaired rows: for each pair a desirable
row (prompt, chosen, label true) and an undesirable one (prompt, rejected, label false), in the pairs' order. A kto
stage also reads pairs directly and converts them the same way (kitcli/stages/kto.py); the converted file is for
editing the rows (dropping some thumbs-up rows, adding unpaired thumbs-down ones) or for other tools.
Imports nothing heavy: the file is read and written with the kit's own JSON code.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from kitcli.errors import KitError


@click.group("data")
def data_group() -> None:
    """Convert datasets between the formats the stages read."""


@data_group.command("to-kto")
@click.argument("pairs", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The KTO file to write (JSONL: prompt, completion, label).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def to_kto(pairs: Path, output: Path, force: bool) -> None:
    """Turn chosen/rejected pairs (JSONL, JSON, CSV or Parquet) into KTO rows: prompt, completion, label."""
    from kitcli.data.rows import read_file
    from kitcli.stages.kto import check_pairs, unpair

    if not pairs.is_file():
        raise KitError(f"{pairs}: no such file; give a file of prompt / chosen / rejected pairs")
    if output.suffix.lower() != ".jsonl":
        raise KitError(f"--output {output}: the KTO file is written as JSONL; give a name ending in .jsonl")
    if output.resolve() == pairs.resolve():
        raise KitError(f"--output {output} is the input file; write the KTO rows to another file")
    if output.exists() and not force:
        raise KitError(f"{output} exists; pass --force to overwrite it, or choose another --output")
    rows = read_file(pairs)
    if not rows:
        raise KitError(f"{pairs}: the file has no rows")
    present = set(rows[0])
    if not {"prompt", "chosen", "rejected"} <= present:
        missing = sorted({"prompt", "chosen", "rejected"} - present)
        raise KitError(f"{pairs}: pairs need columns prompt, chosen and rejected; it has no {', '.join(missing)} "
                       f"(it has {', '.join(sorted(present))})")
    converted = unpair(check_pairs(rows, "kit data to-kto", str(pairs)))
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".tmp")
    with open(partial, "w", encoding="utf-8") as f:
        for row in converted:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(output)
    click.echo(f"wrote {len(converted)} KTO rows ({len(rows)} desirable, {len(rows)} undesirable) from {len(rows)} "
               f"pairs to {output}")


@data_group.command("filter")
@click.argument("recipe")
@click.argument("stage")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The JSONL file of kept rows (the stage's data file's rows, as written there).")
@click.option("--run-dir", help="The run whose finished stages hold the starting policy (default: the one `kit run` "
                                "would use); the pass rates are cached there when it is a kit run.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe value, e.g. stages.grpo.filter.min_pass=0.2 (repeatable).")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def filter_rows(recipe: str, stage: str, output: Path, run_dir: str | None, overrides: tuple[str, ...],
                force: bool) -> None:
    """Keep the prompts of an RL stage that its starting policy passes sometimes (the stage's filter: bounds)."""
    from rich.console import Console

    from kitcli import libraries
    from kitcli.data.rows import read_file
    from kitcli.models.backend import load_stage_policy
    from kitcli.recipe.filter_spec import FilterSpec
    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext
    from kitcli.run.check import resolved_values
    from kitcli.run.lock import choose_run_dir
    from kitcli.run.signal_check import starting_policy
    from kitcli.rundir import RunDir
    from kitcli.training.filtering import filter_dir, run_filter
    from kitcli.training.tool_use import stage_toolbox
    from rewards.registry import load_rewards

    if output.suffix.lower() != ".jsonl":
        raise KitError(f"--output {output}: the kept rows are written as JSONL; give a name ending in .jsonl")
    if output.exists() and not force:
        raise KitError(f"{output} exists; pass --force to overwrite it, or choose another --output")
    loaded = load_recipe(recipe, list(overrides))
    names = [s.name for s in loaded.stages]
    if stage not in names:
        raise KitError(f"{loaded.source}: no stage named '{stage}' (stages: {', '.join(names)})")
    spec = loaded.stage(stage)
    if "filter" not in type(spec).model_fields:
        raise KitError(f"{loaded.source}: stage '{stage}' is a {spec.type} stage; kit data filter keeps the prompts "
                       f"of a stage that samples completions (grpo, gspo, rloo)")
    if not Path(spec.data.path).is_file():
        raise KitError(f"{loaded.source}: stage '{stage}' reads a hub dataset; kit data filter needs a local file")
    if spec.filter is None:  # the filter's default bounds
        spec = spec.model_copy(update={"filter": FilterSpec()})
    folder = choose_run_dir(loaded, run_dir)
    console = Console(stderr=True, highlight=False)
    ctx = StageContext(loaded, spec, folder, console, {s: folder / s for s in names})
    init_dir, why_not = starting_policy(ctx)
    if why_not:
        raise KitError(f"{ctx.where}: {why_not}")
    rewards = load_rewards(spec.rewards, loaded.base_dir, f"{ctx.where}: rewards")
    rows = spec.spec.rows.read(ctx)
    with libraries.library_output():
        policy = load_stage_policy(ctx.model, lora=None, seed=ctx.seed, init_from=init_dir, trainable=False,
                                   log=ctx.log, label="starting policy")
    values = resolved_values(ctx)
    kept, record = run_filter(model=policy.model, tokenizer=policy.tokenizer, rows=rows, rewards=rewards, stage=spec,
                              model_name=ctx.model.name, init_dir=init_dir, values=values,
                              seed=ctx.seed, where=ctx.where, needed=1, log=ctx.log,
                              cache_dir=filter_dir(ctx.stage_dir) if RunDir(folder).is_run() else None,
                              toolbox=stage_toolbox(spec, policy.tokenizer, values, model_name=ctx.model.name,
                                                    base_dir=loaded.base_dir, where=ctx.where))
    raw = read_file(Path(spec.data.path))[: spec.data.limit or None]
    index = {id(row): i for i, row in enumerate(rows)}
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".tmp")
    with open(partial, "w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(raw[index[id(row)]], ensure_ascii=False, default=str) + "\n")
    partial.replace(output)
    click.echo(f"wrote {record['kept']} of {record['prompts']} rows ({record['kept_share']:.0%}) to {output}")
