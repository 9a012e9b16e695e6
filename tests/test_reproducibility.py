"""The same recipe, seed and versions give the same metrics on CPU."""

from __future__ import annotations

import pytest
from helpers import DATA, metrics, run_cli, write_recipe

VOLATILE = {"time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "elapsed",
            "steps_per_second"}


def comparable(rows):
    return [{k: v for k, v in row.items() if k not in VOLATILE} for row in rows]


@pytest.mark.slow
def test_two_runs_log_identical_metrics(in_tmp, tiny_model_dir):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 8, "logging_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 1e-3}}
    recipe = write_recipe(in_tmp / "r.yaml", [stage], seed=123)
    run_cli("run", recipe, "--output", in_tmp / "a")
    run_cli("run", recipe, "--output", in_tmp / "b")
    first, second = comparable(metrics(in_tmp / "a" / "sft")), comparable(metrics(in_tmp / "b" / "sft"))
    assert len(first) >= 4 and first == second
    third = in_tmp / "c"
    run_cli("run", recipe, "--output", third, "--set", "seed=124")
    assert comparable(metrics(third / "sft")) != first  # the seed matters, so the equality above means something


@pytest.mark.slow
def test_from_lock_reruns_the_recorded_recipe(in_tmp, tiny_model_dir):
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 8}}
    recipe = write_recipe(in_tmp / "r.yaml", [stage], seed=5)
    run_cli("run", recipe, "--output", in_tmp / "a", "--set", "stages.sft.train.learning_rate=3e-3")
    lock = in_tmp / "a" / "recipe.lock.yaml"
    recipe.unlink()  # the lock alone is enough
    run_cli("run", "--from-lock", lock, "--output", in_tmp / "b")
    assert comparable(metrics(in_tmp / "b" / "sft")) == comparable(metrics(in_tmp / "a" / "sft"))
    dry = run_cli("run", lock, "--dry-run")
    assert "learning_rate: 0.003" in dry.output
    both = run_cli("run", lock, "--from-lock", lock, expect=2)
    assert "not both or neither" in both.output
