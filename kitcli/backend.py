"""The one place that decides how a model is loaded, and says which way it chose.

Backends:
- `unsloth-gpu`: Unsloth's FastLanguageModel on CUDA (4-bit + LoRA by default).
- `unsloth-cpu`: Unsloth's CPU backend (its loader is stock transformers + PEFT with CPU-tuned defaults).
- `transformers`: plain transformers + PEFT, where Unsloth cannot serve (not installed, sequence
  classification on CPU, multi-process launches) or when a recipe asks for it.

In a training process `unsloth` must be imported before trl / transformers / peft, or its patches are not
applied: `prepare_backend` does that and every stage calls it before touching those libraries.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kitcli import dist
from kitcli.errors import KitError
from kitcli.rundir import StageDir

HEAVY_MODULES = ("torch", "transformers", "trl", "peft", "unsloth")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    backend: str
    device: str
    dtype: str
    load_in_4bit: bool
    trainable_params: int
    total_params: int

    def summary(self, label: str) -> str:
        share = 100.0 * self.trainable_params / max(self.total_params, 1)
        return (f"{label}: backend {self.backend} | device {self.device} | dtype {self.dtype} | "
                f"4-bit {'yes' if self.load_in_4bit else 'no'} | trainable {self.trainable_params:,} of "
                f"{self.total_params:,} parameters ({share:.2f}%)")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_backend(requested: str = "auto", task: str = "causal") -> str:
    """Pick the backend for a model. `task` is "causal" (policies) or "seq_cls" (reward models, critics)."""
    has_unsloth = importlib.util.find_spec("unsloth") is not None
    on_gpu = cuda_available()
    if os.environ.get("KIT_FORCE_BACKEND"):
        requested = os.environ["KIT_FORCE_BACKEND"]
    if requested == "transformers":
        return "transformers"
    if requested == "unsloth" and not has_unsloth:
        raise KitError("model.backend is 'unsloth' but unsloth is not installed; pip install unsloth, "
                       "or set model.backend: transformers")
    if not has_unsloth:
        return "transformers"
    if task == "seq_cls" and not on_gpu:
        return "transformers"  # Unsloth's CPU loader ignores num_labels (see stack facts)
    return "unsloth-gpu" if on_gpu else "unsloth-cpu"


def prepare_backend(backend: str) -> None:
    """Import unsloth first (before trl / transformers / peft) when it will be used; quiet library chatter."""
    if backend.startswith("unsloth"):
        from kitcli.tiny import kit_home

        # Unsloth writes the trainers and modules it generates to ./unsloth_compiled_cache unless told otherwise
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(kit_home() / "unsloth_compiled_cache"))
        late = [m for m in ("trl", "transformers", "peft") if m in sys.modules and "unsloth" not in sys.modules]
        if late:
            print(f"kit: warning: {', '.join(late)} imported before unsloth; Unsloth's patches may be incomplete",
                  file=sys.stderr)
        import unsloth  # noqa: F401
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    os.environ.setdefault("TQDM_DISABLE", "1")  # TRL's own bars (e.g. DPO's reference precompute); kit shows progress
    if backend == "transformers" and not cuda_available():
        route_trl_fused_head_off_gpu()


def route_trl_fused_head_off_gpu() -> None:
    """TRL 1.15's SFT and GRPO trainers compute token log-probabilities with a Triton kernel that runs on CUDA only
    (Unsloth's CPU backend reroutes it; plain transformers + PEFT does not). Off the GPU, compute them with torch."""
    from trl.trainer import utils as trl_utils

    kernel = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if getattr(kernel, "_kit_dispatch", False) or getattr(kernel, "_unsloth_cpu_dispatch", False):
        return

    class DeviceDispatch:
        _kit_dispatch = True

        @staticmethod
        def apply(hidden, *args, **kwargs):
            if kernel is not None and hidden.device.type in ("cuda", "xpu"):
                return kernel.apply(hidden, *args, **kwargs)
            return torch_token_log_probs(hidden, *args, **kwargs)

    trl_utils._ChunkedLogProbFunction = DeviceDispatch


def torch_token_log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                          logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
    """The outputs of TRL's `ChunkedLogProbFunction` (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1;
    None where not asked for) in plain torch. It materialises the [tokens, vocabulary] logits: fine at CPU sizes."""
    import torch

    logits = torch.nn.functional.linear(hidden, weight.to(hidden.dtype),
                                        None if bias is None else bias.to(hidden.dtype)).float() * logit_scale
    if final_logit_softcapping:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if "entropy" in outputs else None
    squares = torch.logsumexp(2 * logprobs, dim=-1).detach() if "log_sum_sq_probs" in outputs else None
    mean = logits.mean(-1).detach() if "mean_logits" in outputs else None
    top1 = (logits.argmax(-1) == targets).detach() if "is_top1" in outputs else None
    return chosen, entropy, squares, mean, top1


def resolve_model_path(name: str, seed: int) -> str:
    if name == "tiny":
        from kitcli.tiny import ensure_tiny_model

        return str(ensure_tiny_model(seed=0))
    return name


def torch_dtype(name: str, on_gpu: bool):
    import torch

    if name == "auto":
        if on_gpu:
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return getattr(torch, name)


def count_parameters(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def lora_from_adapter(adapter_dir: Path) -> dict[str, Any]:
    """The LoRA settings an adapter was saved with, so a later stage continues with the same shapes."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    targets = config.get("target_modules")
    return {"r": config["r"], "alpha": config["lora_alpha"], "dropout": config.get("lora_dropout", 0.0),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}


def load_policy(
    model_name: str,
    *,
    max_seq_length: int,
    load_in_4bit: bool,
    lora: dict[str, Any] | None,
    backend: str = "auto",
    dtype: str = "auto",
    seed: int = 42,
    init_from: Path | None = None,
    trust_remote_code: bool = False,
    trainable: bool = True,
    log=print,
    label: str = "policy",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, with a fresh LoRA adapter, `init_from`'s adapter, or full weights.

    `init_from` is an earlier stage's output: a directory with `adapter/` (LoRA; loaded into the new adapter,
    so the stage starts from exactly those weights) or `model/` (full fine-tuning).
    """
    chosen = choose_backend(backend)
    prepare_backend(chosen)
    path = resolve_model_path(model_name, seed)
    adapter_dir = None
    if init_from is not None:
        init = StageDir(init_from)
        if init.adapter.is_dir():
            adapter_dir = init.adapter
            lora = lora_from_adapter(adapter_dir)
        elif init.model.is_dir():
            path, lora = str(init.model), None
        else:
            raise KitError(f"stage output '{init_from}' has no adapter/ or model/; re-run that stage with --force")
    if chosen.startswith("unsloth"):
        model, tokenizer, quantized = _load_unsloth(path, max_seq_length, load_in_4bit, lora, dtype, seed,
                                                    trust_remote_code, full_finetuning=lora is None and trainable)
    else:
        model, tokenizer, quantized = _load_transformers(path, max_seq_length, load_in_4bit, lora, dtype, seed,
                                                         trust_remote_code)
    if adapter_dir is not None:
        load_adapter_weights(model, adapter_dir)
    if not trainable:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    trainable_count, total = count_parameters(model)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, backend=chosen, device=str(model.device),
                         dtype=str(next(model.parameters()).dtype).replace("torch.", ""), load_in_4bit=quantized,
                         trainable_params=trainable_count, total_params=total)
    log(loaded.summary(label))
    return loaded


def load_stage_policy(model: dict[str, Any], *, lora: dict[str, Any] | None, seed: int, init_from: Path | None,
                      log=print, trainable: bool = True, label: str = "policy", **overrides: Any) -> LoadedModel:
    """`load_policy` with the settings of a recipe's `model:` mapping (`overrides` replace any of them)."""
    settings = {key: model[key] for key in ("max_seq_length", "load_in_4bit", "backend", "dtype", "trust_remote_code")}
    settings.update(overrides)
    return load_policy(model["name"], lora=lora, seed=seed, init_from=init_from, trainable=trainable, log=log,
                       label=label, **settings)


def _is_quantized(model) -> bool:
    return any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())


def _load_unsloth(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code, full_finetuning):
    from unsloth import FastLanguageModel

    on_gpu = cuda_available()
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=path,
        max_seq_length=max_seq_length,
        dtype=torch_dtype(dtype, on_gpu),
        load_in_4bit=load_in_4bit and not full_finetuning,
        full_finetuning=full_finetuning,
        trust_remote_code=trust_remote_code,
        local_files_only=Path(path).is_dir(),
    )
    if lora is not None:
        model = FastLanguageModel.get_peft_model(
            model,
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            bias="none",
            use_gradient_checkpointing="unsloth" if on_gpu else False,
            random_state=seed,
        )
    return model, tokenizer, _is_quantized(model)


def _load_transformers(path, max_seq_length, load_in_4bit, lora, dtype, seed, trust_remote_code):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    on_gpu = cuda_available()
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype, on_gpu), "trust_remote_code": trust_remote_code}
    quantize = load_in_4bit and lora is not None and on_gpu  # bitsandbytes 4-bit training needs CUDA here
    if quantize:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=kwargs["dtype"])
        kwargs["device_map"] = {"": dist.local_rank()}  # this process's GPU
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=Path(path).is_dir(), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, model_max_length=max_seq_length,
                                              trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora is not None:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if quantize:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        torch.manual_seed(seed)
        config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                            target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    return model, tokenizer, _is_quantized(model)


def load_adapter_weights(model, adapter_dir: Path) -> None:
    """Copy a saved adapter's weights into the model's (identically shaped) fresh adapter."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise KitError(f"adapter '{adapter_dir}' does not fit the model (unexpected weights such as "
                       f"{unexpected[0]}); was it trained on a different base model?")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config")


def save_model(model, tokenizer, stage_dir: Path) -> Path:
    """Save the adapter (or full model) and tokenizer under a temporary name, then rename into place."""
    import shutil

    final = StageDir(stage_dir).adapter if is_peft_model(model) else StageDir(stage_dir).model
    state = dist.gathered_state_dict(model)  # sharded weights (ZeRO-3, FSDP) gathered; None otherwise
    if dist.is_main_process():  # under `kit run --launcher` one process writes, the others wait
        staging = stage_dir / (final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(str(staging), **({"state_dict": state} if state is not None else {}))
        tokenizer.save_pretrained(str(staging))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    dist.barrier()
    return final


# --- reward models (sequence classification with one output) --------------------------------------------------

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
    load_in_4bit: bool,
    lora: dict[str, Any] | None,
    backend: str = "auto",
    dtype: str = "auto",
    seed: int = 42,
    init_from: Path | None = None,
    trust_remote_code: bool = False,
    log=print,
    label: str = "reward model",
) -> LoadedModel:
    """Load a sequence-classification model with one output (a scalar reward), with LoRA whose score head is
    trained in full (`modules_to_save`), and `config.pad_token_id` set so the last real token is scored.

    `init_from` is an earlier stage's output. With `adapter/`, its LoRA weights are copied into the new adapter
    (a policy adapter fits: a causal LM and its sequence-classification twin share the decoder under the same
    names); the score head is new either way. With `model/` (full fine-tuning), that model is the base.
    Unsloth serves this on a GPU (`FastModel` with `num_labels`); on CPU, or if Unsloth cannot, transformers + PEFT.
    """
    prepare_backend(choose_backend(backend))  # import unsloth first whenever the run's policies use it
    chosen = choose_backend(backend, task="seq_cls")
    path = resolve_model_path(model_name, seed)
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
    return model, tokenizer, _is_quantized(model)


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
    return model, tokenizer, _is_quantized(model)


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
