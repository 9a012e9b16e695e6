"""Test setup: one shared KIT_HOME (the tiny model is built once per checkout), unsloth imported first."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("KIT_HOME", str(ROOT / ".pytest_kit_home"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if importlib.util.find_spec("unsloth") is not None:
    import unsloth  # noqa: F401  (must precede trl / transformers / peft, as in a real run)

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from kitcli.tiny import ensure_tiny_model

    return ensure_tiny_model(seed=0)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run the test from an empty directory, so default run directories land in tmp_path."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
