"""Recipe validation: every bad input gets one line naming the fault and the fix, exit status 2."""

from __future__ import annotations

import pytest
from helpers import DATA, run_cli, snapshot, write_recipe

from kitcli.recipe.load import apply_overrides, load_recipe, shipped_recipes

SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"), "train": {"max_steps": 2}}


def check_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("Error: "), result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[-1], f"{fragment!r} not in {lines[-1]!r}"


def test_shipped_recipes_validate():
    assert "tiny-sft" in shipped_recipes()
    for name in shipped_recipes():
        recipe = load_recipe(name)
        assert recipe.stages


def test_shipped_recipes_open_with_command_and_hardware():
    for name, path in shipped_recipes().items():
        head = path.read_text().splitlines()[:3]
        assert head[0].startswith("# Run:") and f"kit run {name}" in head[0], (name, head)
        assert any(line.startswith("# Tested:") for line in head), (name, head)


def test_missing_recipe_file(in_tmp):
    check_error(run_cli("run", "nope.yaml", expect=None), "nope.yaml", "does not exist")


def test_unknown_recipe_name_suggests(in_tmp):
    check_error(run_cli("run", "tiny-sfft", expect=None), "tiny-sft")


def test_invalid_yaml(in_tmp):
    path = in_tmp / "bad.yaml"
    path.write_text("name: x\nstages: [\n  - {name: a\n")
    check_error(run_cli("run", path, expect=None), "bad.yaml", "not valid YAML", "line")


@pytest.mark.parametrize("mutate, fragments", [
    (lambda r: r.update(stagse=[]), ["unknown key 'stagse'", "did you mean 'stages'"]),
    (lambda r: r["stages"][0].update(trian={}), ["stage 'sft'", "unknown key 'trian'", "did you mean 'train'"]),
    (lambda r: r["stages"][0].update(type="sfft"), ["unknown stage type 'sfft'", "did you mean 'sft'"]),
    (lambda r: r["model"].update(nmae="x"), ["model", "unknown key 'nmae'", "did you mean 'name'"]),
    (lambda r: r["lora"].update(rank=4), ["lora", "unknown key 'rank'"]),
    (lambda r: r["stages"][0].update(init="later"), ["init 'later' is not an earlier stage"]),
    (lambda r: r["stages"].append({**SFT, "name": "two", "init": "three"}), ["init 'three'"]),
    (lambda r: r["stages"][0].update(data="missing.jsonl"), ["missing.jsonl", "does not exist"]),
    (lambda r: r["model"].update(name="./no/such/model"), ["model path './no/such/model' does not exist"]),
    (lambda r: r["stages"].append(dict(SFT)), ["stage 'sft'", "unique"]),
    (lambda r: r.update(seed="x"), ["'seed' must be an integer"]),
])
def test_structural_errors(in_tmp, mutate, fragments):
    recipe = {"name": "t", "model": {"name": "tiny"}, "lora": {"r": 4}, "stages": [dict(SFT)]}
    mutate(recipe)
    path = write_recipe(in_tmp / "r.yaml", recipe.pop("stages"), **recipe)
    check_error(run_cli("run", path, expect=None), *fragments)


def test_init_must_come_earlier(in_tmp):
    stages = [{**SFT, "name": "a", "init": "b"}, {**SFT, "name": "b"}]
    path = write_recipe(in_tmp / "r.yaml", stages)
    check_error(run_cli("run", path, expect=None), "init 'b' is not an earlier stage")


def test_set_override_and_errors(in_tmp):
    raw = {"name": "t", "stages": [dict(SFT)]}
    out = apply_overrides(raw, ["stages.sft.train.learning_rate=1e-4", "lora.r=4", "seed=7"], "x")
    assert out["stages"][0]["train"]["learning_rate"] == 1e-4 and out["lora"]["r"] == 4 and out["seed"] == 7
    assert raw["stages"][0]["train"] == {"max_steps": 2}  # the original is untouched
    path = write_recipe(in_tmp / "r.yaml", [dict(SFT)])
    check_error(run_cli("run", path, "--set", "stages.sfx.train.max_steps=1", expect=None),
                "no stage named 'sfx'", "did you mean 'sft'")
    check_error(run_cli("run", path, "--set", "nonsense", expect=None), "expected KEY=VALUE")


@pytest.mark.parametrize("content, fragments", [
    ('{"prompt": "a", "completion": "b"}\n{"prompt": "c", \n', ["data.jsonl: line 2 is not valid JSON"]),
    ("", ["is empty"]),
    ('{"question": "a", "response": "b"}\n', ["needs columns prompt+completion or messages or text",
                                             "question, response", "columns:"]),
    ('[1, 2]\n', ["line 1 must be a JSON object"]),
])
def test_bad_datasets(in_tmp, content, fragments):
    data = in_tmp / "data.jsonl"
    data.write_text(content)
    path = write_recipe(in_tmp / "r.yaml", [{**SFT, "data": str(data)}])
    check_error(run_cli("run", path, expect=None), *fragments)


def test_unknown_trl_field_suggests_closest(in_tmp):
    path = write_recipe(in_tmp / "r.yaml", [{**SFT, "train": {"learning_rat": 1e-3}}])
    check_error(run_cli("run", path, expect=None), "train.learning_rat is not a SFTConfig field",
                "did you mean 'learning_rate'")


def test_columns_mapping_fixes_names(in_tmp):
    data = in_tmp / "data.jsonl"
    data.write_text('{"question": "1+1=", "response": "2"}\n')
    stage = {**SFT, "data": {"path": str(data), "columns": {"question": "prompt", "response": "completion"}}}
    path = write_recipe(in_tmp / "r.yaml", [stage])
    result = run_cli("run", path, "--dry-run")
    assert "rows: 1" in result.output


def test_bad_input_leaves_existing_run_untouched(in_tmp):
    """A failing command against an existing run directory changes none of its files."""
    run_dir = in_tmp / "run"
    run_dir.mkdir()
    (run_dir / "recipe.lock.yaml").write_text("recipe: {name: other}\n")
    (run_dir / "sft").mkdir()
    (run_dir / "sft" / "DONE").write_text("{}")
    before = snapshot(run_dir)
    path = write_recipe(in_tmp / "r.yaml", [{**SFT, "train": {"learnin_rate": 1}}])
    check_error(run_cli("run", path, "--output", run_dir, expect=None), "learnin_rate")
    path = write_recipe(in_tmp / "r2.yaml", [dict(SFT)])
    check_error(run_cli("run", path, "--output", run_dir, expect=None), "different recipe", "--force")
    assert snapshot(run_dir) == before
