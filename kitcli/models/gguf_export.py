"""Write a merged model as a GGUF file with the `gguf` package (llama.cpp's own Python writer): no llama.cpp build.

    kit export runs/tiny-sft-20261202-101500 --to gguf               (q8_0, as Unsloth's default GGUF export)
    kit export runs/smol-grpo-20261203-101500 --to gguf --quant f16

The file holds what llama.cpp's converter writes for these architectures, and transformers' GGUF loader (what the
kit uses for `model: file.gguf`) reads it back: the same tensor names (gguf's TensorNameMap), LLaMA's q/k row
permutation, the architecture's hyper-parameters, and a byte-level BPE tokenizer (tokens, types, merges, special
token ids, chat template; gguf's SpecialVocab). 1-D tensors (norms, biases) stay float32, as llama.cpp keeps them;
a matrix whose rows do not fill whole quantization blocks is written f16.

What it cannot write, it says before anything is written (`unwritable`), and the export falls back to llama.cpp's
converter: other architectures, scaled RoPE (llama.cpp stores extra tensors for it), a SentencePiece tokenizer, and
Qwen3 with a head size other than transformers' default of 128 (its GGUF loader does not read the head size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers model_type -> (llama.cpp architecture, whether q/k rows are permuted as llama.cpp does for LLaMA)
WRITABLE = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
            "qwen3": ("qwen3", False)}
KIT_QUANTS = ("q8_0", "q4_0", "f16", "bf16", "f32")
PRE_TOKENIZERS = {"qwen2": "qwen2", "qwen3": "qwen2"}  # llama.cpp's name for a tokenizer's splitting regex


def config_of(config: Any) -> dict[str, Any]:
    return config if isinstance(config, dict) else config.to_dict()


def rope_type(config: dict[str, Any]) -> str:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def unwritable(config: Any, tokenizer_dir: Path | None = None) -> str | None:
    """Why the kit cannot write this model as GGUF itself (None if it can). A LLaMA-architecture file is read
    back with transformers' LLaMA tokenizer converter, which needs a BOS token."""
    config = config_of(config)
    model_type = config.get("model_type", "?")
    if model_type not in WRITABLE:
        return f"architecture '{model_type}' (the kit writes {', '.join(WRITABLE)})"
    if rope_type(config) != "default":
        return f"scaled RoPE ('{rope_type(config)}')"
    if model_type != "llama" and head_dim(config) != read_back_head_dim(model_type, config):
        return (f"a {model_type} head size of {head_dim(config)}: transformers' GGUF loader does not read it and "
                f"assumes {read_back_head_dim(model_type, config)}")
    if tokenizer_dir is not None:
        tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
        if tokenizer.get("model", {}).get("type") != "BPE" or not byte_level(tokenizer.get("decoder")):
            return "a tokenizer that is not byte-level BPE (SentencePiece-style)"
        settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        if WRITABLE[model_type][0] == "llama" and not settings.get("bos_token"):
            return "a LLaMA-architecture model whose tokenizer has no BOS token"
    return None


def read_back_head_dim(model_type: str, config: dict[str, Any]) -> int:
    """The head size transformers gives a model it reads from GGUF: LLaMA's is in the file (rope.dimension_count);
    for the others its loader reads none and the config class's default applies (Qwen3: 128, as in every released
    Qwen3; Qwen2 and Mistral: hidden / heads)."""
    if model_type == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config().head_dim
    return config["hidden_size"] // config["num_attention_heads"]


def byte_level(node: Any) -> bool:
    """Whether a tokenizer.json component is, or contains, a ByteLevel step."""
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(byte_level(v) for v in node)
    return False


def token_table(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token text and llama.cpp token type; ids the tokenizer lacks (a padded vocabulary) are UNUSED."""
    from gguf import TokenType

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, types


def permute(weights, n_head: int, n_head_kv: int | None):
    """llama.cpp's row order for LLaMA's q/k projections (transformers' GGUF loader undoes it)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encode(data, quant: str):
    """(bytes to write, their GGML type) for one tensor."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if data.ndim <= 1 or quant == "f32":
        return data.astype(np.float32), GGMLQuantizationType.F32
    if quant == "f16":
        return data.astype(np.float16), GGMLQuantizationType.F16
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "bf16": GGMLQuantizationType.BF16}[quant]
    try:
        return quants.quantize(data.astype(np.float32), qtype), qtype
    except quants.QuantError:  # rows shorter than a block: f16, as llama.cpp falls back
        return data.astype(np.float16), GGMLQuantizationType.F16


def file_type(quant: str):
    from gguf import LlamaFileType

    return {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "bf16": LlamaFileType.MOSTLY_BF16,
            "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0}[quant]


def write_gguf(model, tokenizer, tokenizer_dir: Path, target: Path, quant: str, name: str,
               pre_tokenizer: str | None = None) -> dict[str, Any]:
    """Write `model` (a merged causal LM) and its tokenizer (saved in `tokenizer_dir`) to `target` as GGUF."""
    import gguf
    import torch

    config = config_of(model.config)
    arch, permuted = WRITABLE[config["model_type"]]
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_head_kv = config.get("num_key_value_heads") or n_head
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    writer = gguf.GGUFWriter(str(target), arch)
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta(config))
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim(config))
    else:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type(quant))

    tokens, types = token_table(tokenizer, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer or PRE_TOKENIZERS.get(arch, "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:  # llama.cpp would otherwise decide whether to prepend a BOS
        sample = tokenizer("x").input_ids
        writer.add_add_bos_token(tokenizer.bos_token_id is not None and sample[:1] == [tokenizer.bos_token_id])

    written: dict[str, int] = {}
    with torch.no_grad():
        for hf_name, tensor in model.state_dict().items():
            if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"no GGUF name for tensor {hf_name}")
            data = tensor.detach().float().cpu().numpy()
            if permuted and hf_name.endswith("q_proj.weight"):
                data = permute(data, n_head, n_head)
            elif permuted and hf_name.endswith("k_proj.weight"):
                data = permute(data, n_head, n_head_kv)
            encoded, qtype = encode(data, quant)
            writer.add_tensor(gguf_name, encoded, raw_dtype=qtype)
            written[qtype.name] = written.get(qtype.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": arch, "tensors": written, "tokens": len(tokens)}
