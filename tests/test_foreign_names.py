"""Names from other tools (kitcli/recipe/foreign_table.py) through `kit check` and `kit run --dry-run` on real recipe
files: a recipe written with Unsloth's, TRL's and axolotl's names runs the very settings of its twin written in the
kit's own (the resolved recipe and every effective trainer setting equal), each no-op is accepted with one line
saying why, each refused name is one fault naming the kit's spelling, all in one pass; every record of the table
does what it says where a recipe uses it; docs/foreign-names.md lists every record."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from helpers import DATA, run_cli

from kitcli.errors import KitFaults
from kitcli.recipe.foreign_names import CONVERSIONS, page, translate
from kitcli.recipe.foreign_table import FOREIGN_NAMES, MAP, REFUSE
from kitcli.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = str(DATA / "arithmetic_prompts.jsonl")

# An Unsloth GRPO notebook's settings, written as a recipe with the notebook's own names (the tiny model's sizes)
NOTEBOOK = {
    "name": "notebook", "seed": 3407,
    "model": {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True, "dtype": "None", "fast_inference": True,
              "max_lora_rank": 16, "gpu_memory_utilization": 0.6, "random_state": 3407},
    "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "bias": "none",
             "use_gradient_checkpointing": "unsloth", "random_state": 3407, "use_rslora": False,
             "loftq_config": "None"},
    "stages": [{"name": "grpo", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
                "train": {"learning_rate": 5e-6, "warmup_ratio": 0.1, "lr_scheduler_type": "cosine",
                          "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
                          "vllm_sampling_params": {"min_p": 0.1, "top_p": 0.9, "top_k": -1, "seed": 3407},
                          "max_steps": 2, "save_steps": 2}}]}
# The same recipe in the kit's own names
KIT_TWIN = {
    "name": "notebook", "seed": 3407,
    "model": {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True, "dtype": "auto"},
    "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
    "stages": [{"name": "grpo", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"],
                "train": {"learning_rate": 5e-6, "warmup_steps": 0.1, "lr_scheduler_type": "cosine",
                          "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8,
                          "min_p": 0.1, "top_p": 0.9, "top_k": 0, "max_steps": 2, "save_steps": 2}}]}
NOTEBOOK_NAMES = ["model.dtype", "model.fast_inference", "model.max_lora_rank", "model.gpu_memory_utilization",
                  "model.random_state", "lora.lora_alpha", "lora.lora_dropout", "lora.bias",
                  "lora.use_gradient_checkpointing", "lora.random_state", "lora.use_rslora", "lora.loftq_config",
                  "stage 'grpo': train.warmup_ratio", "stage 'grpo': train.vllm_sampling_params"]


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def dry_run(path: Path) -> tuple[list[str], str]:
    """(the note lines, the rest of the output with the file's name taken out)."""
    output = run_cli("run", path, "--dry-run").output
    notes = [line for line in output.splitlines() if line.startswith("# note: ")]
    rest = [line for line in output.splitlines() if not line.startswith(("# note: ", "# kit check"))]
    return notes, "\n".join(rest).replace(path.name, "RECIPE")


def fault_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if line.startswith("Error: ") and " faults, each on a line" not in line]


def test_a_notebook_recipe_runs_the_settings_of_its_kit_spelled_twin(tmp_path):
    foreign = write(tmp_path / "notebook.yaml", NOTEBOOK)
    twin = write(tmp_path / "twin.yaml", KIT_TWIN)
    assert load_recipe(str(foreign)).lock_dump() == load_recipe(str(twin)).lock_dump()
    notes, resolved = dry_run(foreign)
    twin_notes, twin_resolved = dry_run(twin)
    assert resolved == twin_resolved  # every effective GRPOConfig value, the model and the adapter
    assert "warmup_steps: 0.1" in resolved and "min_p: 0.1" in resolved and "top_k: 0" in resolved
    assert "alpha: 16.0" in resolved and "dropout: 0.05" in resolved  # not the kit's defaults (32, 0.0)
    assert twin_notes == []
    assert len(notes) == len(NOTEBOOK_NAMES), notes  # one line for each foreign name
    for name in NOTEBOOK_NAMES:
        line = next(line for line in notes if f"notebook.yaml: {name}: " in line)
        assert " read as " in line or " ignored: " in line, line


def test_each_no_op_is_accepted_with_what_the_kit_does_instead(tmp_path):
    path = write(tmp_path / "notebook.yaml", NOTEBOOK)
    output = run_cli("check", path).output
    notes = {line.split("notebook.yaml: ", 1)[1].split(": ", 1)[0]: line
             for line in output.splitlines() if line.startswith("note: ")}
    assert "the kit generates with transformers" in notes["model.fast_inference"]
    assert "the recipe's seed (3407)" in notes["lora.random_state"]
    assert "PEFT's default, which the kit passes: no bias is trained" in notes["lora.bias"]
    assert "Unsloth's offloaded checkpointing ('unsloth') on a GPU, none on a CPU" in \
        notes["lora.use_gradient_checkpointing"]
    assert notes["model.dtype"].endswith("read as model.dtype: auto; Unsloth's None detects the dtype, the kit's "
                                         "auto [Unsloth from_pretrained]")


def test_refused_names_are_all_faults_in_one_pass_each_naming_the_kits_spelling(tmp_path):
    recipe = copy.deepcopy(NOTEBOOK)
    recipe["lora"].update(bias="all", use_rslora=True)
    recipe["stages"][0].update(ref_model="base", reward_funcs=["accuracy"])
    recipe["stages"][0]["train"].update(max_prompt_length=64, warmup_ratio=1.5)
    dpo = {"name": "dpo", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"),
           "train": {"max_completion_length": 8, "max_steps": 2}}
    recipe["stages"].append(dpo)
    path = write(tmp_path / "refused.yaml", recipe)
    result = run_cli("check", path, expect=2)
    faults = fault_lines(result.output)
    expected = {"lora.bias: all": "bias: none", "lora.use_rslora: true": "lora.alpha",
                "stage 'grpo': ref_model: base": "init:", "stage 'grpo': reward_funcs: [\"accuracy\"]": "rewards:",
                "stage 'grpo': train.max_prompt_length: 64": "train.max_length",
                "stage 'grpo': train.warmup_ratio: 1.5": "train.warmup_steps: N",
                "stage 'dpo': train.max_completion_length: 8": "train.max_length"}
    assert len(faults) == len(expected), faults
    for place, spelling in expected.items():
        line = next((f for f in faults if f"{path.name}: {place}" in f), None)
        assert line is not None and spelling in line, (place, faults)
    assert "did you mean" not in result.output  # a rename is never left to a guess


def test_a_name_is_the_kits_own_where_the_stage_has_it_and_foreign_where_it_does_not():
    recipe = copy.deepcopy(KIT_TWIN)
    recipe["stages"].append({"name": "dpo", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"),
                             "train": {"max_completion_length": 8, "max_seq_length": 64}})
    recipe["stages"][0]["train"]["max_seq_length"] = 96  # GRPOConfig has no max_length: the model's length
    recipe["model"]["dtype"] = "bfloat16"  # the kit's own value: left alone, no note
    translated, handled = translate(recipe)
    assert translated["stages"][0]["train"]["max_completion_length"] == 8  # GRPOConfig's own
    assert "max_completion_length" not in translated["stages"][1]["train"]  # DPOConfig lacks it: refused
    assert translated["stages"][1]["train"]["max_length"] == 64  # SFT/DPO: TRL renamed it max_length
    assert [(h.where, h.does) for h in handled] == [
        ("stage 'grpo': train.max_seq_length", "refuse"),  # model.max_seq_length is 128 already: both named
        ("stage 'dpo': train.max_completion_length", "refuse"), ("stage 'dpo': train.max_seq_length", "map")]
    assert "means model.max_seq_length: 96, but the recipe sets model.max_seq_length: 128" in handled[0].line
    assert translated["model"]["dtype"] == "bfloat16"


def test_a_mapped_value_never_silently_replaces_the_one_the_recipe_gives():
    recipe = copy.deepcopy(KIT_TWIN)
    recipe["lora"]["lora_alpha"] = 64
    recipe["stages"][0]["train"]["warmup_ratio"] = 0.2
    _, handled = translate(recipe)
    assert [h.does for h in handled] == ["refuse", "refuse"]
    assert "lora.lora_alpha: 64 means lora.alpha: 64, but the recipe sets lora.alpha: 16" in handled[0].line
    assert "means train.warmup_steps: 0.2, but the recipe sets train.warmup_steps: 0.1" in handled[1].line
    same = copy.deepcopy(KIT_TWIN)
    same["lora"]["lora_alpha"] = 16  # the same value twice: read, with its note
    assert [h.does for h in translate(same)[1]] == ["map"]


# --- every record, where a recipe would use it ---------------------------------------------------------------------

STAGES = {"sft": {"name": "s", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl")},
          "grpo": {"name": "s", "type": "grpo", "data": PROMPTS, "rewards": ["exact_match"]},
          "dpo": {"name": "s", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl")},
          "kto": {"name": "s", "type": "kto", "data": str(DATA / "arithmetic_prefs.jsonl")}}
# a value each mapped target takes (the record's own values come first)
SAMPLES = {"model.name": "tiny", "model.max_seq_length": 64, "model.dtype": "bfloat16", "model.load_in_4bit": True,
           "model.trust_remote_code": False, "model.chat_template": "chatml", "lora.r": 4, "lora.alpha": 8,
           "lora.dropout": 0.1, "lora.target_modules": ["q_proj"], "stage.data.path": PROMPTS,
           "stage.data.config": "main", "stage.data.split": "train", "stage.data.columns": "question",
           "stage.system_prompt": "Be brief.", "stage.eval_fraction": 0.2, "train": {"min_p": 0.1},
           "train.warmup_steps": 0.1, "train.eval_strategy": "no", "train.per_device_train_batch_size": 4,
           "train.per_device_eval_batch_size": 4, "train.hub_model_id": "me/model", "train.use_liger_kernel": False,
           "train.max_length": 64, "train.vllm_max_model_length": 64, "train.vllm_structured_outputs_regex": "[0-9]+",
           "train.num_train_epochs": 2, "train.learning_rate": 1e-4, "train.optim": "adamw_torch_fused",
           "train.lr_scheduler_type": "cosine", "train.dataset_num_proc": 1, "train.packing": True,
           "train.eval_packing": True, "train.beta": 0.2, "train.desirable_weight": 1.5,
           "train.undesirable_weight": 1.5, "train.log_unique_prompts": True, "train.use_cpu": True}


BY_KEY = {"lora_target_linear": True, "sample_packing": True, "eval_sample_packing": True, "train_on_inputs": True,
          "dataset_configs": ["main"], "chat_template_jinja": "{% for m in messages %}{{ m.content }}{% endfor %}"}


def case(record, key: str) -> tuple[dict, str]:
    """A recipe using `key` where `record` reads it, with a value the record covers, and the stage type used."""
    place = record.at()[0]
    target = record.targets()[0] if record.targets() else ""
    value = record.values[0] if record.values else BY_KEY.get(key, SAMPLES.get(target, "x")) \
        if record.does == MAP else "x"
    kind = next(t for t in ("sft", "grpo", "dpo", "kto") if record.does != MAP or t in fits_for(target))
    recipe = {"name": "case", "model": {"name": "tiny"}, "lora": {}, "stages": [copy.deepcopy(STAGES[kind])]}
    section = {"top": recipe, "model": recipe["model"], "lora": recipe["lora"], "stage": recipe["stages"][0],
               "train": recipe["stages"][0].setdefault("train", {})}[place]
    if key in section:  # a kit key with a foreign value (model.name is given): only the value is foreign
        section.pop(key)
    section[key] = value
    if target == "stage.data.path":
        recipe["stages"][0].pop("data")
    return recipe, kind


def fits_for(target: str) -> set[str]:
    owners = {"train.packing": {"sft"}, "train.eval_packing": {"sft"}, "train.max_length": {"sft", "dpo", "kto"},
              "stage.eval_fraction": {"dpo", "kto"}, "train.beta": {"dpo", "kto", "grpo"},
              "train.desirable_weight": {"kto"}, "train.undesirable_weight": {"kto"}, "train": {"grpo"},
              "train.vllm_max_model_length": {"grpo"}, "train.vllm_structured_outputs_regex": {"grpo"},
              "train.log_unique_prompts": {"grpo"}, "train.dataset_num_proc": {"sft", "dpo", "kto"},
              "train.completion_only_loss": {"sft"}}
    return owners.get(target, {"sft", "grpo", "dpo", "kto"})


CASES = [(record, key) for record in FOREIGN_NAMES for key in record.names()]


@pytest.mark.parametrize(("record", "key"), CASES,
                         ids=[f"{key}@{record.at()[0]}-{record.does}-{index}" for index, (record, key)
                              in enumerate(CASES)])
def test_every_record_does_what_the_table_says(tmp_path, record, key):
    recipe, _ = case(record, key)
    path = write(tmp_path / "case.yaml", recipe)
    if record.does == REFUSE:
        with pytest.raises(KitFaults) as raised:  # what `kit check` and `kit run` print, one line each
            load_recipe(str(path))
        assert len(raised.value.lines) == 1, raised.value.lines
        line = raised.value.lines[0]
        assert f" {key}: " in line or f".{key}: " in line, line
        spelled = [t.removeprefix("stage.").removeprefix("train.") for t in record.targets()]
        assert any(s in line for s in spelled) or "remove it" in line, line
        return
    loaded = load_recipe(str(path))  # valid: the schema takes what the name became
    mine = [n for n in loaded.notes if f" {key}: " in n or f".{key}: " in n]
    assert len(mine) == len(loaded.notes) == 1, loaded.notes
    if record.does == MAP and record.targets()[0] != "-":
        target, value = record.targets()[0], recipe_value(recipe, record, key)
        expected = CONVERSIONS[record.convert](value) if record.convert else value
        assert " read as " in mine[0]
        data = loaded.typed.model_dump()
        assert resolved(data, target) == expected or resolved(data, target) == pytest.approx(expected)
    else:
        assert " ignored: " in mine[0]


def recipe_value(recipe: dict, record, key: str):
    place = record.at()[0]
    section = {"top": recipe, "model": recipe["model"], "lora": recipe["lora"], "stage": recipe["stages"][0],
               "train": recipe["stages"][0].get("train", {})}[place]
    return section[key]


def resolved(data: dict, target: str):
    """The value at a mapped target in a loaded recipe's data."""
    stage = data["stages"][0]
    if target == "lora":
        return data["lora"] is not None
    if target == "train":
        return {k: stage["train"][k] for k in ("min_p",)}
    head, _, rest = target.partition(".")
    if head in ("model", "lora"):
        return data[head][rest]
    if head == "train":
        return stage["train"][rest]
    if rest.startswith("data."):
        return stage["data"][rest.removeprefix("data.")]
    return stage[rest]


def test_the_table_is_consistent():
    """Each refusal names the kit's spelling (or says to remove the name); each conversion exists; a name has one
    record for any value at most per place, and it comes last (after the records for single values)."""
    for record in FOREIGN_NAMES:
        assert record.does in ("map", "ignore", "refuse")
        assert not record.convert or record.convert in CONVERSIONS, record
        if record.does == REFUSE:
            spelled = [t.removeprefix("stage.") for t in record.targets()]
            assert any(s in record.why for s in spelled) or "remove it" in record.why, record
        if record.does == MAP:
            assert record.targets(), record
    for record in FOREIGN_NAMES:
        for key in record.names():
            for place in record.at():
                mine = [r for r in FOREIGN_NAMES if key in r.names() and place in r.at()]
                catch_all = [r for r in mine if r.values is None]
                assert len(catch_all) <= 1 and (not catch_all or mine[-1] is catch_all[0]), (key, place)


def test_the_docs_page_lists_every_entry():
    text = (ROOT / "docs" / "foreign-names.md").read_text()
    assert text == page(), ("docs/foreign-names.md is not the table's page; regenerate it: .venv/bin/python -c "
                            "\"from kitcli.recipe.foreign_names import page; print(page(), end='')\" > "
                            "docs/foreign-names.md")
    for record in FOREIGN_NAMES:
        for key in record.names():
            assert f"`{key}`" in text, key
    assert "foreign-names.md" in (ROOT / "docs" / "recipe-format.md").read_text()
