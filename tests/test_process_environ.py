"""The test process keeps one os.environ: a dataset mapped with num_proc (as TRL's trainers map theirs) rebinds it to
a copy, and rich's consoles, which read the original, then missed a later test's COLUMNS (CI's run failed three
tests on it, depending on which files a worker had run before)."""

from __future__ import annotations

import os

from conftest import PROCESS_ENVIRON, put_back_the_process_environ


def test_a_console_sees_columns_after_a_dataset_was_mapped_with_num_proc(monkeypatch):
    from datasets import Dataset
    from rich.console import Console

    Dataset.from_dict({"a": list(range(8))}).map(lambda row: row, num_proc=2)
    put_back_the_process_environ()  # what the autouse fixture does between tests
    assert os.environ is PROCESS_ENVIRON
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("LINES", "50")
    assert Console().width == 200
