"""The offline GPU run, rehearsed on the CPU: the exact command the lent GPU machine runs (bench/GPU.md), from a
clean `git archive` of HEAD plus only the wheelhouse, with the network off, in an interpreter that has only the
target's own packages (bench/gpu-target.txt, taken from this environment) and then the wheelhouse's.

It fails when the run needs anything outside the wheelhouse and the archive (a package, an entry point, a data
file, an ignored path), when the upload passes 40 MiB, or when the results would not come back under the device
tool's rules (at most 8 files of 16 MiB, plain names, two folders down). The run itself is bench/gpu_accept.py's
reduced mode: every stage type on Unsloth's generated trainers (the classes a GPU runs), references checked, a GRPO
stage killed and resumed, one conformance test through pytest.

The wheelhouse is downloaded here for this interpreter's Python (3.11; the GPU machine's is 3.12, which only
changes the compiled wheels' tags) by bench/wheelhouse.py; pip serves it from its cache, filled by `make install`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def load_wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "bench" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_interpreter(directory: Path) -> Path:
    """A venv whose site-packages hold only what the GPU machine has (links into this environment's), and pip."""
    wheelhouse = load_wheelhouse()
    packages, absent = wheelhouse.read_target(ROOT / "bench" / "gpu-target.txt")
    markers = wheelhouse.default_environment()
    present = wheelhouse.closure(list(packages), markers, frozenset(absent))
    venv.EnvBuilder(with_pip=True, symlinks=True).create(directory)
    site = next((directory / "lib").glob("python3.*/site-packages"))
    view = directory / "target-packages"
    view.mkdir()
    import importlib.metadata as metadata

    for dist in metadata.distributions():
        name = wheelhouse.canonicalize_name(dist.metadata["Name"])
        if name not in present or not dist.files:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (view / top).exists() and top not in ("..", "__pycache__"):
                (view / top).symlink_to(source)
    (site / "target-packages.pth").write_text(str(view) + "\n")
    return directory / "bin"


def without_network(command: list[str]) -> list[str]:
    """The command in a network namespace of its own (no interface but a down loopback), where the OS allows it."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn", *command]
    return command  # then the proxies below point at a closed port


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.xdist_group("offline-rehearsal")
def test_offline_gpu_run_rehearsed_from_a_clean_archive_and_the_wheelhouse_alone(tmp_path):
    tree, out, home = tmp_path / "tree", tmp_path / "out", tmp_path / "home"
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True, check=True)
    tree.mkdir()
    (tmp_path / "tree.tar").write_bytes(archive.stdout)
    with tarfile.open(tmp_path / "tree.tar") as tar:
        tar.extractall(tree, filter="data")
    # the wheelhouse, made by the archive's own script (its lora-kit wheel is built from the archive)
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    made = subprocess.run([sys.executable, "bench/wheelhouse.py", "--python", python, "--out", ".whl"], cwd=tree,
                          capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    upload = sum(f.stat().st_size for f in tree.rglob("*") if f.is_file()) / 2**20
    assert upload <= 40, f"the upload is {upload:.1f} MiB"
    wheels = {w.name.split("-")[0] for w in (tree / ".whl").glob("*.whl")}
    assert {"unsloth", "trl", "bitsandbytes", "lora_kit"} <= wheels and not wheels & {"torch", "transformers",
                                                                                        "pytest", "numpy"}

    bin_dir = target_interpreter(tmp_path / "target")
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM", "OMP_NUM_THREADS", "TMPDIR")}
    env = {**keep, "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "OUT": str(out),
           "KIT_SITE": str(tmp_path / "site"), "KIT_CAP_S": "1500", "CI": "1",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "PIP_NO_INDEX": "1"}
    home.mkdir()
    run = subprocess.run(without_network(["bash", "bench/offline_run.sh", "bench/gpu_accept.py", "--reduced"]),
                         cwd=tree, env=env, capture_output=True, text=True, timeout=1600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # what comes back: at most 8 files of at most 16 MiB, plain names, at most two folders down
    files = [f for f in out.rglob("*") if f.is_file()]
    assert 0 < len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files), files
    assert all(RESULT_NAME.match(part) for f in files for part in f.relative_to(out).parts), files
    assert all(len(f.relative_to(out).parts) <= 3 for f in files), files
    assert {f.name for f in files} >= {"gpu-accept-reduced.json", "run.log", "resume.log", "conformance.log"}

    payload = json.loads((out / "gpu-accept-reduced.json").read_text())
    assert payload["environment"]["versions"]["unsloth"] == "2026.10.9"  # the wheelhouse's, found by metadata
    stages = payload["stages"]
    assert {s["type"] for s in stages.values()} == {"eval", "sft", "reward", "dpo", "grpo", "gspo", "ppo"}
    assert all(s["done"] for s in stages.values())
    for name in ("rm", "dpo", "dr-grpo", "dapo", "gspo", "grpo"):
        assert stages[name]["trainer"].startswith("Unsloth"), (name, stages[name]["trainer"])
    assert [c["check"] for c in payload["checks"]] == [
        "dpo: the reference is a frozen copy of the SFT adapter",
        "ppo: the reference is a frozen copy of the SFT adapter",
        "grpo: first KL is 0 (reference = the SFT model)"]
    assert all(c["ok"] for c in payload["checks"])
    resume = payload["resume"]
    assert resume["ok"] and resume["distance_to_uninterrupted"] == 0.0 and resume["distance_moved_by_the_stage"] > 0
    assert payload["conformance"]["ok"] and payload["conformance"]["passed"] == 1
    assert payload["ok"] and "ACCEPTED" in run.stdout
    assert "exact_match" in (out / "run.log").read_text()  # a built-in reward found through its entry point
