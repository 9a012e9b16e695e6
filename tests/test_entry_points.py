"""Every way in answers --help with its usage and exit 0, and writes nothing: the `kit` script, `python -m kitcli`
and the two module entry points (`python -m kitcli.tiny`, `python -m kitcli.synthetic`) under their public and
their in-package names. (Each `kit` subcommand's --help is tested in test_cli.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KIT_SCRIPT = Path(sys.executable).parent / "kit"
PYTHON_M = [sys.executable, "-m"]
# the command line, and how its usage line starts
ENTRY_POINTS = {
    "kit": ([str(KIT_SCRIPT)], "Usage: kit "),
    "python -m kitcli": ([*PYTHON_M, "kitcli"], "Usage: python -m kitcli "),
    "python -m kitcli.tiny": ([*PYTHON_M, "kitcli.tiny"], "usage: python -m kitcli.tiny "),
    "python -m kitcli.tiny build": ([*PYTHON_M, "kitcli.tiny", "build"], "usage: python -m kitcli.tiny build "),
    "python -m kitcli.models.tiny": ([*PYTHON_M, "kitcli.models.tiny"], "usage: python -m kitcli.tiny "),
    "python -m kitcli.synthetic": ([*PYTHON_M, "kitcli.synthetic"], "usage: python -m kitcli.synthetic "),
    "python -m kitcli.data.synthetic": ([*PYTHON_M, "kitcli.data.synthetic"], "usage: python -m kitcli.synthetic "),
}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_point_answers_help_and_writes_nothing(name, flag, tmp_path):
    argv, usage = ENTRY_POINTS[name]
    if name == "kit" and not KIT_SCRIPT.exists():
        pytest.skip("the kit script is not installed beside this interpreter")
    result = subprocess.run([*argv, flag], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(usage), result.stdout
    assert list(tmp_path.iterdir()) == [], "--help wrote files"
