"""Run a recipe: a run directory with a lock file and one folder per stage; finished stages are skipped,
an interrupted stage resumes from its last checkpoint, `--force` redoes.

Layout of a run directory:
    recipe.lock.yaml        resolved recipe, package versions, seed, dataset fingerprints
    <stage>/config.json     the effective TRL config of the stage
    <stage>/metrics.jsonl   one JSON object per logging step
    <stage>/checkpoints/    trainer checkpoints (for resuming)
    <stage>/adapter/        the LoRA adapter (PEFT format) and tokenizer; `model/` for full fine-tuning
    <stage>/DONE            completion marker: summary metrics and wall time
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kitcli import dist, libraries
from kitcli.display.output import emit_json, stage_display
from kitcli.errors import KitError
from kitcli.recipe import stage_types
from kitcli.recipe.load import Recipe
from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.records import first_difference
from kitcli.run.lock import (  # noqa: F401  (dataset_fingerprints: kitcli.run.runner's name too)
    choose_run_dir,
    dataset_fingerprints,
    make_lock,
    same_resolution,
    same_run,
)
from kitcli.run.preflight import preflight
from kitcli.run.selection import check_selected_inputs
from kitcli.rundir import WRITER_LOCK_NAME, RunDir, redact
from kitcli.training import interrupt
from kitcli.writer_lock import WriterLock


def stage_module(stage_type: str):
    return stage_types.module(stage_type)


def resumed_note(checkpoint: str, spec, finished: bool = False) -> str:
    """What a resumed stage restored, for its DONE summary and the report (`spec`: its type's StageSpec)."""
    if finished:  # kitcli/training/finished.py: the weights and the Trainer's state, nothing left to train
        return (f"resumed from {checkpoint} (step {checkpoint.rsplit('-', 1)[-1]}), where it had finished training: "
                f"restored its weights and state, and did only its end work")
    restored = spec.resume.restores
    return f"resumed from {checkpoint} (step {checkpoint.rsplit('-', 1)[-1]}): restored {restored}"


def check_resumable_stages(recipe: Recipe, run_dir: Path, existing: dict[str, Any], lock: dict[str, Any],
                           console: Console) -> None:
    """Before anything runs: every unfinished stage with a checkpoint must be able to resume it faithfully (whole
    files, the settings and LoRA shapes it was written with)."""
    from kitcli.training.checkpoints import (
        VOLATILE_SETTINGS,
        check_files,
        check_lora_shape,
        last_checkpoint,
        required_files,
        stage_lora,
        way_out,
    )

    def without_volatile(tree: Any) -> Any:
        if isinstance(tree, dict):
            return {k: without_volatile(v) for k, v in tree.items() if k not in VOLATILE_SETTINGS}
        return tree

    outputs = {s.name: run_dir / s.name for s in recipe.stages}
    for stage in recipe.stages:
        ctx = StageContext(recipe, stage, run_dir, console, outputs)
        checkpoint = last_checkpoint(ctx.stage_dir)
        if checkpoint is None or ctx.dir.done() is not None:
            continue
        check_files(checkpoint, required_files(ctx.spec.resume.files, checkpoint))
        before = without_volatile((existing.get("resolved") or {}).get(ctx.name))
        now = without_volatile(lock["resolved"][ctx.name])
        differs = first_difference(before, now) if before is not None else None
        if differs:
            key, was, is_now = differs
            raise KitError(f"{ctx.where}: {checkpoint.name} was written with other settings ({key} was {was!r}, now "
                           f"{is_now!r}), so resuming would not continue the same run; "
                           f"{way_out(ctx.stage_dir, checkpoint)}")
        check_lora_shape(checkpoint, stage_lora(ctx.init_dir, ctx.lora), ctx.where)


def run_recipe(recipe: Recipe, *, output: str | None, force: bool, console: Console, no_lock: bool = False,
               selected: list[str] | None = None) -> Path:
    """Run the recipe's stages in their run directory, which this process holds (WriterLock) from before its first
    write to the end. Under `kit run --launcher` every process runs this; only the main one locks and writes files
    (kitcli/run/launch.py)."""
    main = dist.is_main_process()
    lock = make_lock(recipe)
    run_dir = choose_run_dir(recipe, output, lock)
    writer = WriterLock(RunDir(run_dir), no_lock=no_lock, log=lambda line: console.print(
        line, highlight=False, markup=False, soft_wrap=True)) if main else None
    try:
        if writer is not None:
            writer.take(create=False)  # a directory a run wrote: refused here, at once, while another run holds it
        return run_stages(recipe, run_dir, lock, force=force, console=console if main else Console(quiet=True),
                          writer=writer, selected=selected)
    finally:
        if writer is not None:
            writer.release()


def run_stages(recipe: Recipe, run_dir: Path, lock: dict[str, Any], *, force: bool, console: Console,
               writer: WriterLock | None, selected: list[str] | None = None) -> Path:
    """Every stage in order, or the `selected` ones (finished stages before them are reused, the rest left as they
    are; `force` redoes only what runs)."""
    configs = prepare_run_dir(recipe, run_dir, lock, force=force, console=console, writer=writer)
    if selected is not None:
        check_selected_inputs(recipe, run_dir, selected)
    outputs: dict[str, Path] = {}
    results: list[tuple[Any, dict[str, Any], str]] = []
    for index, stage in enumerate(recipe.stages, start=1):
        if selected is not None and stage.name not in selected:
            outcome = reuse_unselected(stage, run_dir, f"{index}/{len(recipe.stages)}", console)
        else:
            ctx = StageContext(recipe, stage, run_dir, console, outputs, config=configs.get(stage.name))
            outcome = run_one_stage(ctx, index, len(recipe.stages), lock, force=force, writer=writer)
        if outcome is not None:
            outputs[stage.name] = run_dir / stage.name
            results.append((stage, *outcome))
    if writer is None:
        return run_dir
    writer.check("its report")
    report = write_run_report(run_dir, console)
    print_summary(results, console, report=report, run_dir=run_dir)
    return run_dir


def prepare_run_dir(recipe: Recipe, run_dir: Path, lock: dict[str, Any], *, force: bool, console: Console,
                    writer: WriterLock | None) -> dict[str, Any]:
    """Before any stage: the model reachable, every stage resolved against its trainer's config and checked, and
    (main process) the run directory taken, checked against the lock of a run it already holds, the lock written.
    Returns the trainer configs preflight built, by stage name: each stage trains with the one that was checked."""
    console.print(f"kit: checking {recipe.name}'s {len(recipe.stages)} stages against TRL's configs (loads torch, "
                  f"TRL and Unsloth first; their messages go to {RunDir(run_dir).library_log})",
                  highlight=False, markup=False)
    checked = preflight(recipe, run_dir, console)  # every fault of every stage, or none
    lock["resolved"] = redact({s.name: d for s, d in zip(recipe.stages, checked.described)})  # e.g. variant presets
    if writer is not None:
        take_run_dir(recipe, run_dir, lock, force=force, console=console, writer=writer)
    dist.barrier()
    console.print(f"run directory: {run_dir}", highlight=False, markup=False)
    if recipe.model.trust_remote_code:
        console.print("warning: model.trust_remote_code is on: the model's own Python code from its repository "
                      "will run",
                      highlight=False, markup=False)
    return checked.configs


def take_run_dir(recipe: Recipe, run_dir: Path, lock: dict[str, Any], *, force: bool, console: Console,
                 writer: WriterLock) -> None:
    """The main process: refuse a directory that holds another run (or is no run directory), check that unfinished
    stages can resume, take the writer lock and write the run's lock file."""
    existing = RunDir(run_dir).read_lock()
    if existing is not None:
        differs = same_run(existing, lock)
        if differs and not force:
            raise KitError(f"{run_dir} holds a run of a different recipe ({differs} differs); use another "
                           f"--output, or --force to redo it with this recipe")
        if not force:
            check_resumable_stages(recipe, run_dir, existing, lock, console)
    elif run_dir.exists() and any(p.name != WRITER_LOCK_NAME for p in run_dir.iterdir()) and not force:
        raise KitError(f"{run_dir} exists and is not a kit run directory; choose another --output")
    writer.take(create=True)  # creates the directory: nothing is written before this
    libraries.library_log(RunDir(run_dir).library_log)
    if existing is not None and not force and existing.get("rewritten by the trainer"):
        lock["rewritten by the trainer"] = existing["rewritten by the trainer"]  # finished stages keep theirs
    if existing is None or force or not same_resolution(existing, lock):
        RunDir(run_dir).write_lock(lock)


def reuse_unselected(stage, run_dir: Path, heading: str, console: Console) -> tuple[dict[str, Any], str] | None:
    """A stage `--until` / `--only` leaves out: its finished output is reused, an unfinished one left as it is."""
    done = RunDir(run_dir).stage(stage.name).done()
    console.print(f"stage {heading} {stage.name} ({stage.type}): not selected, "
                  f"{'its finished output reused' if done is not None else 'left as it is'}",
                  highlight=False, markup=False)
    return (done, "skipped (done)") if done is not None else None


def run_one_stage(ctx: StageContext, index: int, total: int, lock: dict[str, Any], *, force: bool,
                  writer: WriterLock | None) -> tuple[dict[str, Any], str]:
    """Stage `index` of `total`: skipped when it finished earlier, else run (resuming its last checkpoint) and its
    DONE written. Returns (its summary, what happened)."""
    main, stage, console, heading = writer is not None, ctx.stage, ctx.console, f"{index}/{total}"
    if main:
        writer.check(f"stage '{ctx.name}'")
    done = ctx.dir.done()
    if done is not None and not force:
        console.print(f"stage {heading} {ctx.name} ({stage.type}): finished earlier, skipping",
                      highlight=False, markup=False)
        return done, "skipped (done)"
    if main:
        if force and ctx.stage_dir.exists():
            shutil.rmtree(ctx.stage_dir)
        ctx.stage_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if not main and ctx.spec.evaluates:  # generation is not distributed: main evaluates
        dist.barrier()
        return ctx.dir.done() or {}, "ran (main process)"
    console.rule(f"stage {heading}: {ctx.name} ({stage.type})")
    started = time.time()
    with stage_display(index, total, ctx.spec):
        summary = run_stage(ctx)
    summary = {**summary, "seconds": round(time.time() - started, 2), **peak_gpu_memory()}
    if summary.get("resumed_from"):
        from kitcli.training.finished import finished_steps

        resumed = ctx.dir.checkpoints / summary["resumed_from"]
        finished = (resumed / "trainer_state.json").is_file() and finished_steps(resumed) is not None
        summary["resumed"] = resumed_note(summary["resumed_from"], ctx.spec, finished)
    if main:
        write_done(ctx, summary, lock)
    dist.barrier()
    return summary, "ran"


def write_done(ctx: StageContext, summary: dict[str, Any], lock: dict[str, Any]) -> None:
    """The stage's DONE, its warnings printed, and what its trainer rewrote added to the run's lock."""
    ctx.dir.write_done(summary)
    for warning in summary.get("warnings") or ():  # e.g. a reward that scored no sample in the stage
        ctx.console.print(f"warning: stage '{ctx.name}': {warning}", highlight=False, markup=False, soft_wrap=True)
    if summary.get("rewritten"):  # what the trainer changed when it was built, beside what preflight saw
        lock.setdefault("rewritten by the trainer", {})[ctx.name] = summary["rewritten"]
        RunDir(ctx.run_dir).write_lock(lock)


def write_run_report(run_dir: Path, console: Console) -> Path | None:
    """report.md and plots; a failure here must not fail a finished run (`kit report RUN_DIR` retries)."""
    from kitcli.display.report import write_report

    try:
        return write_report(run_dir)
    except Exception as error:  # noqa: BLE001  (matplotlib, a full disk, ...)
        console.print(f"could not write the report ({type(error).__name__}: {error}); retry with "
                      f"`kit report {run_dir}`", highlight=False, markup=False)
        return None


def peak_gpu_memory() -> dict[str, float]:
    """The stage's peak CUDA memory (GiB), recorded in DONE; nothing without a GPU. Resets the counter."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    peak, reserved = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"peak_gpu_memory_gib": round(peak, 3), "peak_gpu_memory_reserved_gib": round(reserved, 3)}


def run_stage(ctx: StageContext) -> dict[str, Any]:
    """Run one stage with clean-stop signal handling; a requested stop leaves the stage unfinished (no DONE)."""
    interrupt.install_handlers()
    try:
        summary = stage_module(ctx.stage.type).run(ctx)
    except Exception as error:
        if type(error).__name__ == "OutOfMemoryError":
            raise out_of_memory(ctx) from None
        raise
    finally:
        interrupt.restore_handlers()
    if interrupt.requested():
        from kitcli.training.checkpoints import last_checkpoint

        checkpoint = last_checkpoint(ctx.stage_dir)
        saved = f"checkpoint saved at {checkpoint}; " if checkpoint else ""
        raise interrupt.StageInterrupted(f"stage '{ctx.name}' stopped by {interrupt.requested()}; {saved}run the same "
                                         f"command again to resume")
    if summary.get("steps") == 0:  # a training stage that trained nothing must not be marked done
        train, data = declared(ctx.stage, "train") or {}, declared(ctx.stage, "data")
        raise KitError(f"{ctx.where}: the stage ran zero optimizer steps (num_train_epochs "
                       f"{train.get('num_train_epochs', 'default')}, max_steps {train.get('max_steps', 'default')}, "
                       f"on the rows of {data.path if data else 'its data'}); give it more data, or set "
                       f"train.max_steps")
    return summary


def out_of_memory(ctx: StageContext) -> KitError:
    train = declared(ctx.stage, "train") or {}
    settings = ", ".join(f"{k}={train[k]}" for k in ctx.spec.memory.settings if k in train) or \
        "the stage's train settings"
    rank = ctx.lora.r if ctx.lora is not None else None
    return KitError(f"stage '{ctx.name}' ran out of GPU memory ({settings}; lora.r={rank}, "
                    f"model.max_seq_length={ctx.model.max_seq_length}); lower per_device_train_batch_size (raise "
                    f"gradient_accumulation_steps to keep the batch), the lengths or num_generations, or lora.r; "
                    f"`kit plan {ctx.recipe.source}` estimates the memory of each stage")


def print_summary(results, console: Console, report: Path | None = None, run_dir: Path | None = None) -> None:
    from kitcli.display.eval_table import before_after

    table = Table(title="stages")
    for column in ("stage", "type", "status", "seconds", "result"):
        table.add_column(column)
    for stage, summary, status in results:
        table.add_row(stage.name, stage.type, status, str(summary.get("seconds", "")), summary.get("headline", ""))
    console.print(table)
    evals = [(stage.model_dump(mode="json"), summary) for stage, summary, _ in results if stage.spec.evaluates]
    if evals:
        header, rows = before_after(evals)
        table = Table(title="evaluation (held-out): before and after training")
        for index, column in enumerate(header):
            table.add_column(column, justify="left" if index == 0 else "right")
        for index, row in enumerate(rows):
            table.add_row(*row, end_section=index == len(rows) - 2)
        console.print(table)
    if report is not None:
        console.print(f"report: {report}", highlight=False, markup=False)
    emit_json({"event": "summary", "run_dir": str(run_dir) if run_dir else None,
               "report": str(report) if report else None,
               "stages": [{"name": stage.name, "type": stage.type, "status": status, **summary}
                          for stage, summary, status in results]})
