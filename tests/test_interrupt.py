"""Disk is checked before a checkpoint is written. (SIGINT / SIGTERM mid-stage, the checkpoint they save and the
exact resume from it: tests/test_resume.py.)"""

from __future__ import annotations

import pytest

from kitcli.errors import KitError
from kitcli.training.interrupt import check_free_disk


def test_disk_check_names_size_and_fix(tmp_path):
    with pytest.raises(KitError, match=r"not enough free disk to save checkpoint-5 .* needs about \d+ MiB"):
        check_free_disk(tmp_path, 1 << 60, "checkpoint-5")
    check_free_disk(tmp_path, 1024, "checkpoint-5")  # plenty of room: no error
