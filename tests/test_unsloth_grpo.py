"""Where Unsloth's generated GRPO trainer differs from TRL's in what a user reads or in what is trained, and the kit's
corrections (kitcli/training/unsloth_grpo.py), on both trainer families (conftest.trainer_family). Unsloth's trainer
forced on the CPU runs the same generated scoring and loss code a GPU runs (its kl averaging, its pad-id loss mask,
its packing and PrefixGrouper self-checks; checked by reading the generated module these tests patch); only its GPU
kernels differ. Nothing here is mocked.

- `kl` is the token-weighted mean over completion tokens on both families, with completions of unequal length, and
  the kit's reader finds it in whichever metrics bucket the trainer recorded it (the model left in training mode, as
  Unsloth's generation leaves it on a GPU).
- A pad = EOS model whose completions end with a sampled EOS trains on that EOS on both families: Unsloth's own mask
  ("token != pad id") drops it, so the kit pads such a tokenizer with a reserved token; with none to use, a stage on
  Unsloth's trainer stops before anything loads.
- DONE and the report say whether Unsloth used sequence packing and shared-prefix attention and what its self-check
  measured; the `unsloth:` keys turn them off, are validated like every key, do nothing (a note) on TRL's trainer,
  and `kit check` names the settings that trade exactness for speed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import (
    DATA,
    TINY_MODEL,
    done,
    forward_precision,
    metrics,
    move_policy,
    precision_scale,
    run_cli,
    write_recipe,
)
from rich.console import Console

from kitcli.errors import KitError
from kitcli.recipe.load import load_recipe
from kitcli.recipe.stage_context import StageContext
from kitcli.training.progress import recorded_metric
from kitcli.training.trainers import is_unsloth_class

GROUPS, G, LENGTH = 2, 4, 8
PROMPTS = str(DATA / "arithmetic_prompts.jsonl")


def build(tmp_path: Path, train: dict, model: dict | None = None, data: str = PROMPTS, console=None):
    """The GRPO trainer the kit builds for a stage (grpo.build_trainer: the real factory, corrections included)."""
    from kitcli.stages import grpo

    (tmp_path / "fixed.py").write_text("def fixed(prompts, completions, **kwargs):\n"
                                       "    return [float(i % 3) for i in range(len(completions))]\n")
    stage = {"name": "rl", "type": "grpo", "variant": "grpo", "data": data, "rewards": ["fixed.py:fixed"],
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G,
                       "max_completion_length": LENGTH, "temperature": 1.0, **train}}
    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", [stage], model=model or TINY_MODEL)))
    ctx = StageContext(recipe, recipe.stage("rl"), tmp_path / "run", console or Console(quiet=True), {})
    trainer, loaded, _ = grpo.build_trainer(ctx, grpo.VARIANTS["grpo"])
    assert is_unsloth_class(type(trainer)) == (os.environ["KIT_TRAINERS"] == "unsloth"), type(trainer)
    return trainer, loaded


def generation_batch(trainer) -> dict:
    rows = [trainer.train_dataset[i] for i in range(GROUPS)]
    trainer.model.eval()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([row for row in rows for _ in range(G)])


def policy_logps(model, batch: dict) -> torch.Tensor:
    """log pi(o_t | q, o_<t) of each completion token, by a plain padded forward (as TRL scores them)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad(), forward_precision():
        logits = model(input_ids=ids, attention_mask=mask).logits
    n = batch["completion_ids"].shape[1]
    return torch.log_softmax(logits[:, -n - 1:-1, :].float(), dim=-1).gather(
        -1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
def test_kl_metric_is_the_token_weighted_mean(trainer_family, tmp_path):
    """TRL logs KL_t = pi_ref/pi - log(pi_ref/pi) - 1 averaged over every completion token; Unsloth's loss averaged
    it per sequence, then over sequences. With completions cut to at most 8, 2, 5, 1, 8, 3, 6 and 4 tokens the two
    differ by a fifth; the kit's `kl` must be the token-weighted one on both families. The loss is computed with the
    model in training mode, where Unsloth's generation leaves it on a GPU: the value goes to the "train" bucket, and
    recorded_metric (the kit's reader of a trainer's recorded metrics) must find it there."""
    trainer, loaded = build(tmp_path, {"beta": 0.5})
    model = trainer.model
    move_policy(model, 0.05)  # off the frozen reference, or every KL is 0
    batch = generation_batch(trainer)
    ids, mask = batch["completion_ids"].clone(), batch["completion_mask"].clone()
    for row, length in enumerate([8, 2, 5, 1, 8, 3, 6, 4]):  # the tail becomes padding, as after a sampled EOS
        ids[row, length:] = loaded.tokenizer.pad_token_id
        mask[row, length:] = 0
    batch = {**batch, "completion_ids": ids, "completion_mask": mask}
    log_ratio = batch["ref_per_token_logps"] - policy_logps(model, batch)
    kl = (torch.exp(log_ratio) - log_ratio - 1) * mask
    token_weighted = (kl.sum() / mask.sum()).item()
    per_sequence = (kl.sum(1) / mask.sum(1)).mean().item()
    assert abs(token_weighted - per_sequence) > 0.1 * token_weighted, (token_weighted, per_sequence)

    model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before each step's losses
    with torch.no_grad():
        trainer.compute_loss(model, batch)
    assert not trainer._metrics["eval"].get("kl"), "recorded in training mode: the 'train' bucket"
    assert recorded_metric(trainer, "kl") == pytest.approx(token_weighted, rel=1e-4 * precision_scale())


def pad_eos_model(root: Path, template_extra: str = "") -> Path:
    """A copy of the tiny model whose tokenizer pads with its EOS (<|im_end|>), as SmolLM2's does."""
    from kitcli.models.tiny import ensure_tiny_model

    folder = root / "tiny-pad-eos"
    shutil.copytree(ensure_tiny_model(seed=0), folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": "<|im_end|>"}))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "pad_token_id": 2}))
    if template_extra:
        template = folder / "chat_template.jinja"
        template.write_text(template.read_text() + template_extra)
    return folder


@pytest.mark.slow
def test_pad_eos_model_trains_on_the_sampled_eos(trainer_family, tmp_path):
    """With pad = EOS (<|im_end|>) the tiny model samples an EOS inside its 8-token budget. TRL trains every token up
    to and including the first EOS. Unsloth's loss mask is "token != pad id" (its create_completion_attention_mask,
    applied here to the batch with the tokenizer's own pad): the EOS is never trained (and Unsloth also drops every
    pad-id token from a row before scoring it). The kit pads such a tokenizer with a reserved token on Unsloth's
    trainer, so both families' losses equal the formula with TRL's mask, which differs from the one without the
    EOS. Plain-string prompts (no EOS inside them) keep the comparison to the completions."""
    (tmp_path / "plain.jsonl").write_text("".join(
        json.dumps({"prompt": row["prompt"][0]["content"] + "\n", "answer": row["answer"]}) + "\n"
        for row in map(json.loads, Path(PROMPTS).read_text().splitlines()[:8])))
    console = Console(record=True, width=300)
    trainer, loaded = build(tmp_path, {"beta": 0.0}, model={**TINY_MODEL, "name": str(pad_eos_model(tmp_path))},
                            data=str(tmp_path / "plain.jsonl"), console=console)
    tokenizer, eos = loaded.tokenizer, loaded.tokenizer.eos_token_id
    unsloth = trainer_family == "unsloth"
    assert tokenizer.pad_token == ("<|endoftext|>" if unsloth else "<|im_end|>")
    assert ("padding with '<|endoftext|>'" in console.export_text()) == unsloth

    batch = generation_batch(trainer)
    ids, mask = batch["completion_ids"], batch["completion_mask"]
    ended = [row for row in range(ids.shape[0]) if (ids[row, :-1] == eos).any()]
    assert ended, f"no completion sampled its EOS inside the budget: {ids.tolist()}"
    for row in ended:  # TRL's mask: up to and including the first EOS
        first = int((ids[row] == eos).nonzero()[0])
        assert mask[row, :first + 1].all() and not mask[row, first + 1:].any(), mask[row]
    if unsloth:  # Unsloth's own rule with the tokenizer's pad = EOS: the EOS is out of the loss
        module = sys.modules[type(trainer).__module__]
        pad_mask = module.create_completion_attention_mask(ids, torch.zeros(len(ids), dtype=torch.long), 0, eos)
        assert all(not pad_mask[row, int((ids[row] == eos).nonzero()[0])] for row in ended)

    logps = policy_logps(trainer.model, batch)
    shift = (torch.rand(logps.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1) * 0.4
    batch = {**batch, "old_per_token_logps": logps - shift}
    advantages = batch["advantages"].unsqueeze(1)

    def grpo_loss(token_mask):  # DeepSeekMath's clipped objective, per-sequence mean (loss_type grpo)
        ratio = torch.exp(shift)
        per_token = -torch.min(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages) * token_mask
        return (per_token.sum(1) / token_mask.sum(1).clamp(min=1)).mean().item()

    with_eos, without_eos = grpo_loss(mask.float()), grpo_loss((mask * (ids != eos)).float())
    assert abs(with_eos - without_eos) > 1e-3, (with_eos, without_eos)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    assert loss == pytest.approx(with_eos, rel=1e-4 * precision_scale(), abs=1e-7), (loss, with_eos, without_eos)


@pytest.mark.slow
@pytest.mark.parametrize("trainer_family", ["unsloth"], indirect=True)
def test_pad_eos_without_a_reserved_token_stops_before_loading(trainer_family, tmp_path, in_tmp):
    """No pad-like token left to use (the tiny model's <|endoftext|> is in its chat template here): a GRPO stage on
    Unsloth's trainer stops in one line, exit 2, naming the pad token, before any model loads."""
    model = pad_eos_model(tmp_path, template_extra="{# <|endoftext|> #}")
    stage = {"name": "grpo", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
             "train": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4}}
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [stage], model={**TINY_MODEL, "name": str(model)}),
                     "--output", tmp_path / "run", expect=2)
    assert "pads with a stop token ('<|im_end|>') and has no reserved token" in result.output
    assert "policy: backend" not in result.output


SPEED_TRAIN = {"max_steps": 1, "per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
               "logging_steps": 1}


@pytest.mark.slow
def test_speed_paths_recorded_and_switched_off(trainer_family, tmp_path):
    """Stage `packed` (beta 0.1: reference log-probs are scored too, without gradient) leaves Unsloth's speed paths
    on: its DONE and the report say whether each ran, with the largest difference Unsloth's self-check measured (on
    this CPU packing is kept and the shared prefix is turned down by its check: used exactly when the check passed).
    Stage `no_prefix` (beta 0) turns shared-prefix attention off, stage `exact` (beta 0.04: the reference scoring
    too) both: what is off is neither run nor checked. Their batches are one prompt's group, which TRL's shuffle of
    the generation batch leaves whole, so the loss's own scoring (the grad path) would check the shared prefix if it
    were on, as the reference scoring does (a batch of several groups in shuffled order it never does). With beta 0
    no `kl` is logged (Unsloth logged a constant 0 there). On TRL's trainer the keys do nothing, and a note says so
    for each."""
    grpo = {"type": "grpo", "data": PROMPTS, "rewards": ["exact_match"]}
    one_group = {**SPEED_TRAIN, "per_device_train_batch_size": 4}  # TRL's shuffle keeps a lone group whole
    stages = [{"name": "packed", **grpo, "train": {**SPEED_TRAIN, "beta": 0.1}},
              {"name": "no_prefix", **grpo, "variant": "dr_grpo", "unsloth": {"shared_prefix_attention": False},
               "train": one_group},
              {"name": "exact", **grpo, "train": one_group,
               "unsloth": {"sequence_packing": False, "shared_prefix_attention": False}}]
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", stages), "--output", tmp_path / "run")
    run = tmp_path / "run"
    packed, no_prefix, exact = (done(run / name) for name in ("packed", "no_prefix", "exact"))
    assert packed["kl_metric"].startswith("token-weighted mean over completion tokens")
    assert all("kl" in row for row in metrics(run / "packed") if "reward" in row)
    assert not any("kl" in row for row in metrics(run / "no_prefix"))
    report = (run / "report.md").read_text()
    assert "- kl: token-weighted mean over completion tokens" in report
    notes = {"no_prefix": "stage 'no_prefix': note: unsloth: shared_prefix_attention: false does nothing here: this "
                          "stage trains with TRL's GRPOTrainer",
             "exact": "stage 'exact': note: unsloth: sequence_packing: false, shared_prefix_attention: false does "
                      "nothing here"}
    if trainer_family == "trl":
        assert all(note in result.output for note in notes.values()), result.output
        assert {p["setting"] for d in (packed, no_prefix, exact) for p in d["speed_paths"].values()} == \
            {"not in TRL's GRPOTrainer"}
        return
    assert not any(note in result.output for note in notes.values())
    packing, prefix = packed["speed_paths"]["sequence_packing"], packed["speed_paths"]["shared_prefix_attention"]
    assert packing["setting"] == prefix["setting"] == "on"
    assert packing["used"] and packing["checks"] >= 2 and packing["max_difference"] < 0.7, packing
    assert prefix["checks"] >= 1 and prefix["used"] == (prefix["max_difference"] < 0.7), prefix
    packing, prefix = no_prefix["speed_paths"]["sequence_packing"], no_prefix["speed_paths"]["shared_prefix_attention"]
    assert packing["setting"] == "on" and packing["used"] and packing["checks"] >= 1, packing
    assert (prefix["setting"], prefix["used"], prefix["checks"]) == ("off (recipe)", False, 0), prefix
    for path in exact["speed_paths"].values():
        assert (path["setting"], path["used"], path["checks"]) == ("off (recipe)", False, 0), path
    assert "exact: Unsloth's speed paths: sequence packing off (recipe), shared-prefix attention (PrefixGrouper) " \
           "off (recipe)" in result.output
    assert "- sequence packing: used (setting: on); Unsloth's self-check: largest log-prob difference" in report
    assert "- sequence packing: not used (setting: off (recipe))" in report


def speed_recipe(tmp_path: Path, unsloth) -> Path:
    stage = {"name": "rl", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"], "unsloth": unsloth}
    return write_recipe(tmp_path / "r.yaml", [stage])


@pytest.mark.parametrize("unsloth, message", [
    ({"sequence_packng": False},
     "stage 'rl': unsloth: unknown key 'sequence_packng'; did you mean 'sequence_packing'?"),
    ({"sequence_packing": False, "shared_prefix_attention": True},
     "stage 'rl': unsloth: shared_prefix_attention needs sequence_packing"),
    ({"sequence_packing": "no"}, "stage 'rl': unsloth.sequence_packing must be"),
])
def test_unsloth_keys_are_validated(tmp_path, unsloth, message):
    with pytest.raises(KitError) as raised:
        load_recipe(str(speed_recipe(tmp_path, unsloth)))
    assert message in raised.value.message, raised.value.message


def test_unsloth_key_belongs_to_grpo_and_gspo_stages(tmp_path):
    stage = {"name": "pairs", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"),
             "unsloth": {"sequence_packing": False}}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]), expect=2)
    assert "stage 'pairs': unknown key 'unsloth'" in result.output, result.output


def test_kit_check_names_the_settings_that_trade_exactness_for_speed(tmp_path):
    from kitcli.run.check import check_recipe

    recipe = load_recipe(str(write_recipe(tmp_path / "r.yaml", [
        {"name": "fast", "type": "gspo", "data": PROMPTS, "rewards": ["exact_match"]},
        {"name": "half", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
         "unsloth": {"shared_prefix_attention": False}},
        {"name": "exact", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
         "unsloth": {"sequence_packing": False, "shared_prefix_attention": False}},
        {"name": "sampled", "type": "rloo", "data": PROMPTS, "rewards": ["exact_match"]}])))
    rows = {f.stage: f for f in check_recipe(recipe) if f.topic == "exactness vs speed"}
    assert set(rows) == {"fast", "half", "exact"}  # rloo: TRL's loss on both families, no speed paths
    assert rows["fast"].level == "info" and "sequence packing on, shared-prefix attention (PrefixGrouper) on" in \
        rows["fast"].figures
    assert "unsloth: {sequence_packing: false, shared_prefix_attention: false}" in rows["fast"].verdict
    assert rows["half"].level == "info" and "unsloth: {sequence_packing: false}" in rows["half"].verdict
    assert rows["exact"].level == "ok" and "padded forward" in rows["exact"].verdict


def test_unsloth_self_check_lines_are_recorded():
    """The lines Unsloth prints under UNSLOTH_ENABLE_LOGGING, as the generated code writes them, read into the
    record: a verify line is a check with its difference, anything else an event."""
    from kitcli.training.unsloth_grpo import SpeedRecord

    record = SpeedRecord({"sequence_packing": "on", "shared_prefix_attention": "on"})
    for line in textwrap.dedent("""\
        [Unsloth] GRPO seq-packing (no-grad) verify: T=387 maxseg=51 packed-vs-perrow max|d|=0.0012
        [Unsloth] GRPO seq-packing (grad) verify: T=387 maxseg=51 packed-vs-perrow max|d|=0.0000
        [Unsloth] GRPO PrefixGrouper (grad) verify: sig=(2, (4, 4)) shared-prefix vs full-row-packed max|d|=11.0244
        [Unsloth] GRPO seq-packing (grad) fell back at T=900 (diff=0.912)""").splitlines():
        record.keep(line)
    summary = record.summary(object())
    assert summary["sequence_packing"]["checks"] == 2 and summary["sequence_packing"]["max_difference"] == 0.0012
    assert summary["sequence_packing"]["events"] == ["seq-packing (grad) fell back at T=900 (diff=0.912)"]
    assert summary["shared_prefix_attention"]["max_difference"] == 11.0244
    assert not summary["sequence_packing"]["used"]  # the model says whether Unsloth kept it; this one says nothing
