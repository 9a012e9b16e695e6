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
