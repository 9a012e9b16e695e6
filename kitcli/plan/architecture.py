"""The architecture numbers the estimate needs (hidden size, layers, heads, KV heads, intermediate size, vocabulary),
read from the model's `config.json`: `--config`, a local model directory, the Hugging Face hub cache, the hub itself
when online, or, offline, a built-in table of popular architectures (`BUILTIN_ARCHITECTURES`)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kitcli.errors import KitError

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
    except Exception:  # noqa: BLE001  (offline, gated, missing: the caller falls back to the built-in table)
        return None


def tiny_config() -> dict[str, Any]:
    from kitcli.models.tiny import ASSETS, TINY_CONFIG, TOKENIZER_VOCAB_SIZE

    built = ASSETS / "config.json"
    if built.exists():
        return json.loads(built.read_text())
    return {**TINY_CONFIG, "vocab_size": TOKENIZER_VOCAB_SIZE}


def local_config(model_name: str) -> tuple[dict[str, Any], str] | None:
    """(config, where it came from) for a model described on this machine: the embedded tiny model, a GGUF file's
    metadata (llama.cpp's architecture name as model_type), a local directory's config.json, or the hub cache;
    None otherwise. Nothing is downloaded."""
    if model_name == "tiny":
        return tiny_config(), "embedded tiny model"
    from kitcli.models import gguf

    source = gguf.source_file(model_name)
    if source is not None:
        return gguf.config_from_metadata(source), f"GGUF metadata ({source.name})"
    local = Path(model_name).expanduser()
    if local.is_dir():
        return (read_config(local / "config.json"), str(local / "config.json")) \
            if (local / "config.json").is_file() else None
    cached = cached_hub_config(model_name) if "/" in model_name else None
    if cached is not None:
        return read_config(cached), f"hub cache ({cached})"
    return None


def find_architecture(model_name: str, config_path: str | None = None) -> Architecture:
    """The model's architecture from --config, a local directory, the hub cache, the hub, or the built-in table."""
    if config_path:
        path = Path(config_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise KitError(f"--config '{config_path}' is not a config.json file (or a directory holding one)")
        return architecture_from_config(read_config(path), model_name, str(path))
    found = local_config(model_name)
    if found is not None:
        return architecture_from_config(found[0], model_name, found[1])
    local = Path(model_name).expanduser()
    if local.is_dir():
        raise KitError(f"model directory '{local}' has no config.json; kit plan reads the architecture from "
                       f"it (or pass --config PATH)")
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

