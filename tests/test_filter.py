"""Difficulty filtering on the tiny model: the filter keeps exactly the prompts whose pass rate lies in the bounds
(pass rates fixed by a reward that passes the first `level` samples of each group, so the expected set is known
without the kit), caches the rates and resumes from a cut cache, stops a stage that would keep nothing with the
histogram and the bound at fault, and records the kept share and histograms in the stage's DONE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import DATA, done, fails, run_cli, write_recipe

pytestmark = pytest.mark.slow

K = 4
LEVELS = [0, 1, 2, 3, 4, 2, 0, 4, 1, 3, 2, 4]  # samples of each prompt's group that pass: pass rate = level / K
REWARD = '''
from rewards.registry import score_range


@score_range(0, 1)
def first_passes(prompts, completions, level, **kwargs):
    """1.0 for the first `level` of each prompt's K samples (the samples of one prompt come together)."""
    return [1.0 if index % K < lv else 0.0 for index, lv in enumerate(level)]
'''


def setup(tmp_path: Path, bounds: dict, **stage) -> Path:
    rows = [json.loads(line) for line in (DATA / "arithmetic_prompts.jsonl").read_text().splitlines()][:len(LEVELS)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({**row, "level": level}) + "\n" for row, level in zip(rows, LEVELS)))
    (tmp_path / "levels.py").write_text(f"K = {K}\n" + REWARD)
    grpo = {"name": "grpo", "type": "grpo", "data": str(data), "rewards": ["levels.py:first_passes"],
            "filter": {"k": K, **bounds},
            "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4,
                      "max_completion_length": 4, "save_steps": 50}, **stage}
    return write_recipe(tmp_path / "r.yaml", [grpo], model={"name": "tiny", "max_seq_length": 128,
                                                            "load_in_4bit": False, "dtype": "float32"})


def run_filter_here(path: Path, tmp_path: Path, cache: Path | None, logged: list[str]):
    from helpers import stage_context

    from kitcli.models.backend import load_stage_policy
    from kitcli.run.check import resolved_values
    from kitcli.stages import grpo
    from kitcli.training.filtering import run_filter

    ctx = stage_context(path, "grpo", tmp_path / "run")
    rewards = grpo.load_reward_functions(ctx)
    loaded = load_stage_policy(ctx.model, lora=None, seed=0, init_from=None, trainable=False, log=logged.append)
    return run_filter(model=loaded.model, tokenizer=loaded.tokenizer, rows=grpo.load_rows(ctx, rewards),
                      rewards=rewards, stage=ctx.stage, model_name="tiny", init_dir=None,
                      values=resolved_values(ctx), seed=0, where=ctx.where, cache_dir=cache, log=logged.append)


@pytest.mark.parametrize("low, high", [(0.25, 0.75), (0.0, 0.5), (0.5, 1.0), (0.3, 0.3)])
def test_keeps_exactly_the_prompts_within_the_bounds(tmp_path, low, high):
    path = setup(tmp_path, {"min_pass": low, "max_pass": high})
    if not any(low <= level / K <= high for level in LEVELS):
        with pytest.raises(Exception, match="kept no prompt"):
            run_filter_here(path, tmp_path, None, [])
        return
    kept, record = run_filter_here(path, tmp_path, None, [])
    expected = [i for i, level in enumerate(LEVELS) if low <= level / K <= high]
    assert [row["level"] for row in kept] == [LEVELS[i] for i in expected]
    assert record["kept"] == len(expected) and record["prompts"] == len(LEVELS)
    counts = [0] * 10
    for level in LEVELS:
        counts[min(int(level / K * 10), 9)] += 1
    assert record["pass_rate_histogram_before"] == counts
    assert record["below_min"] == sum(level / K < low for level in LEVELS)
    assert record["above_max"] == sum(level / K > high for level in LEVELS)


def test_cached_rates_are_reused_and_a_cut_cache_resumes(tmp_path):
    path = setup(tmp_path, {"min_pass": 0.25, "max_pass": 0.75})
    cache = tmp_path / "cache"
    first, record = run_filter_here(path, tmp_path, cache, [])
    lines = (cache / f"{record['cache_key']}.jsonl").read_text().splitlines()
    assert len(lines) == len(LEVELS)
    (cache / f"{record['cache_key']}.jsonl").write_text("\n".join(lines[:8]) + "\n")  # as if killed after a batch
    logged: list[str] = []
    again, _ = run_filter_here(path, tmp_path, cache, logged)
    assert again == first
    assert any(f"8 of {len(LEVELS)} prompts' pass rates read from" in line for line in logged), logged
    assert sorted(json.loads(line)["index"] for line in
                  (cache / f"{record['cache_key']}.jsonl").read_text().splitlines()) == list(range(len(LEVELS)))


def test_a_stage_records_its_filter_and_one_that_keeps_nothing_stops_before_training(tmp_path):
    path = setup(tmp_path, {"min_pass": 0.25, "max_pass": 0.75})
    run_cli("run", path, "--output", tmp_path / "run", "-q")
    record = done(tmp_path / "run" / "grpo")["filter"]
    expected = sum(0.25 <= level / K <= 0.75 for level in LEVELS)
    assert record["kept"] == expected and record["kept_share"] == expected / len(LEVELS)
    assert sum(record["pass_rate_histogram_after"]) == expected
    assert record["zero_variance_share_after"] == 0.0
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"kept {expected} of {len(LEVELS)} prompts" in report and "(plots/grpo-filter.svg)" in report
    svg = (tmp_path / "run" / "plots" / "grpo-filter.svg").read_text()
    before = [0] * 10
    for level in LEVELS:
        before[min(int(level / K * 10), 9)] += 1
    assert f'data-label="before filtering" data-y="{",".join(f"{float(n):g}" for n in before)}"' in svg, svg[:2000]
    measured = json.loads(run_cli("plan", path, "--output", tmp_path / "run", "--json").stdout)["stages"][0]["measured"]
    assert measured["max_completion_length"] == 4 and measured["truncated_share"] == record["truncated_share_before"]
    (tmp_path / "b").mkdir()
    empty = setup(tmp_path / "b", {"min_pass": 0.3, "max_pass": 0.4})
    line = fails("run", empty, "--output", tmp_path / "run2", "-q")
    assert "filter: kept no prompt of 12" in line and "min_pass 0.3 removed 4 and max_pass 0.4 removed 8" in line \
        and "0.0-0.1: 2, 0.2-0.3: 2, 0.5-0.6: 3" in line
    assert not (tmp_path / "run2" / "grpo" / "DONE").exists()
    assert not (tmp_path / "run2" / "grpo" / "checkpoints").exists()


def test_kit_data_filter_writes_the_kept_rows_as_written_in_the_data_file(tmp_path):
    path = setup(tmp_path, {"min_pass": 0.5, "max_pass": 1.0})
    output = tmp_path / "kept.jsonl"
    result = run_cli("data", "filter", path, "grpo", "-o", output, "--run-dir", tmp_path / "none")
    kept = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["level"] for row in kept] == [level for level in LEVELS if level / K >= 0.5]
    assert set(kept[0]) == {"prompt", "answer", "level"}  # the file's own columns
    assert f"wrote {len(kept)} of {len(LEVELS)} rows" in result.output
    assert "exists" in fails("data", "filter", path, "grpo", "-o", output)
    assert "no stage named 'nope'" in fails("data", "filter", path, "nope", "-o", tmp_path / "x.jsonl")
