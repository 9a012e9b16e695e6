"""Where a recipe's names point: a model (a hub name, a local directory or GGUF file, a named model, `tiny`) and a
dataset (a file relative to the recipe, the working directory or the kit's checkout, or a hub name), resolved when the
recipe is validated (kitcli/recipe/schema.py)."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationInfo

from kitcli.errors import KitError
from kitcli.recipe.stage_rules import fail

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(("/",))


def kit_source_root() -> Path:
    """The checkout the kit runs from (holds `examples/`), for recipe paths like examples/data/x.jsonl."""
    return Path(__file__).resolve().parents[2]


def base_dir_of(info: ValidationInfo) -> Path:
    return Path((info.context or {}).get("base_dir") or Path.cwd())


def resolve_model_name(name: str, base_dir: Path) -> str:
    """`tiny`, a named model (`smollm2-135m`), a hub id (`org/name`), a local directory or GGUF file (made
    absolute). A GGUF file (or a directory holding one) and a named model are checked here: present, readable,
    of an architecture and tensor types the kit can load."""
    from kitcli.models import gguf

    if name == "tiny":
        return name
    try:
        if name in gguf.NAMED_MODELS:
            gguf.inspect_gguf(gguf.require_named_model(name, "model"), f"model {name}")
            return name
        for candidate in (Path(name).expanduser(), base_dir / name):
            if candidate.is_dir():
                inside = gguf.gguf_in(candidate)
                if inside is not None:
                    gguf.inspect_gguf(inside)
                return str(candidate.resolve())
            if gguf.is_gguf_name(name) and candidate.is_file():
                gguf.inspect_gguf(candidate)
                return str(candidate.resolve())
    except KitError as error:
        raise fail(str(error), where="") from None
    if looks_like_path(name) or gguf.is_gguf_name(name) or Path(name).expanduser().exists():
        raise fail(f"model path '{name}' does not exist; give an existing directory with config.json or a .gguf "
                   f"file, a hub name like 'unsloth/Qwen3-4B', 'smollm2-135m' or 'tiny'", where="")
    return name


def resolve_data_path(path: str, base_dir: Path) -> str:
    """A local file (relative to the recipe, the working directory or the kit's checkout), or a hub dataset id."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        if candidate.is_file():
            return str(candidate)
    else:
        for root in (base_dir, Path.cwd(), kit_source_root()):
            if (root / candidate).is_file():
                return str((root / candidate).resolve())
    if candidate.suffix.lower() in DATA_SUFFIXES or looks_like_path(path) or candidate.exists():
        raise fail(f"dataset file '{path}' does not exist (looked relative to {base_dir} and the working directory); "
                   f"give an existing JSONL, JSON, CSV or Parquet file")
    return path  # a hub dataset name, loaded with datasets.load_dataset when online
