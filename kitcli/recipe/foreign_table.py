"""The names people bring from other tools' configs, one record per name (or group of names) and behaviour: where
it is found, whose name it is, and what the kit does with it. kitcli/recipe/foreign_names.py applies the table to
a recipe, `kit import` (kitcli/commands/import_config.py) reads a TRL CLI or axolotl config through it, and
docs/foreign-names.md lists it (tests/test_foreign_names.py checks the page against the table).

Read from the sources, not from memory: Unsloth's FastLanguageModel.from_pretrained (unsloth/models/loader.py),
get_peft_model (unsloth/models/llama.py) and its GRPOConfig additions (unsloth/models/rl.py); transformers 5.17's
TrainingArguments (no warmup_ratio: a float warmup_steps below 1 is a fraction of the run, training_args.py
get_warmup_steps); TRL 1.15's ModelConfig (trl/trainer/model_config.py), ScriptArguments (trl/scripts/utils.py),
GRPOScriptArguments (trl/scripts/grpo.py) and its configs, which dropped max_prompt_length; open-r1's
GRPOScriptArguments and config additions (src/open_r1/configs.py); axolotl's config schema
(src/axolotl/utils/schemas/{config,training,peft,trl}.py).

A record's `places`: top (the recipe's top level), model (`model:`), lora (`lora:`), stage (a stage's own keys),
train (a stage's `train:`). `does`: map (read as the kit's key `kit`, the value through `convert`), ignore (dropped:
it changes nothing the kit does, `why` says what the kit does instead) or refuse (a fault naming the kit's spelling).
`values`: the record covers only these values (a name whose meaning depends on its value has one record per
meaning, tried in order); without it, every value. A record with `values` also applies to a key the kit has (a
value the kit spells otherwise: `model.dtype: None`); one without applies only where the key is not the kit's.
`kit` lists where the value goes, the first the stage has (`train.max_length | model.max_seq_length`; `-`: nothing
to set there, dropped with the note).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAP, IGNORE, REFUSE = "map", "ignore", "refuse"
PLACES = ("top", "model", "lora", "stage", "train")
NONE = (None, "None", "none", "null")  # YAML has no None: `dtype: None` is the string "None"

U_LOAD = "Unsloth from_pretrained"
U_PEFT = "Unsloth get_peft_model"
U_GRPO = "Unsloth GRPOConfig"
PEFT = "PEFT LoraConfig"
HF = "transformers 4.x TrainingArguments"
TRL0 = "TRL 0.x configs"
TRL_MODEL = "TRL CLI ModelConfig"
TRL_SCRIPT = "TRL CLI ScriptArguments"
OPEN_R1 = "open-r1"
AXOLOTL = "axolotl"


@dataclass(frozen=True)
class ForeignName:
    keys: str  # the names, space-separated (one behaviour)
    places: str  # where they are read, space-separated (PLACES)
    source: str  # whose names they are
    does: str  # MAP, IGNORE or REFUSE
    why: str  # what it means there and what the kit does (a note or a fault)
    kit: str = ""  # the kit's spelling: where a mapped value goes (alternatives joined by " | ")
    values: tuple | None = None  # only these values (None: any)
    convert: str = ""  # how the value becomes the kit's (foreign_names.CONVERSIONS; "": as it is)

    def names(self) -> list[str]:
        return self.keys.split()

    def at(self) -> list[str]:
        return self.places.split()

    def targets(self) -> list[str]:
        return [t.strip() for t in self.kit.split("|") if t.strip()]

    def covers(self, value: Any) -> bool:
        return self.values is None or any(same(value, v) for v in self.values)


def same(value: Any, wanted: Any) -> bool:
    """YAML-aware equality: True is not 1, and the string "None" (YAML has no None) is None."""
    if wanted is None:
        return value is None or (isinstance(value, str) and value in NONE)
    return type(value) is type(wanted) and value == wanted


# --- the table ---------------------------------------------------------------------------------------------------

GRADIENT_CHECKPOINTING = ("the kit decides: Unsloth's offloaded checkpointing ('unsloth') on a GPU, none on a CPU, "
                          "where activations fit; a stage's train.gradient_checkpointing sets the trainer's")
NO_VLLM = "no vLLM engine is started: the kit generates with transformers (train.use_vllm: false)"
TOKEN = ("a hub token in a recipe would be copied into the run's files; the kit reads it from HF_TOKEN or "
         "`huggingface-cli login`; remove it")
REVISION = ("the kit loads a hub model's main revision; download the one you want (`huggingface-cli download NAME "
            "--revision REV --local-dir DIR`) and give model.name: DIR")
WANDB = ("Weights & Biases names: set train.report_to: wandb and WANDB_PROJECT / WANDB_ENTITY / WANDB_NAME in the "
         "environment")
OPEN_R1_REWARD_ARGS = ("cosine_min_value_wrong cosine_max_value_wrong cosine_min_value_correct "
                       "cosine_max_value_correct cosine_max_len repetition_n_grams repetition_max_penalty "
                       "code_language code_provider ioi_provider code_eval_test_batch_size "
                       "parallel_code_exec_per_proc e2b_router_url morph_router_url max_completion_len "
                       "soft_punish_cache")

F = ForeignName
FOREIGN_NAMES: list[ForeignName] = [
    # Unsloth FastLanguageModel.from_pretrained
    F("model_name", "top model", U_LOAD, MAP, "the model to load", "model.name"),
    F("max_seq_length", "top", U_LOAD, MAP, "the longest sequence in tokens", "model.max_seq_length"),
    F("dtype", "model", U_LOAD, MAP, "Unsloth's None detects the dtype, the kit's auto", "model.dtype",
      values=(None, "torch.bfloat16", "torch.float16", "torch.float32", "bf16", "fp16", "fp32"), convert="dtype_name"),
    F("dtype", "top train", f"{U_LOAD}, {TRL_MODEL}", MAP, "the weights' dtype (None: detect, the kit's auto)",
      "model.dtype", convert="dtype_name"),
    F("torch_dtype", "top model train", f"{TRL_MODEL}, transformers < 4.56", MAP,
      "the weights' dtype (transformers renamed torch_dtype to dtype)", "model.dtype", convert="dtype_name"),
    F("load_in_4bit", "top train", f"{U_LOAD}, {TRL_MODEL}, {AXOLOTL}", MAP, "4-bit (QLoRA) base weights",
      "model.load_in_4bit"),
    F("load_in_8bit", "top model train", f"{U_LOAD}, {TRL_MODEL}, {AXOLOTL}", IGNORE,
      "not 8-bit: the kit loads 4-bit (model.load_in_4bit: true) or 16-bit weights", values=(False, None)),
    F("load_in_8bit", "top model train", f"{U_LOAD}, {TRL_MODEL}, {AXOLOTL}", REFUSE,
      "8-bit weights (bitsandbytes LLM.int8) are not a loading mode of the kit: model.load_in_4bit: true loads "
      "4-bit (QLoRA), false 16-bit", "model.load_in_4bit"),
    F("load_in_16bit", "top model", U_LOAD, IGNORE, "not forced to 16-bit: model.load_in_4bit decides",
      values=(False, None)),
    F("load_in_16bit", "top model", U_LOAD, MAP, "16-bit LoRA: 16-bit base weights", "model.load_in_4bit",
      values=(True,), convert="negate"),
    F("full_finetuning", "top model", U_LOAD, IGNORE, "LoRA, the kit's default (lora: false trains every weight)",
      values=(False, None)),
    F("full_finetuning", "top model", U_LOAD, MAP, "every weight trained: the kit's lora: false", "lora",
      values=(True,), convert="false"),
    F("token use_auth_token hf_use_auth_token push_to_hub_token", "top model train", f"{U_LOAD}, {AXOLOTL}", IGNORE,
      "no token given here: the kit reads the hub token from HF_TOKEN or `huggingface-cli login`",
      values=(None, False, True)),
    F("token use_auth_token hf_use_auth_token push_to_hub_token", "top model train", f"{U_LOAD}, {HF}, {AXOLOTL}",
      REFUSE, TOKEN),
    F("device_map", "top model train", f"{U_LOAD}, {AXOLOTL}", IGNORE,
      "the kit puts the model on its process's GPU (or the CPU) itself"),
    F("rope_scaling", "top model", U_LOAD, IGNORE, "none asked for: the model's config.json decides", values=(None,)),
    F("rope_scaling", "top model", U_LOAD, REFUSE, "the kit has no RoPE scaling setting; save the model with "
      "rope_scaling in its config.json and give that directory as model.name", "model.name"),
    F("fix_tokenizer", "top model", U_LOAD, IGNORE, "Unsloth's default, which the kit keeps", values=(True, None)),
    F("fix_tokenizer", "top model", U_LOAD, REFUSE, "the kit loads every model with Unsloth's tokenizer fixes "
      "(fix_tokenizer: true); remove it"),
    F("trust_remote_code", "top", U_LOAD, MAP, "run the model repository's own code", "model.trust_remote_code"),
    F("use_gradient_checkpointing", "top model lora train", f"{U_LOAD}, {U_PEFT}", IGNORE, GRADIENT_CHECKPOINTING),
    F("revision model_revision revision_of_model", "top model train", f"{U_LOAD}, {TRL_MODEL}, {AXOLOTL}",
      IGNORE, "the hub's main revision, which the kit loads", values=(None, "main")),
    F("revision model_revision revision_of_model", "top model train", f"{U_LOAD}, {TRL_MODEL}, {AXOLOTL}",
      REFUSE, REVISION, "model.name"),
    F("fast_inference", "top model", U_LOAD, IGNORE, f"Unsloth's vLLM engine for generation; {NO_VLLM}, slower, "
      f"with the same sampling settings"),
    F("gpu_memory_utilization", "top model", U_LOAD, IGNORE, f"the GPU memory share vLLM reserves; {NO_VLLM} "
      f"(with train.use_vllm, TRL's share is train.vllm_gpu_memory_utilization)"),
    F("max_lora_rank", "top model", U_LOAD, IGNORE, f"the largest LoRA rank vLLM serves; {NO_VLLM}; the adapter's "
      f"rank is lora.r"),
    F("float8_kv_cache disable_log_stats", "top model", U_LOAD, IGNORE, f"vLLM's settings; {NO_VLLM}"),
    F("random_state", "top model lora", f"{U_LOAD}, {U_PEFT}", IGNORE, "seeds Unsloth's LoRA initialisation; the "
      "kit seeds it, the data order and sampling with the recipe's seed ({seed}); set seed: to change it"),
    # Unsloth get_peft_model, PEFT, the TRL CLI's ModelConfig, axolotl: the adapter
    F("lora_r", "lora top train", f"{TRL_MODEL}, {AXOLOTL}", MAP, "the LoRA rank", "lora.r"),
    F("lora_alpha", "lora top train", f"{U_PEFT}, {PEFT}, {TRL_MODEL}, {AXOLOTL}", MAP,
      "the LoRA scaling numerator (scale alpha / r)", "lora.alpha"),
    F("lora_dropout", "lora top train", f"{U_PEFT}, {PEFT}, {TRL_MODEL}, {AXOLOTL}", MAP, "dropout on the LoRA "
      "input", "lora.dropout"),
    F("lora_target_modules", "lora top train", f"{TRL_MODEL}, {AXOLOTL}", MAP, "the modules adapted",
      "lora.target_modules"),
    F("lora_target_linear", "lora top train", AXOLOTL, IGNORE, "the modules are lora_target_modules",
      values=(False, None)),
    F("lora_target_linear", "lora top train", AXOLOTL, MAP, "every linear layer: PEFT's 'all-linear'",
      "lora.target_modules", convert="all_linear"),
    F("max_seq_length", "lora", U_PEFT, IGNORE, "get_peft_model's copy, unused by Unsloth; the model's length is "
      "model.max_seq_length"),
    F("bias", "lora", f"{U_PEFT}, {PEFT}", IGNORE, "PEFT's default, which the kit passes: no bias is trained",
      values=("none",)),
    F("bias", "lora", f"{U_PEFT}, {PEFT}", REFUSE, "the kit trains no bias terms (bias: none); remove it"),
    F("use_rslora peft_use_rslora", "lora top train", f"{U_PEFT}, {TRL_MODEL}, {AXOLOTL}", IGNORE,
      "the kit's alpha / r scaling", values=(False, None)),
    F("use_rslora peft_use_rslora", "lora top train", f"{U_PEFT}, {TRL_MODEL}, {AXOLOTL}", REFUSE,
      "rank-stabilised LoRA scales by alpha / sqrt(r), the kit by alpha / r: remove it and set lora.alpha to "
      "alpha x sqrt(r) for the same scale (r 16, alpha 16 -> alpha 64)", "lora.alpha"),
    F("use_dora peft_use_dora", "lora top train", f"{PEFT}, {TRL_MODEL}, {AXOLOTL}", IGNORE, "plain LoRA, the kit's",
      values=(False, None)),
    F("use_dora peft_use_dora", "lora top train", f"{PEFT}, {TRL_MODEL}, {AXOLOTL}", REFUSE,
      "DoRA's magnitude vectors are not trained by the kit; remove it (plain LoRA)"),
    F("loftq_config", "lora", f"{U_PEFT}, {PEFT}", IGNORE, "no LoftQ: PEFT's default initialisation, the kit's",
      values=(None, {})),
    F("loftq_config", "lora", f"{U_PEFT}, {PEFT}", REFUSE, "LoftQ initialisation is not available: the kit starts "
      "LoRA from PEFT's default (B = 0); remove it"),
    F("modules_to_save lora_modules_to_save", "lora top train", f"{U_PEFT}, {TRL_MODEL}, {AXOLOTL}", IGNORE,
      "no fully trained modules, as in the kit", values=(None, [])),
    F("modules_to_save lora_modules_to_save", "lora top train", f"{U_PEFT}, {TRL_MODEL}, {AXOLOTL}", REFUSE,
      "the kit trains only the LoRA matrices; modules trained whole (embed_tokens, lm_head) need lora: false",
      "lora"),
    F("layers_to_transform layers_pattern peft_layers_to_transform peft_layers_pattern", "lora top train",
      f"{U_PEFT}, {AXOLOTL}", IGNORE, "every layer adapted, as in the kit", values=(None, [])),
    F("layers_to_transform layers_pattern peft_layers_to_transform peft_layers_pattern", "lora top train",
      f"{U_PEFT}, {AXOLOTL}", REFUSE, "the kit adapts lora.target_modules in every layer; remove it",
      "lora.target_modules"),
    F("init_lora_weights peft_init_lora_weights", "lora top train", f"{U_PEFT}, {AXOLOTL}", IGNORE,
      "PEFT's default initialisation, the kit's", values=(True, None)),
    F("init_lora_weights peft_init_lora_weights", "lora top train", f"{U_PEFT}, {AXOLOTL}", REFUSE,
      "the kit starts LoRA from PEFT's default initialisation (B = 0); remove it"),
    F("task_type lora_task_type", "lora top train", f"{PEFT}, {TRL_MODEL}", IGNORE, "a causal LM's adapter, the "
      "kit's", values=("CAUSAL_LM", None)),
    F("task_type lora_task_type", "lora top train", f"{PEFT}, {TRL_MODEL}", REFUSE, "a stage of type reward builds "
      "its own sequence-classification adapter; remove it"),
    F("lora_target_parameters lora_fan_in_fan_out", "lora top train", f"{TRL_MODEL}, {AXOLOTL}", IGNORE,
      "unset, as in the kit", values=(None, False, [])),
    F("lora_target_parameters lora_fan_in_fan_out", "lora top train", f"{TRL_MODEL}, {AXOLOTL}", REFUSE,
      "not passed by the kit, which adapts lora.target_modules; remove it", "lora.target_modules"),
    F("use_peft", "top train", TRL_MODEL, IGNORE, "LoRA, the kit's default", values=(True,)),
    F("use_peft", "top train", TRL_MODEL, MAP, "every weight trained: the kit's lora: false", "lora",
      values=(False, None), convert="false"),
    F("adapter", "top train", AXOLOTL, IGNORE, "LoRA, the kit's default", values=("lora",)),
    F("adapter", "top train", AXOLOTL, MAP, "LoRA on 4-bit base weights", "model.load_in_4bit", values=("qlora",),
      convert="true"),
    F("adapter", "top train", AXOLOTL, MAP, "no adapter: every weight trained, the kit's lora: false", "lora",
      values=(None, ""), convert="false"),
    F("adapter", "top train", AXOLOTL, REFUSE, "the kit trains a LoRA adapter (lora:) or every weight (lora: "
      "false); remove it", "lora"),
    F("lora_model_dir", "top train", AXOLOTL, IGNORE, "no adapter to start from", values=(None, "")),
    F("lora_model_dir", "top train", AXOLOTL, REFUSE, "a stage starts from an earlier stage's adapter with init:; "
      "an adapter trained elsewhere is not loaded", "stage.init"),
    F("bnb_4bit_quant_type", "top train", TRL_MODEL, IGNORE, "NF4, the kit's 4-bit", values=("nf4",)),
    F("bnb_4bit_quant_type", "top train", TRL_MODEL, REFUSE, "the kit's 4-bit weights are NF4; remove it"),
    F("use_bnb_nested_quant bnb_4bit_quant_storage", "top train", TRL_MODEL, IGNORE,
      "bitsandbytes details the kit's loader decides"),
    F("attn_implementation flash_attention sdp_attention xformers_attention flex_attention eager_attention "
      "s2_attention", "top model train", f"{TRL_MODEL}, {AXOLOTL}", IGNORE,
      "the loader picks the attention: Unsloth's kernels on a GPU, PyTorch's scaled-dot-product attention "
      "otherwise"),
    # the TRL CLI's and open-r1's script arguments
    F("model_name_or_path base_model", "top train", f"{TRL_MODEL}, {AXOLOTL}", MAP, "the model to load",
      "model.name"),
    F("base_model_config tokenizer_config tokenizer_type model_type", "top train", AXOLOTL, IGNORE,
      "the kit loads the model's own config and tokenizer, as AutoModelForCausalLM"),
    F("dataset_name", "stage train", f"{TRL_SCRIPT}, {OPEN_R1}", MAP, "the training data", "stage.data.path"),
    F("dataset_config dataset_configs", "stage train", f"{TRL_SCRIPT}, {OPEN_R1}", MAP, "the hub dataset's "
      "configuration", "stage.data.config", convert="one_config"),
    F("dataset_train_split", "stage train", TRL_SCRIPT, MAP, "the split trained on", "stage.data.split"),
    F("dataset_test_split", "stage train", TRL_SCRIPT, IGNORE, "the held-out split is not read: held-out rows go "
      "in a stage's eval: {data: ...} (eval_data or eval_fraction on preference stages)"),
    F("dataset_streaming", "stage train", TRL_SCRIPT, IGNORE, "read whole, as the kit does", values=(False, None)),
    F("dataset_streaming", "stage train", TRL_SCRIPT, REFUSE, "the kit reads a dataset whole; data.limit: N reads "
      "its first N rows", "stage.data.limit"),
    F("ignore_bias_buffers", "stage train", TRL_SCRIPT, IGNORE, "a DDP debugging switch"),
    F("dataset_prompt_column", "stage train", OPEN_R1, IGNORE, "the column is already prompt", values=("prompt",)),
    F("dataset_prompt_column", "stage train", OPEN_R1, MAP, "the column holding the prompts: renamed to prompt",
      "stage.data.columns", convert="prompt_column"),
    F("system_prompt", "train", OPEN_R1, MAP, "a system message before every prompt", "stage.system_prompt"),
    F("chat_template", "top train", f"{OPEN_R1}, {AXOLOTL}", IGNORE, "the tokenizer's own template, the kit's "
      "default", values=("tokenizer_default",)),
    F("chat_template chat_template_jinja", "top train", f"{OPEN_R1}, {AXOLOTL}", MAP, "the chat template (a "
      "template name or Jinja)", "model.chat_template", convert="template_name"),
    F("reward_funcs", "top stage train", f"{TRL_SCRIPT}, {OPEN_R1}, {AXOLOTL}", REFUSE,
      "reward functions go in the stage's rewards: list: a kit built-in (kit rewards list), module:function or "
      "file.py:function; TRL's are trl.rewards:NAME, open-r1's open_r1.rewards:NAME_reward (a bare name is the "
      "kit's built-in of that name)", "stage.rewards"),
    F("reward_model_name_or_path", "stage train", TRL_SCRIPT, REFUSE, "a learned reward goes in reward_model: a "
      "reward stage of this recipe, or {path: DIR} of a saved sequence-classification model", "stage.reward_model"),
    F(OPEN_R1_REWARD_ARGS, "stage train", OPEN_R1, REFUSE, "an argument of an open-r1 reward: give it in that "
      "reward's args: in rewards: (e.g. {name: open_r1.rewards:get_cosine_scaled_reward, args: {max_len: 1000}})",
      "stage.rewards"),
    F("benchmarks callbacks", "train", OPEN_R1, IGNORE, "open-r1's post-training jobs; `kit eval RUN --tasks ...` "
      "runs lm-eval benchmarks on a finished run"),
    F("hub_model_revision overwrite_hub_revision push_to_hub_revision", "train", OPEN_R1, IGNORE,
      "open-r1's pushes to a Hub branch, which the kit does not make"),
    F("wandb_log_unique_prompts", "train", OPEN_R1, MAP, "log each unique prompt (TRL 1.x's name)",
      "train.log_unique_prompts"),
    F("wandb_entity wandb_project wandb_run_group wandb_name wandb_watch wandb_log_model wandb_run_id wandb_mode",
      "top train", f"{OPEN_R1}, {AXOLOTL}", IGNORE, WANDB),
    F("num_processes", "top train", OPEN_R1, IGNORE, "the number of processes is the launcher's: kit run --launcher "
      "accelerate --num-processes N"),
    # transformers' and TRL's renames and removals across the versions people copy from
    F("warmup_ratio", "train", f"{HF}, {AXOLOTL}", MAP, "transformers 5 has no warmup_ratio: a float warmup_steps "
      "below 1 is the same fraction of the run's steps", "train.warmup_steps", convert="warmup_fraction"),
    F("evaluation_strategy", "train", HF, MAP, "renamed eval_strategy in transformers 4.41", "train.eval_strategy"),
    F("per_gpu_train_batch_size", "train", HF, MAP, "the old name, removed in transformers 5",
      "train.per_device_train_batch_size"),
    F("per_gpu_eval_batch_size", "train", HF, MAP, "the old name, removed in transformers 5",
      "train.per_device_eval_batch_size"),
    F("no_cuda", "train", HF, IGNORE, "the device the kit finds is used", values=(False, None)),
    F("no_cuda", "train", HF, MAP, "renamed use_cpu in transformers 4.34", "train.use_cpu", values=(True,)),
    F("use_mps_device", "train", HF, IGNORE, "not Apple's GPU, as in the kit", values=(False, None)),
    F("use_mps_device", "train", HF, REFUSE, "the kit trains on a CUDA GPU or the CPU (train.use_cpu: true); "
      "remove it", "train.use_cpu"),
    F("logging_dir", "train", HF, IGNORE, "removed in transformers 5; the kit logs to the run directory "
      "(metrics.jsonl, report.md)"),
    F("overwrite_output_dir", "train", HF, IGNORE, "removed in transformers 5; the run directory is the kit's: kit "
      "run resumes it, --force redoes finished stages, -o DIR picks another"),
    F("save_safetensors", "train", HF, IGNORE, "removed in transformers 5, which always saves safetensors"),
    F("include_tokens_per_second", "train", HF, IGNORE, "removed in transformers 5"),
    F("fp16_backend half_precision_backend", "train", HF, IGNORE, "transformers 4's mixed-precision backends, "
      "removed in 5; the kit sets bf16 / fp16 itself"),
    F("group_by_length", "train", f"{HF}, {AXOLOTL}", IGNORE, "random order, the default", values=(False, None)),
    F("group_by_length", "train", f"{HF}, {AXOLOTL}", MAP, "transformers 5's train_sampling_strategy: "
      "group_by_length", "train.train_sampling_strategy", values=(True,), convert="group_by_length"),
    F("push_to_hub_model_id", "train", HF, MAP, "the old name, removed in transformers 5", "train.hub_model_id"),
    F("use_liger", "train", TRL0, MAP, "renamed use_liger_kernel", "train.use_liger_kernel"),
    F("max_seq_length", "train", f"{TRL0}, {U_GRPO}", MAP, "TRL 0.20 renamed SFTConfig's max_seq_length to "
      "max_length; Unsloth's other configs copy the model's", "train.max_length | model.max_seq_length"),
    F("max_prompt_length max_prompt_len", "train", f"{TRL0}, {AXOLOTL}", REFUSE,
      "TRL 1.x truncates no prompts (gone from GRPOConfig, DPOConfig, KTOConfig): GRPO and RLOO keep each prompt "
      "whole (drop long prompts from the data), DPO, KTO, ORPO and SimPO bound prompt + completion with "
      "train.max_length; remove it", "train.max_length"),
    F("max_completion_length", "train", TRL0, REFUSE, "this TRL 1.x config bounds prompt + completion together "
      "with train.max_length; remove it", "train.max_length"),
    F("ref_model", "stage train", TRL0, REFUSE, "the reference is the stage's starting policy (init: an earlier "
      "stage, or the base model), held as a frozen copy of its adapter; remove it", "stage.init"),
    F("model_adapter_name ref_adapter_name", "train", TRL0, REFUSE, "TRL 1.x's DPOTrainer makes the reference "
      "adapter itself, a frozen copy of the starting adapter (init:); remove it", "stage.init"),
    F("rpo_alpha", "train", f"{TRL0}, {AXOLOTL}", REFUSE, "DPO plus the chosen completions' NLL is "
      "train.loss_type: [sigmoid, sft] with loss_weights: [1.0, ALPHA] in TRL 1.x", "train.loss_type"),
    F("generate_during_eval", "train", TRL0, IGNORE, "no generation during evaluation", values=(False, None)),
    F("generate_during_eval", "train", TRL0, REFUSE, "TRL 1.x's DPOTrainer does not generate while it evaluates; "
      "a stage of type eval after it does (init: the stage)", "stage.init"),
    F("vllm_device vllm_dtype vllm_enable_prefix_caching", "train", f"{TRL0}, {AXOLOTL}", IGNORE,
      "removed from TRL's GRPOConfig (vLLM's own settings)"),
    F("vllm_max_model_len", "train", TRL0, MAP, "renamed in TRL 1.x", "train.vllm_max_model_length"),
    F("vllm_guided_decoding_regex", "train", TRL0, MAP, "renamed in TRL 1.x", "train.vllm_structured_outputs_regex"),
    F("vllm_sampling_params", "train", U_GRPO, MAP, "vLLM's SamplingParams: temperature, top_p, top_k (-1: 0), "
      "min_p, repetition_penalty and max_tokens (max_completion_length) are GRPOConfig's own; seed is the "
      "recipe's", "train", convert="sampling_params"),
    F("unsloth_num_chunks unsloth_logit_chunk_multiplier unsloth_grpo_mini_batch", "train", U_GRPO, IGNORE,
      "Unsloth's memory chunking of its GRPO loss; the kit leaves it to Unsloth"),
    # axolotl's training names
    F("micro_batch_size", "train", AXOLOTL, MAP, "rows per device per step", "train.per_device_train_batch_size"),
    F("eval_batch_size", "train", AXOLOTL, MAP, "rows per device per evaluation step",
      "train.per_device_eval_batch_size"),
    F("batch_size", "train", AXOLOTL, REFUSE, "axolotl's total batch is the kit's train.per_device_train_batch_size "
      "x gradient_accumulation_steps (x processes); set those", "train.per_device_train_batch_size"),
    F("num_epochs", "train", AXOLOTL, MAP, "passes over the data", "train.num_train_epochs"),
    F("lr", "train", "hand-written configs", MAP, "the peak learning rate", "train.learning_rate"),
    F("optimizer", "train", AXOLOTL, MAP, "the optimizer", "train.optim"),
    F("lr_scheduler", "train", AXOLOTL, MAP, "the learning-rate schedule", "train.lr_scheduler_type"),
    F("cosine_min_lr_ratio", "train", AXOLOTL, REFUSE, "a cosine schedule down to a share of the peak is "
      "train.lr_scheduler_type: cosine_with_min_lr with lr_scheduler_kwargs: {min_lr_rate: RATIO}",
      "train.lr_scheduler_type"),
    F("sequence_len", "top train", AXOLOTL, MAP, "the longest sequence in tokens", "model.max_seq_length"),
    F("val_set_size", "train", AXOLOTL, IGNORE, "nothing held out", values=(0, 0.0, None)),
    F("val_set_size", "train", AXOLOTL, MAP, "the share of the rows held out (on other stages held-out rows go "
      "in eval: {data: FILE})", "stage.eval_fraction"),
    F("dataset_prepared_path", "train", AXOLOTL, IGNORE, "the kit reads the data file each run"),
    F("dataset_processes", "train", AXOLOTL, MAP, "processes preparing the data (a stage whose trainer has "
      "none drops it)", "train.dataset_num_proc | -"),
    F("sample_packing", "train", AXOLOTL, IGNORE, "no packing, the kit's default", values=(False, None)),
    F("sample_packing", "train", AXOLOTL, MAP, "rows packed into full sequences", "train.packing"),
    F("eval_sample_packing", "train", AXOLOTL, IGNORE, "no packing", values=(False, None)),
    F("eval_sample_packing", "train", AXOLOTL, MAP, "evaluation rows packed", "train.eval_packing"),
    F("pad_to_sequence_len", "train", AXOLOTL, IGNORE, "the kit pads each batch to its longest row"),
    F("train_on_inputs", "train", AXOLOTL, MAP, "the loss on completions only: TRL's completion_only_loss (the "
      "preference and RL losses score completions only anyway)", "train.completion_only_loss | -",
      values=(False, None), convert="negate"),
    F("train_on_inputs", "train", AXOLOTL, MAP, "the loss on prompts too: completion_only_loss false",
      "train.completion_only_loss", convert="negate"),
    F("evals_per_epoch saves_per_epoch", "train", AXOLOTL, IGNORE, "unset", values=(None,)),
    F("evals_per_epoch saves_per_epoch", "train", AXOLOTL, REFUSE, "the kit counts evaluations and saves in "
      "steps: train.eval_steps / train.save_steps (steps per epoch: rows / (batch x accumulation))",
      "train.save_steps"),
    F("early_stopping_patience", "train", AXOLOTL, IGNORE, "no early stopping", values=(None,)),
    F("early_stopping_patience", "train", AXOLOTL, REFUSE, "the kit has no early stopping; train.max_steps ends a "
      "stage, and a held-out eval: records the best step", "train.max_steps"),
    F("auto_resume_from_checkpoints", "train", AXOLOTL, IGNORE, "kit run resumes a run directory from its last "
      "checkpoint itself"),
    F("eval_table_size eval_max_new_tokens", "train", AXOLOTL, IGNORE, "axolotl's generation while it evaluates; "
      "a stage of type eval generates with its generation: settings"),
    F("special_tokens tokens added_tokens_overrides", "train", AXOLOTL, REFUSE, "the kit keeps the tokenizer's own "
      "special tokens and adds none (pad = EOS where it has none); SFTConfig and DPOConfig take train.pad_token",
      "train.pad_token"),
    F("loss_watchdog_threshold loss_watchdog_patience", "train", AXOLOTL, IGNORE, "the kit's alarms watch the loss "
      "(NaN, exploding)"),
    F("gc_steps save_first_step strict", "train", AXOLOTL, IGNORE, "axolotl's own housekeeping"),
    F("plugins unfrozen_parameters", "train", AXOLOTL, IGNORE, "unset", values=(None, [])),
    F("plugins unfrozen_parameters", "train", AXOLOTL, REFUSE, "axolotl's plugins and partly frozen models are not "
      "the kit's: it trains the LoRA adapter or every weight (lora: false); Liger kernels are "
      "train.use_liger_kernel; remove it", "lora"),
    F("rl", "top stage train", AXOLOTL, REFUSE, "the trainer is the stage's type: (dpo, kto, orpo, simpo, grpo; ipo "
      "is dpo with train.loss_type: [ipo])", "stage.type"),
    F("rl_beta orpo_alpha", "train", AXOLOTL, MAP, "the method's beta (TRL's ORPOConfig weighs its odds-ratio loss "
      "with beta)", "train.beta"),
    F("kto_desirable_weight", "train", AXOLOTL, MAP, "the weight of desirable rows", "train.desirable_weight"),
    F("kto_undesirable_weight", "train", AXOLOTL, MAP, "the weight of undesirable rows", "train.undesirable_weight"),
    F("datasets", "stage train", f"{AXOLOTL}, {TRL_SCRIPT}", REFUSE, "a stage reads one dataset: data: {path, "
      "split, config, columns}", "stage.data"),
    F("trl", "train", AXOLOTL, REFUSE, "axolotl's trainer section: its keys are train: keys of the stage "
      "(reward_funcs: the stage's rewards:)", "train"),
    F("vllm", "train", AXOLOTL, IGNORE, f"axolotl's vLLM server settings; {NO_VLLM}"),
    F("bf16", "train", AXOLOTL, IGNORE, "the kit chooses: bf16 on a GPU that has it, else fp16; float32 on a CPU",
      values=("auto",)),
]
