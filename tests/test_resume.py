"""Interrupted work resumes exactly: every trainer stage, killed right after a mid-stage checkpoint and run again,
ends with the same adapter and the same logged metrics as an uninterrupted run of the same recipe (training on this
CPU is deterministic, so the comparison is exact up to float noise). Every stage type that samples (GRPO, GSPO, RLOO
with steps_per_generation > 1, PPO; all with a KL term) runs several short passes over a few prompts and is killed
within its first pass, right after a pass boundary, in its third pass and while a checkpoint is half written. Every
stage type is also killed after its final checkpoint (the one at max_steps) and before its adapter and DONE (a crash
in the summary, a full disk while saving the adapter): it resumes without training, to the uninterrupted run's
adapter, metrics and DONE, with no step and no checkpoint past max_steps; GRPO also dies in its end work, after the
end of training was logged and the adapter saved (its end is logged once), and a full fine-tuning SFT stage
(`lora: false`) is killed after its final checkpoint too. Also after SIGINT and SIGTERM (a clean
stop that saves a checkpoint) and after two interruptions in a row; a checkpoint that cannot resume faithfully is
refused.

Each uninterrupted run happens once per stage type (in-process, through the CLI) and keeps every checkpoint. A run
killed right after checkpoint N is that run's directory cut back to checkpoint N (as_killed_after_checkpoint: the
bytes a killed process leaves, without starting one); real processes are killed where the kill itself matters:
inside a checkpoint write (every sampling type, SIGKILL), on SIGINT / SIGTERM, and twice in a row. Those processes
are forked from the test process (tests/forked.py: a real process, without a fresh interpreter's 7 s of imports).
PPO writes a checkpoint at max_steps only when a stop arrives during its last step (it saves its adapter right
after that step otherwise), so its final checkpoint is made that way: resumed from checkpoint max_steps - 1 and
stopped by a SIGTERM during the last step (in-process). Resumes run in-process."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from forked import KitProcess
from helpers import DATA, done, metrics, run_cli, snapshot, write_recipe
from safetensors.torch import load_file

from kitcli.rundir import WRITER_LOCK_NAME

pytestmark = pytest.mark.slow  # every test here builds or trains a model

PROMPTS = str(DATA / "arithmetic_prompts.jsonl")
PREFS = {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 160}
INIT = {"name": "sft", "type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
        "train": {"max_steps": 2, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "logging_steps": 1}}
STEPS = 8
# The stage under test, named "x", starting from the SFT stage (so DPO, KTO, GRPO, RLOO and PPO have a reference
# to keep).
STAGES = {
    "sft": {"type": "sft", "data": str(DATA / "arithmetic_sft.jsonl"),
            "train": {"per_device_train_batch_size": 8, "learning_rate": 1e-3}},
    "reward": {"type": "reward", "data": PREFS, "eval_fraction": 0.1,
               "train": {"per_device_train_batch_size": 8, "learning_rate": 1e-3, "eval_steps": 4}},
    "dpo": {"type": "dpo", "data": PREFS, "eval_fraction": 0, "train": {"per_device_train_batch_size": 8,
                                                                         "learning_rate": 1e-3}},
    "orpo": {"type": "orpo", "data": PREFS, "eval_fraction": 0, "train": {"per_device_train_batch_size": 8,
                                                                           "learning_rate": 1e-3}},
    "simpo": {"type": "simpo", "data": PREFS, "eval_fraction": 0, "train": {"per_device_train_batch_size": 8,
                                                                             "learning_rate": 1e-3}},
    # The stage types that sample: a few prompts, so that a pass over them is short (GRPO / RLOO: 2 prompts of 4
    # completions per generation batch, 2 optimizer steps each, 4 steps a pass; GSPO: its 4 steps per generation
    # batch, 8 a pass; PPO: 4 prompts a step, 2 steps a pass), a KL term in every pass. GRPO, GSPO and RLOO end
    # half-way through their fourth pass: transformers' Trainer, resumed from a checkpoint at max_steps inside a
    # pass, trained a step past it (at a pass boundary it trained none).
    "grpo": {"type": "grpo", "variant": "grpo", "data": {"path": PROMPTS, "limit": 4},
             "rewards": ["exact_match", "varied.py:varied"],
             "train": {"per_device_train_batch_size": 4, "num_generations": 4, "steps_per_generation": 2,
                       "max_completion_length": 4, "temperature": 1.0, "learning_rate": 1e-3, "beta": 0.04,
                       "max_steps": 14}},
    "gspo": {"type": "gspo", "data": {"path": PROMPTS, "limit": 4}, "rewards": ["exact_match", "varied.py:varied"],
             "train": {"per_device_train_batch_size": 2, "num_generations": 4, "max_completion_length": 4,
                       "temperature": 1.0, "learning_rate": 1e-3, "beta": 0.04, "save_steps": 4, "max_steps": 28}},
    "kto": {"type": "kto", "data": PREFS, "eval_fraction": 0, "train": {"per_device_train_batch_size": 8,
                                                                         "learning_rate": 1e-3}},
    "rloo": {"type": "rloo", "data": {"path": PROMPTS, "limit": 4}, "rewards": ["exact_match", "varied.py:varied"],
             "train": {"per_device_train_batch_size": 4, "num_generations": 4, "steps_per_generation": 2,
                       "max_completion_length": 4, "temperature": 1.0, "learning_rate": 1e-3, "beta": 0.05,
                       "max_steps": 14}},
    # distill: the SFT stage's student distilled towards the base model (a teacher that differs from where the student
    # starts, so it moves); 8 prompts, 2 a step: 4 steps a pass, ending half-way through its fourth pass.
    "distill": {"type": "distill", "teacher": {"model": "tiny"}, "data": {"path": PROMPTS, "limit": 8},
                "train": {"per_device_train_batch_size": 2, "max_completion_length": 4, "temperature": 1.0,
                          "learning_rate": 1e-3, "max_steps": 14}},
    "ppo": {"type": "ppo", "data": {"path": PROMPTS, "limit": 8}, "rewards": ["exact_match", "varied.py:varied"],
            "eval_data": {"path": str(DATA / "arithmetic_eval.jsonl"), "limit": 4},
            "train": {"per_device_train_batch_size": 4, "num_mini_batches": 2, "num_ppo_epochs": 2,
                      "response_length": 4, "learning_rate": 1e-3, "kl_coef": 0.05, "max_steps": 6,
                      "save_steps": 1}},
}
def training_types() -> list[str]:
    """Every registered stage type that trains (the registry decides, not a list here): each needs its stage in
    STAGES, and if it samples while it trains (its StageSpec's rl) its kill points in KILLS."""
    from kitcli.recipe.stage_types import builtin_specs

    return [name for name, spec in builtin_specs().items() if not spec.evaluates]


def samples(stage_type: str) -> bool:
    from kitcli.recipe.stage_types import builtin_specs

    return builtin_specs()[stage_type].rl


SAMPLING = tuple(t for t in training_types() if samples(t))
# Where each sampling stage type is killed: right after its checkpoint at that step, or, for "checkpoint_write",
# while that step's checkpoint is half written (it then resumes from the checkpoint before).
KILLS = {
    "grpo": {"first_pass": 2, "pass_boundary": 4, "third_pass": 10, "checkpoint_write": 8},
    "gspo": {"first_pass": 4, "pass_boundary": 8, "third_pass": 20, "checkpoint_write": 16},
    "rloo": {"first_pass": 2, "pass_boundary": 4, "third_pass": 10, "checkpoint_write": 8},
    "distill": {"first_pass": 2, "pass_boundary": 4, "third_pass": 10, "checkpoint_write": 8},
    "ppo": {"first_pass": 1, "pass_boundary": 2, "third_pass": 5, "checkpoint_write": 4},
}
CASES = [(t, "after_checkpoint") for t in training_types() if t not in SAMPLING] \
    + [(t, k) for t in SAMPLING for k in KILLS.get(t, {"(no kill points in KILLS)": 0})] \
    + [(t, "final_checkpoint") for t in training_types()] + [("grpo", "end_work")]
# final_checkpoint: killed right after the checkpoint at max_steps, before the adapter and DONE; end_work: died in
# the stage's end work (its summary), the end of training logged and the adapter saved, DONE not written.
VARIED = """
def varied(prompts, completions, **kwargs):  # a dense reward, so every group has a spread
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [(sum(map(ord, t)) % 10) / 10 for t in texts]
"""
# Logged values that depend on the wall clock or on what one process did, not on the training.
NOT_COMPARED = ("time", "runtime", "per_second", "seconds", "step_time", "train_loss", "epoch")


def die_in_checkpoint(target: str) -> None:
    """In the `kit run` child (tests/forked.py): SIGKILL its process group right after the first torch.save into
    the checkpoint folder `target` (the weights and optimizer written, the rest not)."""
    save = torch.save

    def save_then_die(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)) and Path(f).parent.name.split(".")[0] == target:
            os.killpg(0, signal.SIGKILL)

    torch.save = save_then_die


def stage(stage_type: str) -> dict:
    if stage_type not in STAGES or (stage_type in SAMPLING and stage_type not in KILLS):
        pytest.fail(f"{stage_type}: no resume case; add a stage to STAGES in tests/test_resume.py (and its kill "
                    f"points to KILLS if it samples completions)", pytrace=False)
    spec = json.loads(json.dumps(STAGES[stage_type]))
    # every checkpoint kept (save_total_limit changes no number), so a copy of the uninterrupted run can stand for
    # one killed after any of them
    spec["train"] = {"max_steps": STEPS, "logging_steps": 1, "save_steps": 2, "save_total_limit": 100, **spec["train"]}
    return {"name": "x", "init": "sft", **spec}


def make_recipe(root: Path, stage_type: str) -> Path:
    (root / "varied.py").write_text(VARIED)
    return write_recipe(root / "r.yaml", [INIT, stage(stage_type)])


_uninterrupted: dict[str, Path] = {}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir):
    """stage type -> the run directory of one uninterrupted run of its recipe."""
    def get(stage_type: str) -> Path:
        if stage_type not in _uninterrupted:
            root = tmp_path_factory.mktemp(f"whole-{stage_type}")
            run_cli("run", make_recipe(root, stage_type), "--output", root / "run")
            _uninterrupted[stage_type] = root / "run"
        return _uninterrupted[stage_type]
    return get


def start(recipe: Path, run_dir: Path, log: Path) -> KitProcess:
    return KitProcess(["run", recipe, "--output", run_dir], log)


def wait_for_checkpoint(process: KitProcess, stage_dir: Path, step: int, log: Path) -> None:
    marker = stage_dir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json"
    deadline = time.time() + 240
    while not marker.exists():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)


def kill_after_checkpoint(recipe: Path, run_dir: Path, step: int) -> None:
    log = run_dir.parent / "killed.log"
    process = start(recipe, run_dir, log)
    wait_for_checkpoint(process, run_dir / "x", step, log)
    process.kill_group()
    assert not (run_dir / "x" / "DONE").exists(), "the stage finished before the kill"


def as_killed_after_checkpoint(whole: Path, run_dir: Path, step: int) -> None:
    """The run directory `kit run` leaves when SIGKILLed right after writing stage x's checkpoint-`step`: a copy of
    the uninterrupted run without what it wrote after that checkpoint (later checkpoints, logs of later steps, the
    final weights, DONE, the report). Training here is deterministic, so the uninterrupted run's checkpoint-`step`
    holds the bytes the killed run wrote; the process kills themselves are tested for real below (during a
    checkpoint write for every sampling type, SIGINT and SIGTERM, two kills in a row), each costing a process."""
    shutil.copytree(whole, run_dir)
    stage_dir = run_dir / "x"
    for checkpoint in (stage_dir / "checkpoints").glob("checkpoint-*"):
        if int(checkpoint.name.split("-")[1].split(".")[0]) > step:
            shutil.rmtree(checkpoint)
    assert (stage_dir / "checkpoints" / f"checkpoint-{step}" / "trainer_state.json").exists() \
        or any((stage_dir / "checkpoints" / f"checkpoint-{step}").glob("*.pkl")), f"no checkpoint-{step} to resume"
    for name in ("DONE", "adapter", "critic", "model", "report.md", "plots"):
        for target in (stage_dir / name, run_dir / name):
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    for log in ("metrics.jsonl", "completions.jsonl", "alarms.jsonl"):
        if (stage_dir / log).exists():  # the Trainer's end-of-training row (train_runtime) follows its last checkpoint
            rows = [line for line in (stage_dir / log).read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= step and "train_runtime" not in line]
            (stage_dir / log).write_text("".join(row + "\n" for row in rows))


def as_died_in_end_work(whole: Path, run_dir: Path) -> None:
    """The run directory `kit run` leaves when it dies while writing stage x's summary: everything the uninterrupted
    run wrote but DONE and the run's report."""
    shutil.copytree(whole, run_dir)
    for target in (run_dir / "x" / "DONE", run_dir / "report.md", run_dir / "plots"):
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def die_in_checkpoint_write(recipe: Path, run_dir: Path, step: int) -> None:
    log = run_dir.parent / "killed.log"
    process = KitProcess(["run", recipe, "--output", run_dir], log,
                         before=["test_resume:die_in_checkpoint", f"checkpoint-{step}"])
    assert process.wait(timeout=600) == -signal.SIGKILL, log.read_text()[-3000:]
    half = [p for p in (run_dir / "x" / "checkpoints").iterdir() if p.name.split(".")[0] == f"checkpoint-{step}"]
    assert half and not (half[0] / "trainer_state.json").exists(), "it did not die inside the checkpoint write"
    assert not (run_dir / "x" / "DONE").exists()


def stop_in_final_step(whole: Path, run_dir: Path, steps: int, monkeypatch) -> None:
    """The run directory a PPO stage leaves when a SIGTERM arrives during its last step: checkpoint-`steps` saved, no
    held-out evaluation after training, no adapter, no DONE (PPO writes no checkpoint at max_steps otherwise). Made
    from the uninterrupted run cut back to checkpoint `steps - 1`, resumed in-process, with the signal raised in
    this process (the kit's own handler takes it) as the last step's update ends."""
    from kitcli.ppo import trainer

    as_killed_after_checkpoint(whole, run_dir, steps - 1)
    update = trainer.ppo_step

    def update_then_stop(*args, **kwargs):
        figures = update(*args, **kwargs)
        if args[-1] == steps - 1:  # `step` counts the finished steps: this is the last one
            signal.raise_signal(signal.SIGTERM)
        return figures

    with monkeypatch.context() as patched:
        patched.setattr(trainer, "ppo_step", update_then_stop)
        result = run_cli("run", whole.parent / "r.yaml", "--output", run_dir, expect=130)
    assert f"stage 'x' stopped by SIGTERM; checkpoint saved at {run_dir / 'x' / 'checkpoints'}" \
        f"/checkpoint-{steps}" in result.output, result.output[-3000:]
    assert not (run_dir / "x" / "DONE").exists() and not (run_dir / "x" / "adapter").exists()


def movement_share(resumed: Path, whole: Path, start: Path) -> float:
    """The resumed adapter's distance from the uninterrupted one, as a share of how far the uninterrupted stage
    moved its adapter from where it started (both Frobenius norms over every tensor)."""
    a, b, s = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (resumed, whole, start))
    apart = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b) ** 0.5
    moved = sum(float(((b[k].double() - s[k].double()) ** 2).sum()) for k in b) ** 0.5
    return apart / moved


def weight_files(stage_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    files = {"adapter": stage_dir / "adapter" / "adapter_model.safetensors"}
    if (stage_dir / "critic").is_dir():  # PPO's critic: its adapter and value head
        files["critic"] = stage_dir / "critic" / "adapter_model.safetensors"
        files["value_head"] = stage_dir / "critic" / "value_head.safetensors"
    return {name: load_file(str(path)) for name, path in files.items()}


def assert_same_weights(resumed: Path, whole: Path) -> None:
    a, b = weight_files(resumed), weight_files(whole)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for key in a[name]:
            difference = (a[name][key].float() - b[name][key].float()).abs().max().item()
            if difference > 1e-6:
                share = movement_share(resumed, whole, whole.parent / "sft")
                raise AssertionError(f"{name} {key} differs by {difference} from the uninterrupted run; the policy "
                                     f"adapter is {share:.1%} of the stage's movement away from it")


def training_rows(stage_dir: Path) -> dict[int, dict]:
    """Logged training rows by step, without the values that depend on the clock."""
    rows = {}
    for row in metrics(stage_dir):
        if row.get("step", 0) < 1 or "train_runtime" in row:
            continue
        kept = {k: v for k, v in row.items()
                if isinstance(v, (int, float)) and not any(part in k for part in NOT_COMPARED)}
        rows.setdefault(row["step"], {}).update(kept)
    return rows


def assert_same_metrics(resumed: Path, whole: Path) -> None:
    a, b = training_rows(resumed), training_rows(whole)
    assert sorted(a) == sorted(b), "the resumed run logged other steps"
    for step in b:
        assert a[step].keys() == b[step].keys(), step
        for key, value in b[step].items():
            other = a[step][key]
            assert (math.isnan(value) and math.isnan(other)) or other == pytest.approx(value, rel=1e-5, abs=1e-7), \
                (step, key, other, value)


def resumed_step(run_dir: Path) -> int:
    summary = done(run_dir / "x")
    step = int(summary["resumed_from"].split("-")[1])
    if step == summary["steps"]:  # its final checkpoint: nothing was left to train
        assert summary["resumed"] == (f"resumed from checkpoint-{step} (step {step}), where it had finished "
                                      f"training: restored its weights and state, and did only its end work")
    else:
        assert summary["resumed"].startswith(f"resumed from checkpoint-{step} (step {step}): restored ")
    return step


# DONE's values that depend on the wall clock or on where the run resumed.
NOT_SUMMARIZED = ("seconds", "seconds_per_step", "resumed_from", "resumed")


def assert_same_summary(resumed: Path, whole: Path) -> None:
    """DONE says what an uninterrupted run's says, but for the clock, the resume and the run's own folder."""
    def summary(stage_dir: Path) -> dict:
        text = (stage_dir / "DONE").read_text().replace(str(stage_dir.parent), "<run>")
        return {k: v for k, v in json.loads(text).items() if k not in NOT_SUMMARIZED and "gpu_memory" not in k}

    def same(x, y) -> bool:  # numbers up to float noise, mappings and lists item by item (pytest.approx is flat)
        if isinstance(y, dict):
            return isinstance(x, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in y)
        if isinstance(y, list):
            return isinstance(x, list) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        if isinstance(y, (int, float)) and not isinstance(y, bool):
            return x == pytest.approx(y, rel=1e-5, abs=1e-7, nan_ok=True)
        return x == y

    a, b = summary(resumed), summary(whole)
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert same(a[key], value), (key, a[key], value)


def final_rows(stage_dir: Path) -> list[dict]:
    """The Trainer's end-of-training rows (train_runtime, train_loss, total_flos): one per finished stage."""
    return [row for row in metrics(stage_dir) if "train_runtime" in row]


@pytest.mark.slow
@pytest.mark.parametrize("stage_type, kill", CASES, ids=[f"{t}-{k}" for t, k in CASES])
def test_sigkill_resumes_exactly(stage_type, kill, uninterrupted, tmp_path, monkeypatch):
    whole = uninterrupted(stage_type)
    recipe = make_recipe(tmp_path, stage_type)
    run_dir = tmp_path / "run"
    steps = stage(stage_type)["train"]["max_steps"]
    if kill == "checkpoint_write":  # a real process, killed inside its checkpoint write
        first = KILLS[stage_type][kill] - stage(stage_type)["train"]["save_steps"]
        die_in_checkpoint_write(recipe, run_dir, KILLS[stage_type][kill])
    elif kill == "final_checkpoint" and stage_type == "ppo":
        first = steps
        stop_in_final_step(whole, run_dir, steps, monkeypatch)
        recipe = whole.parent / "r.yaml"
    elif kill == "end_work":
        first = steps
        as_died_in_end_work(whole, run_dir)
        recipe = whole.parent / "r.yaml"
    else:
        first = {"after_checkpoint": 2, "final_checkpoint": steps}.get(kill) or KILLS[stage_type][kill]
        as_killed_after_checkpoint(whole, run_dir, first)
        recipe = whole.parent / "r.yaml"  # the recipe that run was started with (its reward file's path included)
    init_before = snapshot(run_dir / "sft")

    result = run_cli("run", recipe, "--output", run_dir)
    assert "stage 1/2 sft (sft): finished earlier, skipping" in result.output
    step = resumed_step(run_dir)
    assert step == first
    assert f"resuming x from checkpoint-{step} (step {step})" in result.output
    assert done(run_dir / "x")["steps"] == steps
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "x" / "checkpoints").glob("checkpoint-*"))
    assert saved and saved[-1] <= steps, saved  # no step, and no checkpoint, past max_steps
    assert (run_dir / "x" / "adapter" / "adapter_model.safetensors").is_file()
    assert snapshot(run_dir / "sft") == init_before  # the finished stage is not touched
    logged = [row["step"] for row in metrics(run_dir / "x") if "train_runtime" not in row and row.get("step")]
    assert logged == sorted(logged)  # nothing logged twice after the resume
    assert_same_weights(run_dir / "x", whole / "x")
    assert_same_metrics(run_dir / "x", whole / "x")
    assert_same_summary(run_dir / "x", whole / "x")
    assert len(final_rows(run_dir / "x")) == len(final_rows(whole / "x"))
    if first == steps and final_rows(whole / "x"):  # no step trained here: the stage's own figures
        (resumed_end,), (whole_end,) = final_rows(run_dir / "x"), final_rows(whole / "x")
        assert resumed_end["step"] == whole_end["step"] == steps
        for key in ("train_loss", "total_flos", "epoch"):
            assert resumed_end[key] == pytest.approx(whole_end[key], rel=1e-5), key
    assert f"resumed from checkpoint-{step}" in (run_dir / "report.md").read_text()
    if first == steps:
        assert f"x had finished training at checkpoint-{steps} (step {steps} of {steps})" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("signum, stage_type", [(signal.SIGINT, "gspo"), (signal.SIGTERM, "grpo")],
                         ids=["SIGINT-gspo", "SIGTERM-grpo"])
def test_clean_stop_saves_a_checkpoint_and_resumes_exactly(signum, stage_type, uninterrupted, tmp_path):
    """The first Ctrl-C / SIGTERM saves a checkpoint after the current step (for GSPO: at the end of the
    generation batch, 4 optimizer steps) and exits 130 with a resume hint; the re-run ends where an
    uninterrupted run does."""
    whole = uninterrupted(stage_type)
    recipe = make_recipe(tmp_path, stage_type)
    run_dir = tmp_path / "run"
    process = KitProcess(["run", recipe, "--output", run_dir], tmp_path / "out.txt", tmp_path / "err.txt")
    trained = run_dir / "x" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (trained.exists() and any(json.loads(line).get("step") == 1 for line in trained.read_text().splitlines()
                                        if line.strip())):
        assert process.poll() is None and time.time() < deadline
        time.sleep(0.02)
    process.send_signal(signum)
    process.wait(timeout=240)
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert process.returncode == 130, out + err
    assert f"stopped by {signal.Signals(signum).name}" in err and "run the same command again to resume" in err
    assert "Traceback" not in err
    assert not (run_dir / "x" / "DONE").exists()
    steps = [int(p.name.split("-")[1]) for p in (run_dir / "x" / "checkpoints").glob("checkpoint-*")]
    assert steps, "no checkpoint was saved on the signal"
    if stage_type == "gspo":
        assert all(step % 4 == 0 for step in steps), steps

    run_cli("run", recipe, "--output", run_dir)
    assert resumed_step(run_dir) == max(steps)
    assert_same_weights(run_dir / "x", whole / "x")
    assert_same_metrics(run_dir / "x", whole / "x")


@pytest.mark.slow
def test_two_interruptions_in_a_row(uninterrupted, tmp_path):
    whole = uninterrupted("ppo")
    recipe = make_recipe(tmp_path, "ppo")
    run_dir = tmp_path / "run"
    kill_after_checkpoint(recipe, run_dir, 2)
    kill_after_checkpoint(recipe, run_dir, 5)  # the second run resumes from checkpoint-2 (or -3), then dies again
    run_cli("run", recipe, "--output", run_dir)
    assert resumed_step(run_dir) >= 5
    assert_same_weights(run_dir / "x", whole / "x")
    assert_same_metrics(run_dir / "x", whole / "x")


@pytest.mark.slow
def test_a_length_grouped_sft_stage_resumes_exactly_in_a_later_pass(tmp_path):
    """`train_sampling_strategy: group_by_length` (transformers' LengthGroupedSampler, a TrainingArguments field any
    recipe's `train:` can set) shuffles each pass; killed in its second pass (48 rows of 8: 6 steps a pass), the
    stage resumes with the second pass's shuffle of the uninterrupted run. Without the seeded generator the kit
    gives that sampler, it resumed exactly within the first pass only."""
    sft = {"name": "x", "init": "sft", "type": "sft", "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "limit": 48},
           "train": {"per_device_train_batch_size": 8, "learning_rate": 1e-3, "max_steps": 12, "logging_steps": 1,
                     "save_steps": 2, "save_total_limit": 100, "train_sampling_strategy": "group_by_length"}}
    recipe = write_recipe(tmp_path / "r.yaml", [INIT, sft])
    whole = tmp_path / "whole"
    run_cli("run", recipe, "--output", whole)
    run_dir = tmp_path / "run"
    as_killed_after_checkpoint(whole, run_dir, 8)
    run_cli("run", recipe, "--output", run_dir)
    assert resumed_step(run_dir) == 8
    assert_same_weights(run_dir / "x", whole / "x")
    assert_same_metrics(run_dir / "x", whole / "x")


@pytest.mark.slow
def test_a_full_fine_tuning_stage_resumes_at_its_final_checkpoint(tmp_path):
    """`lora: false`: the checkpoint holds the whole model (model.safetensors), which the Trainer's own loader puts
    back. Killed after its checkpoint at max_steps (step 4 of a 6-step pass, where transformers' resume trained a
    fifth step), the stage trains nothing and saves the uninterrupted run's model."""
    sft = {"name": "x", "type": "sft", "data": {"path": str(DATA / "arithmetic_sft.jsonl"), "limit": 48},
           "train": {"per_device_train_batch_size": 8, "learning_rate": 1e-4, "max_steps": 4, "logging_steps": 1,
                     "save_steps": 2, "save_total_limit": 100}}
    model = {"name": "tiny", "max_seq_length": 128, "load_in_4bit": False, "dtype": "float32"}
    recipe = write_recipe(tmp_path / "r.yaml", [sft], model=model, lora=False)
    whole = tmp_path / "whole"
    run_cli("run", recipe, "--output", whole)
    run_dir = tmp_path / "run"
    as_killed_after_checkpoint(whole, run_dir, 4)
    result = run_cli("run", recipe, "--output", run_dir)
    assert resumed_step(run_dir) == 4 and done(run_dir / "x")["steps"] == 4
    assert "x had finished training at checkpoint-4 (step 4 of 4)" in result.output
    assert not (run_dir / "x" / "checkpoints" / "checkpoint-5").exists()
    a, b = (load_file(str(d / "x" / "model" / "model.safetensors")) for d in (run_dir, whole))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    assert_same_metrics(run_dir / "x", whole / "x")
    assert_same_summary(run_dir / "x", whole / "x")


# --- a checkpoint that cannot resume faithfully is refused ----------------------------------------------------


@pytest.fixture
def interrupted(uninterrupted, tmp_path):
    """A copy of the uninterrupted DPO run made to look killed after checkpoint-6 (its final outputs removed)."""
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted("dpo"), run_dir)
    for name in ("DONE", "adapter"):
        path = run_dir / "x" / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (tmp_path / "varied.py").write_text(VARIED)
    return run_dir


def refused(recipe: Path, run_dir: Path, *overrides: str) -> str:
    def files() -> dict[str, bytes]:  # all but the writer lock, which every `kit run` takes and signs (rundir.py)
        return {name: data for name, data in snapshot(run_dir).items() if name != WRITER_LOCK_NAME}

    before = files()
    result = run_cli("run", recipe, "--output", run_dir, *overrides, expect=2)
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and "Traceback" not in result.output
    assert files() == before  # the checkpoint (and everything else) is left as it is
    return lines[-1]


@pytest.mark.slow
def test_a_truncated_checkpoint_file_is_refused(interrupted, tmp_path):
    checkpoint = interrupted / "x" / "checkpoints" / "checkpoint-8"
    weights = checkpoint / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = refused(write_recipe(tmp_path / "r.yaml", [INIT, stage("dpo")]), interrupted)
    assert "checkpoint-8: adapter_model.safetensors is damaged" in message
    assert "move" in message and "checkpoint-6" in message and "--force" in message


@pytest.mark.slow
def test_a_checkpoint_missing_its_optimizer_is_refused(interrupted, tmp_path):
    (interrupted / "x" / "checkpoints" / "checkpoint-8" / "optimizer.pt").unlink()
    message = refused(write_recipe(tmp_path / "r.yaml", [INIT, stage("dpo")]), interrupted)
    assert "checkpoint-8: optimizer.pt is missing" in message


@pytest.mark.slow
def test_a_checkpoint_of_other_settings_is_refused(interrupted, tmp_path):
    """The lock file catches a changed recipe; a checkpoint written with other effective settings (e.g. another
    kit version's defaults, or a hand-edited lock) is caught at the checkpoint."""
    config = interrupted / "x" / "config.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "beta": 0.5}))
    message = refused(write_recipe(tmp_path / "r.yaml", [INIT, stage("dpo")]), interrupted)
    assert "checkpoint-8 was trained with train.beta 0.5, the stage now has 0.1" in message


@pytest.mark.slow
def test_a_checkpoint_of_another_lora_rank_is_refused(interrupted, tmp_path):
    adapter_config = interrupted / "x" / "checkpoints" / "checkpoint-8" / "adapter_config.json"
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()), "r": 4}))
    message = refused(write_recipe(tmp_path / "r.yaml", [INIT, stage("dpo")]), interrupted)
    assert "checkpoint-8 holds a LoRA adapter with r 4, the stage trains one with lora.r 8" in message


def test_grpo_save_steps_inside_a_generation_batch_is_refused(tmp_path):
    (tmp_path / "varied.py").write_text(VARIED)
    gspo = stage("gspo")
    gspo["train"]["save_steps"] = 6
    recipe = write_recipe(tmp_path / "r.yaml", [INIT, gspo])
    result = run_cli("run", recipe, "--dry-run", expect=2)
    assert "train.save_steps 6 is not a multiple of 4" in result.output and "use save_steps 4 or 8" in result.output
