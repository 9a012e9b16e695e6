"""The bad-input catalogue: each case states its input and the fragment its one-line error must contain.

Every case must exit with status 2, print exactly one `Error:` line and no traceback, and leave an existing run
directory byte-for-byte unchanged. Cases run in-process through Click's CliRunner against a prepared run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from helpers import DATA, run_cli, snapshot

GOOD_SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"), "train": {"max_steps": 2}}


def recipe(tmp: Path, name: str = "r.yaml", **changes) -> Path:
    data = {"name": "cat", "model": {"name": "tiny"}, "lora": {"r": 4}, "stages": [dict(GOOD_SFT)]}
    for key, value in changes.items():
        data[key] = value
    path = tmp / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_stage(tmp: Path, **stage_changes) -> Path:
    return recipe(tmp, stages=[{**GOOD_SFT, **stage_changes}])


def data_file(tmp: Path, text: str, name: str = "d.jsonl") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list]  # builds the command line (writing any files it needs) in a temp dir
    fragment: str
    extra: list[str] = field(default_factory=list)  # more fragments that must appear


RUN = "run"  # the prepared run directory's name
CASES = [
    # --- recipes -------------------------------------------------------------------------------------------
    Case("recipe-file-missing", lambda t: ["run", t / "nope.yaml"], "does not exist"),
    Case("recipe-name-unknown", lambda t: ["run", "tiny-sfft"], "no recipe named 'tiny-sfft'", ["tiny-sft"]),
    Case("recipe-not-yaml", lambda t: ["run", data_file(t, "a: [1,\n", "x.yaml")], "not valid YAML"),
    Case("recipe-not-mapping", lambda t: ["run", data_file(t, "- 1\n- 2\n", "x.yaml")], "must be a YAML mapping"),
    Case("recipe-unknown-top-key", lambda t: ["run", recipe(t, stagez=[])], "unknown key 'stagez'"),
    Case("recipe-no-stages", lambda t: ["run", recipe(t, stages=[])], "'stages' must be a non-empty list"),
    Case("recipe-no-model", lambda t: ["run", recipe(t, model=None)], "'model' is missing"),
    Case("recipe-model-path-missing", lambda t: ["run", recipe(t, model={"name": "./no/model"})],
         "model path './no/model' does not exist"),
    Case("recipe-model-unknown-key", lambda t: ["run", recipe(t, model={"name": "tiny", "bits": 4})],
         "unknown key 'bits'"),
    Case("recipe-bad-backend", lambda t: ["run", recipe(t, model={"name": "tiny", "backend": "vllm"})],
         "model.backend must be one of"),
    Case("recipe-bad-dtype", lambda t: ["run", recipe(t, model={"name": "tiny", "dtype": "fp8"})],
         "model.dtype must be one of"),
    Case("recipe-bad-seq-len", lambda t: ["run", recipe(t, model={"name": "tiny", "max_seq_length": -1})],
         "max_seq_length must be a positive integer"),
    Case("recipe-seed-not-int", lambda t: ["run", recipe(t, seed="abc")], "'seed' must be an integer"),
    Case("recipe-lora-unknown-key", lambda t: ["run", recipe(t, lora={"rank": 8})], "unknown key 'rank'",
         ["did you mean 'r'"]),
    Case("recipe-lora-bad-r", lambda t: ["run", recipe(t, lora={"r": 0})], "r must be a positive integer"),
    Case("recipe-lora-not-mapping", lambda t: ["run", recipe(t, lora=[1])], "expected a mapping"),
    Case("stage-not-mapping", lambda t: ["run", recipe(t, stages=["sft"])], "each stage must be a mapping"),
    Case("stage-type-missing", lambda t: ["run", recipe(t, stages=[{"name": "a"}])], "'type' is missing"),
    Case("stage-type-unknown", lambda t: ["run", with_stage(t, type="sftt")], "unknown stage type 'sftt'",
         ["did you mean 'sft'"]),
    Case("stage-unknown-key", lambda t: ["run", with_stage(t, trian={})], "unknown key 'trian'",
         ["did you mean 'train'"]),
    Case("stage-duplicate-name", lambda t: ["run", recipe(t, stages=[GOOD_SFT, GOOD_SFT])], "must be unique"),
    Case("stage-name-with-slash", lambda t: ["run", with_stage(t, name="a/b")], "becomes a folder name"),
    Case("stage-init-unknown", lambda t: ["run", with_stage(t, init="nothere")], "init 'nothere' is not an earlier"),
    Case("stage-init-later", lambda t: ["run", recipe(t, stages=[{**GOOD_SFT, "name": "a", "init": "b"},
                                                               {**GOOD_SFT, "name": "b"}])],
         "init 'b' is not an earlier stage"),
    Case("stage-init-eval", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl")}, {**GOOD_SFT, "init": "ev"}])],
         "is an eval stage"),
    Case("stage-train-not-mapping", lambda t: ["run", with_stage(t, train=[1])], "'train' must be a mapping"),
    Case("stage-data-missing-key", lambda t: ["run", recipe(t, stages=[{"name": "s", "type": "sft"}])],
         "'data' is missing"),
    Case("trl-field-unknown", lambda t: ["run", with_stage(t, train={"learning_rat": 1.0})],
         "train.learning_rat is not a SFTConfig field", ["did you mean 'learning_rate'"]),
    Case("trl-field-reserved", lambda t: ["run", with_stage(t, train={"output_dir": "x"})],
         "train.output_dir is set by the kit"),
    Case("trl-value-rejected", lambda t: ["run", with_stage(t, train={"lr_scheduler_type": "wobbly"})],
         "SFTConfig rejected the train settings"),
    # --- datasets ------------------------------------------------------------------------------------------
    Case("data-path-missing", lambda t: ["run", with_stage(t, data=str(t / "none.jsonl"))], "none.jsonl",
         ["does not exist"]),
    Case("data-empty", lambda t: ["run", with_stage(t, data=data_file(t, ""))], "is empty"),
    Case("data-bad-jsonl-line", lambda t: ["run", with_stage(t, data=data_file(t, '{"text": "a"}\n{oops\n'))],
         "d.jsonl: line 2 is not valid JSON"),
    Case("data-jsonl-not-object", lambda t: ["run", with_stage(t, data=data_file(t, '"just a string"\n'))],
         "line 1 must be a JSON object"),
    Case("data-missing-columns", lambda t: ["run", with_stage(t, data=data_file(t, '{"q": "a", "a": "b"}\n'))],
         "needs columns prompt+completion or messages or text", ["it has a, q", "columns:"]),
    Case("data-columns-map-missing", lambda t: ["run", with_stage(t, data={
        "path": data_file(t, '{"q": "a"}\n'), "columns": {"question": "prompt"}})], "has no such column"),
    Case("data-columns-not-mapping", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                          "columns": ["a"]})],
         "columns must map dataset columns"),
    Case("data-limit-bad", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                "limit": 0})], "limit must be a positive integer"),
    Case("data-unknown-key", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                  "colums": {}})], "unknown key 'colums'"),
    Case("data-bad-json-file", lambda t: ["run", with_stage(t, data=data_file(t, "[1,", "d.json"))],
         "d.json: not valid JSON"),
    Case("data-bad-format", lambda t: ["run", with_stage(t, data=data_file(t, "a\tb\n", "d.tsv"))],
         "unsupported dataset format"),
    Case("eval-data-no-answer", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_sft.jsonl").replace("sft", "prefs")}])],
         "has no 'answer' column"),
    Case("eval-unknown-generation-key", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"), "generation": {"max_tokens": 4}}])],
         "unknown generation key 'max_tokens'"),
    # --- CLI options -----------------------------------------------------------------------------------------
    Case("set-no-equals", lambda t: ["run", recipe(t), "--set", "lora.r"], "expected KEY=VALUE"),
    Case("set-unknown-stage", lambda t: ["run", recipe(t), "--set", "stages.sfx.train.max_steps=1"],
         "no stage named 'sfx'", ["did you mean 'sft'"]),
    Case("set-bad-yaml", lambda t: ["run", recipe(t), "--set", "lora.r=[1,"], "not valid YAML"),
    Case("set-through-scalar", lambda t: ["run", recipe(t), "--set", "name.x=1"], "is not a mapping"),
    Case("option-unknown", lambda t: ["run", recipe(t), "--nope"], "No such option '--nope'"),
    Case("argument-missing", lambda t: ["sft", "--model", "tiny"], "Missing option '--data'"),
    Case("sft-data-missing", lambda t: ["sft", "--model", "tiny", "--data", t / "x.jsonl"], "does not exist"),
    Case("recipes-show-unknown", lambda t: ["recipes", "show", "nothing"], "no recipe named 'nothing'"),
    # --- run directories -------------------------------------------------------------------------------------
    Case("run-dir-other-recipe", lambda t: ["run", recipe(t), "--output", t / RUN], "holds a run of a different recipe",
         ["--force"]),
    Case("run-dir-not-kit", lambda t: ["run", recipe(t), "--output", t / "notkit"], "is not a kit run directory"),
    Case("run-dir-bad-lock", lambda t: ["run", recipe(t), "--output", t / "badlock"], "is not valid YAML"),
]


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A finished-looking run directory of another recipe, a non-kit directory and one with a corrupt lock."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / RUN
    (run / "sft" / "adapter").mkdir(parents=True)
    (run / "recipe.lock.yaml").write_text(yaml.safe_dump({"recipe": {"name": "other"}, "datasets": {}}))
    (run / "sft" / "DONE").write_text(json.dumps({"headline": "loss 1 -> 0.5"}))
    (run / "sft" / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "notkit").mkdir()
    (tmp_path / "notkit" / "keep.txt").write_text("mine")
    (tmp_path / "badlock").mkdir()
    (tmp_path / "badlock" / "recipe.lock.yaml").write_text("recipe: [unclosed\n")
    return tmp_path


def test_catalogue_has_at_least_forty_cases():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, prepared):
    before = {name: snapshot(prepared / name) for name in (RUN, "notkit", "badlock")}
    result = run_cli(*case.argv(prepared), expect=None)
    output = result.output
    assert result.exit_code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, output
    assert "Traceback" not in output
    for fragment in [case.fragment, *case.extra]:
        assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    assert {name: snapshot(prepared / name) for name in before} == before
    assert not (prepared / "runs").exists() or not any((prepared / "runs").iterdir())
