"""A stage type from an installed package that trains with a trainer class of its own (a subclass of TRL's
SFTTrainer with a config class of its own, both in the package): its StageSpec names the two classes and nothing in
the kit changes. The recipe's `train:` keys are checked against the package's config (read from its source, as
TRL's are), the trainer the kit builds is the package's, and the tiny model's adapter moves."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from helpers import DATA, run_cli, write_recipe

CONFIG = '''
from dataclasses import dataclass, field

from trl.trainer.sft_config import SFTConfig


@dataclass
class NudgeConfig(SFTConfig):
    nudge_scale: float = field(default=1.0, metadata={"help": "Multiplies the SFT loss."})
'''

TRAINER = '''
from trl.trainer.sft_trainer import SFTTrainer


class NudgeTrainer(SFTTrainer):
    """SFT whose loss is scaled by the config's nudge_scale (the gradient with it)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.kit_calls = getattr(self, "kit_calls", 0) + 1
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return loss[0] * self.args.nudge_scale, loss[1]
        return loss * self.args.nudge_scale
'''

STAGE = '''
"""A stage type from outside the kit: SFT with a scaled loss, on a trainer class of its own."""

from typing import ClassVar, Literal

from kitcli.recipe.schema import TrainingSection
from kitcli.recipe.stage_spec import Display, Rows, StageSpec


class NudgeSection(TrainingSection):
    """SFT with a scaled loss."""

    type: Literal["nudge"]
    config: ClassVar[str] = "NudgeConfig"


def describe(ctx):
    return {"data": ctx.stage.data.path}


def run(ctx):
    from kitcli.data.rows import read_rows, to_dataset
    from kitcli.models.backend import load_stage_policy, save_model
    from kitcli.training.progress import attach_progress
    from kitcli.training.trainers import build_trainer, config_class, trainer_summary
    from kitcli.training.trl_config import build_config

    config = build_config(config_class(ctx.spec), stage_defaults={"max_length": 64, "gradient_checkpointing": False},
                          train=ctx.stage.train, where=ctx.where, output_dir=ctx.dir.checkpoints,
                          seed=ctx.seed, on_gpu=False)
    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in read_rows(ctx.stage.data, ctx.where)]
    loaded = load_stage_policy(ctx.model, lora=ctx.recipe.lora, seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    trainer, _ = build_trainer(ctx.spec, loaded, args=config, train_dataset=to_dataset(rows),
                               processing_class=loaded.tokenizer, log=ctx.log, label=ctx.name, where=ctx.where)
    attach_progress(trainer, ctx.name, ctx.dir.metrics, ctx.console)
    trainer.train()
    save_model(loaded.model, loaded.tokenizer, ctx.stage_dir)
    return {**trainer_summary(trainer), "steps": trainer.state.global_step, "nudge_scale": trainer.args.nudge_scale,
            "loss_calls": trainer.kit_calls}


SPEC = StageSpec(type="nudge", module=__name__, section=NudgeSection, summary="SFT with a scaled loss",
                 output="policy", trainer="kit_nudge.trainer:NudgeTrainer", config="kit_nudge.config:NudgeConfig",
                 rows=Rows(shape="text"), display=Display(metrics=(("loss", "loss"),)))
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A package `kit_nudge` with its dist-info (entry point kit.stages: nudge) on sys.path, as pip leaves one."""
    site = tmp_path / "site"
    (site / "kit_nudge").mkdir(parents=True)
    for name, text in (("__init__", STAGE), ("config", CONFIG), ("trainer", TRAINER)):
        (site / "kit_nudge" / f"{name}.py").write_text(textwrap.dedent(text))
    info = site / "kit_nudge-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kit-nudge\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kit.stages]\nnudge = kit_nudge:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    from kitcli.recipe import config_fields, stage_types

    def forget():
        stage_types.specs.cache_clear()
        config_fields.config_fields.cache_clear()

    forget()
    yield
    forget()
    for name in [m for m in sys.modules if m == "kit_nudge" or m.startswith("kit_nudge.")]:
        sys.modules.pop(name)


def nudge_stage(**train):
    return {"name": "nudge", "type": "nudge", "data": str(DATA / "arithmetic_sft.jsonl"),
            "train": {"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **train}}


@pytest.mark.slow  # it trains
def test_a_plugin_stage_trains_with_its_own_trainer_class(plugin, tmp_path):
    from safetensors.torch import load_file

    recipe = write_recipe(tmp_path / "r.yaml", [nudge_stage(nudge_scale=0.5)])
    run_dir = tmp_path / "run"
    run_cli("run", recipe, "--output", run_dir)
    done = json.loads((run_dir / "nudge" / "DONE").read_text())
    assert done["trainer"] == "NudgeTrainer (TRL)" and done["nudge_scale"] == 0.5, done
    assert done["steps"] == 2 and done["loss_calls"] >= 2
    weights = load_file(run_dir / "nudge" / "adapter" / "adapter_model.safetensors")
    moved = [name for name, tensor in weights.items() if "lora_B" in name and tensor.abs().max() > 0]
    assert moved, "the adapter did not train"  # LoRA B starts at zero


def test_its_config_fields_are_read_from_the_package(plugin, tmp_path):
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [nudge_stage(nudge_scal=0.5)]), expect=2)
    assert "train.nudge_scal is not a NudgeConfig field; did you mean 'nudge_scale'?" in result.output
    result = run_cli("run", write_recipe(tmp_path / "r.yaml", [nudge_stage(nudge_scale="big")]), expect=2)
    assert "train.nudge_scale must be a number" in result.output
    checked = run_cli("check", write_recipe(tmp_path / "r.yaml", [nudge_stage()]))
    assert "whole rows" in checked.output and "no length check" not in checked.output
