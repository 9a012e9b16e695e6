"""Helpers for tests: write a recipe, run the CLI in-process, read a run's files."""

from __future__ import annotations

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


def forward_precision():
    """The autocast the kit's trainers run their forwards under: none on a CPU (float32), bf16 (or fp16) on a GPU.
    An independent computation checked against a trainer's numbers runs its forwards under the same."""
    import contextlib

    import torch

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)


def precision_scale() -> float:
    """How much looser a comparison of a trainer's loss with the formula is on a GPU (bf16 forwards, and a padded
    batch against one unpadded sequence at a time, round differently) than on a CPU in float32: 1 on a CPU."""
    import torch

    return 300.0 if torch.cuda.is_available() else 1.0


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
        outputs = {s["name"]: run_dir / s["name"] for s in recipe.stages}
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
