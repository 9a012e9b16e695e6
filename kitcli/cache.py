"""Where the kit keeps what it makes once ($KIT_HOME, default ~/.cache/kit: the tiny model's copy, converted GGUF
models and their headers, Unsloth's compiled trainers), and the sha256 that names a file there or in a lock."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def kit_home() -> Path:
    return Path(os.environ.get("KIT_HOME", Path.home() / ".cache" / "kit"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
