"""Helpers for tests: write a recipe, run the CLI in-process, read a run's files."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner

from kitcli.commands.cli import main

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"
TINY_MODEL = {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True, "dtype": "float32"}
SMALL_LORA = {"r": 8, "alpha": 16, "dropout": 0.0,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# The SFT stage the DPO, KTO/RLOO and reward tests start from (each module trains it once: 2 s in-process).
SFT_8_STEPS = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
               "train": {"max_steps": 8, "learning_rate": 2e-3, "per_device_train_batch_size": 16, "logging_steps": 4,
                         "save_steps": 100}}


# --- precision modes (docs/conformance.md) -------------------------------------------------------------------------
# The formula tests that compare a loss run in two modes (conftest's `precision` fixture): "fp32", the CPU's float32
# as the kit trains on a CPU, and "bf16", the GPU's mixed precision (on a CPU, emulated by emulate_gpu_precision).
# Tests that do not take the fixture keep the device's own precision (None here).
_mode: dict[str, str | None] = {"precision": None}


def current_precision() -> str | None:
    return _mode["precision"]


@contextlib.contextmanager
def at_precision(precision: str | None):
    """Run the block's forward_precision() forwards in `precision` ("fp32" or "bf16"), then go back."""
    before = _mode["precision"]
    _mode["precision"] = precision
    try:
        yield
    finally:
        _mode["precision"] = before


def forward_precision():
    """The autocast the kit's trainers run their forwards under: none on a CPU (float32), bf16 (or fp16) on a GPU;
    in a test's "bf16" mode, bf16 autocast on the CPU too, and none in its "fp32" mode.
    An independent computation checked against a trainer's numbers runs its forwards under the same."""
    import torch

    precision = current_precision()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    if precision == "fp32" or device == "cpu":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)


def precision_scale() -> float:
    """How much looser a comparison of a trainer's loss with the formula is on a GPU (bf16 forwards, and a padded
    batch against one unpadded sequence at a time, round differently) than on a CPU in float32: 1 on a CPU, and in
    a test's own precision mode (its bf16 tolerances are measured: PrecisionGap)."""
    import torch

    return 300.0 if torch.cuda.is_available() and current_precision() is None else 1.0


def gpu_dtype_settings() -> dict[str, bool]:
    """The mixed-precision fields the kit sets on a bf16 GPU (an H100 / H200): kitcli.training.trl_config's own
    device_defaults(on_gpu=True), read with torch told that the GPU supports bfloat16."""
    from unittest import mock

    from kitcli.training import trl_config

    with mock.patch("torch.cuda.is_bf16_supported", return_value=True):
        on_gpu = trl_config.device_defaults(on_gpu=True)
    return {key: on_gpu[key] for key in ("bf16", "fp16")}


UNSLOTH_CPU_BF16 = "UNSLOTH_CPU_BF16"


def forget_unsloth_cpu_bf16() -> None:
    """Unsloth's CPU backend caches whether this CPU trains in bf16 (unsloth_zoo/cpu/runtime.py,
    cpu_bf16_supported: AMX-BF16 or AVX512-BF16, or UNSLOTH_CPU_BF16=0/1); after the variable changes, the next call
    must read it again."""
    try:
        from unsloth_zoo.cpu.runtime import cpu_bf16_supported
    except ImportError:  # a GPU install of Unsloth without the CPU backend
        return
    cpu_bf16_supported.cache_clear()


def set_unsloth_cpu_bf16(monkeypatch, native: bool) -> None:
    """Make Unsloth's CPU backend answer as on a CPU with (or without) native bf16, whatever this CPU has. The
    caller clears the cache again once monkeypatch has put the variable back (conftest's fixtures do)."""
    monkeypatch.setenv(UNSLOTH_CPU_BF16, "1" if native else "0")
    forget_unsloth_cpu_bf16()


def emulate_gpu_precision(monkeypatch) -> None:
    """Build every trainer of the test with the kit's GPU mixed precision, on the CPU.

    The kit's configs get the GPU's dtype fields (gpu_dtype_settings: bf16=True, fp16=False) with the CPU's device
    fields (use_cpu=True, which transformers needs for bf16 without a GPU, and a CPU optimizer): build_config is
    called with on_gpu=True (it forces bf16=False otherwise) and device_defaults answers with that mix. Everything
    after follows as on a GPU: kitcli/training/trainers.py exports ACCELERATE_MIXED_PRECISION=bf16 and leaves the
    model's float32 unflagged; transformers builds the accelerator with mixed_precision bf16 (CPU autocast); TRL's
    trainers score under accelerator.autocast(); Unsloth's GRPO / RLOO trainers latch bf16 autocast for the loss
    from args.mixed_precision on their first scoring or loss call (unsloth/models/rl_replacements.py,
    _unsloth_grpo_autocast: trainer._autocast_enabled / _autocast_dtype), and its loss (unsloth_zoo
    grpo_accumulated_loss) runs the policy forward under torch.amp.autocast(model.device.type, bfloat16), with
    the logits as a float32 matmul of the bf16 hidden states (unsloth_zoo/fused_losses/fused_linear.py, the CPU
    branch of _mm_fp32). The test's own forwards follow forward_precision() (bf16 autocast in this mode).
    Not emulated: Unsloth's GPU kernels (LoRA, RMSNorm, RoPE), bitsandbytes' 4-bit base weights, PrefixGrouper
    (refused by its own check on a CPU) and the GPU's matmul rounding.
    Unsloth's CPU backend is told that this CPU has native bf16 (set_unsloth_cpu_bf16), as a GPU has: without it, it
    turns the configs' bf16 off on a CPU without AMX-BF16 / AVX512-BF16 (the kit puts it back, see build_config),
    and the emulation would depend on which CPU runs it."""
    from kitcli.stages import dpo, grpo, kto, reward, sft
    from kitcli.training import trl_config

    set_unsloth_cpu_bf16(monkeypatch, native=True)
    emulated = {**trl_config.device_defaults(on_gpu=False), **gpu_dtype_settings()}
    monkeypatch.setattr(trl_config, "device_defaults", lambda on_gpu: dict(emulated))
    for stage in (dpo, grpo, kto, reward, sft):
        build = stage.build_config
        monkeypatch.setattr(stage, "build_config", lambda *a, _build=build, **kw: _build(*a, **{**kw, "on_gpu": True}))


class PrecisionGap:
    """The values a formula reads, computed by the test's own forwards at bf16 and at float32 on the test's own batch,
    and the tolerances derived from their gap (docs/conformance.md).

    `inputs()` runs the test's forwards (forward_precision()) and returns the formula's inputs by name: per-token
    log-probs, sequence log-probs, rewards. In the "bf16" mode it runs twice, with its forwards in bf16 and in
    float32, and |x_bf16 - x_fp32| of each value (where `mask`) is the measured gap: how far a bf16 forward puts that
    value from float32. A trainer's bf16 forwards (the same model, tokens and autocast) are taken to be off by as
    much, so the trainer's value and the test's, each one bf16 rounding of the same float32 value, differ by about
    twice the gap:
      mean_tolerance(name)     = 2 * the mean gap of one input: for the mean |difference| over its values (what the
                                 formula tests compare: the trainer's own log-probs / rewards against the test's);
      input_tolerance(name)    = 2 * the largest gap of one input (the formula tests keep token ratios that far
                                 clear of a clip edge); sequence_tolerance: 2 * the largest sum of one row's gaps;
      value_tolerance(f)       = 2 * sum over values x_t of max(|f(x + gap_t e_t) - f(x)|, |f(x - gap_t e_t) - f(x)|),
                                 each value moved by its own gap, one at a time (the first-order worst case of a
                                 formula evaluated on two independent bf16 forwards);
      gradient_tolerance(f)    = 2 * max over elements of |grad f(bf16 inputs) - grad f(float32 inputs)|.
    The formula tests compare a trainer's loss with the formula on the trainer's own inputs from the same forward
    (tests/same_forward.py), which needs none of these; the gap bounds their second check, against the test's own
    forward. In the "fp32" mode nothing is measured and every tolerance is 0: the float32 assertions are today's."""

    def __init__(self, inputs, mask=None):
        self.measured = current_precision() == "bf16"
        self.mask = mask
        self.bf16 = self.fp32 = self.gaps = None
        if not self.measured:
            return
        with at_precision("bf16"):
            self.bf16 = inputs()
        with at_precision("fp32"):
            self.fp32 = inputs()
        self.gaps = {}
        for name, value in self.bf16.items():
            gap = (value - self.fp32[name]).detach().abs()
            self.gaps[name] = gap * mask if mask is not None and mask.shape == gap.shape else gap

    def _counted(self, gap):
        """The gap's values where the mask counts them (all of them for an input of another shape)."""
        import torch

        counted = self.mask if self.mask is not None and self.mask.shape == gap.shape else torch.ones_like(gap)
        return gap[counted.bool()]

    def _gap_values(self):
        import torch

        return torch.cat([self._counted(gap) for gap in self.gaps.values()])

    @property
    def mean(self) -> float:
        return self._gap_values().mean().item() if self.measured else 0.0

    @property
    def max(self) -> float:
        return self._gap_values().max().item() if self.measured else 0.0

    def input_tolerance(self, name: str) -> float:
        return 2 * self.gaps[name].max().item() if self.measured else 0.0

    def mean_tolerance(self, name: str) -> float:
        """2 * the mean gap of one input: for the mean |difference| of that input computed twice in bf16."""
        return 2 * self._counted(self.gaps[name]).mean().item() if self.measured else 0.0

    def sequence_tolerance(self, name: str) -> float:
        """2 * the largest sum of one row's gaps: for a value that sums a per-token input over a sequence."""
        return 2 * self.gaps[name].sum(-1).max().item() if self.measured else 0.0

    def value_tolerance(self, formula) -> float:
        if not self.measured:
            return 0.0
        import torch

        values = {name: value.detach() for name, value in self.bf16.items()}
        effect = 0.0
        with torch.no_grad():
            base = formula(**values).item()
            for name, gap in self.gaps.items():
                for index in gap.flatten().nonzero().flatten().tolist():
                    worst = 0.0
                    for sign in (1, -1):
                        moved = values[name].clone()
                        moved.view(-1)[index] += sign * gap.view(-1)[index]
                        worst = max(worst, abs(formula(**{**values, name: moved}).item() - base))
                    effect += worst
        return 2 * effect

    def gradient_tolerance(self, formula, model) -> float:
        if not self.measured:
            return 0.0
        import torch

        params = [p for p in model.parameters() if p.requires_grad]
        grads = []
        for precision in ("bf16", "fp32"):
            found = torch.autograd.grad(formula(**getattr(self, precision)), params, allow_unused=True,
                                        retain_graph=True)
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, found)])
        return 2 * max((a - b).abs().max().item() for a, b in zip(*grads))

    def __str__(self) -> str:
        if not self.measured:
            return "float32 (no gap measured)"
        return f"bf16 gap per value: mean {self.mean:.2e}, max {self.max:.2e} ({self._gap_values().numel()} values)"


def clear_of(values, edges, margin: float):
    """`values` (log-ratios) moved out of (edge - margin, edge + margin) to the nearer side, for every edge (a clip
    bound, as a log-ratio): a clip decision that no error below `margin` can flip. Unchanged with margin 0."""
    import torch

    if margin <= 0:
        return values
    out = values.clone()
    for edge in edges:
        near = (out - edge).abs() < margin
        out = torch.where(near, torch.where(out >= edge, edge + margin, edge - margin), out)
    assert all(((out - edge).abs() >= margin * (1 - 1e-6)).all() for edge in edges), (edges, margin)
    return out


def on_device(batch, model):
    """The batch with every tensor on the model's device (through dicts, lists and tuples), as the Trainer's
    _prepare_inputs does in training. A test that calls a trainer itself (trainer.compute_loss) must do it: a
    collated batch is on the CPU, a GPU model on CUDA, and nothing else moves it (no accelerate hook on a
    single-GPU load)."""
    import torch

    device = model.device

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(move(item) for item in value)
        return value

    return move(batch)


def trainer_loss(trainer, batch, model=None):
    """trainer.compute_loss as a training step calls it: the batch on the model's device (on_device), and under
    the accelerator's autocast, which wraps the prepared model's forward in training (a bare call on a model the
    accelerator has not prepared runs whatever forward the trainer does not autocast itself in float32, whatever
    the config). In float32 the autocast is no autocast. In a test's precision mode, the trainer must train at it."""
    model = trainer.model if model is None else model
    if current_precision() is not None:
        wanted = "bf16" if current_precision() == "bf16" else "no"
        held = (trainer.args.bf16, trainer.args.mixed_precision, trainer.accelerator.mixed_precision)
        assert held == (wanted == "bf16", wanted, wanted), f"a {current_precision()} test's trainer has {held}"
    with trainer.accelerator.autocast():
        return trainer.compute_loss(model, on_device(batch, model))


def write_recipe(path: Path, stages: list[dict[str, Any]], **top: Any) -> Path:
    recipe = {"name": top.pop("name", "test"), "seed": top.pop("seed", 0), "model": top.pop("model", TINY_MODEL),
              "lora": top.pop("lora", SMALL_LORA), "stages": stages, **top}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run_cli(*args: str, expect: int | None = 0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    if expect is not None and result.exit_code != expect:
        raise AssertionError(f"kit {' '.join(map(str, args))} exited {result.exit_code} (wanted {expect}):\n"
                             f"{result.output}\n{result.exception!r}")
    return result


def metrics(stage_dir: Path) -> list[dict[str, Any]]:
    path = stage_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def done(stage_dir: Path) -> dict[str, Any]:
    return json.loads((stage_dir / "DONE").read_text())


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its bytes, to check that a failed command changed nothing."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def stage_context(recipe_path: Path, stage_name: str, run_dir: Path, outputs: dict[str, Path] | None = None):
    """The StageContext the runner would give stage `stage_name` of a recipe file (outputs: the earlier stages'
    directories, by default those in `run_dir`)."""
    from rich.console import Console

    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext

    recipe = load_recipe(str(recipe_path))
    if outputs is None:
        outputs = {s.name: run_dir / s.name for s in recipe.stages}
    return StageContext(recipe, recipe.stage(stage_name), run_dir, Console(quiet=True), outputs)


def fails(*args: str) -> str:
    """Run `kit ARGS`, which must fail as a user error: exit status 2, no traceback, one `Error:` line at the end
    (what every bad input gets). Returns that line."""
    result = run_cli(*args, expect=2)
    lines = result.output.strip().splitlines()
    assert lines and lines[-1].startswith("Error: "), result.output
    assert "Traceback" not in result.output, result.output
    return lines[-1]


def move_policy(model, size: float = 0.3, seed: int = 0) -> None:
    """Move the trained adapter ("default") off its start, as training would; a frozen reference stays where it was.
    Checks of a KL term or a reference mean nothing before this: a fresh LoRA has B = 0."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(size * torch.randn(param.shape, generator=generator).to(param))


def completion_logprob(model, prompt_ids: list[int], completion_ids: list[int]):
    """log pi(completion | prompt): the sum of the completion tokens' log-probabilities, one unpadded sequence."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    with forward_precision():
        logits = model(input_ids=ids).logits[0].float()
    token_logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return token_logps[len(prompt_ids) - 1:].sum()


def install_plugin_package(root: Path, name: str, group: str, entries: dict[str, str], code: str) -> Path:
    """A third-party distribution `name` (its module: `name` with '-' as '_') that registers `entries` (entry name ->
    attribute of the module) in the entry-point `group`, with `code` as its module, installed by pip into
    root/site: a real dist-info with entry_points.txt, without touching the shared venv. Returns the site folder
    (put it on sys.path to see the entry points)."""
    import subprocess
    import sys
    import textwrap

    module = name.replace("-", "_")
    source = root / "src"
    (source / module).mkdir(parents=True)
    points = "".join(f'{entry} = "{module}:{attr}"\n' for entry, attr in entries.items())
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{name}"\nversion = "0.1.0"\n[project.entry-points."{group}"]\n{points}'
        f'[tool.setuptools]\npackages = ["{module}"]\n')
    (source / module / "__init__.py").write_text(textwrap.dedent(code))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(root / "site"), str(source)], check=True, capture_output=True, timeout=120)
    return root / "site"


def rival_distribution(root: Path, group: str, name: str) -> Path:
    """A bare dist-info of a package 'rival' that registers `name` in the entry-point `group` for rival:`name`
    (another target than the kit's own): put the returned folder on sys.path to make the name claimed twice."""
    dist = root / "rival-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rival\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = rival:{name}\n")
    return root
