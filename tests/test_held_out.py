"""Held-out evaluation inside a training stage (`eval:`, kitcli/training/held_out.py): it scores the live policy at
step 0, every N steps and the last, never changes training (bit-identical adapters and equal training metrics with
and without it, SFT and GRPO), keeps the best step's checkpoint through rotation, exports it with `--step best`, and
resumes without duplicating an evaluation. Its bad input is in tests/test_bad_input_catalogue.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import DATA, done, metrics, run_cli, write_recipe

# A reward that scores the third evaluation of a run best (a file per run: a module of its own, counting its calls).
PEAK = """
calls = []
def peak(prompts, completions, **kwargs):
    calls.append(1)
    return [1.0 if len(calls) == 3 else 0.1] * len(completions)
"""
VARIED = """
def varied(prompts, completions, **kwargs):  # a dense reward of the text: it moves as the policy moves
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(map(ord, t)) % 10) / 10 for t in texts]
"""
SFT = {"name": "x", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
       "train": {"max_steps": 4, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "logging_steps": 1,
                 "save_steps": 2}}
GRPO = {"name": "x", "type": "grpo", "variant": "grpo", "data": {"path": str(DATA / "arithmetic_prompts.jsonl"),
                                                                  "limit": 4},
        "rewards": ["exact_match", "varied.py:varied"],  # a dense reward: every group has a spread, the policy moves
        "train": {"per_device_train_batch_size": 4, "num_generations": 4, "steps_per_generation": 2,
                  "max_completion_length": 4, "temperature": 1.0, "learning_rate": 1e-3, "beta": 0.04,
                  "max_steps": 4, "logging_steps": 1, "save_steps": 2}}
HELD_OUT = {"data": str(DATA / "arithmetic_eval.jsonl"), "every": 2, "limit": 6, "generation": {"max_new_tokens": 4}}
CLOCK = ("time", "runtime", "per_second", "seconds", "step_time")


def run(root: Path, stage: dict, **held_out) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "varied.py").write_text(VARIED)
    (root / "peak.py").write_text(PEAK)
    stage = json.loads(json.dumps(stage))
    if held_out:
        stage["eval"] = held_out
    run_cli("run", write_recipe(root / "r.yaml", [stage]), "--output", root / "run")
    return root / "run" / "x"


def training_rows(stage_dir: Path, skip: tuple[str, ...] = CLOCK) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(part in k for part in skip)}
            for row in metrics(stage_dir) if not any(k.startswith("eval/") for k in row)]


def held_out_rows(stage_dir: Path) -> list[dict]:
    return [row for row in metrics(stage_dir) if any(k.startswith("eval/") for k in row)]


def assert_identical_training(with_eval: Path, without: Path) -> None:
    import torch
    from safetensors.torch import load_file

    a = load_file(str(with_eval / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(without / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a), "the adapter is not bit-identical with eval: on"
    assert training_rows(with_eval) == training_rows(without)


@pytest.mark.slow
def test_sft_with_eval_trains_bit_identically_keeps_its_best_checkpoint_and_exports_it(tiny_model_dir, tmp_path):
    """SFT evaluated at every step (a reward as the figure: no answer column) against the same stage without eval:;
    with save_total_limit 1 the best step's checkpoint survives the rotation, and `kit export --stage x --step best`
    writes its adapter."""
    rows = [json.loads(line) for line in (DATA / "arithmetic_eval.jsonl").read_text().splitlines()][:4]
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    stage = {**SFT, "train": {**SFT["train"], "save_steps": 1, "save_total_limit": 1}}
    stage_dir = run(tmp_path / "with", stage, data=str(tmp_path / "held_out.jsonl"), every=1,
                    rewards=[str(tmp_path / "with" / "peak.py") + ":peak"], generation={"max_new_tokens": 2})
    assert_identical_training(stage_dir, run(tmp_path / "without", stage))

    summary = done(stage_dir)
    assert [row["step"] for row in held_out_rows(stage_dir)] == summary["eval_steps"] == [0, 1, 2, 3, 4]
    assert all("eval/rewards/peak" in row and "eval/exact_match" not in row for row in held_out_rows(stage_dir))
    assert summary["eval_metric"] == "reward" and (summary["eval_best"], summary["eval_best_step"]) == (1.0, 2)
    assert summary["eval_best_checkpoint"] == "checkpoint-2"
    kept = sorted(p.name for p in (stage_dir / "checkpoints").glob("checkpoint-*"))
    assert "checkpoint-2" in kept and "checkpoint-1" not in kept and "checkpoint-3" not in kept, kept
    assert summary["eval_seconds_each"] > 0 and 0 < summary["eval_share"] < 1

    out = tmp_path / "best"
    run_cli("export", stage_dir.parent, "--stage", "x", "--step", "best", "--to", "lora", "-o", out)
    checkpoint = stage_dir / "checkpoints" / "checkpoint-2"
    assert (out / "adapter_model.safetensors").read_bytes() == (checkpoint / "adapter_model.safetensors").read_bytes()
    assert "step 2" in (out / "README.md").read_text()
    gone = run_cli("export", stage_dir.parent, "--stage", "x", "--step", "3", "--to", "lora", "-o",
                   tmp_path / "three", expect=2)
    assert "kept no checkpoint of step 3" in gone.output


@pytest.mark.slow
def test_grpo_with_eval_trains_bit_identically_and_resumes_without_repeating_an_evaluation(tiny_model_dir,
                                                                                            tmp_path):
    """GRPO with eval: every 2 (exact match, and a dense reward's mean) against the same stage without it; then
    killed right after its checkpoint at step 2 and resumed: the held-out curve and DONE's best step are the
    uninterrupted run's, each step evaluated once."""
    from test_resume import as_killed_after_checkpoint

    held_out = {**HELD_OUT, "rewards": [str(tmp_path / "whole" / "varied.py") + ":varied"]}
    whole = run(tmp_path / "whole", GRPO, **held_out)
    assert_identical_training(whole, run(tmp_path / "without", GRPO))

    rows = held_out_rows(whole)
    assert [row["step"] for row in rows] == [0, 2, 4]
    assert all(0 <= row["eval/exact_match"] <= 1 and row["eval/seconds"] > 0 and "eval/rewards/varied" in row
               for row in rows)
    summary = done(whole)
    scores = [row["eval/exact_match"] for row in rows]
    assert summary["eval_steps"] == [0, 2, 4] and summary["eval_metric"] == "exact_match"
    assert (summary["eval_first"], summary["eval_last"], summary["eval_best"]) == (scores[0], scores[-1], max(scores))
    assert summary["eval_best_step"] == rows[scores.index(max(scores))]["step"]
    assert "held-out exact match" in summary["headline"]
    assert "held-out evaluation against step" in (whole.parent / "plots" / "x.svg").read_text()

    resumed = tmp_path / "resumed" / "run"
    as_killed_after_checkpoint(whole.parent, resumed, 2)
    result = run_cli("run", tmp_path / "whole" / "r.yaml", "--output", resumed)
    assert "resuming x from checkpoint-2" in result.output
    assert held_out_rows(resumed / "x")[:2] == rows[:2]  # kept from before the kill
    assert [{k: v for k, v in row.items() if not any(c in k for c in CLOCK)} for row in held_out_rows(resumed / "x")] \
        == [{k: v for k, v in row.items() if not any(c in k for c in CLOCK)} for row in rows]
    resumed_rows = training_rows(resumed / "x", (*CLOCK, "train_loss"))  # the mean over this process's steps
    assert resumed_rows == training_rows(whole, (*CLOCK, "train_loss"))
    for key in ("eval_steps", "eval_first", "eval_best", "eval_best_step", "eval_last", "eval_best_checkpoint"):
        assert done(resumed / "x")[key] == summary[key], key


def test_an_evaluation_leaves_the_rngs_and_the_modules_modes_as_it_found_them():
    """What `untouched` puts back after an evaluation: each RNG training draws from (here drawn from and reseeded
    inside, as generate() seeds torch) and each module's train / eval flag (here flipped inside)."""
    import random

    import numpy
    import torch

    from kitcli.training.held_out import untouched

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    model.train()
    model[1].eval()  # a module in another mode than its parent: kept so
    torch.manual_seed(1)
    random.seed(1)
    numpy.random.seed(1)
    expected = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(1)
    random.seed(1)
    numpy.random.seed(1)
    with untouched(model):
        torch.manual_seed(123)
        torch.rand(5), random.random(), numpy.random.rand()
        model.eval()
    after = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]
    assert model.training and model[0].training and not model[1].training


def test_generation_shows_a_progress_bar_on_a_terminal_only():
    import io

    from rich.console import Console

    from kitcli.training.scoring import generation_progress

    shown = io.StringIO()
    with generation_progress(Console(file=shown, force_terminal=True, width=100), 10) as advance:
        advance(4)
        advance(6)
    assert "10/10" in shown.getvalue() and "eta" in shown.getvalue()
    with generation_progress(Console(file=io.StringIO(), force_terminal=False), 10) as advance:
        assert advance is None
    with generation_progress(None, 10) as advance:  # inside a training stage's dashboard
        assert advance is None


def policy_training_types() -> list[str]:
    """Every registered type that trains a policy and takes `eval:` (the registry decides: a new type that accepts
    eval: and never attaches the held-out evaluation goes red here)."""
    from kitcli.recipe.stage_types import builtin_specs

    return [name for name, spec in builtin_specs().items()
            if spec.output == "policy" and not spec.evaluates and "eval" in spec.section.model_fields]


@pytest.mark.slow
@pytest.mark.parametrize("stage_type", policy_training_types())
def test_every_policy_stage_type_scores_its_held_out_rows_at_step_0_every_n_and_the_end(tmp_path, stage_type):
    """Every policy-training stage type evaluates at step 0, every N steps and the last (its stage module wires
    attach_held_out), and DONE names the best step among them."""
    import test_resume

    if stage_type not in test_resume.STAGES:
        pytest.fail(f"{stage_type}: no sample stage; add one to STAGES in tests/test_resume.py", pytrace=False)
    from kitcli.recipe.stage_types import builtin_specs

    stage = {**json.loads(json.dumps(test_resume.STAGES[stage_type])), "name": "x"}
    last = 4 if builtin_specs()[stage_type].groups else 3  # checkpoints of group samplers at whole generation cycles
    stage["train"] = {**stage["train"], "max_steps": last, "logging_steps": 1, "save_steps": last}
    if stage_type == "ppo":
        stage.pop("eval_data")  # eval_data or eval:, not both
    stage_dir = run(tmp_path, stage, **{**HELD_OUT, "every": 2, "limit": 4})
    steps = [row["step"] for row in held_out_rows(stage_dir)]
    summary = done(stage_dir)
    assert steps == [0, 2, last] and summary["eval_steps"] == steps, steps
    scores = {row["step"]: row["eval/exact_match"] for row in held_out_rows(stage_dir)}
    assert summary["eval_best"] == max(scores.values()) and scores[summary["eval_best_step"]] == summary["eval_best"]


def test_kit_check_resolves_the_held_out_section_and_the_lock_fingerprints_its_rows(tmp_path):
    """`kit check` reads the held-out rows and imports their rewards as the stage will (a misspelt reward: exit 2
    with the closest name); the run's lock records the held-out file, so a run whose held-out rows changed is
    another run (refused without --force), not a resume scored on different rows."""
    from kitcli.recipe.load import load_recipe
    from kitcli.run.runner import dataset_fingerprints

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text((DATA / "arithmetic_eval.jsonl").read_text())
    stage = {**SFT, "eval": {"data": "held_out.jsonl", "every": 2, "rewards": ["exact_matc"]}}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]), expect=2)
    assert "stage 'x': eval: rewards[0]: unknown reward 'exact_matc'. Did you mean 'exact_match'?" in result.output
    stage["eval"]["rewards"] = ["exact_match"]
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    assert "held-out eval" in run_cli("check", recipe).output
    before = dataset_fingerprints(load_recipe(str(recipe)))["x.eval.data"]
    held_out.write_text(held_out.read_text().replace('"answer": "', '"answer": "1', 1))
    assert dataset_fingerprints(load_recipe(str(recipe)))["x.eval.data"] != before


def test_a_ppo_stage_takes_eval_data_or_eval_not_both(tmp_path):
    import test_resume

    stage = {**test_resume.STAGES["ppo"], "name": "x", "eval": HELD_OUT}
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [stage]), "--dry-run", expect=2)
    assert "a PPO stage scores eval_data: before and after training and eval: during it" in result.output


def test_kit_check_warns_when_the_best_step_could_have_no_checkpoint(tmp_path):
    stage = {**SFT, "eval": {"data": str(DATA / "arithmetic_eval.jsonl"), "every": 2}}
    stage["train"] = {**SFT["train"], "save_steps": 3}
    result = run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]))
    flat = " ".join(result.output.replace("│", " ").split())
    assert "eval.every 2, train.save_steps 3" in flat and "set train.save_steps to 2" in flat, result.output
    stage["train"]["save_steps"] = 1
    assert "best checkpoint" not in run_cli("check", write_recipe(tmp_path / "r.yaml", [stage])).output
