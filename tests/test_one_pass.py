"""A copied config is fixed in one round (issue 51): `kit check`, `kit run --dry-run` and `kit run` find every fault
of a recipe in one pass, by one code path, one line each grouped by stage, exit 2, before anything is written; what
they pass runs; every value the kit changes from the recipe is a note; the lock reruns its run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import DATA, run_cli, snapshot, write_recipe

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
       "train": {"max_steps": 2, "per_device_train_batch_size": 4, "save_steps": 2}}
GRPO = {"name": "grpo", "type": "grpo", "init": "sft", "data": PROMPTS, "rewards": ["exact_match"],
        "train": {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4,
                  "max_completion_length": 4, "save_steps": 2}}


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error: ")]


def many_faults(tmp_path: Path) -> Path:
    """Seven faults in four places: a model key, a LoRA key, three in SFT's train:, an unknown stage key, a batch
    TRL refuses (found only by building GRPO's config), a DPO init naming no earlier stage."""
    sft = {**SFT, "colour": "red", "train": {**SFT["train"], "learning_rate": -1, "max_stepz": 3}}
    grpo = {**GRPO, "train": {**GRPO["train"], "per_device_train_batch_size": 1}}
    dpo = {"name": "dpo", "type": "dpo", "init": "nowhere", "data": str(DATA / "arithmetic_prefs.jsonl")}
    return write_recipe(tmp_path / "r.yaml", [sft, grpo, dpo], model={"name": "tiny", "max_seq_length": 128,
                                                                      "shade": 1},
                        lora={"r": 8, "alpha": 16, "rank_dropout": 0.1})


@pytest.mark.parametrize("command", [["check"], ["run", "--dry-run"], ["run"]])
def test_every_fault_of_a_recipe_in_one_pass_grouped_by_stage(tmp_path, command):
    recipe = many_faults(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("untouched")
    before = snapshot(tmp_path / "run")
    args = [command[0], recipe, *command[1:]] + (["--output", tmp_path / "run", "--force"] if command == ["run"]
                                                 else [])
    result = run_cli(*args, expect=2)
    lines = error_lines(result.output)
    assert "Traceback" not in result.output
    assert len(lines) == 8, result.output  # seven faults and the line that counts them
    wanted = ["model: unknown key 'shade'", "lora: unknown key 'rank_dropout'",
              "rejected the train settings: train.learning_rate must be > 0, got -1",
              "stage 'sft': train.max_stepz is not a SFTConfig field; did you mean 'max_steps'?",
              "stage 'sft': unknown key 'colour'",
              "stage 'grpo': num_generations 4 does not divide the generation batch of 1 completions",
              "stage 'dpo': init 'nowhere' is not an earlier stage"]
    for line, fragment in zip(lines, wanted[:2]):
        assert fragment in line, (fragment, line)
    found = "\n".join(lines)
    for fragment in wanted:
        assert fragment in found, (fragment, found)
    order = [next(i for i, line in enumerate(lines) if f"stage '{name}'" in line) for name in ("sft", "grpo", "dpo")]
    assert order == sorted(order), lines  # grouped in the recipe's order
    assert lines[-1].endswith(f"7 faults, each on a line above; fix them all, then `kit check {recipe}` again")
    assert snapshot(tmp_path / "run") == before  # nothing written, nothing lost


def test_check_and_the_dry_run_decide_from_one_path(tmp_path, monkeypatch):
    """What the dry run refuses, kit check refuses with the same line (Unsloth's notebooks: batch 1 with 4
    generations; use_vllm on a CPU), and what kit check passes the dry run passes."""
    for change in ({"per_device_train_batch_size": 1}, {"use_vllm": True}):
        grpo = {**GRPO, "init": None, "train": {**GRPO["train"], **change}}
        grpo.pop("init")
        recipe = write_recipe(tmp_path / "r.yaml", [grpo])
        check, dry = (error_lines(run_cli(*args, expect=2).output) for args in
                      (["check", recipe], ["run", recipe, "--dry-run"]))
        assert check == dry and len(check) == 1, (check, dry)
    fine = write_recipe(tmp_path / "ok.yaml", [SFT, GRPO])
    run_cli("check", fine)
    run_cli("run", fine, "--dry-run")


def test_settings_that_need_a_package_or_the_network_are_one_line_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [({"use_liger_kernel": True}, "train.use_liger_kernel needs the liger-kernel package"),
             ({"push_to_hub": True, "hub_model_id": "me/model"}, "train.push_to_hub needs the network, and "
                                                                 "HF_HUB_OFFLINE is set"),
             ({"optim": "galore_adamw"}, "train.optim galore_adamw needs the galore-torch package")]
    for train, fragment in cases:
        recipe = write_recipe(tmp_path / "r.yaml", [{**SFT, "train": {**SFT["train"], **train}}])
        lines = error_lines(run_cli("check", recipe, expect=2).output)
        assert len(lines) == 1 and fragment in lines[0], lines
        assert "stage 'sft'" in lines[0]


def test_a_gpu_recipe_dry_runs_on_a_cpu_and_says_what_the_cpu_run_changes(tmp_path):
    """The 8-bit optimizer and bf16 every GPU config sets: replaced on the CPU, each with a note in kit check, the
    dry run and the lock (the values as the CPU run's config holds them)."""
    train = {**SFT["train"], "optim": "paged_adamw_8bit", "bf16": True}
    recipe = write_recipe(tmp_path / "r.yaml", [{**SFT, "train": train}])
    check = run_cli("check", recipe).output
    dry = run_cli("run", recipe, "--dry-run").output
    for text in (check, dry):
        assert "train.optim: paged_adamw_8bit needs a GPU" in text and "this CPU run uses adamw_torch_fused" in text
        assert "train.bf16: true is a GPU setting" in text
    resolved = yaml.safe_load("\n".join(line for line in dry.split("# stage 1/1: sft (sft)")[1].splitlines()
                                        if not line.startswith("#")))
    assert resolved["SFTConfig"]["optim"] == "adamw_torch_fused" and resolved["SFTConfig"]["bf16"] is False
    run_cli("run", recipe, "--output", tmp_path / "run", "--until", "sft", "--dry-run")


def test_kit_check_warns_about_what_the_trainer_will_not_use_and_lengths_beyond_the_model(tmp_path):
    sft = {**SFT, "train": {**SFT["train"], "dataset_text_field": "content", "max_length": 100_000}}
    grpo = {**GRPO, "train": {**GRPO["train"], "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.5}}
    recipe = write_recipe(tmp_path / "r.yaml", [sft, grpo])
    found = json.loads(run_cli("check", recipe, "--json").stdout)["findings"]
    by = {(f["stage"], f["topic"]): f for f in found}
    assert by[("grpo", "unused settings")]["level"] == "warn"
    assert "train.vllm_gpu_memory_utilization, train.vllm_mode" in by[("grpo", "unused settings")]["figures"]
    unused = by[("sft", "unused settings")]
    assert unused["level"] == "warn" and "'content'" in unused["figures"]
    from kitcli.models.tiny import ensure_tiny_model

    positions = json.loads((ensure_tiny_model() / "config.json").read_text())["max_position_embeddings"]
    assert by[("sft", "positions")]["figures"] == (f"train.max_length 100000 vs max_position_embeddings {positions}")


def test_kit_check_lists_the_kit_defaults_that_differ_from_the_trainer_config(tmp_path):
    """A config written for TRL itself ran TRL's defaults: each kit default that differs, for a key the recipe leaves
    unset, with the config's own value."""
    from trl import GRPOConfig

    grpo = {**GRPO, "train": {**GRPO["train"], "learning_rate": 1e-6}}
    recipe = write_recipe(tmp_path / "r.yaml", [SFT, grpo])
    found = {(f["stage"], f["topic"]): f for f in json.loads(run_cli("check", recipe, "--json").stdout)["findings"]}
    listed = found[("grpo", "kit defaults")]["figures"]
    assert f"beta 0.04 (GRPOConfig: {GRPOConfig.beta!r})" in listed  # the grpo preset against TRL's default
    assert "learning_rate" not in listed  # set by the recipe


def test_a_bare_reward_name_that_a_file_beside_the_recipe_defines_is_ambiguous(tmp_path):
    (tmp_path / "rewards.py").write_text("def format(completions, **kw):\n    return [0.0] * len(completions)\n")
    grpo = {**GRPO, "rewards": ["format"]}
    recipe = write_recipe(tmp_path / "r.yaml", [SFT, grpo])
    lines = error_lines(run_cli("check", recipe, expect=2).output)
    assert len(lines) == 1 and "reward 'format' is ambiguous" in lines[0], lines
    assert "rewards.builtin:format" in lines[0] and "rewards.py:format" in lines[0]
    run_cli("check", write_recipe(tmp_path / "r.yaml", [SFT, {**GRPO, "rewards": ["rewards.py:format"]}]))


def test_the_lock_keeps_every_value_but_credentials(tmp_path):
    """eos_token, a generation's max_new_tokens and lora: false are settings a rerun needs; hub_token is a
    credential. A lock read back drops the redacted credential with a note, and is the same recipe."""
    sft = {**SFT, "train": {**SFT["train"], "eos_token": "<|im_end|>", "hub_token": "hf_secretValue123"}}
    held_out = {"name": "eval", "type": "eval", "init": "sft", "data": str(DATA / "arithmetic_eval.jsonl"),
                "generation": {"max_new_tokens": 5}}
    recipe = write_recipe(tmp_path / "r.yaml", [sft, held_out], lora=False)
    from kitcli.recipe.load import load_recipe
    from kitcli.run.runner import make_lock

    lock = make_lock(load_recipe(str(recipe)))
    text = yaml.safe_dump(lock)
    assert "hf_secretValue123" not in text
    locked = lock["recipe"]
    assert locked["lora"] is False
    assert locked["stages"][0]["train"]["eos_token"] == "<|im_end|>"
    assert locked["stages"][0]["train"]["hub_token"] == "<redacted>"
    assert locked["stages"][1]["generation"]["max_new_tokens"] == 5
    (tmp_path / "recipe.lock.yaml").write_text(text)
    again = load_recipe(str(tmp_path / "recipe.lock.yaml"))
    assert again.lora is None and "hub_token" not in again.stage("sft").train
    assert any("train.hub_token is a credential the lock does not store" in note for note in again.notes)


@pytest.mark.slow
def test_what_check_passes_runs_older_forms_and_peft_keywords(tmp_path):
    """scale_rewards: false (TRL's older form of "none") and target_modules: [all-linear] pass kit check, then
    train: the trainer's effective scale_rewards is "none" and every linear layer of the model has an adapter."""
    grpo = {**GRPO, "train": {**GRPO["train"], "scale_rewards": False}}
    recipe = write_recipe(tmp_path / "r.yaml", [SFT, grpo], lora={"r": 4, "alpha": 8, "target_modules": ["all-linear"]})
    run_cli("check", recipe)
    run_cli("run", recipe, "--output", tmp_path / "run")
    config = json.loads((tmp_path / "run" / "grpo" / "config.json").read_text())
    assert config["scale_rewards"] == "none"
    adapter = json.loads((tmp_path / "run" / "sft" / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}
    lock = yaml.safe_load((tmp_path / "run" / "recipe.lock.yaml").read_text())
    assert lock["resolved"]["grpo"]["changed from the recipe"] == [
        "train.scale_rewards: false is the older form of 'none' (as TRL maps it); read as 'none'"]


def test_an_unknown_key_set_aside_leaves_the_rest_of_its_stage_checked(tmp_path):
    """The notebook shape: a key the kit sets itself (output_dir) and a batch TRL refuses, in one stage, in one pass
    (an unknown key set aside changes nothing the stage reads, so its trainer config is still built)."""
    grpo = {**GRPO, "train": {**GRPO["train"], "output_dir": "outputs", "per_device_train_batch_size": 1}}
    lines = error_lines(run_cli("check", write_recipe(tmp_path / "r.yaml", [SFT, grpo]), expect=2).output)
    assert len(lines) == 3, lines
    assert "train.output_dir is set by the kit" in lines[0] and "does not divide the generation batch" in lines[1]


def test_the_forms_other_tools_write_that_transformers_reads_otherwise(tmp_path):
    """report_to: [none] (a list holding none) is read as none; adamw_torch, which Unsloth's CPU backend turns into
    its fused kernel, is that kernel with a note (KTO's config rewrote it and the kit refused)."""
    kto = {"name": "kto", "type": "kto", "init": "sft", "data": str(DATA / "arithmetic_prefs.jsonl"),
           "train": {"max_steps": 2, "per_device_train_batch_size": 4, "optim": "adamw_torch", "report_to": ["none"]}}
    recipe = write_recipe(tmp_path / "r.yaml", [SFT, kto])
    dry = run_cli("run", recipe, "--dry-run").output
    assert "train.optim: adamw_torch runs as adamw_torch_fused on a CPU" in dry
    resolved = yaml.safe_load("\n".join(line for line in dry.split("# stage 2/2: kto (kto)")[1].splitlines()
                                        if not line.startswith("#")))
    assert resolved["KTOConfig"]["optim"] == "adamw_torch_fused" and resolved["KTOConfig"]["report_to"] == []  # none
    bad = {**kto, "train": {**kto["train"], "report_to": ["none", "tensorboard"]}}
    lines = error_lines(run_cli("check", write_recipe(tmp_path / "r.yaml", [SFT, bad]), expect=2).output)
    assert len(lines) == 1 and "'none' turns every tracker off, so it stands alone" in lines[0], lines


@pytest.mark.slow
def test_each_stage_trains_with_the_config_its_check_built(tmp_path, monkeypatch):
    """`train:` is resolved once: kit run's preflight builds each stage's trainer config (checking it), and the stage
    trains with that very object, not a second one built from the same section."""
    from kitcli.stages import grpo, sft
    from kitcli.training import trainers

    built, trained = [], []
    for module in (sft, grpo):
        build = module.build_config
        monkeypatch.setattr(module, "build_config",
                            lambda *a, _build=build, **kw: built.append(_build(*a, **kw)) or built[-1])
    make_trainer = trainers.build_trainer
    for module in (sft, trainers):  # sft imports it by name, grpo looks it up in trainers
        monkeypatch.setattr(module, "build_trainer",
                            lambda *a, **kw: trained.append(kw["args"]) or make_trainer(*a, **kw))
    recipe = write_recipe(tmp_path / "r.yaml", [SFT, GRPO])
    run_cli("run", recipe, "--output", tmp_path / "run")
    assert [type(c).__name__ for c in built] == ["SFTConfig", "GRPOConfig"]  # one each, in preflight
    assert len(trained) == 2 and all(t is b for t, b in zip(trained, built))
    assert json.loads((tmp_path / "run" / "grpo" / "DONE").read_text())["steps"] == 2
