"""The wheelhouse for a machine that reaches no package registry: only the wheels it lacks, slimmed, plus a wheel of
lora-kit itself, in one folder that `bench/offline_run.sh` installs and runs from in the same command.

    python bench/wheelhouse.py                            # -> .whl/ for the lent GPU machine (bench/gpu-target.txt)
    python bench/wheelhouse.py --target my-node.txt       # your own offline node (its `pip list --format=freeze`)
    python bench/wheelhouse.py --python 3.11 --out DIR    # for another Python (the CPU rehearsal's)

Run it here, where pip reaches PyPI, with the project's environment (.venv): the versions are that environment's,
so the offline machine runs what CI tests. What goes in:
- every package lora-kit needs (its dependencies, recursively, as this environment's metadata says), less what the
  target already has (the packages its list names and what they need in turn), less the packages built against one
  torch or never imported by a run (SKIP, each with its reason; the CPU rehearsal, tests/test_offline_rehearsal.py,
  fails if one of them is needed after all);
- a package the target has in another version is carried only where lora-kit pins it (`==`): the pin is why;
- unsloth without `studio/` (a web UI nothing imports; 25 of its 27 MiB), bitsandbytes with the CUDA 13 library and
  the CPU one only (its wheel carries one per CUDA and ROCm version);
- a wheel of lora-kit, so its entry points (the built-in rewards and stages) resolve there.
The folder must fit, with the working tree, in what the device tool carries (40 MiB here; the tool's limit is 64).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 40.0
# Needed by metadata, not carried: built against one torch and CUDA (the target's own, or none: Unsloth falls back
# to PyTorch's attention without xformers), or imported only on paths an offline run never takes.
SKIP = {
    "torch": "the target's own", "triton": "the target's own", "torchvision": "built against one torch",
    "torchaudio": "built against one torch", "xformers": "built against one torch; Unsloth falls back to SDPA",
    "torchao": "built against one torch; Unsloth imports it only for float8/QAT",
    "diffusers": "Unsloth imports it for diffusion models only", "hf-transfer": "downloads only",
    "hf-xet": "downloads only", "msgspec": "unsloth_zoo's vLLM LoRA requests only",
    "pip": "installer", "setuptools": "installer", "wheel": "installer",
}
SKIP_PREFIXES = ("nvidia-", "cuda-")
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def read_target(path: Path) -> tuple[dict[str, str | None], set[str]]:
    """The packages a target has (`name==version` or `name` per line, as `pip list --format=freeze` writes them;
    version None where unknown) and those known to be absent (`!name`: what it needs is then not assumed there)."""
    packages, absent = {}, set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("!"):
            absent.add(canonicalize_name(line[1:]))
        elif line and not line.startswith("-e"):
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version.strip() or None
    return packages, absent


def requirements(name: str, markers: dict) -> list[Requirement] | None:
    """The requirements of an installed distribution that apply on the target (no extras); None if not here."""
    try:
        requires = metadata.distribution(name).requires or []
    except metadata.PackageNotFoundError:
        return None
    found = [Requirement(r) for r in requires]
    return [r for r in found if r.marker is None or r.marker.evaluate({**markers, "extra": ""})]


def closure(roots: list[str], markers: dict, absent: frozenset[str] = frozenset()) -> set[str]:
    """The roots and what they need, recursively (not through the packages in `absent`)."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = canonicalize_name(stack.pop())
        if name not in seen and name not in absent:
            seen.add(name)
            stack.extend(r.name for r in requirements(name, markers) or [])
    return seen


def pinned(markers: dict) -> dict[str, str]:
    return {canonicalize_name(r.name): str(r.specifier)[2:] for r in requirements("lora-kit", markers) or []
            if str(r.specifier).startswith("==")}


def select(target: dict[str, str | None], absent: set[str], markers: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> version to carry, name -> why it is not carried) for every package lora-kit needs."""
    present = closure(list(target), markers, frozenset(absent))
    pins = pinned(markers)
    carry, left = {}, {}
    for name in sorted(closure(["lora-kit"], markers) - {"lora-kit"}):
        version = metadata.version(name)
        if name in SKIP or name.startswith(SKIP_PREFIXES):
            left[name] = SKIP.get(name, "the target's CUDA libraries")
        elif name in present and not (name in pins and target.get(name) != pins[name]):
            left[name] = "on the target"
        else:
            carry[name] = version
    return carry, left


def download(carry: dict[str, str], python: str, out: Path) -> None:
    tags = [f"--platform={p}" for p in PLATFORMS]
    abi = f"cp{python.replace('.', '')}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest",
               str(out), "--python-version", python, "--implementation", "cp", f"--abi={abi}", "--abi=abi3",
               "--abi=none", *tags, *(f"{name}=={version}" for name, version in carry.items())]
    fetched = subprocess.run(command, capture_output=True, text=True)
    if fetched.returncode:
        sys.exit(f"pip download failed:\n{fetched.stdout[-3000:]}{fetched.stderr[-3000:]}")


def rewrite_wheel(wheel: Path, keep) -> int:
    """Drop the members for which `keep(name)` is false, and their RECORD lines; returns the bytes saved."""
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if not keep(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in data.decode().splitlines() if keep(line.split(",", 1)[0])]
                data = ("\n".join(lines) + "\n").encode()
            target.writestr(info, data)
    slim.replace(wheel)
    return before - wheel.stat().st_size


def slim(out: Path) -> dict[str, float]:
    saved = {}
    for wheel in out.glob("unsloth-*.whl"):
        saved[wheel.name] = rewrite_wheel(wheel, lambda name: not name.startswith("studio/"))
    for wheel in out.glob("bitsandbytes-*.whl"):
        def keep(name: str) -> bool:
            library = name.startswith("bitsandbytes/libbitsandbytes_")
            return not library or name.endswith(("_cuda130.so", "_cpu.so"))
        saved[wheel.name] = rewrite_wheel(wheel, keep)
    return {name: round(size / 2**20, 1) for name, size in saved.items()}


def build_kit_wheel(out: Path) -> Path:
    """A wheel of the checkout itself (entry points included), built without network or build isolation."""
    with tempfile.TemporaryDirectory() as build:
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                                "--wheel-dir", str(out), str(ROOT)], cwd=build, capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"building lora-kit's wheel failed:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
    return next(out.glob("lora_kit-*.whl"))


def record_hash(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def tree_mib(out: Path) -> float:
    """The working tree that travels with the wheelhouse: the tracked files in a git checkout (what a clean clone
    holds), every file but the wheelhouse's in an unpacked archive."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        files = [ROOT / name.decode() for name in listed.stdout.split(b"\0") if name]
    else:
        files = [f for f in ROOT.rglob("*") if out not in f.parents]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "bench" / "gpu-target.txt",
                        help="the target's packages, `pip list --format=freeze` (default: the lent GPU machine)")
    parser.add_argument("--python", default="3.12", help="the target's Python (default 3.12, the GPU machine's)")
    parser.add_argument("--out", type=Path, default=ROOT / ".whl", help="the wheelhouse folder (default .whl)")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB,
                        help=f"wheelhouse + working tree at most this (default {LIMIT_MIB:g})")
    args = parser.parse_args()
    markers = {**default_environment(), "python_version": args.python, "python_full_version": f"{args.python}.0",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    carry, left = select(*read_target(args.target), markers)
    out = args.out.resolve()
    for old in out.glob("*.whl") if out.exists() else []:
        old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    download(carry, args.python, out)
    saved = slim(out)
    kit = build_kit_wheel(out)
    wheels = sorted(out.glob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    tree = tree_mib(out)
    lines = [f"{w.name}  {w.stat().st_size / 2**20:.2f} MiB  sha256={record_hash(w)}" for w in wheels]
    (out / "CONTENTS").write_text(
        f"# {len(wheels)} wheels, {mib:.1f} MiB (+ working tree {tree:.1f} MiB) for Python {args.python}, "
        f"target {args.target.name}\n" + "\n".join(lines)
        + "\n# not carried:\n" + "\n".join(f"{name}: {why}" for name, why in left.items()) + "\n")
    print("\n".join(lines))
    print(f"slimmed (MiB saved): {saved}; lora-kit: {kit.name}")
    print(f"{len(wheels)} wheels, {mib:.1f} MiB; with the working tree ({tree:.1f} MiB) {mib + tree:.1f} MiB "
          f"(limit {args.limit_mib:g}); not carried: {', '.join(sorted(left))}")
    print(f"run there: bash bench/offline_run.sh bench/gpu_accept.py   (carry [\"{out.name}\"])")
    if mib + tree > args.limit_mib:
        sys.exit(f"the wheelhouse and the working tree are {mib + tree:.1f} MiB, over {args.limit_mib:g} MiB")


if __name__ == "__main__":
    main()
