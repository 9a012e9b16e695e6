"""The memory model: every component of one stage's peak GPU memory, from its architecture and settings (docs/vram.md
derives each term and compares the sum with published figures)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kitcli.plan.architecture import Architecture
    from kitcli.plan.settings import Settings

GiB = 1024**3
MiB = 1024**2
OPTIMIZER_BYTES = {  # optimizer state per trainable parameter
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_hf": 8, "adamw_apex_fused": 8, "adamw_torch_xla": 8,
    "adamw_8bit": 2, "adamw_bnb_8bit": 2, "paged_adamw_8bit": 2, "paged_adamw_32bit": 8, "adamw_anyprecision": 8,
    "adafactor": 4, "sgd": 0, "lion_8bit": 1, "paged_lion_8bit": 1, "lion_32bit": 4, "paged_lion_32bit": 4,
    "rmsprop": 4, "adagrad": 4,
}
CUDA_OVERHEAD = 0.5 * GiB  # CUDA context + cuBLAS workspace + allocator slack, measured typically 0.4-0.6 GiB
UNSLOTH_LOGIT_CHUNK = 0.5 * GiB  # Unsloth's chunked cross entropy sizes chunks to free memory; its floor
UNSLOTH_LOGPROB_CHUNK = 2.0 * GiB  # unsloth_zoo chunked_logprob default chunk (UNSLOTH_LOGPROB_CHUNK_GB)


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

    if s.evaluates:
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
    if s.pairs:
        micro *= s.spec.section.sequences_per_row  # DPO: chosen and rejected go through the model together
    tokens = micro * s.seq_len
    parts.append(Component(f"activations ({micro} sequences x {s.seq_len} tokens, gradient checkpointing "
                           f"{s.checkpointing})", activation_bytes(arch, tokens, s.checkpointing, act), "train"))
    if s.scorer:
        parts.append(Component("score head outputs", micro * 4 * 2, "train"))
    else:
        logit_tokens = micro * (s.completion_len if s.rl else s.seq_len)
        chunk = UNSLOTH_LOGPROB_CHUNK if s.rl else UNSLOTH_LOGIT_CHUNK
        parts.append(Component(f"logits ({logit_tokens} tokens x {arch.vocab_size} vocabulary"
                               f"{', chunked' if s.backend == 'unsloth' else ''})",
                               logits_bytes(arch, logit_tokens, s.backend, act, chunk), "train"))

    # the stage type says whether it trains against a frozen reference (DPO, KTO: always; GRPO-style: with a KL
    # term); a critic stage keeps its own (below)
    reference = s.spec.memory.reference
    needs_reference = (reference == "always" or (reference == "beta" and s.beta > 0)) and not s.critic
    if needs_reference:
        if s.lora_r is None:
            parts.append(Component("reference model (full copy)", weight_bytes(arch, False, s.dtype_bytes),
                                   "resident"))
        else:
            parts.append(Component("reference model (the base with the adapter off)", 0, "resident"))
    if s.frozen_model is not None:  # a distillation teacher: frozen, loaded as the base is (4-bit on a GPU)
        from kitcli.plan.architecture import find_architecture

        frozen = arch if s.frozen_model == arch.name else find_architecture(s.frozen_model)
        parts.append(Component(f"frozen model beside the policy ({s.frozen_model}, "
                               f"{'4-bit NF4' if s.load_in_4bit else f'{8 * s.dtype_bytes}-bit'}, "
                               f"{frozen.total_params / 1e9:.2f}B parameters)",
                               weight_bytes(frozen, s.load_in_4bit, s.dtype_bytes), "resident"))
        parts.append(Component("frozen model forward (no gradient)", inference_working_bytes(frozen, tokens, act),
                               "train"))
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

    if s.rl:
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

