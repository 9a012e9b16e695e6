"""`kit rewards preview` on the tiny model, and the reward-model reward on a tiny sequence-classification model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import DATA, SMALL_LORA, TINY_MODEL, run_cli, write_recipe

from kitcli.errors import KitError
from rewards.registry import load_reward

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A run directory as a recipe leaves it: `sft/adapter` (a policy) and `rm/merged` (a reward model)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kitcli.models.backend import load_policy, save_model

    run = tmp_path_factory.mktemp("run")
    policy = load_policy("tiny", max_seq_length=128, load_in_4bit=False, lora=SMALL_LORA, dtype="float32", seed=0,
                         log=lambda message: None)
    (run / "sft").mkdir()
    save_model(policy.model, policy.tokenizer, run / "sft")
    torch.manual_seed(0)
    scorer = AutoModelForSequenceClassification.from_pretrained(str(tiny_model_dir), num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    scorer.config.pad_token_id = tokenizer.pad_token_id
    scorer.save_pretrained(str(run / "rm" / "merged"))
    tokenizer.save_pretrained(str(run / "rm" / "merged"))
    return run


def test_reward_model_scores_prompt_and_completion(run_dir, tmp_path):
    import torch

    reward = load_reward({"name": "reward_model", "args": {"stage": "rm", "batch_size": 2}}, tmp_path,
                         run_dir=run_dir)
    assert reward.name == "reward_model_rm"
    prompts = ["Ada has 3 apples and gets 5 more. How many apples does Ada have?"] * 3
    completions = ["8", "Ada has 8 apples.", ""]
    state = torch.random.get_rng_state()
    scores = reward.fn(prompts, completions)
    assert torch.equal(state, torch.random.get_rng_state())  # loading did not reseed the trainer's generator
    assert len(scores) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert reward.fn(prompts, completions) == scores  # deterministic, and batched the same way every time
    assert len(set(scores)) > 1
    chat = reward.fn([[{"role": "user", "content": p}] for p in prompts],
                     [[{"role": "assistant", "content": c}] for c in completions])
    assert len(chat) == 3 and chat != scores  # scored through the chat template
    # the same model by its path, scored in the same batches (other batch sizes pad differently, and float32 rounds
    # the padded sequences' scores 1e-7 apart on some CPUs)
    by_path = load_reward({"name": "reward_model", "args": {"path": str(run_dir / "rm" / "merged"), "batch_size": 2}},
                          tmp_path)
    assert by_path.fn(prompts, completions) == pytest.approx(scores)


def test_reward_model_without_a_model_names_the_stage(tmp_path):
    reward = load_reward({"name": "reward_model", "args": {"stage": "rm"}}, tmp_path, run_dir=tmp_path)
    with pytest.raises(KitError, match="no model at .*rm/merged .*run the reward stage 'rm' first"):
        reward.fn(["q"], ["a"])


def preview_recipe(path: Path, failing: Path, **extra) -> Path:
    reward_stage = [{"name": "rm", "type": "reward", "data": str(DATA / "arithmetic_prefs.jsonl")}] \
        if extra.get("reward_model") == "rm" else []  # a recipe's reward_model names an earlier reward stage
    return write_recipe(path, [
        {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"), "train": {"max_steps": 1}},
        *reward_stage,
        {"name": "grpo", "type": "grpo", "init": "sft", "data": str(DATA / "arithmetic_prompts.jsonl"),
         "rewards": ["exact_match",
                     {"name": "format", "args": {"tags": ["think", "answer"]}, "weight": 0.5},
                     {"name": str(ROOT / "examples" / "my_rewards.py:ends_with_answer")},
                     {"name": f"{failing.name}:explodes"}],
         **extra}], model=TINY_MODEL)


@pytest.fixture
def failing_reward(tmp_path) -> Path:
    path = tmp_path / "failing.py"
    path.write_text("def explodes(prompts, completions, **kwargs):\n    raise RuntimeError('bad reward')\n")
    return path


def test_preview_samples_scores_and_warns(run_dir, failing_reward, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    recipe = preview_recipe(tmp_path / "r.yaml", failing_reward, reward_model="rm")
    output = run_cli("rewards", "preview", recipe, "-n", "8", "--max-new-tokens", "12", "--run-dir", run_dir).output
    assert "starting model: the output of stage 'sft'" in output
    assert "sampling 8 completions (max_new_tokens 12, temperature 1)" in output
    for name in ("exact_match", "format_think_answer", "ends_with_answer", "explodes", "reward_model_rm",
                 "weighted total"):
        assert name in output
    assert "sample 0:" in output and "sample 2:" in output and "sample 3:" not in output
    assert "warning: reward 'format_think_answer' is constant over the 8 samples (always 0)" in output
    assert "warning: reward 'explodes' failed: reward 'explodes' raised RuntimeError: bad reward" in output
    assert "reward_model_rm' is constant" not in output  # a real model's scores vary


def test_preview_falls_back_to_the_base_model_and_picks_the_stage(failing_reward, tmp_path, in_tmp, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    recipe = preview_recipe(tmp_path / "r.yaml", failing_reward)
    output = run_cli("rewards", "preview", recipe, "--stage", "grpo", "-n", "4", "--max-new-tokens", "8",
                     "--temperature", "0", "--show", "1").output
    assert ("init stage 'sft' has no output (no run directory of this recipe yet); sampling from the base "
            "model") in output
    assert "temperature 0" in output and "sample 0:" in output and "sample 1:" not in output


def test_preview_errors(failing_reward, tmp_path):
    recipe = preview_recipe(tmp_path / "r.yaml", failing_reward)
    assert "no stage named 'grp'; did you mean 'grpo'?" in run_cli("rewards", "preview", recipe, "--stage", "grp",
                                                                    expect=2).output
    assert "stage 'sft' has no rewards; stages with rewards: grpo" in run_cli("rewards", "preview", recipe, "--stage",
                                                                              "sft", expect=2).output
    no_rewards = write_recipe(tmp_path / "plain.yaml", [{"name": "sft", "type": "sft",
                                                         "data": str(DATA / "arithmetic_sft.jsonl")}])
    assert "no stage lists rewards" in run_cli("rewards", "preview", no_rewards, expect=2).output
    missing_column = write_recipe(tmp_path / "m.yaml", [{"name": "grpo", "type": "grpo",
                                                         "data": str(DATA / "arithmetic_prompts.jsonl"),
                                                         "rewards": ["code_exec"]}])
    assert "reward 'code_exec' needs column 'tests'" in run_cli("rewards", "preview", missing_column, expect=2).output


# --- kit rewards test: samples in the other format from the reward's --------------------------------------------

NOTEBOOK_REWARDS = '''
def correctness(prompts, completions, answer, **kwargs):  # the Unsloth notebooks' style
    return [2.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]

def stripped(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def counts_digits(prompts, completions, **kwargs):
    import re
    return [float(len(re.findall(r"[0-9]", c))) for c in completions]

def adds_one(prompts, completions, **kwargs):
    return [c + 1 for c in completions]
'''


@pytest.mark.parametrize("name, samples, says", [
    ("correctness", ['"8"', '"7"'], "raised TypeError: string indices must be integers"),
    ("stripped", ['[{"role": "assistant", "content": "8"}]'], "raised AttributeError: 'list' object has no "
                                                             "attribute 'strip'"),
    ("counts_digits", ['[{"role": "assistant", "content": "8"}]'], "raised TypeError: expected string or bytes-like "
                                                                  "object"),
])
def test_rewards_test_says_when_the_samples_are_in_the_other_format(name, samples, says, tmp_path):
    module = tmp_path / "notebook.py"
    module.write_text(NOTEBOOK_REWARDS)
    data = tmp_path / "samples.jsonl"
    data.write_text("".join(f'{{"completion": {s}, "answer": "8"}}\n' for s in samples))
    result = run_cli("rewards", "test", f"{module}:{name}", "--data", data, expect=2)
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line and f"reward '{name}' {says}" in line
    assert f"'{data}'" in line
    if samples[0].startswith('"'):
        assert ("completions in" in line and "are plain strings; write them as messages, e.g. {\"completion\": "
                "[{\"role\": \"assistant\", \"content\": \"...\"}]}" in line and "data: {chat: true}" in line)
    else:
        assert "are lists of messages; write them as strings, e.g. {\"completion\": \"...\"}" in line


def test_rewards_test_keeps_the_plain_error_for_other_faults(tmp_path):
    """A TypeError of the reward's own on samples of the right format is not called a format mismatch."""
    module = tmp_path / "notebook.py"
    module.write_text(NOTEBOOK_REWARDS)
    data = tmp_path / "samples.jsonl"
    data.write_text('{"completion": "8", "answer": "8"}\n')
    line = run_cli("rewards", "test", f"{module}:adds_one", "--data", data, expect=2).output
    assert "reward 'adds_one' raised TypeError: can only concatenate str" in line and "as messages" not in line
