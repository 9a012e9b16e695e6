"""Every built-in stage type comes with what a user and the suite rely on: a shipped tiny recipe that runs it, a
resume case, a `kit check` / `kit plan` sample, its StageSpec's summary as its row in the README's stages table, and
its name in the README's opening list, in `kit --help` and in docs/stages.md (no hand-kept list goes stale). A new
stage type (docs/extending.md) that lacks one goes red here, naming the file to edit and what to add."""

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


def readme_stage_rows() -> dict[str, str]:
    """The README's stages table: type -> what it runs."""
    return dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", readme_section("## Stages"), flags=re.MULTILINE))


def readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def named_in(stage_type: str, text: str) -> bool:
    """`text` names the type (a word starting with it, any case: `reward model`, `distillation`, `SimPO`)."""
    return re.search(rf"\b{re.escape(stage_type)}", text, flags=re.IGNORECASE) is not None


def help_summary() -> str:
    from click.testing import CliRunner

    from kitcli.commands.cli import main

    return CliRunner().invoke(main, ["--help"]).output


def missing() -> list[str]:
    import test_plan
    import test_resume

    recipes, rows = tiny_recipe_types(), readme_stage_rows()
    opening = (ROOT / "README.md").read_text().split("\n\n")[1]
    summary, stages_doc = help_summary(), (ROOT / "docs" / "stages.md").read_text()
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
        if rows.get(stage_type) != spec.summary:
            lacks.append(f"{stage_type}: the stages table of README.md must hold | `{stage_type}` | {spec.summary} | "
                         f"(its StageSpec's summary, as kit recipes list shows it; details go to docs/stages.md)")
        if not spec.evaluates and not named_in(stage_type, opening):
            lacks.append(f"{stage_type}: README.md's opening paragraph does not name it; add it to the bold list of "
                         f"stages")
        if not spec.evaluates and not named_in(stage_type, summary):
            lacks.append(f"{stage_type}: `kit --help` does not name it; add it to the docstring of main() in "
                         f"kitcli/commands/cli.py")
        if not named_in(stage_type, stages_doc):
            lacks.append(f"{stage_type}: docs/stages.md does not describe it; add a section")
    lacks += [f"{stage_type}: README.md's stages table has a row for a type the kit does not have; remove it"
              for stage_type in set(rows) - set(builtin_specs())]
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
                "text": {"whole rows"}, "pairs": {"prompt + chosen", "prompt + completion"}}[spec.rows.shape]
    assert topics & expected, [f.line() for f in findings]
    assert not any("no length check" in f.verdict for f in findings)
