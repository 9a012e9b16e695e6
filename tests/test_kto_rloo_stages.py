"""The KTO and RLOO stages on the tiny model, run through the CLI after an SFT stage: what each trains, logs,
references and saves; `kit data to-kto` converts pairs the way the stage reads them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DATA, SFT_8_STEPS, done, metrics, run_cli, write_recipe
from safetensors.torch import load_file

SFT = SFT_8_STEPS  # trained once per module
KTO_STEPS = 20
KTO = {"name": "kto", "type": "kto", "init": "sft",
       "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 100},
       "eval_fraction": 0.1,
       "train": {"max_steps": KTO_STEPS, "learning_rate": 5e-4, "per_device_train_batch_size": 8, "logging_steps": 5,
                 "eval_steps": 10, "save_steps": 100}}
RLOO_STEPS = 4
RLOO = {"name": "rloo", "type": "rloo", "init": "sft", "data": str(DATA / "arithmetic_prompts.jsonl"),
        "rewards": ["exact_match", {"name": "length_penalty", "args": {"max_length": 4, "target": 1}}],
        "train": {"max_steps": RLOO_STEPS, "learning_rate": 1e-3, "per_device_train_batch_size": 16,
                  "num_generations": 4, "max_completion_length": 4, "logging_steps": 1, "save_steps": 100}}


@pytest.fixture(scope="module")
def sft_kto_rloo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto-rloo")
    recipe = write_recipe(root / "r.yaml", [SFT, KTO, RLOO])
    result = run_cli("run", recipe, "--output", root / "run")
    return root / "run", result.output


def adapter(run_dir, stage: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / stage / "adapter" / "adapter_model.safetensors"))


def test_kto_trains_from_sft_against_the_sft_model(sft_kto_rloo_run):
    run_dir, output = sft_kto_rloo_run
    rows = [r for r in metrics(run_dir / "kto") if "loss" in r]
    assert len(rows) == KTO_STEPS // 5
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "kl"):
        assert all(key in r for r in rows), key
    # at the first step the policy is its reference (the SFT model): implied rewards near 0, loss near 1/2
    first = rows[0]
    assert abs(first["rewards/chosen"]) < 0.05 and abs(first["rewards/rejected"]) < 0.05, first
    summary = done(run_dir / "kto")
    assert summary["steps"] == KTO_STEPS and summary["beta"] == 0.1
    assert summary["labels"]["desirable"] == summary["labels"]["undesirable"] == 90  # 90 training pairs, unpaired
    assert "frozen 'ref' adapter" in summary["reference"]
    assert "eval margin" in summary["headline"]
    assert "reference = frozen 'ref' adapter" in output
    config = json.loads((run_dir / "kto" / "config.json").read_text())
    assert (config["loss_type"], config["desirable_weight"], config["train_sampling_strategy"]) == (
        "kto", 1.0, "sequential")
    kto, sft = adapter(run_dir, "kto"), adapter(run_dir, "sft")
    assert kto.keys() == sft.keys()  # the policy only: no 'ref' adapter saved
    assert all(not torch.equal(kto[k], sft[k]) for k in kto)  # every tensor trained
    # and it learned what the labels say: on held-out rows (where the margin starts at exactly 0, policy = reference)
    # desirable completions gained log-probability relative to undesirable ones
    assert summary["eval"]["rewards/margins"] > 0.01, summary["eval"]


def test_rloo_trains_from_sft_with_kl_to_the_sft_model(sft_kto_rloo_run):
    run_dir, output = sft_kto_rloo_run
    rows = [r for r in metrics(run_dir / "rloo") if "loss" in r]
    assert len(rows) == RLOO_STEPS
    assert all("reward" in r and "kl" in r and "rewards/length_penalty/mean" in r for r in rows)
    assert rows[0]["reward_std"] > 0  # the completions' rewards differ, so the leave-one-out advantages are not 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # reference = the policy it starts from
    summary = done(run_dir / "rloo")
    assert summary["steps"] == RLOO_STEPS
    assert summary["trainer"].startswith("RLOOTrainer")
    config = json.loads((run_dir / "rloo" / "config.json").read_text())
    assert (config["beta"], config["num_generations"], config["normalize_advantages"]) == (0.05, 4, False)
    rloo, sft = adapter(run_dir, "rloo"), adapter(run_dir, "sft")
    assert rloo.keys() == sft.keys()
    assert any(not torch.equal(rloo[k], sft[k]) for k in rloo)


def test_data_to_kto_writes_what_the_stage_reads(tmp_path):
    from kitcli.data.rows import read_file

    out = tmp_path / "kto.jsonl"
    result = run_cli("data", "to-kto", DATA / "arithmetic_prefs.jsonl", "-o", out)
    pairs = read_file(DATA / "arithmetic_prefs.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert f"wrote {2 * len(pairs)} KTO rows" in result.output
    assert rows[0] == {"prompt": pairs[0]["prompt"], "completion": pairs[0]["chosen"], "label": True}
    assert rows[1] == {"prompt": pairs[0]["prompt"], "completion": pairs[0]["rejected"], "label": False}
    # the converted file passes the stage's own checks, as a dry run shows
    recipe = write_recipe(tmp_path / "r.yaml", [{"name": "kto", "type": "kto", "data": str(out)}])
    dry = run_cli("run", recipe, "--dry-run")
    assert "prompt / completion / label rows" in dry.output
    assert f"rows: {int(round(len(rows) * 0.9))}" in dry.output


def test_unbalanced_labels_get_the_papers_weight_range():
    from kitcli.stages.kto import balance

    rows = [{"label": True}] * 1000 + [{"label": False}] * 3000
    report = balance(rows, desirable_weight=1.0, undesirable_weight=1.0)
    assert (report["desirable"], report["undesirable"], report["weighted_ratio"]) == (1000, 3000, 0.333)
    assert "set train.desirable_weight in [3.00, 4.00]" in report["note"]
    assert "note" not in balance(rows, desirable_weight=3.5, undesirable_weight=1.0)  # 1.17: inside [1, 4/3]
    flipped = balance([{"label": not r["label"]} for r in rows], 1.0, 1.0)
    assert "set train.desirable_weight in [0.33, 0.44]" in flipped["note"]
