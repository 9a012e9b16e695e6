"""Every shipped recipe validates with `--dry-run`, offline: hub models and datasets are named, never downloaded."""

from __future__ import annotations

import pytest
from helpers import run_cli

from kitcli.recipe.load import shipped_recipes


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipe_dry_runs_offline(name, monkeypatch, in_tmp):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = run_cli("run", name, "--dry-run")
    assert f"name: {name}" in result.output
    assert "# stage 1/" in result.output
    text = shipped_recipes()[name].read_text()
    assert text.startswith("# Run:") and "# Tested:" in text, "a recipe opens with its command and hardware"
