"""`train: {report_to: ...}`: a tracker whose package is missing is refused before anything loads (the bad-input
catalogue, tests/test_bad_input_catalogue.py); an installed one records the stage, here TensorBoard (the `test`
extra installs it)."""

from __future__ import annotations

import pytest
from helpers import DATA, done, metrics, run_cli, write_recipe


@pytest.mark.slow
def test_an_installed_tracker_records_the_stage(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"max_steps": 4, "learning_rate": 2e-3, "per_device_train_batch_size": 8, "logging_steps": 2,
                       "save_steps": 100, "report_to": "tensorboard"}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    run_cli("run", recipe, "--output", tmp_path / "run", "--quiet")
    assert done(tmp_path / "run" / "sft")["steps"] == 4
    events = sorted((tmp_path / "run" / "sft").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file in the stage folder"
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    losses = {e.step: e.value for e in accumulator.Scalars("train/loss")}
    logged = {row["step"]: row["loss"] for row in metrics(tmp_path / "run" / "sft") if "loss" in row}
    assert sorted(losses) == sorted(logged) == [2, 4]
    assert all(losses[step] == pytest.approx(logged[step], rel=1e-6) for step in logged)
