"""Part of a recipe: `kit run RECIPE --until STAGE` runs the stages up to one, `--only A,B` the ones it names; the
finished stages they start from are reused (not touched), later stages are left as they are, and a name the recipe
does not have is one line listing its stages, before anything runs."""

from __future__ import annotations

import pytest
from helpers import DATA, done, run_cli, snapshot, write_recipe

STAGES = [
    {"name": "sft", "type": "sft", "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "limit": 32},
     "train": {"max_steps": 2, "per_device_train_batch_size": 8}},
    {"name": "grpo", "type": "grpo", "init": "sft", "data": {"path": str(DATA / "arithmetic_prompts.jsonl"),
                                                             "limit": 16},
     "rewards": ["exact_match"], "train": {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
                                           "max_completion_length": 4}},
    {"name": "eval", "type": "eval", "init": "grpo", "data": {"path": str(DATA / "arithmetic_eval.jsonl"),
                                                              "limit": 8}},
]


@pytest.mark.parametrize("option, value, words", [
    ("--until", "sfx", "--until: r.yaml has no stage 'sfx'; did you mean 'sft'? (its stages: sft, grpo, eval)"),
    ("--only", "grpo,evl", "--only: r.yaml has no stage 'evl'; did you mean 'eval'? (its stages: sft, grpo, eval)"),
])
def test_an_unknown_stage_is_one_line_before_anything_runs(option, value, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_recipe(tmp_path / "r.yaml", STAGES)
    result = run_cli("run", "r.yaml", "--output", tmp_path / "run", option, value, expect=2)
    assert result.output.strip().splitlines()[-1] == f"Error: {words}"
    assert not (tmp_path / "run").exists()


def test_until_and_only_exclude_each_other(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", STAGES)
    result = run_cli("run", recipe, "--until", "sft", "--only", "grpo", expect=2)
    assert "--until and --only exclude each other" in result.output


@pytest.mark.slow
def test_until_then_only_runs_the_parts_and_reuses_what_finished(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", STAGES)
    run_dir = tmp_path / "run"
    refused = run_cli("run", recipe, "--output", run_dir, "--only", "grpo", expect=2)
    assert ("stage 'grpo' starts from stage 'sft' (init:), which has not finished in " in refused.output
            and "--only sft,grpo (or --until grpo)" in refused.output)
    assert not (run_dir / "grpo" / "DONE").exists()

    run_cli("run", recipe, "--output", run_dir, "--until", "sft")
    assert done(run_dir / "sft")["steps"] == 2
    assert not (run_dir / "grpo").exists() and not (run_dir / "eval").exists()

    sft_before = snapshot(run_dir / "sft")
    result = run_cli("run", recipe, "--output", run_dir, "--only", "grpo")
    assert "stage 1/3 sft (sft): not selected, its finished output reused" in result.output
    assert snapshot(run_dir / "sft") == sft_before  # reused, not touched
    assert done(run_dir / "grpo")["steps"] == 2
    assert not (run_dir / "eval").exists()  # after the selected stage: left alone

    run_cli("run", recipe, "--output", run_dir)  # the whole recipe now runs only what is left
    assert snapshot(run_dir / "sft") == sft_before and "exact_match" in done(run_dir / "eval")
