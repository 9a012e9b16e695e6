"""PPO checkpoints on accelerate: `<stage>/checkpoints/checkpoint-N/` from `save_state`, plus the trained weights.

accelerate writes the optimizer, the scheduler, this process's RNG states and the registered KL controller; a
save/load pre-hook writes and restores the two LoRA adapters and the value head in safetensors under PEFT's names
(the base model is never prepared, so it is never saved); trainer_state.json is written last, and the folder is
renamed into place only then (kitcli/training/checkpoints.py reads a checkpoint as finished when
trainer_state.json exists).
Imports no torch at module level: the stage's StageSpec reads CHECKPOINT_FILES.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kitcli.errors import KitError

POLICY_FILE, CRITIC_FILE, VALUE_HEAD_FILE = ("policy_adapter.safetensors", "critic_adapter.safetensors",
                                             "value_head.safetensors")
CHECKPOINT_FILES = (POLICY_FILE, CRITIC_FILE, VALUE_HEAD_FILE, "optimizer.bin", "scheduler.bin",
                    "random_states_0.pkl", "custom_checkpoint_0.pkl", "trainer_state.json")


def register_checkpoint_state(accelerator, models, kl_ctl) -> None:
    """Make `accelerator.save_state` / `load_state` carry the policy and critic adapters, the value head and the KL
    controller of `models` (a kitcli.ppo.models.PPOModels)."""
    from safetensors.torch import load_file

    from kitcli.ppo.models import CRITIC, POLICY, adapter_state, save_safetensors
    from kitcli.training.checkpoints import load_into

    adapters = {POLICY: POLICY_FILE, CRITIC: CRITIC_FILE}

    def save_weights(_models, _weights, output_dir: str) -> None:
        if accelerator.is_main_process:
            for adapter, name in adapters.items():
                save_safetensors(adapter_state(models.model, adapter), Path(output_dir) / name)
            save_safetensors(models.value_head.state_dict(), Path(output_dir) / VALUE_HEAD_FILE)

    def load_weights(_models, input_dir: str) -> None:
        where = f"stage checkpoint {input_dir}"
        for adapter, name in adapters.items():
            load_into(models.model, load_file(str(Path(input_dir) / name)), adapter, where)
        models.value_head.load_state_dict(load_file(str(Path(input_dir) / VALUE_HEAD_FILE)))

    accelerator.register_save_state_pre_hook(save_weights)
    accelerator.register_load_state_pre_hook(load_weights)
    accelerator.register_for_checkpointing(kl_ctl)


def save_checkpoint(accelerator, checkpoint_dir: Path, step: int, keep: int, max_steps: int,
                    best_step: int | None = None) -> Path:
    """checkpoint_dir/checkpoint-N, then checkpoints older than the newest `keep` removed. accelerate's own rotation
    (ProjectConfiguration total_limit) does not fit: it names folders checkpoint_<number of saves> and deletes the
    old ones before the new one is whole. trainer_state.json records the step and the stage's max_steps, as
    transformers' does (kitcli/training/checkpoints.py's finished_steps reads a checkpoint at max_steps as a stage
    that had finished training). The checkpoint of `best_step` (the best held-out evaluation) is kept beside them,
    as transformers keeps its best_model_checkpoint."""
    final = checkpoint_dir / f"checkpoint-{step}"
    staging = checkpoint_dir / f"checkpoint-{step}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    accelerator.save_state(str(staging))
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps}))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    kept = sorted((p for p in checkpoint_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                  key=lambda p: int(p.name.split("-")[-1]))
    for old in kept[:-keep]:
        if old.name != f"checkpoint-{best_step}":
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(accelerator, checkpoint: Path) -> int:
    """Restore everything save_checkpoint wrote; returns the step it was written at. accelerate's .pkl files are
    torch.save archives, which kitcli/training/checkpoints.py's whole-file check (by suffix) does not open: a cut one is
    refused here in one line."""
    from kitcli.training.checkpoints import check_torch_file, way_out

    for path in sorted(checkpoint.glob("*.pkl")):
        problem = check_torch_file(path)
        if problem:
            raise KitError(f"{checkpoint}: {problem}; {way_out(checkpoint.parent.parent, checkpoint)}")
    accelerator.load_state(str(checkpoint))
    return int(json.loads((checkpoint / "trainer_state.json").read_text())["global_step"])
