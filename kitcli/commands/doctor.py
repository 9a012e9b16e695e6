"""`kit doctor`: is this machine ready to run kit's recipes? One line per check, ok / warn / fail, with the fix.

    kit doctor
    kit doctor --json

Critical checks (a failure makes the exit status 1): Python, torch, the libraries kit trains with, bitsandbytes
4-bit (a real quantize + matmul on this device, since recipes load in 4-bit by default), free disk for the caches.
Everything else (no GPU, no bf16, no vLLM, versions other than kit's known-good set, hub offline) is a warning or
information: kit still runs, maybe slower or CPU-only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import click

PYTHON_RANGE = ((3, 10), (3, 14))  # pyproject: requires-python >=3.10,<3.14
# Libraries whose absence stops every recipe (module name -> distribution name).
CORE = {"transformers": "transformers", "trl": "trl", "peft": "peft", "datasets": "datasets",
        "accelerate": "accelerate", "bitsandbytes": "bitsandbytes"}
# Compared with the kit's pins (pyproject); Unsloth caps trl / transformers, so other versions may not work.
VERSIONED = ("trl", "transformers", "peft", "unsloth", "unsloth-zoo", "datasets", "accelerate", "bitsandbytes")
DISK_WARN_GIB = 20
DISK_FAIL_GIB = 2


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""
    critical: bool = False


def known_good() -> dict[str, str]:
    """The exact pins of the installed kit (its pyproject dependencies)."""
    pins = {}
    try:
        requirements = metadata.requires("lora-kit") or []
    except metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^;\s]+)", requirement)
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def version_of(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def quiet_output():
    """Libraries print banners on import (Unsloth, bitsandbytes); keep the doctor's table clean."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def check_python() -> Check:
    version = sys.version_info[:2]
    low, high = PYTHON_RANGE
    text = f"Python {platform.python_version()} ({sys.executable})"
    if low <= version < high:
        return Check("python", "ok", text, critical=True)
    return Check("python", "fail", text, f"use Python {low[0]}.{low[1]} to {high[0]}.{high[1] - 1} (Unsloth's range)",
                 critical=True)


def check_torch() -> list[Check]:
    try:
        with quiet_output():
            import torch
    except Exception as error:  # noqa: BLE001
        return [Check("torch", "fail", f"cannot import torch ({type(error).__name__}: {error})",
                      "pip install 'torch<2.15' (a CUDA build for GPUs: see pytorch.org)", critical=True)]
    cuda_build = torch.version.cuda
    checks = [Check("torch", "ok", f"torch {torch.__version__}, "
                                   f"{'CUDA ' + cuda_build + ' build' if cuda_build else 'CPU-only build'}",
                    "" if cuda_build else "for a GPU install a CUDA build of torch (pytorch.org)", critical=True)]
    if not torch.cuda.is_available():
        checks.append(Check("cuda devices", "warn", "no CUDA GPU visible: kit trains on CPU (the tiny recipes; "
                                                    "real models need a GPU)",
                            "on a GPU machine: check `nvidia-smi` and CUDA_VISIBLE_DEVICES" if cuda_build else
                            "install a CUDA build of torch"))
        checks.append(Check("bf16", "warn", "no GPU: training runs in float32 on CPU"))
        checks.append(check_cpu_bf16())
        return checks
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        devices.append(f"{index}: {props.name} {total / 1024**3:.1f} GiB ({free / 1024**3:.1f} free), "
                       f"compute {props.major}.{props.minor}")
    checks.append(Check("cuda devices", "ok", "; ".join(devices)))
    if torch.cuda.is_bf16_supported():
        checks.append(Check("bf16", "ok", "bfloat16 supported: training runs in bf16"))
    else:
        checks.append(Check("bf16", "warn", "no bfloat16 on this GPU (pre-Ampere): training runs in fp16",
                            "fp16 is fine for LoRA; watch for overflow in long runs"))
    return checks


def check_cpu_bf16() -> Check:
    """Whether this CPU computes bf16 natively (AMX-BF16 / AVX512-BF16 on x86, BF16 on Arm), as Unsloth's CPU backend
    decides it (unsloth_zoo/cpu/runtime.py; UNSLOTH_CPU_BF16=0/1 overrides), and what that changes for the kit."""
    try:
        with quiet_output():
            import unsloth  # noqa: F401  (unsloth_zoo refuses to import before it; the unsloth check imports it too)
            from unsloth_zoo.cpu.runtime import cpu_bf16_supported, cpu_flags
        native = cpu_bf16_supported()
        flags = sorted(cpu_flags() & {"amx_bf16", "avx512_bf16", "bf16", "avx2"})
    except Exception as error:  # noqa: BLE001
        return Check("cpu bf16", "warn", f"cannot ask Unsloth's CPU backend ({type(error).__name__}: {error})",
                     "pip install the unsloth-zoo version pyproject.toml pins")
    override = os.environ.get("UNSLOTH_CPU_BF16", "").strip()
    source = f"UNSLOTH_CPU_BF16={override}" if override else f"CPU flags: {', '.join(flags) or 'none of note'}"
    same = ("the kit trains in float32 on a CPU either way (bf16 and fp16 off, model dtype float32), so a recipe "
            "gives the same settings on every CPU; float rounding differs between CPU kinds, so held-out figures "
            "can differ by a few questions in 100")
    if native:
        return Check("cpu bf16", "ok", f"native bf16 ({source}): {same}; model.dtype bfloat16 runs at full speed")
    return Check("cpu bf16", "ok", f"no native bf16 ({source}): {same}; model.dtype bfloat16 would be emulated "
                                   f"by torch, several times slower than float32")


def check_libraries() -> list[Check]:
    checks = []
    for module, distribution in CORE.items():
        if importlib.util.find_spec(module) is None:
            pin = known_good().get(distribution)
            checks.append(Check(module, "fail", "not installed", f"pip install {distribution}"
                                f"{'==' + pin if pin else ''}", critical=True))
    return checks


def check_versions() -> list[Check]:
    pins = known_good()
    checks = []
    for distribution in VERSIONED:
        installed = version_of(distribution)
        wanted = pins.get(distribution)
        if installed is None:
            if distribution.startswith("unsloth"):
                checks.append(Check(distribution, "warn", "not installed: kit uses transformers + PEFT (slower, "
                                                          "more memory)", f"pip install {distribution}=={wanted}"
                                    if wanted else f"pip install {distribution}"))
            continue
        if wanted is None or installed == wanted:
            checks.append(Check(distribution, "ok", f"{installed}" + (" (kit's known-good version)" if wanted else "")))
        else:
            checks.append(Check(distribution, "warn", f"{installed}, kit is tested with {wanted}",
                                f"pip install {distribution}=={wanted}"))
    return checks


def check_bitsandbytes_4bit() -> Check:
    """Quantize a 64x64 weight to NF4 and multiply with it on the device recipes train on."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return Check("bitsandbytes 4-bit", "fail", "bitsandbytes is not installed (recipes load in 4-bit)",
                     "pip install bitsandbytes, or set model.load_in_4bit: false", critical=True)
    try:
        with quiet_output():
            import bitsandbytes as bnb
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(64, 64, generator=generator)
            layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4")
            layer = layer.to(device)
            x = torch.randn(4, 64, generator=generator)
            out = layer(x.to(device)).float().cpu()
            error = float((out - x @ weight.T).norm() / (x @ weight.T).norm())
            packed = layer.weight.dtype == torch.uint8
    except Exception as failure:  # noqa: BLE001
        return Check("bitsandbytes 4-bit", "fail", f"NF4 matmul failed ({type(failure).__name__}: "
                                                  f"{str(failure).splitlines()[0][:160] if str(failure) else ''})",
                     "reinstall bitsandbytes for this platform, or set model.load_in_4bit: false", critical=True)
    if not packed or error > 0.25:
        return Check("bitsandbytes 4-bit", "fail", f"NF4 matmul on {device} is wrong (relative error {error:.3f})",
                     "reinstall bitsandbytes, or set model.load_in_4bit: false", critical=True)
    return Check("bitsandbytes 4-bit", "ok", f"NF4 quantize + matmul works on {device} (relative error "
                                             f"{error:.3f}, as expected for 4 bits)", critical=True)


def check_unsloth() -> Check:
    if importlib.util.find_spec("unsloth") is None:
        return Check("unsloth backend", "warn", "Unsloth not installed: kit uses transformers + PEFT",
                     "pip install unsloth")
    try:
        with quiet_output():
            import unsloth  # noqa: F401

            from kitcli.models.backend import choose_backend

            backend = choose_backend("auto")
    except Exception as error:  # noqa: BLE001
        return Check("unsloth backend", "warn", f"import unsloth failed ({type(error).__name__}: "
                                                f"{str(error).splitlines()[0][:160] if str(error) else ''}); kit "
                                                f"falls back to transformers + PEFT",
                     "set model.backend: transformers, or reinstall unsloth")
    if backend == "unsloth-gpu":
        return Check("unsloth backend", "ok", "Unsloth GPU backend (fast kernels, 4-bit QLoRA)")
    return Check("unsloth backend", "warn" if backend == "unsloth-cpu" else "ok",
                 f"{backend}: Unsloth's CPU backend (transformers + PEFT underneath)" if backend == "unsloth-cpu"
                 else backend, "a CUDA GPU enables Unsloth's GPU backend" if backend == "unsloth-cpu" else "")


def check_named_models() -> list[Check]:
    """Whether each named real model (`model: smollm2-135m`) can load here, offline."""
    from kitcli.models import gguf

    checks = []
    for name, model in gguf.NAMED_MODELS.items():
        path = gguf.named_model_file(name)
        if path is None:
            checks.append(Check(f"model {name}", "warn", "not installed (optional): a real model to run offline",
                                model.install))
        elif version_of("gguf") is None:
            checks.append(Check(f"model {name}", "warn", f"{path.name} is here, but reading it needs the gguf "
                                                        f"package", gguf.GGUF_INSTALL))
        else:
            converted = gguf.converted_dir(gguf.file_sha256(path))
            state = f"converted in {converted}" if converted.is_dir() else "converted on first use (about 30 s)"
            checks.append(Check(f"model {name}", "ok", f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB), {state}"))
    return checks


def check_gguf_export() -> list[Check]:
    """What `kit export --to gguf` can write here: the kit's own writer (the gguf package) and llama.cpp."""
    from kitcli.commands.export import LLAMA_CPP_INSTALL, llama_cpp_dir, llama_cpp_files
    from kitcli.models.gguf import GGUF_INSTALL
    from kitcli.models.gguf_export import KIT_QUANTS, WRITABLE

    if version_of("gguf") is None:
        checks = [Check("gguf export", "warn", "the gguf package is not installed (optional)", GGUF_INSTALL)]
    else:
        checks = [Check("gguf export", "ok", f"the kit writes {'/'.join(KIT_QUANTS)} GGUF files of "
                                             f"{'/'.join(WRITABLE)} models itself")]
    folder = llama_cpp_dir()
    converter, quantizer = llama_cpp_files(folder)
    if converter is not None and quantizer is not None:
        checks.append(Check("llama.cpp", "ok", f"{folder}: k-quants (q4_k_m, ...) and other architectures"))
    else:
        checks.append(Check("llama.cpp", "warn", f"not found in {folder} (optional): GGUF k-quants (q4_k_m, ...) "
                                                 f"and architectures the kit does not write need it",
                            LLAMA_CPP_INSTALL))
    return checks


def check_vllm() -> Check:
    version = version_of("vllm")
    if version is None:
        return Check("vllm", "warn", "not installed (optional): GRPO/GSPO generate with transformers",
                     "pip install vllm (GPU only) to use train.use_vllm")
    return Check("vllm", "ok", f"vllm {version} installed")


def free_gib(path: Path) -> float:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free / 1024**3


def check_disk() -> list[Check]:
    from kitcli.cache import kit_home

    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    places = {"kit cache (KIT_HOME)": kit_home(), "hub cache (HF_HOME)": Path(os.environ.get("HF_HUB_CACHE",
                                                                                            hf_home / "hub")),
              "runs (working directory)": Path.cwd()}
    checks = []
    for label, path in places.items():
        free = free_gib(path)
        detail = f"{path}: {free:.1f} GiB free"
        if free < DISK_FAIL_GIB:
            checks.append(Check(f"disk: {label}", "fail", detail, "free disk space; a 4B model and its checkpoints "
                                                                  "need ~20 GiB", critical=True))
        elif free < DISK_WARN_GIB:
            checks.append(Check(f"disk: {label}", "warn", detail, "a 4B model and its checkpoints need ~20 GiB",
                                critical=True))
        else:
            checks.append(Check(f"disk: {label}", "ok", detail, critical=True))
    return checks


def check_offline() -> Check:
    flags = [k for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
             if os.environ.get(k, "").upper() in ("1", "ON", "TRUE", "YES")]
    if flags:
        return Check("hub offline mode", "ok", f"{', '.join(flags)} set: only local models, the hub cache and "
                                               f"`model: tiny` can load", "unset them to download models")
    return Check("hub offline mode", "ok", "online: models and datasets download from the hub on first use")


def run_checks() -> list[Check]:
    checks = [check_python(), *check_torch(), *check_libraries(), check_bitsandbytes_4bit(), check_unsloth(),
              check_vllm(), *check_gguf_export(), *check_named_models(), *check_versions(), *check_disk(),
              check_offline()]
    return checks


def run_doctor(as_json: bool, console) -> int:
    checks = run_checks()
    healthy = not any(c.critical and c.status == "fail" for c in checks)
    if as_json:
        click.echo(json.dumps({"ok": healthy, "checks": [asdict(c) for c in checks]}, indent=2))
        return 0 if healthy else 1
    from rich.table import Table

    table = Table(title="kit doctor")
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    colours = {"ok": "green", "warn": "yellow", "fail": "red"}
    for check in checks:
        table.add_row(check.name, f"[{colours[check.status]}]{check.status}[/]", check.detail, check.fix)
    console.print(table)
    failed = [c.name for c in checks if c.critical and c.status == "fail"]
    if failed:
        console.print(f"not ready: {', '.join(failed)} failed (see the fix column)", highlight=False, markup=False)
    else:
        warnings = sum(c.status == "warn" for c in checks)
        console.print(f"ready: every critical check passed ({warnings} warning{'s' if warnings != 1 else ''})",
                      highlight=False, markup=False)
    return 0 if healthy else 1


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor_command(as_json: bool) -> None:
    """Check this machine: Python, torch and CUDA, bf16, bitsandbytes 4-bit, Unsloth, vLLM, versions, disk, hub."""
    from rich.console import Console

    click.get_current_context().exit(run_doctor(as_json, Console(highlight=False)))
