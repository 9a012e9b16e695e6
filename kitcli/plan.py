"""VRAM planner: an estimate of each stage's peak GPU memory, from the model's config alone.

    kit plan my-grpo.yaml --gpu-memory 12GB
    kit plan tiny-sft --json

No model is loaded and no GPU is needed. The architecture (hidden size, layers, heads, KV heads, intermediate size,
vocabulary) comes from `config.json` in a local model directory, the Hugging Face hub cache, the hub itself when
online, or, offline, a built-in table of popular architectures (`BUILTIN_ARCHITECTURES`).

What is counted, per stage (all bytes; docs/vram.md derives each term and compares with published figures):
    weights            decoder linears in 4-bit NF4 (0.5 byte + quantisation constants) or 16-bit; embeddings,
                       LM head and norms stay 16-bit
    LoRA               adapter parameters (fp32), their gradients (fp32) and the optimizer state (by optimizer)
    activations        what backward keeps per token: every layer without gradient checkpointing; one layer plus
                       each layer's input with it; one layer plus a small buffer with Unsloth's offloaded
                       checkpointing (layer inputs go to CPU RAM)
    logits             vocabulary-sized rows: bf16 logits, their fp32 copy and gradient with transformers;
                       a fixed-size chunk with Unsloth's chunked cross entropy
    KV cache           generation: completions generated at once x (prompt + completion) x layers x 2 x KV width
    other models       reference (a full copy when fully fine-tuning; none with LoRA, whose reference is the base
                       with the adapter off), reward model (16-bit, merged), PPO critic
    vLLM               vllm_gpu_memory_utilization x GPU memory when `use_vllm` runs colocated
    overhead           CUDA context, cuBLAS workspace, allocator slack, 4-bit dequantisation buffer

Peak = what stays resident (weights, adapters, optimizer, other models, vLLM) + the larger of the generation phase
and the training phase (they do not overlap).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from kitcli.errors import KitError

GiB = 1024**3
MiB = 1024**2

# --- architectures ---------------------------------------------------------------------------------------------

# Config numbers of popular checkpoints (from their config.json), for planning offline. Keys are normalised
# names (see `normalise_name`); `extra_params` counts parameters outside the text decoder (Gemma 3's vision tower).
BUILTIN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-1.7b": {"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-4b": {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False},
    "llama-3.1-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256,
                     "tie_word_embeddings": False},
    "llama-3.2-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "llama-3.2-3b": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
                     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "vocab_size": 128256,
                     "tie_word_embeddings": True},
    "gemma-3-4b": {"hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                   "head_dim": 256, "intermediate_size": 10240, "vocab_size": 262208, "tie_word_embeddings": True,
                   "extra_params": 417_000_000},
    "mistral-7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "intermediate_size": 14336, "vocab_size": 32768, "tie_word_embeddings": False},
}
# Suffixes that name a variant of the same architecture (instruct, base, pre-quantised uploads, ...).
VARIANT_SUFFIXES = ("-unsloth-bnb-4bit", "-bnb-4bit", "-4bit", "-instruct-2507", "-thinking-2507", "-instruct",
                    "-it", "-base", "-pt", "-v0.3", "-v0.2", "-v0.1", "-hf")


def normalise_name(name: str) -> str:
    """`unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit` -> `llama-3.1-8b`; `Qwen/Qwen3-4B-Base` -> `qwen3-4b`."""
    text = name.strip().rstrip("/").split("/")[-1].lower().replace("_", "-")
    text = re.sub(r"^meta-", "", text)
    changed = True
    while changed:
        changed = False
        for suffix in VARIANT_SUFFIXES:
            if text.endswith(suffix):
                text = text[: -len(suffix)]
                changed = True
    text = re.sub(r"^mistral-7b.*", "mistral-7b", text)
    return text


@dataclass
class Architecture:
    name: str
    source: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    extra_params: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def decoder_linear_params(self) -> int:
        return self.num_hidden_layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def norm_params(self) -> int:
        return (2 * self.num_hidden_layers + 1) * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.decoder_linear_params + self.embedding_params + self.norm_params + self.extra_params

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        shapes = self.linear_shapes()
        chosen = list(shapes) if targets == "all-linear" else [t for t in targets if t in shapes]
        return self.num_hidden_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in chosen)


def architecture_from_config(config: dict[str, Any], name: str, source: str) -> Architecture:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(text.get(k), int)]
    if missing:
        raise KitError(f"config for model '{name}' ({source}) has no {', '.join(missing)}; kit plan estimates "
                       f"decoder-only transformers (Llama, Qwen, Mistral, Gemma, ...); pass --config with a "
                       f"config.json that has them")
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    extra = int(config.get("extra_params", 0))
    if "vision_config" in config and not extra:
        vision = config["vision_config"] or {}
        width, depth = vision.get("hidden_size", 0), vision.get("num_hidden_layers", vision.get("depth", 0))
        extra = 12 * width * width * depth  # a ViT layer has ~12 h^2 parameters
    return Architecture(name=name, source=source, hidden_size=text["hidden_size"],
                        num_hidden_layers=text["num_hidden_layers"], num_attention_heads=heads,
                        num_key_value_heads=text.get("num_key_value_heads") or heads, head_dim=head_dim,
                        intermediate_size=text["intermediate_size"], vocab_size=text["vocab_size"],
                        tie_word_embeddings=bool(tied), extra_params=extra)


def hub_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def cached_hub_config(repo_id: str) -> Path | None:
    folder = "models--" + repo_id.replace("/", "--")
    for root in hub_cache_dirs():
        snapshots = root / folder / "snapshots"
        if snapshots.is_dir():
            found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
            if found:
                return found[0]
    return None


def hub_offline() -> bool:
    return any(os.environ.get(k, "").upper() in ("1", "ON", "TRUE", "YES")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def download_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception:  # offline, gated, missing: the caller falls back to the built-in table
        return None


def tiny_config() -> dict[str, Any]:
    from kitcli.tiny import TINY_CONFIG, TOKENIZER_VOCAB_SIZE, tiny_model_dir

    built = tiny_model_dir(0) / "config.json"
    if built.exists():
        return json.loads(built.read_text())
    return {**TINY_CONFIG, "vocab_size": TOKENIZER_VOCAB_SIZE}


def find_architecture(model_name: str, config_path: str | None = None) -> Architecture:
    """The model's architecture from --config, a local directory, the hub cache, the hub, or the built-in table."""
    if config_path:
        path = Path(config_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise KitError(f"--config '{config_path}' is not a config.json file (or a directory holding one)")
        return architecture_from_config(read_config(path), model_name, str(path))
    if model_name == "tiny":
        return architecture_from_config(tiny_config(), "tiny", "embedded tiny model")
    local = Path(model_name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise KitError(f"model directory '{local}' has no config.json; kit plan reads the architecture from "
                           f"it (or pass --config PATH)")
        return architecture_from_config(read_config(local / "config.json"), model_name, str(local / "config.json"))
    cached = cached_hub_config(model_name) if "/" in model_name else None
    if cached is not None:
        return architecture_from_config(read_config(cached), model_name, f"hub cache ({cached})")
    key = normalise_name(model_name)
    if key in BUILTIN_ARCHITECTURES:
        return architecture_from_config(BUILTIN_ARCHITECTURES[key], model_name, f"kit's built-in table ({key})")
    if "/" in model_name and not hub_offline():
        downloaded = download_config(model_name)
        if downloaded is not None:
            return architecture_from_config(read_config(downloaded), model_name, f"hub ({model_name})")
    raise KitError(f"cannot find a config for model '{model_name}': it is not a local directory, not in the hub "
                   f"cache ({hub_cache_dirs()[-1]}), not one of kit's built-in architectures "
                   f"({', '.join(BUILTIN_ARCHITECTURES)}){', and the hub is offline' if hub_offline() else ''}; "
                   f"pass --config path/to/config.json, or fetch it with "
                   f"`huggingface-cli download {model_name} config.json`")


def read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise KitError(f"cannot read model config '{path}': {error}") from None


# --- what a stage does, in the numbers that decide memory --------------------------------------------------------

OPTIMIZER_BYTES = {  # optimizer state per trainable parameter
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_hf": 8, "adamw_apex_fused": 8, "adamw_torch_xla": 8,
    "adamw_8bit": 2, "adamw_bnb_8bit": 2, "paged_adamw_8bit": 2, "paged_adamw_32bit": 8, "adamw_anyprecision": 8,
    "adafactor": 4, "sgd": 0, "lion_8bit": 1, "paged_lion_8bit": 1, "lion_32bit": 4, "paged_lion_32bit": 4,
    "rmsprop": 4, "adagrad": 4,
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
RL_TYPES = ("grpo", "gspo", "ppo")
TRAIN_TYPES = ("sft", "reward", "dpo", "grpo", "gspo", "ppo")
CUDA_OVERHEAD = 0.5 * GiB  # CUDA context + cuBLAS workspace + allocator slack, measured typically 0.4-0.6 GiB
UNSLOTH_LOGIT_CHUNK = 0.5 * GiB  # Unsloth's chunked cross entropy sizes chunks to free memory; its floor
UNSLOTH_LOGPROB_CHUNK = 2.0 * GiB  # unsloth_zoo chunked_logprob default chunk (UNSLOTH_LOGPROB_CHUNK_GB)


@dataclass
class Settings:
    """One stage's memory-relevant settings, resolved from the recipe and the kit's stage defaults."""

    stage_type: str = "sft"
    backend: str = "unsloth"  # unsloth | transformers
    load_in_4bit: bool = True
    dtype_bytes: int = 2
    lora_r: int | None = 16
    lora_targets: list[str] | str = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"])
    optim: str = "adamw_8bit"
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    seq_len: int = 1024  # max_length (sft/dpo/reward) or prompt + completion (RL)
    gradient_checkpointing: bool = True
    # RL and eval generation
    prompt_len: int = 0
    completion_len: int = 0
    num_generations: int = 0
    steps_per_generation: int = 1
    generation_batch_size: int | None = None
    beta: float = 0.0
    reward_model: bool = False
    critic: bool = False
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    eval_batch_size: int = 0

    @property
    def completions_at_once(self) -> int:
        """Completions one process generates in one call: TRL's local generation batch."""
        if self.generation_batch_size:
            return self.generation_batch_size
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def checkpointing(self) -> str:
        if not self.gradient_checkpointing:
            return "off"
        return "offloaded" if self.backend == "unsloth" else "on"


def stage_settings(recipe_data: dict[str, Any], stage: dict[str, Any], backend: str) -> Settings:
    """Settings as the stage will run them: the recipe's `train:` values over the kit's defaults (the same values
    `kit run --dry-run` prints; kept in step with kitcli/stages/*.py by tests/test_plan.py)."""
    model, lora, train = recipe_data["model"], recipe_data.get("lora"), stage.get("train") or {}
    kind = stage["type"]
    seq = model["max_seq_length"]
    values: dict[str, Any] = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                              "optim": "adamw_8bit", "gradient_checkpointing": True, "max_length": seq}
    if kind in ("grpo", "gspo"):
        variant_beta = {"grpo": 0.04}.get(stage.get("variant", "grpo"), 0.0) if kind == "grpo" else 0.0
        values.update(num_generations=8, max_completion_length=256, beta=variant_beta, use_vllm=False,
                      vllm_mode="colocate", vllm_gpu_memory_utilization=0.3)
    if kind == "gspo":
        values.update(gradient_accumulation_steps=1, steps_per_generation=4)
    if kind == "ppo":  # kitcli/stages/ppo.py PPOConfig: one response per prompt, mini-batches of the rollout
        values.update(per_device_train_batch_size=16, optim="adamw_torch", response_length=64, kl_coef=0.05,
                      num_mini_batches=1)
    values.update(train)
    if kind == "ppo":
        rollout = int(values["per_device_train_batch_size"])
        values.update(num_generations=1, max_completion_length=values["response_length"], beta=values["kl_coef"],
                      generation_batch_size=rollout,
                      per_device_train_batch_size=max(1, rollout // int(values["num_mini_batches"])))
    if kind in ("grpo", "gspo", "ppo") and "steps_per_generation" not in values:
        values["steps_per_generation"] = values["gradient_accumulation_steps"]
    settings = Settings(
        stage_type=kind, backend=backend, load_in_4bit=bool(model["load_in_4bit"]) and lora is not None,
        dtype_bytes=DTYPE_BYTES.get(model.get("dtype", "auto"), 2),
        lora_r=lora["r"] if lora else None, lora_targets=lora["target_modules"] if lora else [],
        optim=str(values["optim"]), per_device_train_batch_size=int(values["per_device_train_batch_size"]),
        gradient_accumulation_steps=int(values["gradient_accumulation_steps"]),
        seq_len=int(values.get("max_length") or seq), gradient_checkpointing=bool(values["gradient_checkpointing"]),
    )
    if kind in RL_TYPES:
        completion = int(values["max_completion_length"])
        prompt = max(seq - completion, 128)
        settings = replace(settings, prompt_len=prompt, completion_len=completion, seq_len=prompt + completion,
                           num_generations=int(values["num_generations"]),
                           steps_per_generation=int(values["steps_per_generation"]),
                           generation_batch_size=values.get("generation_batch_size"),
                           beta=float(values.get("beta", 0.0)), reward_model=stage.get("reward_model") is not None,
                           critic=kind == "ppo", use_vllm=bool(values.get("use_vllm", False)),
                           vllm_mode=str(values.get("vllm_mode", "colocate")),
                           vllm_gpu_memory_utilization=float(values.get("vllm_gpu_memory_utilization", 0.3)))
    if kind == "dpo":
        settings = replace(settings, beta=float(values.get("beta", 0.1)))
    if kind == "eval":
        generation = {"max_new_tokens": 32, "batch_size": 32, **(stage.get("generation") or {})}
        settings = replace(settings, prompt_len=seq, completion_len=int(generation["max_new_tokens"]),
                           eval_batch_size=int(generation["batch_size"]), gradient_checkpointing=False,
                           load_in_4bit=bool(model["load_in_4bit"]))
    return settings


# --- the estimate ----------------------------------------------------------------------------------------------

@dataclass
class Component:
    name: str
    bytes: float
    phase: str  # resident | train | generate
    note: str = ""


@dataclass
class Estimate:
    components: list[Component]

    def phase_total(self, phase: str) -> float:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def peak(self) -> float:
        return self.phase_total("resident") + max(self.phase_total("train"), self.phase_total("generate"))


def weight_bytes(arch: Architecture, four_bit: bool, dtype_bytes: int) -> float:
    """Decoder linears in NF4 with double quantisation (4 bits + ~0.127 bit of constants per weight) or 16-bit;
    embeddings, LM head, norms and any vision tower stay 16-bit (bitsandbytes and Unsloth skip them)."""
    linear = arch.decoder_linear_params * (4.127 / 8 if four_bit else dtype_bytes)
    return linear + (arch.embedding_params + arch.norm_params + arch.extra_params) * dtype_bytes


def layer_activation_bytes(arch: Architecture, act_bytes: int) -> int:
    """Per token, what one decoder layer keeps for backward: the two norm inputs and outputs (4h), q and the
    attention output (2 q_dim), k and v (2 kv_dim), and the MLP's gate, up, activation and product (4 I)."""
    return act_bytes * (4 * arch.hidden_size + 2 * arch.q_dim + 2 * arch.kv_dim + 4 * arch.intermediate_size)


def activation_bytes(arch: Architecture, tokens: int, checkpointing: str, act_bytes: int) -> float:
    """Kept for backward, plus the layer being back-propagated: its recomputed activations (checkpointing) and
    the gradients of its MLP's gate and up outputs (2 I)."""
    layer = layer_activation_bytes(arch, act_bytes)
    backward = act_bytes * 2 * arch.intermediate_size
    if checkpointing == "off":
        return tokens * (layer * arch.num_hidden_layers + backward)
    hidden = act_bytes * arch.hidden_size
    if checkpointing == "on":
        return tokens * (layer + backward + hidden * arch.num_hidden_layers)
    return tokens * (layer + backward + 2 * hidden)  # offloaded: layer inputs live in CPU RAM; a double buffer stays


def logits_bytes(arch: Architecture, tokens: int, backend: str, act_bytes: int, chunk: float) -> float:
    """transformers: the logits (act dtype), their fp32 upcast for the loss, and its gradient.
    Unsloth: chunked, so one chunk at a time (it sizes chunks to the free memory, this is the floor)."""
    full = tokens * arch.vocab_size * (act_bytes + 4 + 4)
    return min(full, chunk) if backend == "unsloth" else full


def kv_cache_bytes(arch: Architecture, sequences: int, length: int, act_bytes: int) -> float:
    return sequences * length * arch.num_hidden_layers * 2 * arch.kv_dim * act_bytes


def inference_working_bytes(arch: Architecture, tokens: int, act_bytes: int) -> float:
    """A forward pass without gradients keeps only the current layer's intermediates."""
    return tokens * act_bytes * (2 * arch.hidden_size + 2 * arch.intermediate_size + arch.q_dim + 2 * arch.kv_dim)


def adapter_components(arch: Architecture, s: Settings, label: str = "") -> list[Component]:
    """Trainable state of one model: LoRA parameters, gradients, optimizer; or the full model's."""
    optimizer = OPTIMIZER_BYTES.get(s.optim, 8)
    prefix = f"{label} " if label else ""
    if s.lora_r is None:  # full fine-tuning: every weight trains in the compute dtype
        params = arch.total_params
        return [Component(f"{prefix}gradients (full model)", params * s.dtype_bytes, "resident"),
                Component(f"{prefix}optimizer state ({s.optim})", params * optimizer, "resident")]
    params = arch.lora_params(s.lora_r, s.lora_targets)
    return [Component(f"{prefix}LoRA parameters (r={s.lora_r}, {params / 1e6:.1f}M, fp32)", params * 4, "resident"),
            Component(f"{prefix}LoRA gradients (fp32)", params * 4, "resident"),
            Component(f"{prefix}optimizer state ({s.optim})", params * optimizer, "resident")]


def estimate(arch: Architecture, s: Settings, gpu_bytes: float | None = None) -> Estimate:
    """Every component of one stage's GPU memory."""
    act = s.dtype_bytes
    four_bit = s.load_in_4bit and s.lora_r is not None
    weights = weight_bytes(arch, four_bit, s.dtype_bytes)
    parts = [Component(f"weights ({'4-bit NF4' if four_bit else f'{8 * s.dtype_bytes}-bit'}, "
                       f"{arch.total_params / 1e9:.2f}B parameters)", weights, "resident")]
    overhead = CUDA_OVERHEAD + (arch.hidden_size * arch.intermediate_size * act if four_bit else 0)
    parts.append(Component("CUDA context, workspace, allocator slack", overhead, "resident",
                           "incl. one dequantised weight" if four_bit else ""))

    if s.stage_type == "eval":
        sequences = s.eval_batch_size
        length = s.prompt_len + s.completion_len
        parts += [Component(f"KV cache ({sequences} sequences x {length} tokens)",
                            kv_cache_bytes(arch, sequences, length, act), "generate"),
                  Component("prefill working set", inference_working_bytes(arch, sequences * s.prompt_len, act),
                            "generate"),
                  Component("next-token logits (fp32)", sequences * arch.vocab_size * 4 * 2, "generate")]
        return Estimate(parts)

    parts += adapter_components(arch, s)
    micro = s.per_device_train_batch_size
    if s.stage_type in ("dpo", "reward"):
        micro *= 2  # chosen and rejected go through the model together
    tokens = micro * s.seq_len
    parts.append(Component(f"activations ({micro} sequences x {s.seq_len} tokens, gradient checkpointing "
                           f"{s.checkpointing})", activation_bytes(arch, tokens, s.checkpointing, act), "train"))
    if s.stage_type == "reward":
        parts.append(Component("score head outputs", micro * 4 * 2, "train"))
    else:
        logit_tokens = micro * (s.completion_len if s.stage_type in RL_TYPES else s.seq_len)
        chunk = UNSLOTH_LOGPROB_CHUNK if s.stage_type in RL_TYPES else UNSLOTH_LOGIT_CHUNK
        parts.append(Component(f"logits ({logit_tokens} tokens x {arch.vocab_size} vocabulary"
                               f"{', chunked' if s.backend == 'unsloth' else ''})",
                               logits_bytes(arch, logit_tokens, s.backend, act, chunk), "train"))

    needs_reference = s.stage_type == "dpo" or (s.stage_type in RL_TYPES and s.beta > 0 and not s.critic)
    if needs_reference:
        if s.lora_r is None:
            parts.append(Component("reference model (full copy)", weight_bytes(arch, False, s.dtype_bytes),
                                   "resident"))
        else:
            parts.append(Component("reference model (the base with the adapter off)", 0, "resident"))
    if s.reward_model and s.critic and s.lora_r is not None:  # PPO: the reward stage's adapter on the same base
        parts.append(Component("reward adapter + score head (on the shared base)",
                               arch.lora_params(s.lora_r, s.lora_targets) * 4, "resident"))
    elif s.reward_model:
        parts.append(Component("reward model (merged, 16-bit)", weight_bytes(arch, False, 2), "resident"))
        parts.append(Component("reward model forward", inference_working_bytes(arch, micro * s.seq_len, 2),
                               "generate"))
    if s.critic:  # kit's PPO: the critic is a second adapter (+ value head) on the same base weights
        parts += [replace(c, name=f"critic {c.name}") for c in adapter_components(arch, s)]
        parts.append(Component("critic activations", activation_bytes(arch, tokens, s.checkpointing, act), "train"))
        if s.lora_r is not None:
            parts.append(Component("reference adapter (frozen copy of the starting adapter)",
                                   arch.lora_params(s.lora_r, s.lora_targets) * 4, "resident"))

    if s.stage_type in RL_TYPES:
        sequences = s.completions_at_once
        length = s.prompt_len + s.completion_len
        if s.use_vllm and s.vllm_mode == "colocate":
            reserved = s.vllm_gpu_memory_utilization * gpu_bytes if gpu_bytes else 0
            parts.append(Component(f"vLLM reservation ({s.vllm_gpu_memory_utilization:g} x GPU memory)", reserved,
                                   "resident", "" if gpu_bytes else "needs --gpu-memory to size"))
        elif s.use_vllm:
            parts.append(Component("vLLM (server mode: on another GPU)", 0, "resident"))
        else:
            parts += [Component(f"KV cache ({sequences} completions x {length} tokens)",
                                kv_cache_bytes(arch, sequences, length, act), "generate"),
                      Component("prefill working set", inference_working_bytes(arch, sequences * s.prompt_len, act),
                                "generate"),
                      Component("sampling logits (fp32)", sequences * arch.vocab_size * 4 * 2, "generate")]
    return Estimate(parts)


# --- fitting a GPU ---------------------------------------------------------------------------------------------

@dataclass
class Change:
    key: str
    old: Any
    new: Any


def halved(value: int, floor: int) -> int:
    return max(floor, value // 2)


def candidate_moves(s: Settings) -> list[tuple[list[Change], Settings]]:
    """Changes that lower memory, most harmless first: checkpointing, batch (keeping the effective batch with
    gradient accumulation), generations, lengths, LoRA rank, 4-bit."""
    moves: list[tuple[list[Change], Settings]] = []
    if not s.gradient_checkpointing and s.stage_type != "eval":
        moves.append(([Change("train.gradient_checkpointing", False, True)], replace(s, gradient_checkpointing=True)))
    if s.stage_type == "eval" and s.eval_batch_size > 1:
        new = halved(s.eval_batch_size, 1)
        moves.append(([Change("generation.batch_size", s.eval_batch_size, new)], replace(s, eval_batch_size=new)))
    if s.stage_type != "eval" and s.per_device_train_batch_size > 1:
        new = halved(s.per_device_train_batch_size, 1)
        factor = s.per_device_train_batch_size // new
        accumulation = s.gradient_accumulation_steps * factor
        changes = [Change("train.per_device_train_batch_size", s.per_device_train_batch_size, new),
                   Change("train.gradient_accumulation_steps", s.gradient_accumulation_steps, accumulation)]
        updated = replace(s, per_device_train_batch_size=new, gradient_accumulation_steps=accumulation)
        if s.stage_type in RL_TYPES and not s.generation_batch_size:
            steps = s.steps_per_generation * factor  # the same completions per generation round
            changes.append(Change("train.steps_per_generation", s.steps_per_generation, steps))
            updated = replace(updated, steps_per_generation=steps)
        moves.append((changes, updated))
    if s.stage_type in RL_TYPES and s.num_generations > 2 and not s.use_vllm:
        new = halved(s.num_generations, 2)
        batch = s.completions_at_once * new // s.num_generations  # same prompts per round, fewer completions
        changes = [Change("train.num_generations", s.num_generations, new)]
        if not s.generation_batch_size and batch % s.per_device_train_batch_size == 0:
            steps = batch // s.per_device_train_batch_size  # TRL takes steps_per_generation or the batch, not both
            changes.append(Change("train.steps_per_generation", s.steps_per_generation, steps))
            moves.append((changes, replace(s, num_generations=new, steps_per_generation=steps)))
        else:
            changes.append(Change("train.generation_batch_size", s.completions_at_once, batch))
            moves.append((changes, replace(s, num_generations=new, generation_batch_size=batch)))
    if s.completion_len > 64 and s.stage_type in RL_TYPES:
        new = halved(s.completion_len, 64)
        moves.append(([Change("train.max_completion_length", s.completion_len, new)],
                      replace(s, completion_len=new, seq_len=s.prompt_len + new)))
    if s.stage_type in ("sft", "dpo", "reward") and s.seq_len > 256:
        new = halved(s.seq_len, 256)
        moves.append(([Change("train.max_length", s.seq_len, new)], replace(s, seq_len=new)))
    if s.lora_r is not None and s.lora_r > 8:
        new = halved(s.lora_r, 8)
        moves.append(([Change("lora.r", s.lora_r, new)], replace(s, lora_r=new)))
    if s.lora_r is not None and not s.load_in_4bit:
        moves.append(([Change("model.load_in_4bit", False, True)], replace(s, load_in_4bit=True)))
    return moves


def fit(arch: Architecture, s: Settings, budget: float, limit: int = 24) -> tuple[list[Change], Settings, Estimate]:
    """Apply the first move that lowers the peak, repeatedly, until the stage fits `budget` (or nothing helps)."""
    changes: list[Change] = []
    current = s
    current_estimate = estimate(arch, current, budget)
    for _ in range(limit):
        if current_estimate.peak <= budget:
            break
        for moved, candidate in candidate_moves(current):
            candidate_estimate = estimate(arch, candidate, budget)
            if candidate_estimate.peak < current_estimate.peak - MiB:
                changes = merge_changes(changes, moved)
                current, current_estimate = candidate, candidate_estimate
                break
        else:
            break
    touched = {c.key for c in changes}
    if s.stage_type in RL_TYPES and not current.generation_batch_size and touched & {
            "train.per_device_train_batch_size", "train.gradient_accumulation_steps", "train.num_generations"}:
        # spell out steps_per_generation: the kit's default for it follows gradient_accumulation_steps
        changes = [c for c in changes if c.key != "train.steps_per_generation"]
        changes.append(Change("train.steps_per_generation", s.steps_per_generation, current.steps_per_generation))
    return changes, current, current_estimate


def merge_changes(changes: list[Change], new: list[Change]) -> list[Change]:
    merged = {c.key: c for c in changes}
    for change in new:
        merged[change.key] = Change(change.key, merged[change.key].old if change.key in merged else change.old,
                                    change.new)
    return [c for c in merged.values() if c.old != c.new]


def set_flag(stage_name: str, change: Change) -> str:
    if change.key.startswith(("lora.", "model.")):
        return f"--set {change.key}={json.dumps(change.new)}"
    return f"--set stages.{stage_name}.{change.key}={json.dumps(change.new)}"


# --- GPU memory ------------------------------------------------------------------------------------------------

def parse_memory(text: str) -> float:
    """`12GB`, `12GiB`, `12 G`, `24000MB`, `80` (GB) -> bytes. GPU makers' "GB" are binary (a 12GB card has
    12 GiB), so GB and GiB both mean 1024^3 here."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*", str(text).lower())
    if not match or float(match.group(1)) <= 0:
        raise KitError(f"--gpu-memory '{text}' is not a memory size; write it like 12GB, 24GiB or 80000MB")
    unit = (match.group(2) or "gb")[0]
    return float(match.group(1)) * {"g": GiB, "m": MiB, "t": 1024 * GiB}[unit]


def detect_gpu() -> tuple[float, str] | None:
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return float(props.total_memory), props.name
    except Exception:  # no usable torch / driver: planning still works from --gpu-memory
        return None
    return None


# --- the command -----------------------------------------------------------------------------------------------

def planned_backend(model: dict[str, Any], requested: str | None) -> str:
    import importlib.util

    choice = requested or os.environ.get("KIT_FORCE_BACKEND") or model.get("backend", "auto")
    if choice == "transformers":
        return "transformers"
    return "unsloth" if importlib.util.find_spec("unsloth") is not None else "transformers"


def plan_recipe(recipe, *, gpu_bytes: float | None, config_path: str | None, backend: str | None) -> dict[str, Any]:
    arch = find_architecture(recipe.data["model"]["name"], config_path)
    chosen = planned_backend(recipe.data["model"], backend)
    stages = []
    for stage in recipe.stages:
        settings = stage_settings(recipe.data, stage, chosen)
        result = estimate(arch, settings, gpu_bytes)
        entry: dict[str, Any] = {
            "stage": stage["name"], "type": stage["type"], "peak_gib": round(result.peak / GiB, 2),
            "components": [{"name": c.name, "phase": c.phase, "gib": round(c.bytes / GiB, 3), "note": c.note}
                           for c in result.components],
            "settings": asdict(settings),
        }
        if gpu_bytes:
            entry["fits"] = result.peak <= gpu_bytes
            if not entry["fits"]:
                changes, _, fitted = fit(arch, settings, gpu_bytes)
                entry["suggestion"] = {"changes": [asdict(c) for c in changes],
                                       "set": [set_flag(stage["name"], c) for c in changes],
                                       "peak_gib": round(fitted.peak / GiB, 2), "fits": fitted.peak <= gpu_bytes}
        stages.append(entry)
    return {"model": recipe.data["model"]["name"], "architecture": asdict(arch),
            "parameters_b": round(arch.total_params / 1e9, 3), "backend": chosen,
            "gpu_gib": round(gpu_bytes / GiB, 2) if gpu_bytes else None, "stages": stages}


def print_plan(plan: dict[str, Any], gpu_name: str | None, console) -> None:
    from rich.table import Table

    arch = plan["architecture"]
    console.print(f"model {plan['model']}: {plan['parameters_b']:.2f}B parameters, {arch['num_hidden_layers']} "
                  f"layers, hidden {arch['hidden_size']}, vocabulary {arch['vocab_size']} (config from "
                  f"{arch['source']}); backend {plan['backend']}", highlight=False, markup=False)
    if plan["gpu_gib"]:
        console.print(f"GPU: {gpu_name or 'given'} with {plan['gpu_gib']:.1f} GiB", highlight=False, markup=False)
    else:
        console.print("GPU: none detected here; pass --gpu-memory 24GB to check a card", highlight=False,
                      markup=False)
    for entry in plan["stages"]:
        table = Table(title=f"stage {entry['stage']} ({entry['type']})", title_justify="left")
        for column, justify in (("component", "left"), ("phase", "left"), ("GiB", "right")):
            table.add_column(column, justify=justify)
        for c in entry["components"]:
            if c["gib"] == 0 and not c["note"] and "reference" not in c["name"]:
                continue
            table.add_row(c["name"] + (f" ({c['note']})" if c["note"] else ""), c["phase"], f"{c['gib']:.2f}")
        table.add_row("peak (resident + larger phase)", "", f"{entry['peak_gib']:.2f}", style="bold")
        console.print(table)
        if "fits" in entry:
            spare = plan["gpu_gib"] - entry["peak_gib"]
            if entry["fits"]:
                console.print(f"  fits: {entry['peak_gib']:.2f} of {plan['gpu_gib']:.1f} GiB ({spare:.2f} spare)",
                              highlight=False, markup=False)
            else:
                suggestion = entry["suggestion"]
                verdict = "fits" if suggestion["fits"] else "still does not fit"
                console.print(f"  does not fit: {entry['peak_gib']:.2f} of {plan['gpu_gib']:.1f} GiB",
                              highlight=False, markup=False)
                for change in suggestion["changes"]:
                    console.print(f"    {change['key']}: {change['old']} -> {change['new']}", highlight=False,
                                  markup=False)
                if suggestion["set"]:
                    console.print(f"    {' '.join(suggestion['set'])}", highlight=False, markup=False, soft_wrap=True)
                console.print(f"    new estimate {suggestion['peak_gib']:.2f} GiB: {verdict}", highlight=False,
                              markup=False)
    summary = Table(title="summary")
    for column in ("stage", "type", "peak GiB", "fits"):
        summary.add_column(column)
    for entry in plan["stages"]:
        fits = "" if "fits" not in entry else ("yes" if entry["fits"] else
                                                f"no (-> {entry['suggestion']['peak_gib']:.2f} GiB with changes)")
        summary.add_row(entry["stage"], entry["type"], f"{entry['peak_gib']:.2f}", fits)
    console.print(summary)


def run_plan(recipe_name: str, overrides: list[str], gpu_memory: str | None, config_path: str | None,
             backend: str | None, as_json: bool, console) -> None:
    from kitcli.recipe import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    gpu_name = None
    gpu_bytes = parse_memory(gpu_memory) if gpu_memory else None
    if gpu_bytes is None:
        detected = detect_gpu()
        if detected:
            gpu_bytes, gpu_name = detected
    plan = plan_recipe(recipe, gpu_bytes=gpu_bytes, config_path=config_path, backend=backend)
    if as_json:
        click.echo(json.dumps(plan, indent=2))
        return
    print_plan(plan, gpu_name, console)



@click.command("plan")
@click.argument("recipe")
@click.option("--gpu-memory", metavar="SIZE", help="GPU memory to plan for, e.g. 12GB, 24GB, 80GB (default: the "
                                                  "GPU of this machine, if any).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a recipe value, e.g. stages.grpo.train.num_generations=4 (repeatable).")
@click.option("--config", "config_path", metavar="PATH",
              help="The model's config.json (or its folder), when kit cannot find it.")
@click.option("--backend", type=click.Choice(["unsloth", "transformers"]), default=None,
              help="Plan for this backend (default: the recipe's; Unsloth when installed).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(recipe: str, gpu_memory: str | None, overrides: tuple[str, ...], config_path: str | None,
                 backend: str | None, as_json: bool) -> None:
    """Estimate each stage's peak GPU memory and whether it fits; suggest settings when not."""
    from rich.console import Console

    run_plan(recipe, list(overrides), gpu_memory, config_path, backend, as_json, Console(highlight=False))
