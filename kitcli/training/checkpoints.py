"""Checkpoints of a training stage: find the last one, refuse one that cannot resume faithfully, and restore it.

A resumed stage must end exactly where the uninterrupted one would have. transformers' Trainer restores the
optimizer, the scheduler, the RNG states and the data position, but its restore of the weights is not enough for
the kit's trainers: with two adapters on the model (the trained `default` and TRL's frozen `ref`, which GRPO with
beta > 0 and DPO add), PEFT saves `default` in the checkpoint's root and `ref` in `ref/`, and
`Trainer._load_from_checkpoint` then loads only the sub-folders, so the policy silently restarts from its initial
weights. It also loads an adapter with PEFT's dtype autocast, turning bf16 LoRA weights into float32. So the kit
restores every adapter itself, in place and in the dtype training uses, tells the Trainer to leave the weights
alone, and checks at the start of training that the model holds exactly the checkpoint's weights.

A checkpoint at the stage's last step (its trainer_state.json's global_step has reached max_steps: the process ended
after its final checkpoint and before DONE, e.g. a crash in the summary or a full disk while saving the adapter) is
not trained from: transformers' Trainer, resumed there, starts another step before it checks max_steps whenever the
last step falls inside a pass over the data, and ends one step (and one checkpoint) past max_steps. The kit restores
the weights and the Trainer's state and does only the stage's end work (kitcli/training/finished.py).

Refused before anything trains (one line, exit status 2, the checkpoint left as it is): a checkpoint with a
missing or damaged file, one written with other settings (the stage's `config.json` from the interrupted run is
compared with the one it would write now) or with adapters of other names or shapes.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitcli import dist
from kitcli.errors import KitError
from kitcli.records import first_difference
from kitcli.rundir import StageDir
from kitcli.training.finished import finished_steps

if TYPE_CHECKING:
    from kitcli.recipe.schema import LoraSpec

ADAPTER_FILE = "adapter_model.safetensors"
# Config fields that may change between an interrupted run and its resume without changing what is trained.
REWRITTEN_KEY = "kit_rewritten"  # config.json: the fields the built trainer changed from the kit's request
VOLATILE_SETTINGS = {"logging_steps", "logging_first_step", "logging_dir", "logging_strategy", "save_steps",
                     "save_total_limit", "disable_tqdm", "report_to", "output_dir", "run_name", "log_level",
                     "log_level_replica", "hub_token", "push_to_hub", "eval_steps", "log_completions"}


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


def checkpoints(stage_dir: Path) -> list[Path]:
    """Finished checkpoints (their trainer_state.json, written last, exists), oldest first."""
    found = [p for p in StageDir(stage_dir).checkpoints.glob("checkpoint-*")
             if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").exists()]
    return sorted(found, key=step_of)


def last_checkpoint(stage_dir: Path) -> Path | None:
    found = checkpoints(stage_dir)
    return found[-1] if found else None


def way_out(stage_dir: Path, checkpoint: Path) -> str:
    older = [p for p in checkpoints(stage_dir) if step_of(p) < step_of(checkpoint)]
    back = f"move {checkpoint} away to resume from {older[-1].name}, or " if older else ""
    return f"{back}run with --force to restart the stages"


# --- is the checkpoint whole? -----------------------------------------------------------------------------------

def check_safetensors(path: Path) -> str | None:
    """None when the file's header parses and its tensors fit in the file (a cut file fails here)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                f.get_slice(key).get_shape()
        return None
    except Exception as error:  # noqa: BLE001  (safetensors raises several types for a damaged file)
        return f"{path.name} is damaged ({str(error).splitlines()[0][:120]})"


def check_torch_file(path: Path) -> str | None:
    """torch.save writes a zip archive; a cut one has no central directory."""
    if not zipfile.is_zipfile(path):
        return f"{path.name} is damaged (not a complete torch.save archive)"
    return None


def check_files(checkpoint: Path, required: list[str]) -> None:
    for name in required:
        path = checkpoint / name
        if not path.is_file() or path.stat().st_size == 0:
            raise KitError(f"{checkpoint}: {name} is missing; {way_out(checkpoint.parent.parent, checkpoint)}")
    for path in sorted(checkpoint.rglob("*")):
        problem = None
        if path.suffix == ".safetensors":
            problem = check_safetensors(path)
        elif path.suffix in (".pt", ".pth", ".bin", ".pkl"):  # torch.save archives (accelerate's too)
            problem = check_torch_file(path)
        elif path.name in ("trainer_state.json", "adapter_config.json"):
            try:
                json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                problem = f"{path.name} is not valid JSON"
        if problem:
            where = path.relative_to(checkpoint)
            raise KitError(f"{checkpoint}: {problem if str(where) == path.name else f'{where}: {problem}'}; "
                           f"{way_out(checkpoint.parent.parent, checkpoint)}")


# What a checkpoint must hold: transformers' Trainer writes the weights (an adapter or a full model), optimizer,
# scheduler, RNG states and trainer state; a stage with its own loop (PPO) lists its set in its StageSpec.


def required_files(own: tuple[str, ...], checkpoint: Path) -> list[str]:
    """The files `checkpoint` must hold: `own` (a StageSpec's resume.files), else transformers' Trainer's."""
    if own:
        return list(own)
    weights = ADAPTER_FILE if (checkpoint / "adapter_config.json").exists() else "model.safetensors"
    return [weights, "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]


# --- was it written with these settings? ------------------------------------------------------------------------

def check_settings(stage_dir: Path, checkpoint: Path, settings: dict[str, Any], where: str) -> None:
    """The stage's config.json (written when the interrupted run started) must equal what it would be now."""
    path = StageDir(stage_dir).config
    saved = StageDir(stage_dir).read_config()
    if saved is None:
        raise KitError(f"{where}: {checkpoint.name} has no record of the settings it was trained with ({path} is "
                       f"missing or damaged); {way_out(stage_dir, checkpoint)}")
    rewritten = set(saved.pop(REWRITTEN_KEY, ()))  # the trainer sets these whatever the stage asks
    found = first_difference(saved, json.loads(json.dumps(settings, default=str)),
                             ignore=VOLATILE_SETTINGS | rewritten)
    if found:
        key, before, now = found
        raise KitError(f"{where}: {checkpoint.name} was trained with train.{key} {before!r}, the stage now has "
                       f"{now!r}, so resuming would not continue the same run; set it back, or "
                       f"{way_out(stage_dir, checkpoint)}")


def saved_adapters(checkpoint: Path, root_name: str = "default") -> dict[str, Path]:
    """Adapter name -> folder: PEFT saves `default` in the checkpoint's root and any other adapter in a sub-folder
    of its name."""
    found = {}
    if (checkpoint / ADAPTER_FILE).exists():
        found[root_name] = checkpoint
    for sub in sorted(p for p in checkpoint.iterdir() if p.is_dir() and (p / ADAPTER_FILE).exists()):
        found[sub.name] = sub
    return found


def check_lora_shape(checkpoint: Path, lora: dict[str, Any] | None, where: str) -> None:
    """The checkpoint's adapter must have the rank, alpha and target modules the stage trains with."""
    config_path = checkpoint / "adapter_config.json"
    if lora is None or not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    targets = config.get("target_modules")
    saved = {"r": config.get("r"), "alpha": config.get("lora_alpha"),
             "target_modules": sorted(targets) if isinstance(targets, list) else targets}
    wanted = {"r": lora["r"], "alpha": lora["alpha"], "target_modules": sorted(lora["target_modules"])
              if isinstance(lora["target_modules"], list) else lora["target_modules"]}
    for key in ("r", "alpha", "target_modules"):
        if saved[key] != wanted[key]:
            raise KitError(f"{where}: {checkpoint.name} holds a LoRA adapter with {key} {saved[key]!r}, the stage "
                           f"trains one with lora.{key} {wanted[key]!r}; set it back, or "
                           f"{way_out(checkpoint.parent.parent, checkpoint)}")


def check_resumable(stage_dir: Path, settings: dict[str, Any], lora: dict[str, Any] | None, where: str,
                    checkpoint_files: tuple[str, ...] = ()) -> Path | None:
    """The checkpoint a stage will resume from, after checking it is whole (`checkpoint_files`: its StageSpec's) and
    was written with these settings and LoRA shapes; None when there is none. Raises KitError (nothing is changed)
    when it cannot resume."""
    checkpoint = last_checkpoint(stage_dir)
    if checkpoint is None:
        return None
    check_files(checkpoint, required_files(checkpoint_files, checkpoint))
    check_settings(stage_dir, checkpoint, settings, where)
    check_lora_shape(checkpoint, lora, where)
    return checkpoint


# --- restore ----------------------------------------------------------------------------------------------------

def load_into(model, state: dict[str, Any], adapter: str, where: str) -> None:
    """Copy `state` (PEFT's saved names) into the adapter's parameters in place: each keeps its dtype and device,
    so the optimizer and the training precision are those of an uninterrupted run."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    current = get_peft_model_state_dict(model, adapter_name=adapter)
    for key, tensor in state.items():
        if key not in current:
            raise KitError(f"{where}: the checkpoint's adapter '{adapter}' does not fit the stage's model "
                           f"({key} is not a weight of it); it was written by another model or LoRA setting")
        if tuple(current[key].shape) != tuple(tensor.shape):
            raise KitError(f"{where}: checkpoint tensor {key} of adapter '{adapter}' is shaped "
                           f"{tuple(tensor.shape)}, the model's {tuple(current[key].shape)}; it was written with "
                           f"another LoRA rank or model")
    missing = sorted(set(current) - set(state))
    if missing:
        raise KitError(f"{where}: the checkpoint's adapter '{adapter}' lacks {missing[0]}; it was written by "
                       f"another model or LoRA setting")
    set_peft_model_state_dict(model, state, adapter_name=adapter)  # load_state_dict: copy_ keeps each dtype


def restore_adapters(model, checkpoint: Path, where: str) -> list[str]:
    """Load every adapter the checkpoint holds into the model's adapter of the same name; returns their names."""
    from safetensors.torch import load_file

    names = []
    for name, folder in saved_adapters(checkpoint).items():
        if name not in model.peft_config:
            raise KitError(f"{where}: {checkpoint.name} holds adapter '{name}', which this stage's model does "
                           f"not have; it was written by another stage setup")
        load_into(model, load_file(str(folder / ADAPTER_FILE)), name, where)
        names.append(name)
    missing = [n for n in model.peft_config if n not in names]
    if missing:
        raise KitError(f"{where}: {checkpoint.name} has no weights for adapter '{missing[0]}'; it was written by "
                       f"another stage setup; {way_out(checkpoint.parent.parent, checkpoint)}")
    return names


def make_weights_check(checkpoint: Path, where: str):
    """A TrainerCallback that checks, once training starts (after the Trainer's own restore), that the model holds
    exactly the checkpoint's adapter weights: a transformers change that reloads them differently fails here."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    class ResumedWeightsCheck(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            import torch
            from peft import get_peft_model_state_dict

            for name, folder in saved_adapters(checkpoint).items():
                live = get_peft_model_state_dict(model, adapter_name=name)
                for key, tensor in load_file(str(folder / ADAPTER_FILE)).items():
                    if not torch.equal(live[key].detach().cpu().to(tensor.dtype), tensor):
                        raise KitError(f"{where}: after resuming from {checkpoint.name} the model's {key} is not "
                                       f"the checkpoint's; this transformers version restores checkpoints "
                                       f"differently than kit expects")

    return ResumedWeightsCheck()


COUNTERS = "KitCounters"


def make_counters_callback(trainer):
    """TRL's running counts the Trainer does not checkpoint (SFT/DPO/reward's token count, logged as num_tokens):
    saved in every checkpoint's trainer_state.json (transformers' ExportableState) and put back on resume."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class KitCounters(TrainerCallback, ExportableState):
        def state(self) -> dict:
            return {"args": {}, "attributes": {"total_train_tokens": getattr(trainer, "_total_train_tokens", 0)}}

    return KitCounters()


def restore_counters(trainer, checkpoint: Path) -> None:
    saved = json.loads((checkpoint / "trainer_state.json").read_text()).get("stateful_callbacks", {}).get(COUNTERS)
    if saved and hasattr(trainer, "_total_train_tokens"):
        trainer._total_train_tokens = saved["attributes"]["total_train_tokens"]


def replay_sampler_passes(trainer) -> None:
    """Give the samplers that shuffle from a generator of their own the `set_epoch` through which the Trainer
    positions a sampler at a pass over the data, so that a resumed run shuffles every pass as an uninterrupted run
    does (a plain random sampler gets this from accelerate's SeedableRandomSampler).

    - TRL's RL trainers (GRPO, GSPO, RLOO: trl's RepeatSampler) draw each pass's shuffle from one torch.Generator
      seeded once, so pass n of an uninterrupted run gets the generator's n-th permutation; a resumed run skips the
      finished passes without drawing them and would shuffle pass n like the first (other prompts, other
      completions). set_epoch(n) re-seeds the generator and draws the n permutations before it: every pass gets
      the prompts it gets in an uninterrupted run, which it leaves unchanged.
    - `train_sampling_strategy: group_by_length` (transformers' LengthGroupedSampler) has no generator and shuffles
      from the global RNG, whose state at a later pass a resumed run does not have: it resumed exactly within the
      first pass only. It now gets a generator seeded with the data seed plus the pass, as accelerate's sampler
      does, so pass n is the same shuffle in every run."""
    from transformers.trainer_pt_utils import LengthGroupedSampler
    from trl.trainer.utils import RepeatSampler

    build = trainer._get_train_sampler
    data_seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed

    def sampler(*args, **kwargs):
        made = build(*args, **kwargs)
        if isinstance(made, RepeatSampler) and made.shuffle and made.seed is not None \
                and not hasattr(made, "set_epoch"):
            made.set_epoch = lambda epoch: replay(made, epoch)
        if isinstance(made, LengthGroupedSampler) and made.generator is None and not hasattr(made, "set_epoch"):
            import torch

            made.generator = torch.Generator().manual_seed(data_seed)
            made.set_epoch = lambda epoch: made.generator.manual_seed(data_seed + epoch)
        return made

    def replay(made, epoch: int) -> None:
        import torch

        made.generator.manual_seed(made.seed)
        for _ in range(epoch):
            torch.randperm(made.num_samples, generator=made.generator)

    trainer._get_train_sampler = sampler


def train(trainer, checkpoint: Path | None, where: str, stop_every: int = 1) -> None:
    """trainer.train(), from `checkpoint` when given: the kit restores the weights (every adapter, in place) and
    TRL's running counts, the Trainer the optimizer, scheduler, RNG states and data position (with the shuffle of
    the pass it resumes in: replay_sampler_passes). A checkpoint at the stage's last step trains nothing
    (training/finished.py). A Ctrl-C or SIGTERM saves a checkpoint (at a step that is a multiple of `stop_every`)
    and ends training; free disk is checked before every checkpoint."""
    from kitcli.training.interrupt import make_stop_callback

    trainer.add_callback(make_stop_callback(Path(trainer.args.output_dir), stop_every))
    trainer.add_callback(make_counters_callback(trainer))
    replay_sampler_passes(trainer)
    if checkpoint is None:
        trainer.train()
        return
    model = trainer.model
    if hasattr(model, "peft_config"):
        restore_adapters(model, checkpoint, where)
        trainer._load_from_checkpoint = lambda *args, **kwargs: None  # weights restored above
        trainer.add_callback(make_weights_check(checkpoint, where))
    restore_counters(trainer, checkpoint)
    if finished_steps(checkpoint) is not None:
        from kitcli.training.finished import end_finished_training

        end_finished_training(trainer, checkpoint)
        return
    trainer.train(resume_from_checkpoint=str(checkpoint))


# --- the stage's side ------------------------------------------------------------------------------------------

def stage_lora(init_dir: Path | None, lora: LoraSpec | None) -> dict[str, Any] | None:
    """The LoRA settings a stage trains with: its init stage's adapter's (`init_dir`), else the recipe's `lora`."""
    from kitcli.models.backend import lora_from_adapter

    if init_dir is not None and (StageDir(init_dir).adapter / "adapter_config.json").is_file():
        return lora_from_adapter(StageDir(init_dir).adapter)
    return lora.model_dump() if lora is not None else None


def resume_checkpoint(stage: StageDir, settings: dict[str, Any], *, lora: dict[str, Any] | None, where: str,
                      log=print, checkpoint_files: tuple[str, ...] = ()) -> Path | None:
    """The stage's last checkpoint, checked (whole, same settings and LoRA shapes: `lora`, stage_lora's) before
    anything trains; then the stage's config.json records `settings` and its metrics are cut back to the
    checkpoint's step (they will be logged again)."""
    from kitcli.training.progress import truncate_metrics

    resume = check_resumable(stage.path, settings, lora, where, checkpoint_files)
    main = dist.is_main_process()  # under `kit run --launcher` one process writes
    if main:
        stage.write_config(settings)
    if resume is None:
        return None
    step, name = step_of(resume), stage.name
    finished = finished_steps(resume)
    if main:  # a run that died in its end work logged the end of training already: it is logged again
        truncate_metrics(stage.metrics, step, drop_end=finished is not None)
    if finished:
        log(f"resuming {name} from {resume.name} (step {step}): {name} had finished training at "
            f"{resume.name} (step {finished[0]} of {finished[1]}); its weights are restored and only its end "
            f"work is done (final weights, summary, DONE), without training a step")
    else:
        log(f"resuming {name} from {resume.name} (step {step}): weights, optimizer, scheduler and RNG "
            f"state restored")
    return resume


def record_effective_settings(stage: StageDir, trainer) -> None:
    """config.json from the built trainer's own config (`trainer.args` after __init__), so the file says what
    trains, not what was asked. resume_checkpoint wrote the kit's request there just before: the fields the trainer
    changed from it (e.g. Unsloth's DPO fills in max_seq_length) are listed under `kit_rewritten`, and a resume
    does not compare them (the trainer sets them whatever the stage asks). Called before the trainer trains."""
    from kitcli.training.trl_config import config_dict

    if not dist.is_main_process():
        return
    requested = stage.read_config() or {}
    effective = config_dict(trainer.args)
    rewritten = sorted(k for k in set(requested) | set(effective) if requested.get(k) != effective.get(k))
    stage.write_config({**effective, **({REWRITTEN_KEY: rewritten} if rewritten else {})})
