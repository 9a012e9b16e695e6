"""The PPO stage on the tiny model: SFT -> reward model -> PPO trains the policy adapter and the critic, logs the
PPO metrics, keeps one copy of the base, resumes from its checkpoint; the reference stays frozen; bad input fails
in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import DATA, done, metrics, run_cli, write_recipe
from safetensors.torch import load_file

FP32_TINY = {"name": "tiny", "max_seq_length": 128, "load_in_4bit": False, "dtype": "float32"}
PPO_TRAIN = {"max_steps": 2, "per_device_train_batch_size": 8, "num_mini_batches": 2, "num_ppo_epochs": 2,
             "response_length": 4, "temperature": 1.0, "learning_rate": 5e-4, "logging_steps": 1, "save_steps": 1}
PPO_METRICS = ("loss/policy", "loss/value", "objective/kl", "policy/entropy", "policy/clipfrac", "policy/approxkl",
               "objective/scores", "objective/non_score_reward", "val/explained_variance", "rewards/exact_match/mean",
               "rewards/reward_model/mean")


def stages(**ppo):
    return [
        {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
         "train": {"max_steps": 8, "learning_rate": 2e-3, "per_device_train_batch_size": 16, "logging_steps": 4}},
        {"name": "rm", "type": "reward", "init": "sft", "eval_fraction": 0,
         "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 32},
         "train": {"max_steps": 2, "per_device_train_batch_size": 16, "logging_steps": 1}},
        {"name": "ppo", "type": "ppo", "init": "sft", "reward_model": "rm", "rewards": ["exact_match"],
         "data": {"path": str(DATA / "arithmetic_prompts.jsonl"), "limit": 32}, "train": dict(PPO_TRAIN), **ppo},
    ]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("ppo")
    recipe = write_recipe(root / "ppo.yaml", stages(), model=FP32_TINY)
    result = run_cli("run", recipe, "--output", root / "run")
    return root, recipe, result


def lora_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(path)).items() if "lora_" in k}


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert a.keys() == b.keys()
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_ppo_trains_policy_and_critic_on_one_base(ppo_run):
    root, _, result = ppo_run
    stage_dir = root / "run" / "ppo"
    summary = done(stage_dir)
    assert summary["steps"] == 2 and summary["base_copies"] == 1
    assert "reward model: adapter 'reward'" in " ".join(summary["memory"])
    assert "memory: 1 copy of base weights" in result.output
    assert "[ppo] step 2/2" in result.output

    rows = [row for row in metrics(stage_dir) if "loss/policy" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for key in PPO_METRICS:
        assert all(key in row for row in rows), key

    sft = lora_tensors(root / "run" / "sft" / "adapter" / "adapter_model.safetensors")
    checkpoint = stage_dir / "checkpoints" / "checkpoint-1"
    after_one = lora_tensors(checkpoint / "policy_adapter.safetensors")
    final = lora_tensors(stage_dir / "adapter" / "adapter_model.safetensors")
    assert differs(sft, after_one) and differs(after_one, final)  # the policy adapter moves every step

    critic_dir = stage_dir / "critic"
    assert json.loads((critic_dir / "adapter_config.json").read_text())["r"] == 8
    critic = lora_tensors(critic_dir / "adapter_model.safetensors")
    assert differs(sft, critic)  # the critic started as a copy of the SFT adapter
    assert differs(lora_tensors(checkpoint / "critic_adapter.safetensors"), critic)
    head_after_one = load_file(str(checkpoint / "value_head.safetensors"))
    head = load_file(str(critic_dir / "value_head.safetensors"))
    assert head["weight"].shape == (1, 128) and not torch.equal(head_after_one["weight"], head["weight"])
    assert not (stage_dir / "adapter" / "critic").exists()  # only the policy in adapter/


def test_ppo_resumes_from_its_last_checkpoint(ppo_run, tmp_path):
    root, recipe, _ = ppo_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    stage_dir = run / "ppo"
    finished = lora_tensors(stage_dir / "adapter" / "adapter_model.safetensors")
    for name in ("DONE", "adapter", "critic"):
        path = stage_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    result = run_cli("run", recipe, "--output", run)
    assert "resuming ppo from checkpoint-1 (step 1)" in result.output
    assert done(stage_dir)["resumed_from"] == "checkpoint-1" and done(stage_dir)["steps"] == 2
    resumed = lora_tensors(stage_dir / "adapter" / "adapter_model.safetensors")
    assert all(torch.allclose(finished[k], resumed[k], atol=1e-6) for k in finished)  # same RNG, same batches
    steps = [row["step"] for row in metrics(stage_dir) if "loss/policy" in row]
    assert steps == [1, 2]


def stage_context(root: Path, recipe_path: Path, run_dir: Path):
    from rich.console import Console

    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext

    recipe = load_recipe(str(recipe_path))
    outputs = {s.name: root / "run" / s.name for s in recipe.stages}
    ctx = StageContext(recipe, recipe.stage("ppo"), run_dir, Console(width=200), outputs)
    ctx.stage_dir.mkdir(parents=True, exist_ok=True)
    return ctx


def fixed_inputs(models, ctx):
    """Prompts with fixed response tokens (the same every call)."""
    from kitcli.ppo.rollout import prompt_texts
    from kitcli.stages import ppo

    tokenizer = models.tokenizer
    tokenizer.padding_side = "left"
    rows = ppo.load_rows(ctx)[:4]
    batch = tokenizer(prompt_texts(tokenizer, [r["prompt"] for r in rows]), return_tensors="pt", padding=True,
                      add_special_tokens=False)
    response = torch.tensor([tokenizer.encode("12", add_special_tokens=False) + [tokenizer.eos_token_id]] * 4)
    ids = torch.cat([batch["input_ids"], response], 1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(response)], 1)
    return ids, mask, batch["input_ids"].shape[1]


@pytest.mark.parametrize("init", ["sft", None])
def test_reference_stays_frozen_while_the_policy_moves(ppo_run, tmp_path, init):
    """With init: the reference is a frozen copy of the SFT adapter (4-bit base, merged reward model beside it);
    without: the base with adapters disabled (reward functions only)."""
    from kitcli.ppo.models import policy_logprobs, reference_logprobs
    from kitcli.stages import ppo
    from rewards.guard import RewardStats, guard_rewards

    root, _, _ = ppo_run
    extra = {"init": init} if init else {"init": None, "reward_model": None}
    ppo_stage = {k: v for k, v in {**stages()[2], **extra}.items() if v is not None}
    recipe = write_recipe(tmp_path / "r.yaml", [*stages()[:2], ppo_stage],
                          model={**FP32_TINY, "load_in_4bit": True})
    ctx = stage_context(root, recipe, tmp_path / "run")
    config = ppo.make_config(ctx)
    models = ppo.load_models(ctx)
    assert models.base_copies == (2 if init else 1)  # on CPU the reward model trained on an fp32 base
    ids, mask, prompt_length = fixed_inputs(models, ctx)
    with torch.no_grad():
        reference_before = reference_logprobs(models, ids, mask, prompt_length, 1.0)
        policy_before = policy_logprobs(models, ids, mask, prompt_length, 1.0)
    assert torch.allclose(reference_before, policy_before, atol=1e-6)  # the reference is the starting policy

    config.max_steps = 1
    rewards = ppo.load_reward_functions(ctx)
    ppo.train(ctx, config, models, ppo.load_rows(ctx), guard_rewards(rewards, RewardStats()), rewards)
    with torch.no_grad():
        reference_after = reference_logprobs(models, ids, mask, prompt_length, 1.0)
        policy_after = policy_logprobs(models, ids, mask, prompt_length, 1.0)
    assert torch.equal(reference_before, reference_after)
    assert not torch.allclose(policy_before, policy_after, atol=1e-5)


def check_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("Error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[-1], f"{fragment!r} not in {lines[-1]!r}"


def ppo_only(**stage):
    return [{"name": "ppo", "type": "ppo", "data": str(DATA / "arithmetic_prompts.jsonl"),
             "train": dict(PPO_TRAIN), **stage}]


def test_ppo_without_any_reward_fails_in_one_line(in_tmp, tiny_model_dir):
    recipe = write_recipe(in_tmp / "r.yaml", ppo_only())
    check_error(run_cli("run", recipe, expect=None), "stage 'ppo'", "PPO needs a reward", "reward_model:", "rewards:")
    assert not (in_tmp / "runs").exists()


def test_response_length_beyond_max_seq_length_fails_in_one_line(in_tmp, tiny_model_dir):
    recipe = write_recipe(in_tmp / "r.yaml", ppo_only(rewards=["exact_match"], train={**PPO_TRAIN,
                                                                                   "response_length": 128}))
    check_error(run_cli("run", recipe, expect=None), "train.response_length 128", "model.max_seq_length 128")


@pytest.mark.parametrize("train, fragment", [
    ({"num_mini_batches": 3}, "num_mini_batches (3) must divide train.per_device_train_batch_size (8)"),
    ({"cliprange": "wide"}, "train.cliprange must be a number"),
    ({"lam": 1.5}, "train.lam must be in [0, 1]"),
    ({"kl_coeff": 0.1}, "did you mean 'kl_coef'"),
])
def test_bad_ppo_settings_fail_in_one_line(in_tmp, tiny_model_dir, train, fragment):
    recipe = write_recipe(in_tmp / "r.yaml", ppo_only(rewards=["exact_match"], train={**PPO_TRAIN, **train}))
    check_error(run_cli("run", recipe, expect=None), fragment)


def test_reward_model_with_another_tokenizer_and_no_chat_template_fails_in_one_line(in_tmp, tiny_model_dir):
    from transformers import AutoTokenizer

    other = in_tmp / "other-rm"
    other.mkdir()
    shutil.copy(tiny_model_dir / "config.json", other / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.add_tokens(["<other>"])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(other))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    recipe = write_recipe(in_tmp / "r.yaml", ppo_only(reward_model=str(other)))
    check_error(run_cli("run", recipe, expect=None), "different tokenizer from the policy's", "no chat template",
                "cannot be re-tokenized")


def test_shipped_ppo_recipes_dry_run(in_tmp, tiny_model_dir):
    result = run_cli("run", "tiny-ppo", "--dry-run")
    assert "# stage 5/6: ppo (ppo)" in result.output and "kl_coef: 0.05" in result.output
    assert "reward model rm (weight 0.1)" in " ".join(result.output.split())  # YAML wraps long lines
    gpu = run_cli("run", "qwen3-4b-ppo", "--dry-run")
    assert "response_length: 256" in gpu.output and "hub dataset, read when the stage runs" in gpu.output


def test_rollout_and_update_share_the_autocast(ppo_run, tmp_path):
    """Under bf16 autocast (what a GPU uses; CPU autocast here) the rollout's log-probs and values come from the
    same precision as the update's, so before any weight moves the first mini-batch's ratio is exactly 1 and the
    value clip is centred on the values it recomputes."""
    from kitcli.ppo import trainer
    from kitcli.ppo.losses import KLController
    from kitcli.ppo.models import policy_logprobs
    from kitcli.ppo.rollout import make_rollout
    from kitcli.stages import ppo
    from rewards.guard import RewardStats, guard_rewards

    root, _, _ = ppo_run
    ppo_stage = {k: v for k, v in {**stages()[2], "reward_model": None}.items() if v is not None}
    recipe = write_recipe(tmp_path / "r.yaml", [*stages()[:2], ppo_stage], model=FP32_TINY)
    ctx = stage_context(root, recipe, tmp_path / "run")
    config = ppo.make_config(ctx)
    config.bf16, config.num_ppo_epochs, config.num_mini_batches, config.learning_rate = True, 1, 1, 1e-30
    models = ppo.load_models(ctx)
    rewards = ppo.load_reward_functions(ctx)
    rows = ppo.load_rows(ctx)[: config.per_device_train_batch_size]
    with trainer.accelerated(config) as accelerator:
        torch.manual_seed(0)
        rollout, _ = make_rollout(models, rows, config, guard_rewards(rewards, RewardStats()), rewards, accelerator)
        with torch.no_grad():  # the same forward in float32 differs: bf16 autocast really is in effect
            fp32 = policy_logprobs(models, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                   config.temperature)
        assert not torch.allclose(fp32 * rollout.mask, rollout.logprobs * rollout.mask, atol=1e-4)

        optimizer, scheduler = trainer.make_optimizer(models, config, 1, accelerator)
        kl_ctl = KLController(config.kl_coef, config.adaptive_kl_ctrl, config.kl_target, config.kl_horizon)
        figures = trainer.ppo_step(models, rollout, config, kl_ctl, optimizer, scheduler, accelerator, step=0)
    assert figures["policy/ratio"] == 1.0 and figures["policy/approxkl"] == 0.0
    assert figures["policy/clipfrac"] == 0.0 and figures["val/clipfrac"] == 0.0
