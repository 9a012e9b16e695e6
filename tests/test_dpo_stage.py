"""The DPO stage on the tiny model: trains from an SFT stage against the SFT model as reference, logs TRL's reward
metrics, saves an adapter that reloads; bad data and a wrong `init` fail in one line before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    DATA,
    SFT_8_STEPS,
    TINY_MODEL,
    completion_logprob,
    done,
    metrics,
    run_cli,
    snapshot,
    stage_context,
    write_recipe,
)
from safetensors.torch import load_file

DPO_STEPS = 6
PREFS = {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 72}
SFT = SFT_8_STEPS  # trained once per module
DPO = {"name": "dpo", "type": "dpo", "init": "sft", "data": PREFS, "eval_fraction": 0.1,
       "train": {"max_steps": DPO_STEPS, "learning_rate": 2e-3, "per_device_train_batch_size": 8, "logging_steps": 2,
                 "eval_steps": 3, "save_steps": 100}}


@pytest.fixture(scope="module")
def sft_dpo_run(tmp_path_factory):
    """sft -> dpo (init sft), run once through the CLI for the tests of this module."""
    root = tmp_path_factory.mktemp("dpo")
    recipe = write_recipe(root / "sft-dpo.yaml", [SFT, DPO])
    result = run_cli("run", recipe, "--output", root / "run")
    return recipe, root / "run", result.output


def completion_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: log p(chosen | prompt) and log p(rejected | prompt), from one plain forward of the padded batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    sums = (token_logps * batch["completion_mask"][:, 1:]).sum(dim=1)
    return sums.chunk(2)


def test_dpo_trains_from_sft_logs_reward_metrics_and_saves(sft_dpo_run, tiny_model_dir):
    _, run_dir, output = sft_dpo_run
    rows = metrics(run_dir / "dpo")
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == DPO_STEPS // 2
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert all(key in r for r in train_rows), key
    assert any("eval_rewards/accuracies" in r and "eval_rewards/margins" in r for r in rows)
    assert all(r["rewards/margins"] != 0 and r["rewards/chosen"] != r["rewards/rejected"] for r in train_rows)
    summary = done(run_dir / "dpo")
    assert summary["steps"] == DPO_STEPS and summary["beta"] == 0.1
    assert "frozen 'ref' adapter" in summary["reference"] and "eval reward accuracy" in summary["headline"]
    assert "reference = frozen 'ref' adapter" in output

    adapter = run_dir / "dpo" / "adapter"
    assert not (adapter / "ref").exists() and not (run_dir / "dpo" / "adapter.tmp").exists()  # policy only
    config = json.loads((run_dir / "dpo" / "config.json").read_text())
    assert config["beta"] == 0.1 and config["loss_type"] == ["sigmoid"] and config["precompute_ref_log_probs"] is False
    dpo_weights = load_file(str(adapter / "adapter_model.safetensors"))
    sft_weights = load_file(str(run_dir / "sft" / "adapter" / "adapter_model.safetensors"))
    assert dpo_weights.keys() == sft_weights.keys()
    assert all(not torch.equal(dpo_weights[k], sft_weights[k]) for k in dpo_weights)  # every tensor trained

    from kitcli.models.backend import load_policy
    from kitcli.models.generate import generate

    reloaded = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                           dtype="float32", init_from=run_dir / "dpo", trainable=False, log=lambda _: None)
    state = reloaded.model.state_dict()
    some = next(k for k in dpo_weights if "lora_B" in k)
    assert torch.equal(state[some.replace(".weight", ".default.weight")].to(dpo_weights[some].dtype), dpo_weights[some])
    [completion] = generate(reloaded.model, reloaded.tokenizer,
                            [[{"role": "user",
                               "content": "Ada has 2 apples and gets 3 more. How many apples does Ada have?"}]],
                            max_new_tokens=4)
    assert isinstance(completion, str)


def preference_margins(stage_dir, rows: list[dict]) -> torch.Tensor:
    """Per pair: log pi(chosen | prompt) - log pi(rejected | prompt) under the policy `stage_dir` saved, computed
    here from the chat template and one forward per completion."""
    from kitcli.models.backend import load_policy

    loaded = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                         dtype="float32", init_from=stage_dir, trainable=False, log=lambda _: None)
    tokenizer = loaded.tokenizer
    margins = []
    with torch.no_grad():
        for row in rows:
            prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            chosen, rejected = (tokenizer(row[k][0]["content"], add_special_tokens=False)["input_ids"]
                                for k in ("chosen", "rejected"))
            margins.append(completion_logprob(loaded.model, prompt, chosen)
                           - completion_logprob(loaded.model, prompt, rejected))
    return torch.stack(margins)


def test_dpo_widens_the_margin_of_the_preferred_completion(sft_dpo_run):
    """The outcome DPO is for: on its training pairs the trained policy prefers the chosen completion over the
    rejected one by more than the SFT model it started from did (a stage that stepped the wrong way, or trained on
    swapped pairs, narrows it)."""
    _, run_dir, _ = sft_dpo_run
    rows = [json.loads(line) for line in Path(PREFS["path"]).read_text().splitlines()[:PREFS["limit"]]]
    gain = preference_margins(run_dir / "dpo", rows) - preference_margins(run_dir / "sft", rows)
    assert gain.mean() > 0.2, gain  # measured 0.49 (seed 0): 6 steps of DPO from the SFT model


def test_dpo_reference_is_the_sft_model_not_the_base(sft_dpo_run):
    from kitcli.models.backend import load_policy
    from kitcli.stages import dpo

    recipe, run_dir, _ = sft_dpo_run
    ctx = stage_context(recipe, "dpo", run_dir.parent / "rebuilt")
    ctx = type(ctx)(ctx.recipe, ctx.stage, ctx.run_dir, ctx.console, {"sft": run_dir / "sft"})
    trainer, loaded, reference = dpo.build_trainer(ctx)
    model = trainer.model

    # Stage 2 starts from exactly the weights stage 1 saved: the trained adapter and the frozen "ref" copy.
    saved = load_file(str(run_dir / "sft" / "adapter" / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    for key, tensor in saved.items():
        name = key.replace(".weight", ".default.weight")
        assert torch.equal(params[name].detach().to(tensor.dtype), tensor), key
        assert torch.equal(params[name.replace(".default.", ".ref.")].detach().to(tensor.dtype), tensor), key
        assert params[name].requires_grad and not params[name.replace(".default.", ".ref.")].requires_grad

    # Train a few steps so the policy leaves the reference; the reference must not move with it.
    trainer.args.max_steps = 3
    trainer.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    quiet = {"max_seq_length": TINY_MODEL["max_seq_length"], "load_in_4bit": True, "lora": None, "dtype": "float32",
             "trainable": False, "log": lambda _: None}
    sft_model = load_policy("tiny", init_from=run_dir / "sft", **quiet).model
    base_model = load_policy("tiny", **quiet).model
    model.eval()
    with torch.no_grad():
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(model, batch)
        sft_chosen, sft_rejected = completion_logprobs(sft_model, batch)
        base_chosen, base_rejected = completion_logprobs(base_model, batch)
        policy_chosen, _ = completion_logprobs(model, batch)
        model.train()  # dropout is off (disable_dropout); train mode files the metrics under "train"
        trainer._metrics["train"].clear()
        trainer.compute_loss(model, batch)  # the training path: TRL logs rewards = beta * (policy - reference)
        logged = trainer._metrics["train"]
    assert torch.allclose(ref_chosen, sft_chosen, atol=1e-4) and torch.allclose(ref_rejected, sft_rejected, atol=1e-4)
    assert (ref_chosen - base_chosen).abs().max() > 0.5  # the base is a different model here
    assert (policy_chosen - sft_chosen).abs().max() > 1e-3  # the policy did move
    implied_ref_chosen = logged["logps/chosen"][-1] - logged["rewards/chosen"][-1] / trainer.args.beta
    assert abs(implied_ref_chosen - sft_chosen.mean().item()) < 1e-3


def test_dpo_init_from_a_reward_stage_is_refused(in_tmp):
    reward = {"name": "rm", "type": "reward", "init": "sft", "data": PREFS}
    recipe = write_recipe(in_tmp / "r.yaml", [SFT, reward, {**DPO, "init": "rm"}])
    result = run_cli("run", recipe, "--output", in_tmp / "run", expect=2)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error:") and "init 'rm' is a reward stage" in line and "sft" in line
    assert "Traceback" not in result.output
    assert not (in_tmp / "run").exists()  # refused before anything was written


def test_dpo_data_without_chosen_rejected_is_refused_and_nothing_is_lost(in_tmp):
    prompts = DATA / "arithmetic_prompts.jsonl"  # prompt + answer columns
    recipe = write_recipe(in_tmp / "r.yaml", [{**DPO, "init": None, "data": str(prompts)}])
    (in_tmp / "run").mkdir()
    (in_tmp / "run" / "keep.txt").write_text("earlier work")
    before = snapshot(in_tmp)
    result = run_cli("run", recipe, "--output", in_tmp / "run", expect=2)
    line = result.output.strip().splitlines()[-1]
    assert "needs columns chosen+rejected" in line and "it has answer, prompt" in line and "columns:" in line
    assert snapshot(in_tmp) == before


@pytest.mark.slow
def test_dpo_over_several_epochs_precomputes_reference_logprobs_with_the_same_result(tmp_path):
    """With num_train_epochs > 1 the kit turns precompute_ref_log_probs on (a reference forward per row once,
    not per step); the training numbers must be those of the per-step reference."""
    stage = {"name": "dpo", "type": "dpo", "data": {"path": PREFS["path"], "limit": 16}, "eval_fraction": 0,
             "train": {"num_train_epochs": 2, "learning_rate": 2e-3, "per_device_train_batch_size": 8,
                       "logging_steps": 1, "save_steps": 100}}
    runs = {}
    for precompute in (None, False):
        train = dict(stage["train"], **({} if precompute is None else {"precompute_ref_log_probs": precompute}))
        recipe = write_recipe(tmp_path / f"dpo-{precompute}.yaml", [dict(stage, train=train)])
        run_cli("run", recipe, "--output", tmp_path / f"run-{precompute}")
        runs[precompute] = tmp_path / f"run-{precompute}" / "dpo"
    assert json.loads((runs[None] / "config.json").read_text())["precompute_ref_log_probs"] is True
    assert json.loads((runs[False] / "config.json").read_text())["precompute_ref_log_probs"] is False
    default, per_step = ([r for r in metrics(run) if "loss" in r] for run in (runs[None], runs[False]))
    assert len(default) == len(per_step) == 4
    for a, b in zip(default, per_step):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
    assert default[-1]["rewards/margins"] != 0  # the policy moved away from the reference
