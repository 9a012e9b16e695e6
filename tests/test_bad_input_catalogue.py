"""The bad-input catalogue: each case states its input and the fragment its one-line error must contain.

Every case must exit with status 2, print exactly one `Error:` line and no traceback (with KIT_DEBUG unset), and
leave an existing run directory byte-for-byte unchanged. Cases run in-process through Click's CliRunner against a
prepared run directory, through the same top level as `kit` (KitGroup.main: an exception that got past it would be
a traceback); with KIT_DEBUG=1 every case shows its traceback before the same line. A few run as real processes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from helpers import DATA, run_cli, snapshot

GOOD_SFT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"), "train": {"max_steps": 2}}


def recipe(tmp: Path, name: str = "r.yaml", **changes) -> Path:
    data = {"name": "cat", "model": {"name": "tiny"}, "lora": {"r": 4}, "stages": [dict(GOOD_SFT)]}
    for key, value in changes.items():
        data[key] = value
    path = tmp / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_stage(tmp: Path, **stage_changes) -> Path:
    return recipe(tmp, stages=[{**GOOD_SFT, **stage_changes}])


def data_file(tmp: Path, text: str, name: str = "d.jsonl") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def model_dir(tmp: Path) -> str:
    """A directory with a config.json (what a reward_model path must be)."""
    (tmp / "rm").mkdir(exist_ok=True)
    (tmp / "rm" / "config.json").write_text("{}")
    return str(tmp / "rm")


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list]  # builds the command line (writing any files it needs) in a temp dir
    fragment: str
    extra: list[str] = field(default_factory=list)  # more fragments that must appear


RUN = "run"  # the prepared run directory's name
CASES = [
    # --- recipes -------------------------------------------------------------------------------------------
    Case("recipe-file-missing", lambda t: ["run", t / "nope.yaml"], "does not exist"),
    Case("recipe-name-unknown", lambda t: ["run", "tiny-sfft"], "no recipe named 'tiny-sfft'", ["tiny-sft"]),
    Case("recipe-not-yaml", lambda t: ["run", data_file(t, "a: [1,\n", "x.yaml")], "not valid YAML"),
    Case("recipe-not-mapping", lambda t: ["run", data_file(t, "- 1\n- 2\n", "x.yaml")], "must be a YAML mapping"),
    Case("recipe-unknown-top-key", lambda t: ["run", recipe(t, stagez=[])], "unknown key 'stagez'"),
    Case("recipe-no-stages", lambda t: ["run", recipe(t, stages=[])], "'stages' must be a non-empty list"),
    Case("recipe-no-model", lambda t: ["run", recipe(t, model=None)], "'model' is missing"),
    Case("recipe-model-path-missing", lambda t: ["run", recipe(t, model={"name": "./no/model"})],
         "model path './no/model' does not exist"),
    Case("recipe-model-unknown-key", lambda t: ["run", recipe(t, model={"name": "tiny", "bits": 4})],
         "unknown key 'bits'"),
    Case("recipe-bad-backend", lambda t: ["run", recipe(t, model={"name": "tiny", "backend": "vllm"})],
         "model.backend must be one of"),
    Case("recipe-bad-dtype", lambda t: ["run", recipe(t, model={"name": "tiny", "dtype": "fp8"})],
         "model.dtype must be one of"),
    Case("recipe-bad-seq-len", lambda t: ["run", recipe(t, model={"name": "tiny", "max_seq_length": -1})],
         "max_seq_length must be a positive integer"),
    Case("recipe-seed-not-int", lambda t: ["run", recipe(t, seed="abc")], "'seed' must be an integer"),
    Case("recipe-lora-unknown-key", lambda t: ["run", recipe(t, lora={"rank": 8})], "unknown key 'rank'",
         ["did you mean 'r'"]),
    Case("recipe-lora-bad-r", lambda t: ["run", recipe(t, lora={"r": 0})], "r must be a positive integer"),
    Case("recipe-lora-not-mapping", lambda t: ["run", recipe(t, lora=[1])], "expected a mapping"),
    Case("stage-not-mapping", lambda t: ["run", recipe(t, stages=["sft"])], "each stage must be a mapping"),
    Case("stage-type-missing", lambda t: ["run", recipe(t, stages=[{"name": "a"}])], "'type' is missing"),
    Case("stage-type-unknown", lambda t: ["run", with_stage(t, type="sftt")], "unknown stage type 'sftt'",
         ["did you mean 'sft'"]),
    Case("stage-unknown-key", lambda t: ["run", with_stage(t, trian={})], "unknown key 'trian'",
         ["did you mean 'train'"]),
    Case("stage-duplicate-name", lambda t: ["run", recipe(t, stages=[GOOD_SFT, GOOD_SFT])], "must be unique"),
    Case("stage-name-with-slash", lambda t: ["run", with_stage(t, name="a/b")], "becomes a folder name"),
    Case("stage-init-unknown", lambda t: ["run", with_stage(t, init="nothere")], "init 'nothere' is not an earlier"),
    Case("stage-init-later", lambda t: ["run", recipe(t, stages=[{**GOOD_SFT, "name": "a", "init": "b"},
                                                               {**GOOD_SFT, "name": "b"}])],
         "init 'b' is not an earlier stage"),
    Case("stage-init-eval", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl")}, {**GOOD_SFT, "init": "ev"}])],
         "is an eval stage"),
    Case("stage-train-not-mapping", lambda t: ["run", with_stage(t, train=[1])], "'train' must be a mapping"),
    Case("stage-data-missing-key", lambda t: ["run", recipe(t, stages=[{"name": "s", "type": "sft"}])],
         "'data' is missing"),
    Case("trl-field-unknown", lambda t: ["run", with_stage(t, train={"learning_rat": 1.0})],
         "train.learning_rat is not a SFTConfig field", ["did you mean 'learning_rate'"]),
    Case("trl-field-reserved", lambda t: ["run", with_stage(t, train={"output_dir": "x"})],
         "train.output_dir is set by the kit"),
    Case("trl-value-rejected", lambda t: ["run", with_stage(t, train={"lr_scheduler_type": "wobbly"})],
         "SFTConfig rejected the train settings"),
    # --- wrong values: the real field names, values of the wrong type or out of range --------------------------
    *[Case(f"value-{key.replace('.', '-')}-{label}", lambda t, key=key, value=value: ["run", recipe(t), "--set",
                                                                                     f"{key}={value}"],
           fragment) for key, value, label, fragment in [
        ("stages.sft.train.learning_rate", "fast", "string", "train.learning_rate must be a number > 0, got 'fast'"),
        ("stages.sft.train.learning_rate", "-1e-4", "negative", "train.learning_rate must be > 0, got -0.0001"),
        ("stages.sft.train.learning_rate", "0", "zero", "train.learning_rate must be > 0, got 0"),
        ("stages.sft.train.per_device_train_batch_size", "0", "zero", "per_device_train_batch_size must be >= 1"),
        ("stages.sft.train.per_device_train_batch_size", "2.5", "float", "per_device_train_batch_size must be an "
                                                                          "integer"),
        ("stages.sft.train.per_device_train_batch_size", "true", "bool", "must be an integer >= 1, got True"),
        ("stages.sft.train.gradient_accumulation_steps", "0", "zero", "gradient_accumulation_steps must be >= 1"),
        ("stages.sft.train.num_train_epochs", "-3", "negative", "train.num_train_epochs must be > 0, got -3"),
        ("stages.sft.train.num_train_epochs", "0", "zero", "train.num_train_epochs must be > 0, got 0"),
        ("stages.sft.train.max_steps", "ten", "string", "train.max_steps must be an integer >= 1 or -1, got 'ten'"),
        ("stages.sft.train.max_steps", "0", "zero", "train.max_steps must be >= 1 or -1, got 0"),
        ("stages.sft.train.max_steps", "-5", "negative", "train.max_steps must be >= 1 or -1, got -5"),
        ("stages.sft.train.adam_beta2", "1.5", "above-one", "train.adam_beta2 must be in [0, 1), got 1.5"),
        ("stages.sft.train.warmup_steps", "-1", "negative", "train.warmup_steps must be >= 0"),
        ("stages.sft.train.weight_decay", "-0.1", "negative", "train.weight_decay must be >= 0"),
        ("stages.sft.train.max_grad_norm", "big", "string", "train.max_grad_norm must be a number"),
        ("stages.sft.train.logging_steps", "0", "zero", "train.logging_steps must be > 0"),
        ("stages.sft.train.save_steps", "-10", "negative", "train.save_steps must be > 0"),
        ("stages.sft.train.save_total_limit", "0", "zero", "train.save_total_limit must be >= 1"),
        ("stages.sft.train.adam_beta1", "1.0", "one", "train.adam_beta1 must be in [0, 1)"),
        ("stages.sft.train.adam_epsilon", "0", "zero", "train.adam_epsilon must be > 0"),
        ("stages.sft.train.lr_scheduler_type", "cosin", "typo", "train.lr_scheduler_type must be one of linear, "
                                                                  "cosine"),
        ("stages.sft.train.optim", "adam_w", "unknown", "train.optim must be one of"),
        ("stages.sft.train.packing", "maybe", "string", "train.packing must be true or false, got 'maybe'"),
        ("stages.sft.train.max_length", "0", "zero", "train.max_length must be >= 1"),
        ("stages.sft.train.loss_type", "mse", "unknown", "train.loss_type must be one of nll, dft"),
        ("stages.sft.train.gradient_checkpointing", "1", "int", "train.gradient_checkpointing must be true or false"),
        ("stages.sft.train.dataloader_num_workers", "-2", "negative", "dataloader_num_workers must be >= 0"),
        ("lora.alpha", "big", "string", "lora.alpha must be a number, got 'big'"),
        ("lora.alpha", "0", "zero", "lora.alpha must be a number > 0, got 0"),
        ("lora.dropout", "1.5", "above-one", "lora.dropout must be a number < 1, got 1.5"),
        ("lora.dropout", "-0.1", "negative", "lora.dropout must be a number >= 0, got -0.1"),
        ("lora.r", "eight", "string", "lora.r must be an integer, got 'eight'"),
        ("lora.r", "4.5", "float", "lora.r must be an integer, got 4.5"),
        ("lora.target_modules", "7", "int", "lora.target_modules must be a list or a string, got 7"),
        ("model.load_in_4bit", "maybe", "string", "model.load_in_4bit must be true or false, got 'maybe'"),
        ("model.trust_remote_code", "yes please", "string", "model.trust_remote_code must be true or false"),
        ("model.max_seq_length", "long", "string", "model.max_seq_length must be an integer, got 'long'"),
        ("model.max_seq_length", "0", "zero", "max_seq_length must be a positive integer, got 0"),
        ("seed", "-1", "negative", "'seed' must be an integer >= 0, got -1"),
        ("seed", "1.5", "float", "'seed' must be an integer, got 1.5"),
        ("name", "[1, 2]", "list", "'name' must be a string"),
        ("description", "{a: 1}", "mapping", "'description' must be a string"),
        ("stages.sft.data.limit", "-4", "negative", "data.limit must be a positive integer, got -4"),
        ("stages.sft.data.limit", "many", "string", "data.limit must be an integer, got 'many'"),
        ("stages.sft.data.split", "3", "int", "data.split must be a string, got 3"),
        ("stages.sft.system_prompt", "[1]", "list", "system_prompt must be a string"),
        ("stages.sft.init", "5", "int", "init must be a string, got 5"),
    ]],
    # --- wrong values in the other stage types -------------------------------------------------------------
    *[Case(f"value-{stage['type']}-{label}", lambda t, stage=stage: ["run", recipe(t, stages=[stage])], fragment)
      for stage, label, fragment in [
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"temperature": -1.0}}, "temperature", "train.temperature must be > 0, got -1.0"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"max_completion_length": 0}}, "completion-length", "train.max_completion_length must be >= 1"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"beta": "strong"}}, "beta", "train.beta must be a number >= 0, got 'strong'"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"loss_type": "grpoo"}}, "loss-type", "train.loss_type must be one of grpo, dr_grpo, dapo"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"num_generations": 1}}, "one-generation", "train.num_generations must be >= 2, got 1"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"top_p": 1.5}}, "top-p", "train.top_p must be in (0, 1], got 1.5"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"scale_rewards": "grup"}}, "scale-rewards", "train.scale_rewards must be one of group, batch"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "variant": "grp"}, "variant",
         "variant must be one of grpo, dr_grpo, dapo, bnpo, cispo, sapo, vespo, got 'grp'"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
          "rewards": [{"name": "exact_match", "weight": "heavy"}]}, "reward-weight",
         "rewards.0.weight must be a number"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
          "rewards": [{"name": "exact_match", "on_error": "ignore"}]}, "on-error",
         "on_error must be one of raise, skip"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": "exact_match"},
         "rewards-not-list", "'rewards' must be a list of reward names or mappings"),
        ({"name": "g", "type": "gspo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "allow_on_policy": "yes"}, "allow-on-policy", "allow_on_policy must be true or false, got 'yes'"),
        ({"name": "g", "type": "gspo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"epsilon": 0}}, "epsilon", "train.epsilon must be > 0, got 0"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"loss_type": "luspo"}}, "luspo-token-level",
         "loss_type 'luspo' scales GSPO's sequence-level objective by each sequence's length, so it needs "
         "importance_sampling_level 'sequence'"),
        ({"name": "g", "type": "gspo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "variant": "lusp"}, "variant", "variant must be one of gspo, luspo, got 'lusp'"),
        ({"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "variant": "sapo", "train": {"sapo_temperature_neg": 0}}, "sapo-temperature",
         "train.sapo_temperature_neg must be > 0, got 0"),
        ({"name": "r", "type": "rloo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"num_generations": 1}}, "one-generation", "train.num_generations must be >= 2, got 1"),
        ({"name": "r", "type": "rloo", "data": str(DATA / "arithmetic_prompts.jsonl")}, "no-reward",
         "no rewards; RLOO needs a reward"),
        ({"name": "k", "type": "kto", "data": str(DATA / "arithmetic_prefs.jsonl"),
          "train": {"per_device_train_batch_size": 1}}, "batch-of-one",
         "train.per_device_train_batch_size must be at least 2, got 1"),
        ({"name": "k", "type": "kto", "data": str(DATA / "arithmetic_prefs.jsonl"),
          "train": {"desirable_weight": -1}}, "negative-weight", "train.desirable_weight must be > 0, got -1"),
        ({"name": "k", "type": "kto", "data": str(DATA / "arithmetic_prefs.jsonl"),
          "train": {"loss_type": "dpo"}}, "loss-type", "train.loss_type must be one of kto, apo_zero_unpaired"),
        ({"name": "d", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"), "train": {"beta": -0.1}},
         "negative-beta", "train.beta must be > 0, got -0.1"),
        ({"name": "d", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"), "train": {"beta": 0}},
         "zero-beta", "train.beta must be > 0, got 0"),
        ({"name": "d", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"), "train": {"loss_type": "sigmod"}},
         "loss-type", "train.loss_type must be one of sigmoid, hinge"),
        ({"name": "d", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"), "eval_fraction": 1.0},
         "eval-fraction", "eval_fraction must be a number < 1, got 1.0"),
        ({"name": "d", "type": "dpo", "data": str(DATA / "arithmetic_prefs.jsonl"), "eval_fraction": 0.1,
          "eval_data": str(DATA / "arithmetic_prefs.jsonl")}, "both-evals",
         "give eval_data or eval_fraction, not both"),
        ({"name": "r", "type": "reward", "data": str(DATA / "arithmetic_prefs.jsonl"),
          "train": {"center_rewards_coefficient": -1}}, "centering", "center_rewards_coefficient must be >= 0"),
        ({"name": "p", "type": "ppo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"response_length": 0}}, "response-length", "train.response_length must be >= 1, got 0"),
        ({"name": "p", "type": "ppo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"kl_coef": -0.1}}, "kl-coef", "train.kl_coef must be >= 0, got -0.1"),
        ({"name": "p", "type": "ppo", "data": str(DATA / "arithmetic_prompts.jsonl"), "rewards": ["exact_match"],
          "train": {"gamma": 2}}, "gamma", "train.gamma must be in [0, 1], got 2"),
        ({"name": "e", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"),
          "generation": {"max_new_tokens": 0}}, "max-new-tokens",
         "generation.max_new_tokens must be a positive integer"),
        ({"name": "e", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"),
          "generation": {"temperature": -0.5}}, "temperature", "generation.temperature must be a number >= 0"),
        ({"name": "e", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"),
          "generation": {"n": 4}}, "greedy-samples", "generation.n is 4 but temperature is 0"),
        ({"name": "e", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"), "generation": [4]},
         "generation-not-mapping", "generation must be a mapping"),
    ]],
    # one fault only: a reward model directory that exists (a stage named `rm` would be a second fault, now named too)
    Case("value-grpo-reward-model-weight", lambda t: ["run", recipe(t, stages=[
        {"name": "g", "type": "grpo", "data": str(DATA / "arithmetic_prompts.jsonl"),
         "reward_model": {"path": model_dir(t), "weight": "x"}}])], "reward_model.weight must be a number"),
    # --- datasets ------------------------------------------------------------------------------------------
    Case("data-path-missing", lambda t: ["run", with_stage(t, data=str(t / "none.jsonl"))], "none.jsonl",
         ["does not exist"]),
    Case("data-empty", lambda t: ["run", with_stage(t, data=data_file(t, ""))], "is empty"),
    Case("data-bad-jsonl-line", lambda t: ["run", with_stage(t, data=data_file(t, '{"text": "a"}\n{oops\n'))],
         "d.jsonl: line 2 is not valid JSON"),
    Case("data-jsonl-not-object", lambda t: ["run", with_stage(t, data=data_file(t, '"just a string"\n'))],
         "line 1 must be a JSON object"),
    Case("data-missing-columns", lambda t: ["run", with_stage(t, data=data_file(t, '{"q": "a", "a": "b"}\n'))],
         "needs columns prompt+completion or messages or text", ["it has a, q", "columns:"]),
    Case("data-columns-map-missing", lambda t: ["run", with_stage(t, data={
        "path": data_file(t, '{"q": "a"}\n'), "columns": {"question": "prompt"}})], "has no such column"),
    Case("data-columns-not-mapping", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                          "columns": ["a"]})],
         "columns must map dataset columns"),
    Case("data-limit-bad", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                "limit": 0})], "limit must be a positive integer"),
    Case("data-unknown-key", lambda t: ["run", with_stage(t, data={"path": str(DATA / "arithmetic_sft.jsonl"),
                                                                  "colums": {}})], "unknown key 'colums'"),
    Case("data-bad-json-file", lambda t: ["run", with_stage(t, data=data_file(t, "[1,", "d.json"))],
         "d.json: not valid JSON"),
    Case("data-bad-format", lambda t: ["run", with_stage(t, data=data_file(t, "a\tb\n", "d.tsv"))],
         "unsupported dataset format"),
    Case("eval-data-no-answer", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_sft.jsonl").replace("sft", "prefs")}])],
         "has no 'answer' column"),
    Case("eval-unknown-generation-key", lambda t: ["run", recipe(t, stages=[
        {"name": "ev", "type": "eval", "data": str(DATA / "arithmetic_eval.jsonl"), "generation": {"max_tokens": 4}}])],
         "unknown generation key 'max_tokens'"),
    # --- `eval:` on a training stage (held-out evaluation while it trains, kitcli/training/held_out.py) -----------
    Case("held-out-every-zero", lambda t: ["run", with_stage(t, eval={"data": str(DATA / "arithmetic_eval.jsonl"),
                                                                      "every": 0})],
         "stage 'sft': eval.every must be a positive integer, got 0"),
    Case("held-out-no-answer", lambda t: ["run", with_stage(t, eval={"data": str(DATA / "arithmetic_prefs.jsonl"),
                                                                      "every": 5})],
         "stage 'sft': eval: data", ["has no 'answer' column", "list rewards: under eval:"]),
    Case("held-out-unknown-reward", lambda t: ["run", with_stage(t, eval={
        "data": str(DATA / "arithmetic_eval.jsonl"), "every": 5, "rewards": ["exact_mtch"]})],
         "stage 'sft': eval: rewards[0]: unknown reward 'exact_mtch'", ["Did you mean 'exact_match'?"]),
    Case("held-out-data-missing", lambda t: ["run", with_stage(t, eval={"data": "held_out.jsonl", "every": 5})],
         "stage 'sft': eval.data: dataset file 'held_out.jsonl' does not exist"),
    Case("held-out-on-a-reward-stage", lambda t: ["run", recipe(t, stages=[
        {"name": "rm", "type": "reward", "data": str(DATA / "arithmetic_prefs.jsonl"),
         "eval": {"data": str(DATA / "arithmetic_eval.jsonl"), "every": 5}}])],
         "stage 'rm': eval: held-out evaluation generates with a policy"),
    Case("kto-label-not-bool", lambda t: ["run", recipe(t, stages=[{"name": "k", "type": "kto", "data": data_file(
        t, '{"prompt": "a", "completion": "b", "label": true}\n'
           '{"prompt": "c", "completion": "d", "label": "yes"}\n')}])],
        "row 2 of", ["has label 'yes'", "must be true (desirable, thumbs up) or false"]),
    Case("kto-no-label", lambda t: ["run", recipe(t, stages=[{"name": "k", "type": "kto", "data": data_file(
        t, '{"prompt": "a", "completion": "b"}\n')}])], "has no 'label' column"),
    Case("kto-one-label", lambda t: ["run", recipe(t, stages=[{
        "name": "k", "type": "kto", "eval_fraction": 0,
        "data": data_file(t, '{"prompt": "a", "completion": "b", "label": true}\n' * 4)}])],
         "have label true; KTO needs both desirable (label true) and undesirable (label false) examples"),
    Case("data-to-kto-not-pairs", lambda t: ["data", "to-kto", data_file(t, '{"prompt": "a", "completion": "b"}\n'),
                                             "-o", t / "k.jsonl"], "pairs need columns prompt, chosen and rejected"),
    Case("data-to-kto-exists", lambda t: ["data", "to-kto", str(DATA / "arithmetic_prefs.jsonl"), "-o",
                                          data_file(t, "keep\n", "k.jsonl")], "exists; pass --force"),
    # --- values of the wrong type in a data file: named by file, row and column, before any model loads -------
    Case("data-prompt-number", lambda t: ["run", with_stage(t, data=data_file(
        t, '{"prompt": "a", "completion": "b"}\n{"prompt": 42, "completion": "c"}\n'))],
        "row 2 of", ["d.jsonl', column 'prompt' holds int 42", "must be a string or a list of messages"]),
    Case("data-completion-null", lambda t: ["run", with_stage(t, data=data_file(
        t, '{"prompt": "a", "completion": null}\n'))], "row 1 of", ["column 'completion' holds null"]),
    Case("data-text-list", lambda t: ["run", with_stage(t, data=data_file(t, '{"text": ["a"]}\n'))],
         "column 'text' holds list [\"a\"]", ["it must be a string"]),
    Case("data-renamed-column-number", lambda t: ["run", with_stage(t, data={
        "path": data_file(t, '{"q": 7, "a": "b"}\n'), "columns": {"q": "prompt", "a": "completion"}})],
        "column 'prompt' (the file's 'q') holds int 7"),
    Case("data-chosen-number", lambda t: ["run", recipe(t, stages=[{"name": "d", "type": "dpo", "data": data_file(
        t, '{"prompt": "a", "chosen": 3, "rejected": "c"}\n')}])], "row 1 of", ["column 'chosen' holds int 3"]),
    Case("data-rejected-mapping", lambda t: ["run", recipe(t, stages=[{"name": "d", "type": "dpo", "data": data_file(
        t, '{"prompt": "a", "chosen": "b", "rejected": {"x": 1}}\n')}])], "column 'rejected' holds dict"),
    Case("data-answer-mapping", lambda t: ["run", recipe(t, stages=[{"name": "e", "type": "eval", "data": data_file(
        t, '{"prompt": "a", "answer": 4}\n{"prompt": "b", "answer": {"x": 1}}\n')}])],
        "row 2 of", ["column 'answer' holds dict", "a string, a number or a list of them"]),
    Case("data-prompt-bool-grpo", lambda t: ["run", recipe(t, stages=[{
        "name": "g", "type": "grpo", "rewards": ["exact_match"],
        "data": data_file(t, '{"prompt": true, "answer": "1"}\n')}])], "column 'prompt' holds bool true"),
    Case("data-loader-name", lambda t: ["run", recipe(t, stages=[{"name": "s", "type": "sft", "data": "text"}])],
         "data 'text' is neither a file here nor a hub dataset", ["`datasets` library's file loaders",
                                                                 "e.g. data/train.jsonl"]),
    # --- models and trackers that are not here ---------------------------------------------------------------
    Case("model-hub-offline", lambda t: ["run", recipe(t, model={"name": "someorg/not-cached-model"})],
         "model 'someorg/not-cached-model' is not in the local Hugging Face cache",
         ["there is no network", "hf download someorg/not-cached-model", "a local model directory"]),
    Case("report-to-not-installed", lambda t: ["run", with_stage(t, train={"max_steps": 2, "report_to": "clearml"})],
         "train.report_to 'clearml' needs the clearml package, which is not installed", ["pip install clearml"]),
    Case("report-to-unknown", lambda t: ["run", with_stage(t, train={"max_steps": 2, "report_to": ["tensorbored"]})],
         "train.report_to 'tensorbored' is not a tracker transformers knows", ["did you mean 'tensorboard'"]),
    # --- CLI options -----------------------------------------------------------------------------------------
    Case("set-no-equals", lambda t: ["run", recipe(t), "--set", "lora.r"], "expected KEY=VALUE"),
    Case("set-unknown-stage", lambda t: ["run", recipe(t), "--set", "stages.sfx.train.max_steps=1"],
         "no stage named 'sfx'", ["did you mean 'sft'"]),
    Case("set-bad-yaml", lambda t: ["run", recipe(t), "--set", "lora.r=[1,"], "not valid YAML"),
    Case("set-through-scalar", lambda t: ["run", recipe(t), "--set", "name.x=1"], "is not a mapping"),
    Case("option-unknown", lambda t: ["run", recipe(t), "--nope"], "No such option '--nope'"),
    Case("argument-missing", lambda t: ["sft", "--model", "tiny"], "Missing option '--data'"),
    Case("sft-data-missing", lambda t: ["sft", "--model", "tiny", "--data", t / "x.jsonl"], "does not exist"),
    Case("recipes-show-unknown", lambda t: ["recipes", "show", "nothing"], "no recipe named 'nothing'"),
    # --- run directories -------------------------------------------------------------------------------------
    Case("run-dir-other-recipe", lambda t: ["run", recipe(t), "--output", t / RUN], "holds a run of a different recipe",
         ["--force"]),
    Case("run-dir-not-kit", lambda t: ["run", recipe(t), "--output", t / "notkit"], "is not a kit run directory"),
    Case("run-dir-bad-lock", lambda t: ["run", recipe(t), "--output", t / "badlock"], "is not valid YAML"),
]


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A finished-looking run directory of another recipe, a non-kit directory and one with a corrupt lock."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: a hub model must be in the cache
    monkeypatch.delenv("KIT_DEBUG", raising=False)
    run = tmp_path / RUN
    (run / "sft" / "adapter").mkdir(parents=True)
    (run / "recipe.lock.yaml").write_text(yaml.safe_dump({"recipe": {"name": "other"}, "datasets": {}}))
    (run / "sft" / "DONE").write_text(json.dumps({"headline": "loss 1 -> 0.5"}))
    (run / "sft" / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "notkit").mkdir()
    (tmp_path / "notkit" / "keep.txt").write_text("mine")
    (tmp_path / "badlock").mkdir()
    (tmp_path / "badlock" / "recipe.lock.yaml").write_text("recipe: [unclosed\n")
    return tmp_path


def test_catalogue_has_at_least_a_hundred_cases():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, prepared):
    before = {name: snapshot(prepared / name) for name in (RUN, "notkit", "badlock")}
    result = run_cli(*case.argv(prepared), expect=None)
    output = result.output
    assert isinstance(result.exception, (SystemExit, type(None))), (output, result.exception)  # none got past
    assert result.exit_code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, output
    assert "Traceback" not in output
    for fragment in [case.fragment, *case.extra]:
        assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    assert {name: snapshot(prepared / name) for name in before} == before
    assert not (prepared / "runs").exists() or not any((prepared / "runs").iterdir())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kit_debug_shows_the_traceback(case, prepared, monkeypatch):
    monkeypatch.setenv("KIT_DEBUG", "1")
    result = run_cli(*case.argv(prepared), expect=None)
    assert result.exit_code == 2, result.output
    assert "Traceback (most recent call last)" in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: ")


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_real_kit_process_shows_a_traceback_only_with_kit_debug(prepared, debug):
    import os
    import subprocess
    import sys

    # refused before anything loads: a quick process (a recipe's own faults are gathered in one pass, which builds
    # every stage's trainer config and so imports TRL first: about 10 s of a process)
    case = next(c for c in CASES if c.id == "recipe-not-yaml")
    env = {k: v for k, v in os.environ.items() if k != "KIT_DEBUG"} | ({"KIT_DEBUG": debug} if debug else {})
    process = subprocess.run([sys.executable, "-m", "kitcli", *map(str, case.argv(prepared))], capture_output=True,
                             text=True, env=env)
    assert process.returncode == 2, process.stderr
    assert ("Traceback" in process.stdout + process.stderr) == bool(debug), process.stderr
    assert case.fragment in process.stderr.strip().splitlines()[-1]


def test_an_exception_past_the_commands_is_one_line_and_a_saved_traceback(prepared, monkeypatch):
    import kitcli.recipe.load

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero in a bug")

    monkeypatch.setattr(kitcli.recipe.load, "load_recipe", broken)
    result = run_cli("run", recipe(prepared), expect=1)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert lines[0].startswith("Error: internal error in kit: ZeroDivisionError: division by zero in a bug (a bug;")
    saved = Path(lines[0].split("its traceback is in ")[1].split(";")[0])
    assert "Traceback" in saved.read_text()
    assert "raise ZeroDivisionError" in saved.read_text()
    saved.unlink()
    monkeypatch.setenv("KIT_DEBUG", "1")
    result = run_cli("run", recipe(prepared), expect=1)
    assert isinstance(result.exception, ZeroDivisionError)  # KIT_DEBUG=1: Python's own traceback, as before
