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

from kitcli import dist, libraries
from kitcli.errors import KitError
from kitcli.models.chat_template import apply_chat_template, require_unsloth_for
from kitcli.models.cpu_routes import allow_inductor_pool_aliasing, route_trl_fused_head_off_gpu
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


CPU_PRECISION_NOTE = ("16-bit base on a CPU: bitsandbytes dequantizes 4-bit weights at every matmul there, so "
                      "16-bit LoRA trains faster (bench/defaults.py); set model.load_in_4bit: true for 4-bit anyway")


def four_bit(requested: bool | None) -> bool:
    """Whether the base is loaded in 4-bit: as the recipe says, or, where it says nothing, on a GPU only."""
    return cuda_available() if requested is None else requested


def prepare_backend(backend: str) -> None:
    """Import unsloth first (before trl / transformers / peft) when it will be used; quiet library chatter."""
    if backend.startswith("unsloth"):
        from kitcli.cache import kit_home

        # Unsloth writes the trainers and modules it generates to ./unsloth_compiled_cache unless told otherwise
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", str(kit_home() / "unsloth_compiled_cache"))
        late = [m for m in ("trl", "transformers", "peft") if m in sys.modules and "unsloth" not in sys.modules]
        if late:
            print(f"kit: warning: {', '.join(late)} imported before unsloth; Unsloth's patches may be incomplete",
                  file=sys.stderr)
        with libraries.library_output():
            import unsloth  # noqa: F401
        allow_inductor_pool_aliasing()
    with libraries.library_output():
        import datasets
        import transformers
    libraries.quiet_torch_loggers()

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    os.environ.setdefault("TQDM_DISABLE", "1")  # TRL's own bars (e.g. DPO's reference precompute); kit shows progress
    if backend == "transformers" and not cuda_available():
        route_trl_fused_head_off_gpu()


def resolve_model_path(name: str, seed: int, log=print) -> str:
    """The directory or hub id transformers loads: the tiny model's copy, a GGUF file's (or named model's)
    converted directory, or `name` itself."""
    if name == "tiny":
        from kitcli.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(seed=0))
    from kitcli.models import gguf

    source = gguf.source_file(name)
    if source is not None:
        return str(gguf.ensure_converted(source, log=log))
    check_model_reachable(name)
    return name


def hub_offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "TRUE", "YES")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def uncached_hub_model(name: str) -> bool:
    """`name` is a hub id (not the tiny model, a GGUF file or a local path) whose files are not in the local
    Hugging Face cache."""
    if name == "tiny" or Path(name).expanduser().exists():
        return False
    from kitcli.models import gguf

    if gguf.is_gguf_name(name) or name in gguf.NAMED_MODELS:
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return not isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001  (not a valid repo id: not in the cache either)
        return True


def not_cached(name: str, why: str) -> KitError:
    from huggingface_hub import constants

    return KitError(f"model '{name}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
                    f"download it where there is a network (`hf download {name}`) and copy its cache folder "
                    f"(models--{name.replace('/', '--')}) here, or set model.name to a local model directory or a "
                    f".gguf file")


def check_model_reachable(name: str) -> None:
    """Before anything loads: a hub model that is not cached while the hub is switched off is one line, not the
    loader's traceback. (Without HF_HUB_OFFLINE the loader tries the network; load_policy words its failure.)"""
    if hub_offline() and uncached_hub_model(name):
        raise not_cached(name, "there is no network (HF_HUB_OFFLINE is set)")


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
    load_in_4bit: bool | None,
    lora: dict[str, Any] | None,
    backend: str = "auto",
    dtype: str = "auto",
    seed: int = 42,
    init_from: Path | None = None,
    trust_remote_code: bool = False,
    trainable: bool = True,
    chat_template: str | None = None,
    log=print,
    label: str = "policy",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, with a fresh LoRA adapter, `init_from`'s adapter, or full weights.

    `init_from` is an earlier stage's output: a directory with `adapter/` (LoRA; loaded into the new adapter,
    so the stage starts from exactly those weights) or `model/` (full fine-tuning). The tokenizer is the base
    model's with the recipe's `chat_template` (kitcli/models/chat_template.py), unset: its own.
    """
    chosen = choose_backend(backend)
    require_unsloth_for(chat_template, chosen, label)  # before anything loads
    prepare_backend(chosen)
    if load_in_4bit is None:
        load_in_4bit = four_bit(None)
        if not load_in_4bit and lora is not None and trainable:
            log(f"{label}: {CPU_PRECISION_NOTE}")
    path = resolve_model_path(model_name, seed, log=log)
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
    try:
        with libraries.library_output():  # the kit's summary line below says what was loaded
            if chosen.startswith("unsloth"):
                model, tokenizer, quantized = _load_unsloth(path, max_seq_length, load_in_4bit, lora, dtype, seed,
                                                            trust_remote_code,
                                                            full_finetuning=lora is None and trainable)
            else:
                model, tokenizer, quantized = _load_transformers(path, max_seq_length, load_in_4bit, lora, dtype,
                                                                 seed, trust_remote_code)
    except OSError as error:
        if path == model_name and uncached_hub_model(model_name):  # the hub could not be reached
            raise not_cached(model_name, f"the hub cannot be reached ({str(error).splitlines()[0]})") from None
        raise
    tokenizer = apply_chat_template(tokenizer, chat_template)
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


def load_stage_policy(model: Any, *, lora: Any, seed: int, init_from: Path | None, log=print, trainable: bool = True,
                      label: str = "policy", **overrides: Any) -> LoadedModel:
    """`load_policy` with the settings of a recipe's `model:` and `lora:` (its validated sections, read by their
    attributes; `lora` None: full fine-tuning, or none to add); `overrides` replace any of the model's."""
    settings = {key: getattr(model, key) for key in ("max_seq_length", "load_in_4bit", "backend", "dtype",
                                                       "trust_remote_code", "chat_template")}
    settings.update(overrides)
    return load_policy(model.name, lora=lora_settings(lora), seed=seed, init_from=init_from, trainable=trainable,
                       log=log, label=label, **settings)


def lora_settings(lora: Any) -> dict[str, Any] | None:
    """A recipe's `lora:` section (read by its attributes) as the settings load_policy takes; None stays None."""
    if lora is None:
        return None
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules}


def is_quantized(model) -> bool:
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
        # Unsloth's loader turns recomputation on by default, and on its CPU backend with full fine-tuning nothing
        # turns it off again: about a fifth of every step went to recomputing activations that fit in memory.
        use_gradient_checkpointing="unsloth" if on_gpu else False,
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
    return model, tokenizer, is_quantized(model)


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
    return model, tokenizer, is_quantized(model)


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
