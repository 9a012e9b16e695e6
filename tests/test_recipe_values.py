"""Every value is checked before anything runs.

- For every numeric `train:` field a shipped recipe sets, a value of the wrong type and one out of range are refused
  with exit status 2, one line naming the key, and nothing run or written: every field of a recipe at once, each
  named on its own line in the one pass.
- A seeded mutation test: 240 mutations of the shipped recipes (a key deleted, a key misspelled, a value's type
  swapped, a number negated) through `kit run --dry-run`; every outcome is exit 2 with one `Error:` line and no
  traceback, or a dry run that succeeds.
- The JSON Schema `kit recipes schema` prints accepts every shipped recipe and flags a wrong value.
- Validating a recipe imports no heavy module, and a zero-step stage is an error, not a DONE marker.
"""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import DATA, run_cli, write_recipe

from kitcli.recipe.load import parse_yaml, shipped_recipes
from kitcli.recipe.stage_types import specs

ROOT = Path(__file__).resolve().parent.parent


def numeric_train_fields() -> list[tuple[str, str, str, object]]:
    """(recipe, stage, field, value) for every numeric train: value a shipped recipe sets."""
    found = []
    for name, path in sorted(shipped_recipes().items()):
        for stage in parse_yaml(path.read_text())["stages"]:
            for key, value in (stage.get("train") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found.append((name, stage["name"], key, value))
    return found


FIELDS = numeric_train_fields()


def out_of_range(section, key: str, value) -> object | None:
    """A value of the field's type outside the kit's range for it (None when the field has no range)."""
    bounds = section.train_ranges.get(key)
    if bounds is None:
        return None
    if bounds.low is not None:
        below = bounds.low - (1 if isinstance(value, int) else 0.5)
        return below if not bounds.low_open else bounds.low
    return bounds.high + 1


def test_every_numeric_field_of_the_shipped_recipes_is_covered():
    assert len(FIELDS) >= 60
    uncovered = [(r, s, k) for r, s, k, v in FIELDS if out_of_range(config_of(r, s), k, v) is None]
    assert not uncovered, f"no range for {uncovered}"


def config_of(recipe: str, stage_name: str):
    """The stage's section: its config's fields are checked against the section's ranges."""
    stage = next(s for s in parse_yaml(shipped_recipes()[recipe].read_text())["stages"] if s["name"] == stage_name)
    return specs()[stage["type"]].section


def refused(tmp_path: Path, recipe: str, settings: dict[str, object]) -> list[str]:
    """`kit run RECIPE --set KEY=VALUE ...` with every setting at once: its fault lines (one per fault, then the line
    that counts them), after checking that it exited 2 with no traceback and wrote nothing."""
    run_dir = tmp_path / "run"
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    result = run_cli("run", recipe, "--output", run_dir, *overrides, expect=None)
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert not run_dir.exists()  # nothing ran, nothing was written
    if len(settings) > 1:
        assert errors[-1].endswith(f"{len(settings)} faults, each on a line above; fix them all, then "
                                   f"`kit check {shipped_recipes()[recipe]}` again"), result.output
        errors = errors[:-1]
    assert len(errors) == len(settings), result.output  # one line per bad value, none for the values left alone
    return errors


def fields_by_recipe() -> dict[str, list[tuple[str, str, object]]]:
    by_recipe: dict[str, list[tuple[str, str, object]]] = {}
    for recipe, stage, key, value in FIELDS:
        by_recipe.setdefault(recipe, []).append((stage, key, value))
    return by_recipe


RECIPE_FIELDS = fields_by_recipe()


def line_for(errors: list[str], stage: str, key: str) -> str:
    lines = [line for line in errors if f"stage '{stage}'" in line and f"train.{key} must be" in line]
    assert len(lines) == 1, (stage, key, errors)
    return lines[0]


@pytest.mark.parametrize("recipe", sorted(RECIPE_FIELDS))
def test_a_wrong_type_is_refused(tmp_path, recipe):
    """Every numeric train: field of the recipe given a string, all at once: one line each, in one pass."""
    fields = RECIPE_FIELDS[recipe]
    errors = refused(tmp_path, recipe, {f"stages.{stage}.train.{key}": "not-a-number" for stage, key, _ in fields})
    for stage, key, _ in fields:
        assert "got 'not-a-number'" in line_for(errors, stage, key)


@pytest.mark.parametrize("recipe", sorted(RECIPE_FIELDS))
def test_a_value_out_of_range_is_refused(tmp_path, recipe):
    """Every numeric train: field of the recipe just outside the kit's range for it, all at once: one line each."""
    fields = [(stage, key, out_of_range(config_of(recipe, stage), key, value))
              for stage, key, value in RECIPE_FIELDS[recipe]]
    errors = refused(tmp_path, recipe, {f"stages.{stage}.train.{key}": bad for stage, key, bad in fields})
    for stage, key, bad in fields:
        assert f"got {bad!r}" in line_for(errors, stage, key)


# --- mutations ------------------------------------------------------------------------------------------------

def paths(node, prefix=()) -> list[tuple]:
    """Every key path of a YAML tree (list items by index)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        out.append((*prefix, key))
        out += paths(value, (*prefix, key))
    return out


def mutate(tree: dict, rng: random.Random) -> tuple[dict, str]:
    tree = copy.deepcopy(tree)
    path = rng.choice([p for p in paths(tree) if p])
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    value = parent[key]
    kind = rng.choice(["delete", "misspell", "swap", "negate"])
    if kind == "delete":
        del parent[key]
    elif kind == "misspell" and isinstance(key, str):
        parent[key[:-1] + rng.choice("xyz") if len(key) > 1 else key + "x"] = parent.pop(key)
    elif kind == "negate" and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = -value if value else -1
    else:
        kind = "swap"
        parent[key] = rng.choice(["text", 3, 2.5, True, None, [1], {"a": 1}])
    return tree, f"{kind} {'.'.join(map(str, path))}"


MUTATIONS = 240


@pytest.mark.slow
def test_seeded_mutations_never_produce_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # shipped recipes name data relative to the checkout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = random.Random(20261203)
    recipes = {name: parse_yaml(path.read_text()) for name, path in sorted(shipped_recipes().items())}
    outcomes = {"refused": 0, "valid": 0}
    for number in range(MUTATIONS):
        name = rng.choice(sorted(recipes))
        tree, what = mutate(recipes[name], rng)
        path = tmp_path / f"{name}-{number}.yaml"
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        result = run_cli("run", path, "--dry-run", expect=None)
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert "Traceback" not in result.output, (name, what, result.output)
        assert result.exit_code in (0, 2), (name, what, result.exit_code, result.output[-2000:], result.exception)
        if result.exit_code == 2:  # one line per fault (a mutation may make two), and then how many there were
            faults = errors[:-1] if len(errors) > 1 else errors
            assert all(line.startswith(f"Error: {path}") or line.startswith("Error: ") and ": " in line[7:]
                       for line in errors), (name, what, result.output)
            if len(errors) > 1:
                assert errors[-1].endswith(f"{len(faults)} faults, each on a line above; fix them all, then "
                                           f"`kit check {path}` again"), (name, what, result.output)
            outcomes["refused"] += 1
        else:
            outcomes["valid"] += 1
    assert outcomes["refused"] > MUTATIONS // 3 and outcomes["valid"] > 0, outcomes


# --- the JSON Schema ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(run_cli("recipes", "schema").output)


def test_every_shipped_recipe_fits_the_schema(schema):
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    for name, path in shipped_recipes().items():
        errors = [e.message for e in validator.iter_errors(parse_yaml(path.read_text()))]
        assert not errors, (name, errors[:3])


@pytest.mark.parametrize("change", [
    lambda r: r["stages"][1]["train"].update(learning_rate="fast"),
    lambda r: r["stages"][1]["train"].update(per_device_train_batch_size=0),
    lambda r: r["stages"][1]["train"].update(learning_rat=1e-4),
    lambda r: r["lora"].update(rank=8),
    lambda r: r["model"].update(load_in_4bit="maybe"),
    lambda r: r["stages"][0].update(type="sftt"),
], ids=["string-lr", "zero-batch", "unknown-field", "unknown-lora-key", "string-bool", "unknown-type"])
def test_the_schema_flags_what_the_kit_refuses(schema, change):
    import jsonschema

    recipe = parse_yaml(shipped_recipes()["tiny-sft"].read_text())
    change(recipe)
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(recipe))


def test_validating_a_recipe_imports_nothing_heavy():
    code = ("import sys, time\nfrom kitcli.recipe.load import load_recipe\nstarted = time.perf_counter()\n"
            "for name in ('tiny-ppo', 'tiny-grpo', 'qwen3-4b-grpo'):\n    load_recipe(name)\n"
            "print(time.perf_counter() - started)\n"
            "heavy = [m for m in ('torch', 'transformers', 'trl', 'peft', 'unsloth') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip()) < 5.0


def test_a_stage_that_would_train_nothing_is_refused(tmp_path):
    """GRPO draws whole generation batches: 2 prompts cannot fill one of 8 prompts, so it would train 0 steps."""
    stage = {"name": "grpo", "type": "grpo", "data": {"path": str(DATA / "arithmetic_prompts.jsonl"), "limit": 2},
             "rewards": ["exact_match"], "train": {"per_device_train_batch_size": 32, "num_generations": 4,
                                                   "max_completion_length": 2, "num_train_epochs": 1}}
    recipe = write_recipe(tmp_path / "r.yaml", [stage])
    result = run_cli("run", recipe, "--output", tmp_path / "run", expect=2)
    message = result.output.strip().splitlines()[-1]
    assert "would run zero optimizer steps" in message and "has 2 prompts, fewer than the 8" in message
    assert not (tmp_path / "run").exists()  # refused before anything ran


@pytest.mark.parametrize("on_gpu, expected", [(False, "no"), (True, "bf16")])
def test_the_config_s_precision_is_the_kit_s_not_the_environment_s(on_gpu, expected, tmp_path, monkeypatch,
                                                                   unsloth_cpu_bf16):
    """transformers 5 reads ACCELERATE_MIXED_PRECISION (set by `accelerate launch`, a shell, or an earlier trainer
    in the process) into any config whose bf16 and fp16 are both off: a float32 CPU run would autocast in bf16 while
    its config.json said bf16 false. The kit's config holds the precision it asked for, whatever the environment,
    and on every CPU: Unsloth's CPU backend turns bf16 off where the CPU has no native bf16, and the kit's
    mixed_precision is derived after it puts bf16 back (on_gpu=True with a CPU is the GPU-precision emulation)."""
    import torch

    from kitcli.recipe import stage_types
    from kitcli.training.trainers import config_class
    from kitcli.training.trl_config import build_config

    if on_gpu and not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # no CUDA here: the GPU's answer
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    config = build_config(config_class(stage_types.spec("dpo")), stage_defaults={}, train={}, where="t",
                          output_dir=tmp_path, seed=0, on_gpu=on_gpu)
    assert (config.bf16, config.mixed_precision) == (on_gpu, expected)


def test_the_choices_a_config_declares_are_read_from_it(tmp_path):
    """TRL declares SFTConfig.loss_type's choices in its field metadata (nll, dft, chunked_nll): the kit reads them
    there, so a choice TRL adds is accepted without a table of the kit's to update, and a wrong one names them."""
    from kitcli.recipe import stage_types
    from kitcli.recipe.config_fields import config_fields

    declared = config_fields(stage_types.spec("sft").config)["loss_type"].choices
    assert declared is not None and "chunked_nll" in declared
    stage = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
             "train": {"loss_type": "chunked_nll", "max_steps": 2}}
    run_cli("check", write_recipe(tmp_path / "r.yaml", [stage]))
    bad = write_recipe(tmp_path / "r.yaml", [{**stage, "train": {"loss_type": "nlx", "max_steps": 2}}])
    line = run_cli("check", bad, expect=2).output.strip().splitlines()[-1]
    assert f"train.loss_type must be one of {', '.join(declared)}, got 'nlx'" in line, line
