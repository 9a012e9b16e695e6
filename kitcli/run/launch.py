"""Past one GPU: run a recipe's stages in N processes under `accelerate launch`.

    kit run my-grpo.yaml --launcher accelerate --num-processes 4
    kit run my-grpo.yaml --launcher accelerate --num-processes 4 --deepspeed zero2
    kit run tiny-sft --launcher accelerate --num-processes 2 --cpu        # two CPU processes, gloo

The parent `kit run` validates the recipe, fixes the run directory (so every process writes to the same one) and
starts `accelerate launch ... -m kitcli run RECIPE --output DIR` with the transformers + PEFT backend
(KIT_FORCE_BACKEND=transformers: Unsloth trains on one GPU only). accelerate's torchrun launcher starts the
processes; TRL's trainers do data parallelism (DDP), DeepSpeed ZeRO or FSDP as accelerate configures them.

Inside the processes only the main one (rank 0) holds the run directory's lock (kitcli/rundir.py: WriterLock) and
writes the lock file, DONE markers, saved adapters and metrics; the others wait at a barrier (`kitcli/dist.py`)
where the main process writes, and skip eval stages (generation is not distributed). docs/multi-gpu.md lists
which stage types support this.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from kitcli.errors import KitError
from kitcli.rundir import RunDir
from kitcli.writer_lock import in_use, lock_holder

LAUNCHERS = ("accelerate",)
DEEPSPEED_STAGES = ("zero2", "zero3")


# --- the parent `kit run --launcher accelerate` ----------------------------------------------------------------

def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001  (no usable torch: no GPUs to count)
        return 0


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_request(recipe, *, num_processes: int, deepspeed: str | None, fsdp: bool, cpu: bool) -> None:
    if num_processes < 1:
        raise KitError(f"--num-processes must be at least 1, got {num_processes}")
    if deepspeed and fsdp:
        raise KitError("--deepspeed and --fsdp exclude each other; choose one way to shard")
    if not installed("accelerate"):
        raise KitError("--launcher accelerate needs accelerate; pip install accelerate")
    if cpu and (deepspeed or fsdp):
        raise KitError(f"--{'deepspeed' if deepspeed else 'fsdp'} needs GPUs; drop --cpu (CPU processes run "
                       f"plain data parallel with gloo)")
    if deepspeed and not installed("deepspeed"):
        raise KitError(f"--deepspeed {deepspeed} needs DeepSpeed, which is not installed; pip install deepspeed "
                       f"(it builds against your CUDA toolkit), or use --fsdp / plain data parallel")
    if not cpu:
        gpus = visible_gpus()
        if num_processes > gpus:
            raise KitError(f"--num-processes {num_processes} but {gpus} CUDA device{'s are' if gpus != 1 else ' is'} "
                           f"visible; use at most {gpus}, or add --cpu to run the processes on CPU (gloo)"
                           if gpus else
                           f"--num-processes {num_processes} but no CUDA device is visible; add --cpu to run the "
                           f"processes on CPU (gloo), or run on a machine with {num_processes} GPUs")
    for stage in recipe.stages:
        if stage.spec.launcher.runs is None:
            why = stage.spec.launcher.refusal or "it does not run under --launcher"
            raise KitError(f"{recipe.source}: stage '{stage.name}': {why}")
    sharded = (deepspeed == "zero3") or fsdp
    four_bit = recipe.model.load_in_4bit is not False and not cpu  # unset: 4-bit on GPUs
    if sharded and four_bit and recipe.lora is not None:
        raise KitError(f"{'--deepspeed zero3' if deepspeed else '--fsdp'} shards the weights, which bitsandbytes "
                       f"4-bit weights do not support here; add --set model.load_in_4bit=false (16-bit LoRA), or "
                       f"use --deepspeed zero2 / plain data parallel with 4-bit")


def accelerate_arguments(*, num_processes: int, deepspeed: str | None, fsdp: bool, cpu: bool) -> list[str]:
    """`accelerate launch` flags. Its torchrun launcher (`--multi_gpu`) starts the processes; with --cpu the GPUs
    are hidden, so each process runs on CPU and accelerate picks gloo (its own `--cpu` starts only one process)."""
    args = ["--num_processes", str(num_processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", os.environ.get("KIT_MAIN_PROCESS_PORT", "29517")]
    if deepspeed:
        args += ["--use_deepspeed", "--zero_stage", deepspeed[-1], "--offload_optimizer_device", "none",
                 "--offload_param_device", "none", "--zero3_init_flag", "false",
                 "--zero3_save_16bit_model", "true" if deepspeed == "zero3" else "false"]
    elif fsdp:
        args += ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                 "--fsdp_reshard_after_forward", "true", "--fsdp_state_dict_type", "FULL_STATE_DICT",
                 "--fsdp_cpu_ram_efficient_loading", "false"]
    else:
        args += ["--multi_gpu"]
    return args


def child_environment(num_processes: int, cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["KIT_FORCE_BACKEND"] = "transformers"
    env["KIT_LAUNCHED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))
    return env


def launch(recipe, recipe_arg: str, *, output: str | None, overrides: list[str], force: bool, num_processes: int,
           deepspeed: str | None, fsdp: bool, cpu: bool, extra: list[str] = (), console=None) -> Path:
    """Validate, choose the run directory, and run `accelerate launch`; returns the run directory."""
    from kitcli.run.lock import choose_run_dir

    check_request(recipe, num_processes=num_processes, deepspeed=deepspeed, fsdp=fsdp, cpu=cpu)
    run_dir = Path(output) if output else choose_run_dir(recipe, None)
    holder = lock_holder(RunDir(run_dir))  # the main process takes the lock; refuse here before starting N processes
    if holder is not None:
        raise in_use(RunDir(run_dir), holder)
    command = [sys.executable, "-m", "accelerate.commands.launch",
               *accelerate_arguments(num_processes=num_processes, deepspeed=deepspeed, fsdp=fsdp, cpu=cpu),
               "-m", "kitcli", "run", recipe_arg, "--output", str(run_dir)]
    for item in overrides:
        command += ["--set", item]
    if force:
        command.append("--force")
    command += list(extra)
    where = f"{num_processes} CPU processes (gloo)" if cpu else f"{num_processes} GPUs"
    mode = f"DeepSpeed {deepspeed}" if deepspeed else "FSDP" if fsdp else "data parallel"
    message = f"launching {where}, {mode}, transformers + PEFT backend: {' '.join(command[2:])}"
    if console is not None:
        console.print(message, highlight=False, markup=False, soft_wrap=True)
    result = subprocess.run(command, env=child_environment(num_processes, cpu))
    if result.returncode != 0:
        raise LaunchFailed(result.returncode)
    return run_dir


class LaunchFailed(Exception):
    """The launched processes failed; they printed why. Carries their exit status."""

    def __init__(self, returncode: int):
        super().__init__(f"accelerate launch exited with status {returncode}")
        self.returncode = returncode


# --- the `kit run` options -------------------------------------------------------------------------------------

def launcher_options(command):
    """`kit run`'s options for running past one GPU."""
    import click

    options = [
        click.option("--launcher", type=click.Choice(LAUNCHERS), default=None,
                     help="Run the stages in several processes under this launcher (transformers + PEFT backend)."),
        click.option("--num-processes", type=int, default=None, metavar="N",
                     help="Processes to launch: one per GPU (with --launcher)."),
        click.option("--deepspeed", type=click.Choice(DEEPSPEED_STAGES), default=None,
                     help="Shard with DeepSpeed ZeRO stage 2 or 3 (with --launcher)."),
        click.option("--fsdp", is_flag=True, help="Shard with PyTorch FSDP (with --launcher)."),
        click.option("--cpu", is_flag=True, help="Run the launched processes on CPU (gloo), e.g. to test a "
                                                 "multi-process run without GPUs (with --launcher)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_with_launcher(recipe, recipe_arg: str, *, launcher: str | None, num_processes: int | None,
                      deepspeed: str | None, fsdp: bool, cpu: bool, output: str | None, overrides: list[str],
                      force: bool, quiet: bool, as_json: bool, console, no_lock: bool = False,
                      extra: list[str] | None = None) -> Path | None:
    """`kit run --launcher ...`: launch and return the run directory; None when no launcher was asked for."""
    if launcher is None:
        used = [name for name, value in (("--num-processes", num_processes), ("--deepspeed", deepspeed),
                                         ("--fsdp", fsdp), ("--cpu", cpu)) if value]
        if used:
            raise KitError(f"{', '.join(used)} only appl{'y' if len(used) > 1 else 'ies'} to multi-process runs; add "
                           f"--launcher accelerate (and --num-processes N)")
        return None
    if os.environ.get("KIT_LAUNCHED"):
        raise KitError("--launcher inside a launched process; run `kit run --launcher ...` from a plain shell")
    extra = (["--quiet"] if quiet else ["--json"] if as_json else []) + (["--no-lock"] if no_lock else []) + \
        list(extra or [])  # --until / --only
    return launch(recipe, recipe_arg, output=output, overrides=overrides, force=force,
                  num_processes=num_processes or 1, deepspeed=deepspeed, fsdp=fsdp, cpu=cpu, extra=extra,
                  console=console)
