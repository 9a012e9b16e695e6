"""Reward models: sequence-classification models with one output (a scalar score), loaded the way
kitcli/models/backend.py decides (Unsloth on a GPU; transformers + PEFT on a CPU, where Unsloth's loader cannot
build one), trained by the reward stage, merged for the stages that score with them, or attached to a policy's base
for PPO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kitcli import dist
from kitcli.errors import KitError
from kitcli.models.backend import (
    LoadedModel,
    choose_backend,
    count_parameters,
    cuda_available,
    four_bit,
    is_peft_model,
    is_quantized,
    lora_from_adapter,
    prepare_backend,
    resolve_model_path,
    torch_dtype,
)
from kitcli.models.chat_template import apply_chat_template, require_unsloth_for
from kitcli.rundir import StageDir

REWARD_HEADS = ("score", "classifier")


def classification_head_name(model) -> str:
    """The name of the freshly initialised output head of a sequence-classification model (`score` for Qwen/Llama)."""
    base = model.get_base_model() if is_peft_model(model) else model
    for name in REWARD_HEADS:
        if hasattr(base, name):
            return name
    raise KitError(f"{type(base).__name__} has no '{REWARD_HEADS[0]}' head; kit's reward stage supports decoder "
                   f"models whose sequence-classification class has one (Qwen, Llama, Mistral, Gemma, ...)")


def load_reward_model(
    model_name: str,
    *,
    max_seq_length: int,
    load_in_4bit: bool | None,
    lora: dict[str, Any] | None,
    backend: str = "auto",
    dtype: str = "auto",
    seed: int = 42,
    init_from: Path | None = None,
    trust_remote_code: bool = False,
    chat_template: str | None = None,
    log=print,
    label: str = "reward model",
) -> LoadedModel:
    """Load a sequence-classification model with one output (a scalar reward), with LoRA whose score head is
    trained in full (`modules_to_save`), and `config.pad_token_id` set so the last real token is scored.

    `init_from` is an earlier stage's output. With `adapter/`, its LoRA weights are copied into the new adapter
    (a policy adapter fits: a causal LM and its sequence-classification twin share the decoder under the same
    names); the score head is new either way. With `model/` (full fine-tuning), that model is the base.
    Unsloth serves this on a GPU (`FastModel` with `num_labels`); on CPU, or if Unsloth cannot, transformers + PEFT.
    The tokenizer gets the recipe's `chat_template`, as the policies' do (kitcli/models/chat_template.py).
    """
    require_unsloth_for(chat_template, choose_backend(backend), label)
    prepare_backend(choose_backend(backend))  # import unsloth first whenever the run's policies use it
    chosen = choose_backend(backend, task="seq_cls")
    load_in_4bit = four_bit(load_in_4bit)
    path = resolve_model_path(model_name, seed, log=log)
    adapter_dir = None
    if init_from is not None:
        init = StageDir(init_from)
        if init.adapter.is_dir():
            adapter_dir = init.adapter
            lora = lora_from_adapter(adapter_dir)
        elif init.model.is_dir():
            path = str(init.model)
        else:
            raise KitError(f"stage output '{init_from}' has no adapter/ or model/; re-run that stage with --force")
    loaded = None
    if chosen == "unsloth-gpu":
        try:
            loaded = _load_unsloth_seq_cls(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code)
        except Exception as error:  # noqa: BLE001  (an optional fast path: say why, then fall back to transformers + PEFT)
            log(f"{label}: Unsloth could not load a sequence-classification model ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:160] if str(error) else ''}); using transformers + PEFT")
            chosen = "transformers"
    if loaded is None:
        loaded = _load_transformers_seq_cls(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code)
    model, tokenizer, quantized = loaded
    tokenizer = apply_chat_template(tokenizer, chat_template)
    if adapter_dir is not None:
        load_partial_adapter_weights(model, adapter_dir)
    trainable_count, total = count_parameters(model)
    result = LoadedModel(model=model, tokenizer=tokenizer, backend=chosen, device=str(model.device),
                         dtype=str(next(model.parameters()).dtype).replace("torch.", ""), load_in_4bit=quantized,
                         trainable_params=trainable_count, total_params=total)
    log(result.summary(label))
    return result


def load_partial_adapter_weights(model, adapter_dir: Path) -> None:
    """Copy a saved adapter's weights into the model's adapter, keeping what the file lacks (a policy adapter has
    no score head, so the reward model's stays as initialised). Every weight in the file must fit."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    current = get_peft_model_state_dict(model)
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, tensor in saved.items():
        if key not in current or current[key].shape != tensor.shape:
            found = "absent" if key not in current else f"shaped {tuple(current[key].shape)}"
            raise KitError(f"adapter '{adapter_dir}' does not fit the model: {key} {tuple(tensor.shape)} is {found} "
                           f"here; was it trained on a different base model or LoRA rank?")
    set_peft_model_state_dict(model, {**current, **saved})


def _set_pad_token(model, tokenizer) -> None:
    """Sequence classification scores the last token that is not padding, so the model must know the pad id."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id


def _load_unsloth_seq_cls(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code):
    from transformers import AutoModelForSequenceClassification
    from unsloth import FastModel

    model, tokenizer = FastModel.from_pretrained(
        model_name=path,
        auto_model=AutoModelForSequenceClassification,
        num_labels=1,
        max_seq_length=max_seq_length,
        dtype=torch_dtype(dtype, True),
        load_in_4bit=load_in_4bit and lora is not None,
        full_finetuning=lora is None,
        trust_remote_code=trust_remote_code,
        local_files_only=Path(path).is_dir(),
    )
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor for multimodal checkpoints
    if getattr(model.config, "num_labels", None) != 1 or not any(hasattr(model, h) for h in REWARD_HEADS):
        raise TypeError(f"got {type(model).__name__} with num_labels={getattr(model.config, 'num_labels', None)}")
    _set_pad_token(model, tokenizer)
    if lora is not None:
        model = FastModel.get_peft_model(
            model,
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            bias="none",
            modules_to_save=[classification_head_name(model)],
            task_type="SEQ_CLS",
            use_gradient_checkpointing="unsloth",
            random_state=seed,
        )
    return model, tokenizer, is_quantized(model)


def _load_transformers_seq_cls(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

    on_gpu = cuda_available()
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype, on_gpu), "trust_remote_code": trust_remote_code,
                              "num_labels": 1}
    quantize = load_in_4bit and lora is not None and on_gpu  # bitsandbytes 4-bit training needs CUDA here
    if quantize:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=kwargs["dtype"], llm_int8_skip_modules=list(REWARD_HEADS))
        kwargs["device_map"] = {"": dist.local_rank()}  # this process's GPU
    torch.manual_seed(seed)  # the score head is initialised at random
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=Path(path).is_dir(), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=max_seq_length,
                                              trust_remote_code=trust_remote_code)
    _set_pad_token(model, tokenizer)
    if lora is not None:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if quantize:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        torch.manual_seed(seed)
        config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                            target_modules=lora["target_modules"], bias="none", task_type="SEQ_CLS",
                            modules_to_save=[classification_head_name(model)])
        model = get_peft_model(model, config)
    return model, tokenizer, is_quantized(model)


def save_merged_reward_model(stage_dir: Path, *, base: str, dtype: str = "auto", trust_remote_code: bool = False,
                             log=print) -> Path:
    """Write `<stage_dir>/merged/`: the saved adapter (LoRA + score head) merged into a fresh, unquantized copy of
    `base`, as a plain `AutoModelForSequenceClassification` + tokenizer (what GRPO/PPO stages load as a reward
    model). Written under a temporary name and renamed into place, like `save_model`."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    final = StageDir(stage_dir).merged
    if not dist.is_main_process():  # under `kit run --launcher` the main process writes it
        dist.barrier()
        return final
    staging = stage_dir / "merged.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    adapter_dir, model_dir = StageDir(stage_dir).adapter, StageDir(stage_dir).model
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir if adapter_dir.is_dir() else model_dir))
    if adapter_dir.is_dir():
        model = AutoModelForSequenceClassification.from_pretrained(
            base, num_labels=1, dtype=torch_dtype(dtype, cuda_available()), trust_remote_code=trust_remote_code,
            local_files_only=Path(base).is_dir())
        _set_pad_token(model, tokenizer)
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    else:  # full fine-tuning: the saved model is already plain
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir))
    _set_pad_token(model, tokenizer)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    log(f"merged reward model: {final} ({type(model).__name__}, pad_token_id {model.config.pad_token_id})")
    dist.barrier()
    return final


# --- reward models for PPO: on the policy's base, or beside it ---------------------------------------------------

def attach_reward_adapter(model, adapter_dir: Path, name: str = "reward"):
    """Put a reward stage's seq-cls adapter on a PeftModel's base as the frozen adapter `name`, and return its
    score head (a Linear on the last token's hidden state). The decoder's LoRA weights have the same names in a
    causal LM and its sequence-classification twin, so one base serves both."""
    import torch
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.modules_to_save = None  # the score head lives outside the causal LM; built below
    config.task_type = "CAUSAL_LM"
    config.inference_mode = True
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    heads = ("score", "classifier")  # the seq-cls heads PEFT saves as modules_to_save
    head_state = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 2)[-2] in heads}
    lora_state = {k: v for k, v in state.items() if k.rsplit(".", 2)[-2] not in heads}
    if "weight" not in head_state or head_state["weight"].shape[0] != 1:
        raise KitError(f"reward adapter '{adapter_dir}' has no score head with one output; re-run the reward stage")
    model.add_adapter(name, config)
    result = set_peft_model_state_dict(model, lora_state, adapter_name=name)
    if list(getattr(result, "unexpected_keys", []) or []):
        raise KitError(f"reward adapter '{adapter_dir}' does not fit the policy's base (unexpected weights such as "
                       f"{result.unexpected_keys[0]}); was it trained on a different base model?")
    weight = head_state["weight"]
    head = torch.nn.Linear(weight.shape[1], 1, bias="bias" in head_state, dtype=weight.dtype)
    head.load_state_dict(head_state)
    head.requires_grad_(False)
    return head.to(model.device)


def load_seq_cls_scorer(path: Path, *, dtype: str = "auto", log=print):
    """A saved AutoModelForSequenceClassification (e.g. a reward stage's `merged/`) for scoring only: frozen, eval
    mode, on the GPU when there is one (rewards.reward_model.load_scorer: the `reward_model` reward loads it the same
    way). Returns (model, tokenizer)."""
    from rewards.reward_model import load_scorer

    model, tokenizer = load_scorer(Path(path), torch_dtype(dtype, cuda_available()))
    log(f"reward model: {path} ({type(model).__name__}, loaded separately)")
    return model, tokenizer
