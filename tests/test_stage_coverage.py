"""Every built-in stage type comes with what a user and the suite rely on: a shipped tiny recipe that runs it, a
resume case, a `kit check` / `kit plan` sample, and a row in the README's stages table. A new stage type
(docs/extending.md) that lacks one goes red here, naming the file to edit and what to add."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import write_recipe

ROOT = Path(__file__).resolve().parents[1]


def builtin_specs():
    from kitcli.recipe import stage_types

    return stage_types.builtin_specs()


def tiny_recipe_types() -> set[str]:
    found = set()
    for path in sorted((ROOT / "recipes").glob("tiny-*.yaml")):
        found |= {stage["type"] for stage in yaml.safe_load(path.read_text())["stages"]}
    return found


def readme_stage_rows() -> set[str]:
    return set(re.findall(r"^\| `([a-z_]+)` \|", (ROOT / "README.md").read_text(), flags=re.MULTILINE))


def missing() -> list[str]:
    import test_plan
    import test_resume

    recipes, rows = tiny_recipe_types(), readme_stage_rows()
    lacks = []
    for stage_type, spec in builtin_specs().items():
        if stage_type not in recipes:
            lacks.append(f"{stage_type}: no shipped tiny recipe runs it; add recipes/tiny-{stage_type}.yaml (opening "
                         f"with the command that runs it and the hardware it was tested on)")
        if not spec.evaluates and stage_type not in test_resume.STAGES:
            lacks.append(f"{stage_type}: no resume case; add a stage to STAGES in tests/test_resume.py (and its kill "
                         f"points to KILLS if it samples completions)")
        if stage_type not in test_plan.SAMPLE_STAGES:
            lacks.append(f"{stage_type}: no kit check / kit plan sample; add it to SAMPLE_STAGES in "
                         f"tests/test_plan.py")
        if stage_type not in rows:
            lacks.append(f"{stage_type}: no row in the stages table of README.md; add | `{stage_type}` | what it runs "
                         f"| notes |")
    return lacks


def test_every_builtin_stage_type_has_a_recipe_a_resume_case_a_check_sample_and_a_readme_row():
    lacks = missing()
    assert not lacks, "\n".join(lacks)


def test_the_coverage_check_names_the_file_to_edit(monkeypatch):
    import test_resume

    monkeypatch.delitem(test_resume.STAGES, "dpo")
    assert [line for line in missing() if line.startswith("dpo:")] == [
        "dpo: no resume case; add a stage to STAGES in tests/test_resume.py (and its kill points to KILLS if it "
        "samples completions)"]


@pytest.mark.parametrize("stage_type", sorted(builtin_specs()))
def test_kit_check_measures_the_lengths_of_every_sample(tmp_path, stage_type):
    """kit check on each type's sample measures its lengths as its row shape says (a type whose StageSpec says no
    rows_shape would get the warning that it has none instead)."""
    import test_plan

    from kitcli.recipe.load import load_recipe
    from kitcli.run.check import check_recipe

    spec = builtin_specs()[stage_type]
    body = test_plan.SAMPLE_STAGES[stage_type][0]
    stages = [{"name": "x", "type": stage_type, **body}]
    findings = check_recipe(load_recipe(str(write_recipe(tmp_path / "r.yaml", stages))))
    topics = {f.topic for f in findings if f.stage == "x"}
    expected = {"prompts": {"prompt + 256 new tokens", "prompt + 64 new tokens", "prompt + 32 new tokens"},
                "text": {"whole rows"}, "pairs": {"prompt + chosen", "prompt + completion"}}[spec.rows_shape]
    assert topics & expected, [f.line() for f in findings]
    assert not any("no length check" in f.verdict for f in findings)
