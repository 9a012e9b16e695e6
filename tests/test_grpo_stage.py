"""GRPO stage on the tiny model: trains, logs, changes the adapter, reloads; variant presets; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import DATA, done, fails, metrics, run_cli, snapshot, write_recipe
from safetensors.torch import load_file

from kitcli.stages.grpo import VARIANTS

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
SFT_DATA = str(DATA / "arithmetic_sft.jsonl")
SMALL_GRPO = {"learning_rate": 1e-3, "max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4,
              "max_completion_length": 4, "logging_steps": 1, "save_steps": 50}
# A dense reward (so every group has a spread and the policy gets a gradient) loaded from a file.
LENGTH_REWARD = """
def varied(prompts, completions, **kwargs):  # deterministic per text, different across texts
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(map(ord, t)) % 10) / 10 for t in texts]
"""


def sft_stage(steps: int = 4) -> dict:
    return {"name": "sft", "type": "sft", "data": SFT_DATA,
            "train": {"max_steps": steps, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "logging_steps": 2,
                      "save_steps": 50}}


def grpo_stage(**overrides) -> dict:
    stage = {"name": "grpo", "type": "grpo", "init": "sft", "data": PROMPTS,
             "rewards": ["exact_match", {"name": "length_reward.py:varied", "weight": 0.5}],
             "train": dict(SMALL_GRPO)}
    train = overrides.pop("train", {})
    stage.update(overrides)
    stage["train"].update(train)
    return stage


def adapter_weights(stage_dir):
    return load_file(str(stage_dir / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    recipe = write_recipe(root / "r.yaml", [sft_stage(), grpo_stage()])
    run_cli("run", recipe, "--output", root / "run")
    return root / "run"


def test_grpo_trains_logs_and_changes_the_adapter(trained):
    rows = metrics(trained / "grpo")
    logged = [row for row in rows if "reward" in row]
    assert len(logged) == 2
    for key in ("loss", "reward", "reward_std", "kl", "rewards/exact_match/mean", "rewards/varied/mean",
                "reward_seconds/exact_match", "reward_seconds/varied", "completions/mean_length"):
        assert key in logged[-1], key
    summary = done(trained / "grpo")
    assert summary["steps"] == 2 and summary["variant"] == "grpo" and summary["headline"].startswith("reward")
    before, after = adapter_weights(trained / "sft"), adapter_weights(trained / "grpo")
    assert before.keys() == after.keys()
    changed = [k for k in before if not (before[k] == after[k]).all()]
    assert len(changed) == len(before), f"unchanged: {sorted(set(before) - set(changed))[:3]}"
    assert not (trained / "grpo" / "adapter" / "ref").exists()  # TRL's frozen reference copy is not saved


def test_grpo_config_records_the_preset_and_reward_weights(trained):
    config = json.loads((trained / "grpo" / "config.json").read_text())
    for key, value in VARIANTS["grpo"].items():
        assert config[key] == value, key
    assert config["reward_weights"] == [1.0, 0.5]
    assert config["use_vllm"] is False and config["use_bias_correction_kl"] is False
    assert config["steps_per_generation"] == 1 and config["num_generations"] == 4


def test_grpo_adapter_reloads_and_generates(trained):
    from kitcli.models.backend import load_policy
    from kitcli.models.generate import generate

    loaded = load_policy("tiny", max_seq_length=128, load_in_4bit=True, lora=None, dtype="float32",
                         init_from=trained / "grpo", trainable=False, log=lambda _: None)
    state = {k.replace(".default", ""): v for k, v in loaded.model.state_dict().items() if "lora_" in k}
    saved = adapter_weights(trained / "grpo")
    assert all((state[k] == v).all() for k, v in saved.items() if k in state) and len(state) == len(saved)
    out = generate(loaded.model, loaded.tokenizer, [[{"role": "user", "content": "Ada has 2 pens and gets 3 more. "
                                                      "How many pens does Ada have?"}]], max_new_tokens=4)
    assert isinstance(out[0], str)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_sets_its_fields_explicitly(tmp_path, variant):
    recipe = write_recipe(tmp_path / "r.yaml", [sft_stage(), grpo_stage(variant=variant, rewards=["exact_match"])])
    result = run_cli("run", recipe, "--dry-run")
    resolved = yaml.safe_load(result.output.split("(grpo)\n", 1)[1])
    assert resolved["variant"] == variant
    for key, value in VARIANTS[variant].items():
        assert resolved["GRPOConfig"][key] == value, key
    for key in ("max_completion_length", "num_generations", "temperature", "top_p", "steps_per_generation",
                "num_iterations", "importance_sampling_level", "use_vllm", "learning_rate"):
        assert key in resolved["GRPOConfig"], key


def test_train_block_overrides_the_preset(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [sft_stage(), grpo_stage(variant="dr_grpo", rewards=["exact_match"],
                                                                         train={"scale_rewards": "batch"})])
    resolved = yaml.safe_load(run_cli("run", recipe, "--dry-run").output.split("(grpo)\n", 1)[1])
    assert resolved["GRPOConfig"]["scale_rewards"] == "batch" and resolved["GRPOConfig"]["loss_type"] == "dr_grpo"


# --- bad input: one line, exit status 2, nothing lost -------------------------------------------------------


def test_data_without_prompt(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    recipe = write_recipe(tmp_path / "r.yaml", [grpo_stage(init=None, data=str(data), rewards=["exact_match"])])
    message = fails("run", recipe, "--output", tmp_path / "run")
    assert "has no prompt column" in message and "columns: {question: prompt}" in message
    assert not (tmp_path / "run").exists()


def test_num_generations_that_does_not_divide_the_batch(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [grpo_stage(init=None, rewards=["exact_match"],
                                                           train={"num_generations": 3})])
    message = fails("run", recipe, "--dry-run")
    assert "num_generations 3 does not divide the generation batch of 8" in message
    assert "use num_generations 2, 4, 8" in message and "generation_batch_size: 24" in message


def test_reward_model_pointing_at_a_policy_stage(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [sft_stage(), grpo_stage(rewards=["exact_match"], reward_model="sft")])
    message = fails("run", recipe, "--dry-run")
    assert "reward_model 'sft' is a sft stage" in message and "type reward" in message


def test_init_pointing_at_a_reward_stage(tmp_path):
    pytest.importorskip("kitcli.stages.reward")
    reward = {"name": "rm", "type": "reward", "data": str(DATA / "arithmetic_prefs.jsonl"), "train": {"max_steps": 1}}
    recipe = write_recipe(tmp_path / "r.yaml", [reward, grpo_stage(init="rm", rewards=["exact_match"])])
    message = fails("run", recipe, "--dry-run")
    assert "init 'rm' is a reward stage" in message and "reward_model" in message


def test_no_rewards_at_all(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [grpo_stage(init=None, rewards=[])])
    assert "no rewards" in fails("run", recipe, "--dry-run")


BAD_REWARDS = """
import math

def raises(prompts, completions, answer, **kwargs):
    return [1.0 / (int(a) % 2) for a in answer]  # ZeroDivisionError on the first even answer

def short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def not_a_number(prompts, completions, **kwargs):
    return ["high"] * len(completions)

def nan(prompts, completions, **kwargs):
    return [0.5] + [math.nan] * (len(completions) - 1)
"""


@pytest.mark.parametrize("name, expected", [
    ("raises", r"reward 'raises' raised ZeroDivisionError: .* on sample \d+"),
    ("short", r"reward 'short' returned 7 scores for 8 completions"),
    ("not_a_number", r"reward 'not_a_number' returned 'high' is not a number for sample 0"),
    ("nan", r"reward 'nan' returned nan is not a finite number for sample 1"),
])
@pytest.mark.slow
def test_bad_reward_stops_the_stage_naming_reward_and_sample(tmp_path, name, expected):
    import re

    (tmp_path / "bad.py").write_text(BAD_REWARDS)
    first = {"name": "look", "type": "eval", "data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 4},
             "generation": {"max_new_tokens": 2}}
    recipe = write_recipe(tmp_path / "r.yaml", [first, grpo_stage(init=None, rewards=[f"bad.py:{name}"])])
    run = tmp_path / "run"
    message = fails("run", recipe, "--output", run)
    assert re.search(expected, message), message
    assert "stage 'grpo'" in message
    assert (run / "look" / "DONE").exists() and not (run / "grpo" / "DONE").exists()
    kept = snapshot(run / "look")
    assert fails("run", recipe, "--output", run) == message  # run again: the same stop, the finished stage kept
    assert snapshot(run / "look") == kept and not (run / "grpo" / "DONE").exists()


@pytest.mark.slow
def test_on_error_skip_counts_the_skipped_samples(tmp_path):
    (tmp_path / "bad.py").write_text(BAD_REWARDS)
    stage = grpo_stage(init=None, rewards=["exact_match", {"name": "bad.py:nan", "on_error": "skip"}],
                       train={"max_steps": 1})
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    run_cli("run", recipe, "--output", tmp_path / "run")
    row = [r for r in metrics(tmp_path / "run" / "grpo") if "reward" in r][-1]
    assert row["reward_skipped/nan"] == 7


def test_use_vllm_without_a_gpu_or_vllm(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", [grpo_stage(init=None, rewards=["exact_match"],
                                                           train={"use_vllm": True})])
    assert "train.use_vllm needs a CUDA GPU and vLLM" in fails("run", recipe, "--dry-run")


DIGIT_REWARD = """
def sevens(prompts, completions, **kwargs):  # the share of 7s in a completion: a target the policy can move toward
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [t.count("7") / max(1, len(t)) for t in texts]
"""


def sampled_reward(stage_dir, prompts: list, samples: int = 8) -> float:
    """Mean `sevens` reward of completions sampled (temperature 1, seeded) from the policy `stage_dir` saved."""
    from kitcli.models.backend import load_policy
    from kitcli.models.generate import generate

    loaded = load_policy("tiny", max_seq_length=128, load_in_4bit=True, lora=None, dtype="float32",
                         init_from=stage_dir, trainable=False, log=lambda _: None)
    texts = generate(loaded.model, loaded.tokenizer, prompts * samples, max_new_tokens=4, temperature=1.0, seed=0)
    return sum(t.count("7") / max(1, len(t)) for t in texts) / len(texts)


@pytest.mark.slow
def test_grpo_raises_the_reward_it_is_trained_on(tmp_path):
    """The outcome GRPO is for: completions sampled from the trained policy on its training prompts score higher
    than those of the SFT policy it started from (a stage that stepped against the advantage lowers it)."""
    (tmp_path / "digits.py").write_text(DIGIT_REWARD)
    stage = grpo_stage(rewards=["digits.py:sevens"],
                       train={"max_steps": 16, "learning_rate": 1e-2, "beta": 0.0, "temperature": 1.0})
    run_cli("run", write_recipe(tmp_path / "r.yaml", [sft_stage(), stage]), "--output", tmp_path / "run")
    prompts = [json.loads(line)["prompt"] for line in Path(PROMPTS).read_text().splitlines()[:16]]
    before, after = (sampled_reward(tmp_path / "run" / name, prompts) for name in ("sft", "grpo"))
    assert after > before + 0.2, (before, after)  # measured 0.02 -> 0.54 (seed 0)
