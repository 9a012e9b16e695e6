"""ORPO and SimPO, the reference-free preference stages, without training: what they refuse (one line naming stage
and key, exit 2, before anything loads), what `kit check` measures of their pairs (the length checks DPO gets) and
what `kit plan` counts (no reference model, where DPO has one). Their losses: tests/test_orpo_simpo_formulas.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import DATA, fails, run_cli, write_recipe

PREFS = str(DATA / "arithmetic_prefs.jsonl")
REFERENCE_FREE = ("orpo", "simpo")


def pair_stage(stage_type: str, **changes) -> dict:
    train = changes.pop("train", {})
    return {"name": "x", "type": stage_type, "data": PREFS, "train": {"max_steps": 2, **train}, **changes}


@pytest.mark.parametrize("stage_type", REFERENCE_FREE)
@pytest.mark.parametrize("changes, key", [
    ({"ref_adapter": "sft"}, "ref_adapter"),
    ({"reference_model": "org/model"}, "reference_model"),
    ({"ref_model": "org/model"}, "ref_model"),
    ({"train": {"precompute_ref_log_probs": True}}, "train.precompute_ref_log_probs"),
    ({"train": {"sync_ref_model": True}}, "train.sync_ref_model"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_reference_key_is_refused_in_one_line(in_tmp, stage_type, changes, key):
    line = fails("run", write_recipe(in_tmp / "r.yaml", [pair_stage(stage_type, **changes)]), "--dry-run")
    assert "stage 'x'" in line and f"{key} does not apply to" in line and "reference-free" in line, line
    assert "remove it" in line


@pytest.mark.parametrize("stage_type, train, expected", [
    ("orpo", {"beta": 0}, "train.beta must be > 0, got 0"),
    ("orpo", {"beta": -0.1}, "train.beta must be > 0, got -0.1"),
    ("simpo", {"beta": 0.0}, "train.beta must be > 0, got 0.0"),
    ("simpo", {"simpo_gamma": -0.5}, "train.simpo_gamma must be >= 0, got -0.5"),
    ("simpo", {"cpo_alpha": -1.0}, "train.cpo_alpha must be >= 0, got -1.0"),
    ("simpo", {"loss_type": "sigmoid"}, "train.loss_type 'sigmoid' is not SimPO"),
    ("simpo", {"loss_type": "alphapo"}, "train.loss_type 'alphapo' is not SimPO"),
])
def test_out_of_range_settings_are_refused_in_one_line(in_tmp, stage_type, train, expected):
    line = fails("run", write_recipe(in_tmp / "r.yaml", [pair_stage(stage_type, train=train)]), "--dry-run")
    assert "stage 'x'" in line and expected in line, line


@pytest.mark.parametrize("stage_type", REFERENCE_FREE)
@pytest.mark.parametrize("side", ["chosen", "rejected"])
@pytest.mark.parametrize("empty", ["", "   ", [{"role": "assistant", "content": ""}]], ids=["text", "blank", "message"])
def test_a_pair_with_an_empty_side_is_refused_naming_its_row(in_tmp, stage_type, side, empty):
    rows = [json.loads(line) for line in Path(PREFS).read_text().splitlines()[:20]]
    rows[6][side] = empty  # row 7 of the file, wherever the eval split puts it
    data = in_tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    line = fails("run", write_recipe(in_tmp / "r.yaml", [pair_stage(stage_type, data=str(data))]), "--dry-run")
    assert "stage 'x'" in line and f"row 7 of '{data}'" in line and f"'{side}'" in line, line


def check_topics(path, stage: str) -> dict[str, str]:
    from kitcli.recipe.load import load_recipe
    from kitcli.run.check import check_recipe

    return {f.topic: f.verdict for f in check_recipe(load_recipe(str(path))) if f.stage == stage}


def test_kit_check_measures_their_pairs_as_dpos(in_tmp):
    """The same length checks as DPO (prompt + chosen, prompt + rejected, the sample note), none missing."""
    stages = [{"name": t, **{k: v for k, v in pair_stage(t).items() if k != "name"}}
              for t in ("dpo", *REFERENCE_FREE)]
    path = write_recipe(in_tmp / "r.yaml", stages)
    dpo = check_topics(path, "dpo")
    assert {"prompt + chosen", "prompt + rejected", "lengths"} <= set(dpo)
    lengths = {t for t in dpo if t.startswith("prompt + ") or t == "lengths"}
    assert len(lengths) == 3, dpo
    for stage_type in REFERENCE_FREE:
        found = check_topics(path, stage_type)
        assert {t for t in found if t.startswith("prompt + ") or t == "lengths"} == lengths, found
        assert not any("no length check" in verdict for verdict in found.values())
    output = run_cli("check", path).output
    assert "no length check" not in output


def test_kit_plan_counts_no_reference_for_them(in_tmp):
    stages = [{"name": t, **{k: v for k, v in pair_stage(t).items() if k != "name"}}
              for t in ("dpo", *REFERENCE_FREE)]
    path = write_recipe(in_tmp / "r.yaml", stages, lora=False)
    plan = json.loads(run_cli("plan", path, "--gpu-memory", "24GB", "--json").stdout)
    by_stage = {s["stage"]: [c["name"] for c in s["components"]] for s in plan["stages"]}
    assert any(name.startswith("reference model") for name in by_stage["dpo"]), by_stage["dpo"]
    for stage_type in REFERENCE_FREE:
        assert not any("reference" in name for name in by_stage[stage_type]), by_stage[stage_type]
