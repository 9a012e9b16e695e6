"""The reward model stage on the tiny model: Bradley–Terry training from an SFT stage's LoRA weights, accuracy and
margin on a held-out split, an adapter plus a merged model that loads as a plain AutoModelForSequenceClassification
and ranks chosen above rejected more often than before training; bad input fails in one line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import DATA, SFT_8_STEPS, TINY_MODEL, done, metrics, run_cli, snapshot, stage_context, write_recipe
from safetensors.torch import load_file

RM_STEPS = 16
TRAIN_PAIRS = {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 40}
SFT = SFT_8_STEPS  # trained once per module
RM = {"name": "rm", "type": "reward", "init": "sft", "data": TRAIN_PAIRS, "eval_fraction": 0.2,
      "train": {"max_steps": RM_STEPS, "learning_rate": 3e-3, "per_device_train_batch_size": 8, "logging_steps": 4,
                "eval_steps": 8, "save_steps": 100}}


@pytest.fixture(scope="module")
def sft_rm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    recipe = write_recipe(root / "sft-rm.yaml", [SFT, RM])
    result = run_cli("run", recipe, "--output", root / "run")
    return recipe, root / "run", result.output


def pair_accuracy(model, tokenizer, rows) -> float:
    """Share of pairs whose chosen conversation scores above its rejected one (one padded batch each)."""
    def scores(side):
        texts = [tokenizer.apply_chat_template(r["prompt"] + r[side], tokenize=False) for r in rows]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            return model(**batch).logits[:, 0]

    return (scores("chosen") > scores("rejected")).float().mean().item()


def test_reward_stage_trains_logs_accuracy_and_saves_adapter_and_merged(sft_rm_run):
    _, run_dir, output = sft_rm_run
    stage_dir = run_dir / "rm"
    rows = metrics(stage_dir)
    train_rows = [r for r in rows if "loss" in r and "accuracy" in r]
    assert len(train_rows) == RM_STEPS // 4 and all("margin" in r for r in train_rows)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert len(evals) >= 3 and evals[0]["step"] == 0 and evals[-1]["step"] == RM_STEPS  # before, during, after
    assert all("eval_margin" in r for r in evals)
    summary = done(stage_dir)
    assert summary["headline"].startswith("eval accuracy ") and "margin" in summary["headline"]
    assert summary["eval_after"]["accuracy"] == evals[-1]["eval_accuracy"]
    assert summary["backend"] == "transformers"  # no GPU: Unsloth's CPU loader ignores num_labels
    config = json.loads((stage_dir / "config.json").read_text())
    assert config["center_rewards_coefficient"] is None and config["max_length"] == TINY_MODEL["max_seq_length"]
    assert "merged reward model:" in output

    adapter = load_file(str(stage_dir / "adapter" / "adapter_model.safetensors"))
    sft = load_file(str(run_dir / "sft" / "adapter" / "adapter_model.safetensors"))
    assert set(sft) < set(adapter)  # the SFT LoRA layers plus the score head
    assert [k for k in set(adapter) - set(sft)] == ["base_model.model.score.weight"]
    assert all(not torch.equal(adapter[k].float(), sft[k].float()) for k in sft)  # every LoRA tensor trained
    assert not (stage_dir / "adapter.tmp").exists() and not (stage_dir / "merged.tmp").exists()

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    merged = AutoModelForSequenceClassification.from_pretrained(stage_dir / "merged")
    tokenizer = AutoTokenizer.from_pretrained(stage_dir / "merged")
    assert type(merged).__name__ == "Qwen2ForSequenceClassification" and merged.config.num_labels == 1
    assert merged.config.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert torch.equal(merged.score.weight, adapter["base_model.model.score.weight"].to(merged.score.weight.dtype))
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_merged_reward_model_ranks_chosen_above_rejected_more_often_than_before(sft_rm_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kitcli.models.reward_models import load_reward_model
    from kitcli.stages.pairs import train_eval_rows

    recipe, run_dir, _ = sft_rm_run
    ctx = stage_context(recipe, "rm", run_dir)
    train_rows, eval_rows = train_eval_rows(ctx)
    assert len(eval_rows) == 8 and len(train_rows) == 32
    before = load_reward_model("tiny", max_seq_length=128, load_in_4bit=True, lora=ctx.recipe.lora.model_dump(),
                               dtype="float32", seed=ctx.seed, init_from=run_dir / "sft", log=lambda _: None)
    before.model.eval()
    merged = AutoModelForSequenceClassification.from_pretrained(run_dir / "rm" / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "rm" / "merged")
    accuracy_before = pair_accuracy(before.model, before.tokenizer, train_rows)
    accuracy_after = pair_accuracy(merged, tokenizer, train_rows)
    assert accuracy_after > accuracy_before, (accuracy_before, accuracy_after)


def test_reward_model_starts_from_the_sft_adapter_weights(sft_rm_run):
    from kitcli.models.reward_models import load_reward_model

    _, run_dir, _ = sft_rm_run
    loaded = load_reward_model("tiny", max_seq_length=128, load_in_4bit=True, lora=None, dtype="float32",
                               init_from=run_dir / "sft", log=lambda _: None)
    params = dict(loaded.model.named_parameters())
    saved = load_file(str(run_dir / "sft" / "adapter" / "adapter_model.safetensors"))
    for key, tensor in saved.items():
        assert torch.equal(params[key.replace(".weight", ".default.weight")].detach().to(tensor.dtype), tensor), key
    assert params["base_model.model.score.modules_to_save.default.weight"].requires_grad  # the new head trains


def test_reward_data_without_chosen_rejected_is_refused_and_nothing_is_lost(in_tmp):
    bad = in_tmp / "pairs.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "good": "4", "bad": "5"}) + "\n")
    recipe = write_recipe(in_tmp / "r.yaml", [{**RM, "init": None, "data": str(bad)}])
    (in_tmp / "run").mkdir()
    (in_tmp / "run" / "keep.txt").write_text("earlier work")
    before = snapshot(in_tmp)
    result = run_cli("run", recipe, "--output", in_tmp / "run", expect=2)
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("Error:") and "needs columns chosen+rejected" in line
    assert "it has bad, good, question" in line and "columns: {good: chosen, bad: rejected}" in line
    assert "Traceback" not in result.output
    assert snapshot(in_tmp) == before


def test_reward_rows_that_mix_formats_name_the_row(in_tmp):
    bad = in_tmp / "pairs.jsonl"
    good_row = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    mixed_row = {"prompt": "3+3=", "chosen": [{"role": "assistant", "content": "6"}], "rejected": "7"}
    bad.write_text(json.dumps(good_row) + "\n" + json.dumps(mixed_row) + "\n")
    recipe = write_recipe(in_tmp / "r.yaml", [{**RM, "init": None, "data": str(bad)}])
    result = run_cli("run", recipe, "--dry-run", expect=2)
    assert "row 2 of" in result.output and "mixes formats" in result.output


def test_reward_stage_init_from_an_eval_stage_is_refused(in_tmp):
    evaluate = {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl")}
    recipe = write_recipe(in_tmp / "r.yaml", [evaluate, {**RM, "init": "ev"}])
    result = run_cli("run", recipe, "--dry-run", expect=2)
    assert "init 'ev' is an eval stage" in result.output
