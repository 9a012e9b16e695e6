"""`kit import FILE`: configs in the shapes people publish (an open-r1 GRPO demo and an OpenR1-Distill SFT config
in the TRL CLI's flat YAML, an axolotl QLoRA KTO example), written here for the tiny model and the kit's own data,
become recipes that name their source, account for every key (read as the kit's with a comment naming the source
key, or in a closing comment saying why not), pass `kit check` and dry-run with the source's values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import DATA, fails, run_cli

from kitcli.recipe.load import load_recipe

# open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml, on the tiny model and the kit's prompts
OPEN_R1_GRPO = {
    "model_name_or_path": "tiny", "model_revision": "main", "torch_dtype": "float32",
    "attn_implementation": "sdpa", "dataset_name": str(DATA / "arithmetic_prompts.jsonl"),
    "dataset_prompt_column": "prompt", "system_prompt": "Answer with the number only.",
    "bf16": False, "use_vllm": False, "do_eval": False, "gradient_accumulation_steps": 1,
    "gradient_checkpointing": False, "learning_rate": 2.0e-05, "log_completions": False, "log_level": "info",
    "logging_first_step": True, "logging_steps": 1, "logging_strategy": "steps", "lr_scheduler_type": "cosine",
    "max_prompt_length": 64, "max_completion_length": 8, "max_steps": 2, "num_generations": 4,
    "num_train_epochs": 1, "output_dir": "data/tiny-GRPO", "overwrite_output_dir": True,
    "per_device_eval_batch_size": 8, "per_device_train_batch_size": 8, "push_to_hub": False, "report_to": "none",
    "reward_funcs": ["rewards.builtin.exact_match", "think_format_reward"], "reward_weights": [1.0, 0.5],
    "save_strategy": "no", "seed": 7, "warmup_ratio": 0.1, "wandb_log_unique_prompts": True}
# open-r1's OpenR1-Distill SFT shape, with PEFT (the TRL CLI's use_peft and lora_* arguments)
OPEN_R1_SFT = {
    "model_name_or_path": "tiny", "torch_dtype": "float32", "dataset_name": str(DATA / "arithmetic_sft.jsonl"),
    "dataset_num_proc": 1, "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj", "v_proj"],
    "bf16": False, "do_eval": False, "eval_strategy": "no", "gradient_accumulation_steps": 2,
    "gradient_checkpointing": False, "learning_rate": 4.0e-05, "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "packing": False, "max_seq_length": 96, "max_steps": 2,
    "num_train_epochs": 1, "output_dir": "data/tiny-sft", "per_device_train_batch_size": 4, "report_to": "none",
    "save_strategy": "no", "seed": 42, "use_liger": False, "warmup_ratio": 0.05}
# axolotl's examples/llama-3/qlora-1b-kto.yaml, on the tiny model and the kit's preference pairs
AXOLOTL_KTO = {
    "base_model": "tiny", "load_in_8bit": False, "load_in_4bit": True, "strict": False, "rl": "kto",
    "rl_beta": 0.5, "kto_desirable_weight": 1.0,
    "datasets": [{"path": str(DATA / "arithmetic_prefs.jsonl"), "type": "chatml.argilla", "split": "train"}],
    "dataset_prepared_path": "last_run_prepared", "val_set_size": 0.1, "output_dir": "./outputs/qlora-out",
    "remove_unused_columns": False, "adapter": "qlora", "lora_model_dir": None, "sequence_len": 128,
    "sample_packing": False, "eval_sample_packing": False, "pad_to_sequence_len": False, "lora_r": 8,
    "lora_alpha": 16, "lora_dropout": 0.05, "lora_target_linear": True, "lora_fan_in_fan_out": None,
    "wandb_project": None, "wandb_entity": None, "gradient_accumulation_steps": 1, "micro_batch_size": 8,
    "num_epochs": 1, "max_steps": 2, "optimizer": "adamw_torch_fused", "lr_scheduler": "cosine",
    "learning_rate": 0.0002, "train_on_inputs": False, "group_by_length": False, "bf16": "auto", "fp16": None,
    "tf32": False, "gradient_checkpointing": False, "early_stopping_patience": None, "resume_from_checkpoint": None,
    "logging_steps": 1, "xformers_attention": None, "flash_attention": False, "warmup_steps": 1,
    "evals_per_epoch": None, "eval_max_new_tokens": 128, "saves_per_epoch": None, "weight_decay": 0.0,
    "special_tokens": None}


def imported(tmp_path: Path, config: dict, *options: str) -> tuple[Path, Path, str]:
    source = tmp_path / "source.yaml"
    source.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "recipe.yaml"
    run_cli("import", source, "-o", out, *options)
    return source, out, out.read_text()


def unaccounted(config: dict, text: str) -> list[str]:
    """Source keys the recipe neither carries under the same name nor names in a comment (read from it, or not
    carried over and why)."""
    recipe = yaml.safe_load(text)
    train = recipe["stages"][0].get("train", {})
    comments = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    return [key for key in config if key not in train and key not in recipe
            and not re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", comments)]


def dry_run(path: Path) -> str:
    return run_cli("run", path, "--dry-run").output


def test_an_open_r1_grpo_config_becomes_a_recipe_that_checks_and_runs_its_settings(tmp_path):
    source, out, text = imported(tmp_path, OPEN_R1_GRPO)
    assert text.startswith(f"# kit run {out}\n# Imported by `kit import` from {source} (TRL CLI config); stage type "
                           f"grpo: from reward_funcs")
    assert unaccounted(OPEN_R1_GRPO, text) == []
    assert "#   max_prompt_length: 64 -- not the kit's: TRL 1.x truncates no prompts" in text
    assert "warmup_steps: 0.1  # <- warmup_ratio: 0.1" in text
    run_cli("check", out)
    recipe = load_recipe(str(out)).typed.model_dump(exclude_unset=True)
    stage = recipe["stages"][0]
    assert (stage["type"], recipe["seed"], recipe["lora"], recipe["model"]["dtype"]) == ("grpo", 7, None, "float32")
    assert stage["rewards"] == [{"name": "rewards.builtin:exact_match", "weight": 1.0},
                                {"name": "trl.rewards:think_format_reward", "weight": 0.5}]
    assert stage["system_prompt"] == "Answer with the number only."
    resolved = dry_run(out)
    for setting in ("learning_rate: 2.0e-05", "warmup_steps: 0.1", "num_generations: 4", "max_completion_length: 8",
                    "lr_scheduler_type: cosine", "log_unique_prompts: true", "reward_weights: [1.0, 0.5]"):
        assert setting in resolved, setting


def test_a_trl_cli_sft_config_with_peft_keeps_the_clis_lora_settings(tmp_path):
    _, out, text = imported(tmp_path, OPEN_R1_SFT)
    assert unaccounted(OPEN_R1_SFT, text) == []
    assert "stage type sft: from packing" in text.splitlines()[1]
    run_cli("check", out)
    recipe = load_recipe(str(out)).typed.model_dump(exclude_unset=True)
    # lora_dropout unset: the TRL CLI's default 0.05 (ModelConfig), not the kit's 0.0
    assert recipe["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    assert "dropout: 0.05  # unset in the source: the TRL CLI's default" in text
    train = recipe["stages"][0]["train"]
    assert (train["max_length"], train["warmup_steps"], train["use_liger_kernel"]) == (96, 0.05, False)
    assert train["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    resolved = dry_run(out)
    assert "max_length: 96" in resolved and "lr_scheduler_type: cosine_with_min_lr" in resolved
    out.unlink()
    _, _, text = imported(tmp_path, {k: v for k, v in OPEN_R1_SFT.items() if k != "lora_target_modules"})
    assert "lora:  # target_modules unset in the source: PEFT's default for the architecture" in text


def test_an_axolotl_kto_config_becomes_a_kto_recipe(tmp_path):
    source, out, text = imported(tmp_path, AXOLOTL_KTO)
    assert text.splitlines()[1] == \
        f"# Imported by `kit import` from {source} (axolotl config); stage type kto: rl: kto."
    assert unaccounted(AXOLOTL_KTO, text) == []
    assert "datasets[0].type: chatml.argilla -- axolotl's prompt format" in text
    assert re.search(r"#   empty there: lora_model_dir, lora_fan_in_fan_out, wandb_project", text)
    run_cli("check", out)
    recipe = load_recipe(str(out)).typed.model_dump(exclude_unset=True)
    stage = recipe["stages"][0]
    assert (recipe["model"]["load_in_4bit"], recipe["model"]["max_seq_length"]) == (True, 128)
    assert re.search(r"load_in_4bit: true  # <- load_in_4bit: true .*; <- adapter: qlora \[axolotl\]", text)
    assert recipe["lora"] == {"r": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": "all-linear"}
    assert (stage["type"], stage["eval_fraction"], stage["data"]["split"]) == ("kto", 0.1, "train")
    assert {k: stage["train"][k] for k in ("beta", "desirable_weight", "per_device_train_batch_size", "optim",
                                           "lr_scheduler_type", "num_train_epochs")} == {
        "beta": 0.5, "desirable_weight": 1.0, "per_device_train_batch_size": 8, "optim": "adamw_torch_fused",
        "lr_scheduler_type": "cosine", "num_train_epochs": 1}
    assert "beta: 0.5" in dry_run(out)


def test_the_stage_type_comes_from_the_keys_or_is_given(tmp_path):
    dpo = {"model_name_or_path": "tiny", "dataset_name": str(DATA / "arithmetic_prefs.jsonl"), "beta": 0.2,
           "loss_type": ["sigmoid"], "precompute_ref_log_probs": False, "max_steps": 2}
    _, out, text = imported(tmp_path, dpo)
    assert yaml.safe_load(text)["stages"][0]["type"] == "dpo"
    out.unlink()
    _, out, text = imported(tmp_path, dpo, "--type", "orpo")
    assert yaml.safe_load(text)["stages"][0]["type"] == "orpo" and "stage type orpo: --type" in text
    out.unlink()
    ipo = {**{k: v for k, v in AXOLOTL_KTO.items() if not k.startswith("kto_")}, "rl": "ipo"}
    _, out, text = imported(tmp_path, ipo)
    stage = yaml.safe_load(text)["stages"][0]
    assert (stage["type"], stage["train"]["loss_type"]) == ("dpo", ["ipo"])


def test_unknown_and_refused_keys_become_comments_and_the_recipe_still_checks(tmp_path):
    config = {**OPEN_R1_GRPO, "my_own_flag": 3, "ref_model": "gpt2", "lora_r": 8}
    _, out, text = imported(tmp_path, config)
    assert "#   my_own_flag: 3 -- not a GRPOConfig field nor a name the kit knows from another tool" in text
    assert "#   ref_model: gpt2 -- not the kit's: the reference is the stage's starting policy" in text
    # lora_r without use_peft: the TRL CLI trains every weight and never reads it
    assert yaml.safe_load(text)["lora"] is False
    assert "#   lora_r: 8 -- means lora.r: 8, but the recipe sets lora: false (every weight trained)" in text
    run_cli("check", out)


def test_a_file_of_neither_shape_or_an_existing_output_is_one_line(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "x", "model": "tiny", "stages": []}))
    assert "nor an axolotl config" in fails("import", recipe, "-o", tmp_path / "out.yaml")
    source = tmp_path / "source.yaml"
    source.write_text(yaml.safe_dump(OPEN_R1_SFT))
    (tmp_path / "taken.yaml").write_text("mine\n")
    taken = fails("import", source, "-o", tmp_path / "taken.yaml")
    assert "taken.yaml exists; give another --output or --force" in taken
    assert (tmp_path / "taken.yaml").read_text() == "mine\n"
    assert "--type dpx: one of" in fails("import", source, "--type", "dpx", "-o", tmp_path / "o.yaml")


@pytest.mark.slow
def test_an_imported_grpo_recipe_trains(tmp_path):
    _, out, _ = imported(tmp_path, OPEN_R1_GRPO)
    run_dir = tmp_path / "run"
    run_cli("run", out, "-o", run_dir, "--quiet")
    assert (run_dir / "grpo" / "DONE").is_file()
