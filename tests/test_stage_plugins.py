"""A stage type is declared in one place. A throwaway package registers one through the `kit.stages` entry-point
group (as a third-party package would, with no change to the kit) and a recipe runs it: validated by its own
section model, shown by `kit recipes schema`, run by the runner, its DONE written, its metrics in the report."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from helpers import DATA, metrics, run_cli, write_recipe

PLUGIN = '''
"""A stage type from outside the kit: counts the rows of its data, in `steps` logged steps."""

from typing import Literal

from pydantic import Field

from kitcli.data.rows import read_rows
from kitcli.display.dashboard import StageDashboard
from kitcli.recipe.schema import DataSpec, StageSection
from kitcli.recipe.stage_spec import Display, StageSpec


class CountSection(StageSection):
    """Count the rows of a dataset."""

    type: Literal["count"]
    data: DataSpec = Field(description="The rows to count.")
    steps: int = Field(3, gt=0, description="Logged steps.")


def describe(ctx):
    return {"data": ctx.stage.data.path, "rows": len(read_rows(ctx.stage.data, ctx.where))}


def run(ctx):
    rows = read_rows(ctx.stage.data, ctx.where)
    board = StageDashboard(ctx.name, ctx.dir.metrics, ctx.console, spec=ctx.spec)
    board.begin(ctx.stage.steps)
    for step in range(1, ctx.stage.steps + 1):
        board.log(step, {"counted": len(rows) * step / ctx.stage.steps})
    board.end()
    return {"rows": len(rows), "headline": f"{len(rows)} rows"}


SPEC = StageSpec(type="count", module=__name__, section=CountSection, summary="count the rows of a dataset",
                 output="none", display=Display(metrics=(("counted", "counted"),),
                                                panels=(("rows counted", "rows", ("counted",)),)))
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A package `kit_count` with its dist-info (entry point kit.stages: count) on sys.path."""
    site = tmp_path / "site"
    (site / "kit_count").mkdir(parents=True)
    (site / "kit_count" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "kit_count-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-count\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kit.stages]\ncount = kit_count:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    from kitcli.recipe import stage_types

    stage_types.specs.cache_clear()
    yield
    stage_types.specs.cache_clear()
    sys.modules.pop("kit_count", None)


def test_a_stage_type_from_an_installed_package_runs(plugin, tmp_path):
    stages = [{"name": "count", "type": "count", "data": str(DATA / "arithmetic_eval.jsonl"), "steps": 2}]
    recipe = write_recipe(tmp_path / "r.yaml", stages)
    run_dir = tmp_path / "run"
    run_cli("run", recipe, "--output", run_dir)
    assert json.loads((run_dir / "count" / "DONE").read_text())["rows"] == 100
    assert [row["counted"] for row in metrics(run_dir / "count")] == [50.0, 100.0]
    assert "![count training curves](plots/count.svg)" in (run_dir / "report.md").read_text()
    assert (run_dir / "plots" / "count.svg").stat().st_size > 0
    schema = json.loads(run_cli("recipes", "schema").output)
    assert "CountSection" in schema["$defs"]


def test_its_own_keys_and_values_are_checked(plugin, tmp_path):
    stage = {"name": "count", "type": "count", "data": str(DATA / "arithmetic_eval.jsonl"), "steps": 0}
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [stage]), expect=2)
    assert "stage 'count': steps must be a positive integer, got 0" in result.output
    stage = {**stage, "steps": 2, "stpes": 2}
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [stage]), expect=2)
    assert "unknown key 'stpes'; did you mean 'steps'?" in result.output


def test_kit_check_says_when_it_has_no_length_check_for_a_stage_type(plugin, tmp_path):
    """The count stage's StageSpec sets no rows_shape: kit check cannot know what to measure and says so (a
    warning), instead of reporting fewer checks in silence."""
    stage = {"name": "count", "type": "count", "data": str(DATA / "arithmetic_eval.jsonl"), "steps": 2}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]))
    assert "kit check has no length check for this stage type" in result.output.replace("\n", " ").replace("│", "")
