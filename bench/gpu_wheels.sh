#!/usr/bin/env bash
# Download, here (a machine that reaches PyPI), every wheel bench/gpu_accept.py needs on the lent GPU machine, which
# reaches no registry and has Python 3.12 with torch 2.11 (CUDA 13), transformers, peft, accelerate and triton, but
# no unsloth, unsloth_zoo, trl, bitsandbytes, datasets or math-verify.
#
#     bash bench/gpu_wheels.sh            # -> .whl/group-1 ... .whl/group-N (each at most 56 MiB) and .whl/INSTALL
#
# The versions are this checkout's environment's (.venv), so the GPU runs what CI tests; torch, triton, the CUDA
# libraries and the packages built against this torch (torchvision, xformers, torchao) stay the GPU machine's own.
# The device tool carries at most 64 MiB per call: carry one group per call (carry: [".whl/group-1"]) and run its
# install line; everything lands in .gpusite/ of the working tree, which stays on a warm machine between calls.
# .whl/INSTALL lists the install line of each group and then the acceptance command.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=.whl
LIMIT=$((56 * 1024 * 1024))  # the call carries the working tree too (64 MiB in all)
KEEP_GPU_OWN='^(torch|triton|torchvision|torchaudio|xformers|torchao|nvidia-.*|cuda-.*|lora-kit|pip|setuptools|wheel)$'

rm -rf "$OUT"
mkdir -p "$OUT/all"
"$PYTHON" -m pip list --format=freeze 2>/dev/null | grep -v '^-e' | grep -v ' @ ' | while IFS='=' read -r name _ version; do
  if echo "$name" | tr 'A-Z_' 'a-z-' | grep -Eq "$KEEP_GPU_OWN"; then continue; fi
  echo "$name==$version"
done > "$OUT/requirements.txt"

# One wheel per requirement, for CPython 3.12 on manylinux x86-64 (pure-Python wheels where there is no other).
"$PYTHON" -m pip download --no-deps --only-binary=:all: --dest "$OUT/all" \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -r "$OUT/requirements.txt" >/dev/null

# Groups of at most LIMIT bytes, largest wheels first (first fit).
"$PYTHON" - "$OUT" "$LIMIT" <<'EOF'
import pathlib, shutil, sys
out, limit = pathlib.Path(sys.argv[1]), int(sys.argv[2])
wheels = sorted((out / "all").glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
groups: list[list[pathlib.Path]] = []
for wheel in wheels:
    size = wheel.stat().st_size
    if size > limit:
        sys.exit(f"{wheel.name} is {size / 2**20:.1f} MiB, more than one group may hold")
    for group in groups:
        if sum(p.stat().st_size for p in group) + size <= limit:
            group.append(wheel)
            break
    else:
        groups.append([wheel])
lines = []
for number, group in enumerate(groups, start=1):
    folder = out / f"group-{number}"
    folder.mkdir()
    mib = sum(p.stat().st_size for p in group) / 2**20
    for wheel in group:
        shutil.move(str(wheel), folder / wheel.name)
    lines.append(f"# group {number}: {len(group)} wheels, {mib:.1f} MiB; carry [\"{folder}\"]")
    lines.append(f"python3 -m pip install --no-index --no-deps --quiet --target .gpusite {folder}/*.whl")
(out / "all").rmdir()
lines.append("# then, in the same warm session (PYTHONPATH puts the wheels first):")
lines.append("PYTHONPATH=$PWD/.gpusite:$PWD python3 bench/gpu_accept.py")
(out / "INSTALL").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
