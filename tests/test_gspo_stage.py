"""GSPO stage on the tiny model: the paper configuration, training, reload, and the on-policy refusal."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import DATA, done, metrics, run_cli, write_recipe
from safetensors.torch import load_file

from kitcli.errors import KitError
from kitcli.stages.gspo import GSPO_PRESET

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
LENGTH_REWARD = """
def varied(prompts, completions, **kwargs):  # deterministic per text, different across texts
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(map(ord, t)) % 10) / 10 for t in texts]
"""
PAPER = {"importance_sampling_level": "sequence", "loss_type": "grpo", "beta": 0.0, "epsilon": 3e-4,
         "epsilon_high": 4e-4, "gradient_accumulation_steps": 1, "steps_per_generation": 4}


def stages(**gspo) -> list[dict]:
    sft = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
           "train": {"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "save_steps": 50}}
    stage = {"name": "gspo", "type": "gspo", "init": "sft", "data": PROMPTS,
             "rewards": ["exact_match", "length_reward.py:varied"],
             "train": {"learning_rate": 1e-3, "max_steps": 4, "per_device_train_batch_size": 4, "num_generations": 4,
                       "max_completion_length": 4, "logging_steps": 2, "save_steps": 48, **gspo.pop("train", {})},
             **gspo}
    return [sft, stage]


def dry_run(tmp_path, **gspo) -> dict:
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    recipe = write_recipe(tmp_path / "r.yaml", stages(**gspo))
    return yaml.safe_load(run_cli("run", recipe, "--dry-run").output.split("(gspo)\n", 1)[1])


def test_preset_is_the_paper_configuration():
    assert {k: GSPO_PRESET[k] for k in PAPER} == PAPER


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("gspo")
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    run_cli("run", write_recipe(root / "r.yaml", stages()), "--output", root / "run")
    return root / "run"


def test_gspo_trains_with_the_paper_settings(trained):
    config = json.loads((trained / "gspo" / "config.json").read_text())
    for key, value in PAPER.items():
        assert config[key] == value, key
    rows = metrics(trained / "gspo")
    assert len([row for row in rows if "loss" in row]) == 2
    # one generation batch serves 4 optimizer steps, so rewards are logged with the first log of each
    scored = [row for row in rows if "reward" in row]
    assert len(scored) == 1
    assert {"loss", "rewards/exact_match/mean", "rewards/varied/mean", "clip_ratio/region_mean",
            "reward_seconds/varied"} <= set(scored[0])
    assert "kl" not in scored[0]  # beta 0: no reference model
    summary = done(trained / "gspo")
    assert summary["steps"] == 4 and summary["method"] == "gspo"
    before = load_file(str(trained / "sft" / "adapter" / "adapter_model.safetensors"))
    after = load_file(str(trained / "gspo" / "adapter" / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and all(not (before[k] == after[k]).all() for k in before)


def test_gspo_adapter_reloads(trained):
    from kitcli.models.backend import load_policy

    loaded = load_policy("tiny", max_seq_length=128, load_in_4bit=True, lora=None, dtype="float32",
                         init_from=trained / "gspo", trainable=False, log=lambda _: None)
    assert loaded.trainable_params == 0 and loaded.total_params > 0
    saved = load_file(str(trained / "gspo" / "adapter" / "adapter_model.safetensors"))
    state = {k.replace(".default", ""): v for k, v in loaded.model.state_dict().items() if "lora_" in k}
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k].to(v.dtype), v) for k, v in saved.items())  # the GSPO stage's weights, not SFT's


def test_on_policy_settings_are_refused_with_the_reason(tmp_path):
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # the recipe's reward file: its only fault is on-policy
    recipe = write_recipe(tmp_path / "r.yaml", stages(train={"steps_per_generation": 1}))
    result = run_cli("run", recipe, "--dry-run", expect=2)
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("Error: ") and "on-policy" in message
    assert "sequence ratio is exactly 1" in message and "allow_on_policy: true" in message


def test_on_policy_can_be_allowed_deliberately(tmp_path):
    resolved = dry_run(tmp_path, allow_on_policy=True, train={"steps_per_generation": 1})
    assert resolved["allow_on_policy"] is True and resolved["GRPOConfig"]["steps_per_generation"] == 1


def test_more_iterations_make_it_off_policy(tmp_path):
    resolved = dry_run(tmp_path, train={"steps_per_generation": 1, "num_iterations": 2})
    assert resolved["GRPOConfig"]["num_iterations"] == 2


def test_token_level_ratio_is_refused(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", stages(train={"importance_sampling_level": "token"}))
    assert "use a stage of type grpo" in run_cli("run", recipe, "--dry-run", expect=2).output


def test_the_on_policy_guard_counts_processes(tmp_path, monkeypatch):
    """Under `kit run --launcher accelerate --num-processes N` a generation batch is shared by N processes: a batch
    of 2 x 4 completions with 4 per device is 2 optimizer steps in one process (off-policy) but 1 in two
    (on-policy), which the guard must refuse."""
    from rich.console import Console

    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext
    from kitcli.stages import gspo

    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    train = {"generation_batch_size": 8, "steps_per_generation": None, "save_steps": 2}
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", stages(train=train))))
    ctx = StageContext(recipe, recipe.stage("gspo"), tmp_path / "run", Console(quiet=True), {})
    gspo.check_off_policy(ctx)  # one process: 8 / 4 = 2 optimizer steps per generation batch
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(KitError, match="on-policy"):
        gspo.check_off_policy(ctx)
