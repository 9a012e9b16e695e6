"""Held-out evaluation inside a training stage (`eval:`, kitcli/recipe/held_out_spec.py): the live policy (the
adapter as it stands) is scored at step 0, every `every` optimizer steps and at the last step, with the eval
stage's generation and scoring (kitcli/training/scoring.py: exact match, pass@k, each reward's mean).

A stage resolves its section once, `plan = held_out_plan(stage, ...)` (before any model loads: `describe_held_out(plan)`
is what --dry-run shows), makes one call for it, `held_out = attach_held_out(trainer, plan, metrics_path, log)` after
attach_progress (TRL trainers) or `held_out_evaluator(plan, metrics_path, log)` for a loop of its own (PPO,
kitcli/ppo/trainer.py), and ends with `held_out.summarize(summary)`.

What TRL's own eval loop serves: nothing of this. `eval_strategy` runs the trainer's `evaluate()`, which gives SFT /
DPO / KTO a loss on `eval_dataset` and GRPO the sampled training rewards on it; none of them generates greedily and
compares with an answer (TRL has no `compute_metrics` for generation, trl#5787). What the kit takes from
transformers is the callback protocol (`on_train_begin` / `on_step_end` with the model) and its best-checkpoint
bookkeeping: `state.best_global_step` makes the checkpoint of the best step `best_model_checkpoint`, which
transformers' checkpoint rotation (`save_total_limit`) never deletes, and which trainer_state.json keeps on resume.

It never changes training: the evaluation runs with every RNG training draws from saved and put back (Python's,
NumPy's, torch's CPU and CUDA generators; generate() seeds torch), and the model left as it was found (each module's
train / eval flag, the active adapter, `use_cache`). Its figures go to metrics.jsonl as `eval/<metric>` rows at
their step, the dashboard (a line each time), the report (kitcli/display/report.py) and DONE (first, best and its
step, last; its cost as seconds per evaluation and share of the stage).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitcli import dist
from kitcli.data.rows import apply_system_prompt, read_rows
from kitcli.errors import KitError
from kitcli.records import read_jsonl
from kitcli.training.scoring import check_eval_rows, check_generation, evaluate_rows, format_score, load_eval_rewards

if TYPE_CHECKING:
    from kitcli.display.dashboard import StageDashboard
    from kitcli.recipe.schema import TrainingSection

PREFIX = "eval/"


@dataclass
class HeldOutPlan:
    """What `eval:` asks, resolved before any model loads: the rows, the rewards and the generation settings."""

    spec: Any  # the typed section: HeldOutSpec[DataSpec, GenerationSpec, RewardSpec]
    rows: list[dict[str, Any]]
    rewards: list
    settings: dict[str, Any]
    where: str
    seed: int

    @property
    def metric(self) -> str:
        """The figure a best step is chosen by: exact match where there are answers, else the weighted reward."""
        return "exact_match" if "answer" in self.rows[0] else "reward"


def held_out_plan(stage: TrainingSection, *, base_dir: Path, run_dir: Path, seed: int,
                  where: str) -> HeldOutPlan | None:
    """A training stage's `eval:` (its typed section, kitcli/recipe/held_out_spec.py) checked and resolved (None
    without one): rows, answer column, reward names (with a "did you mean"), the rewards' columns (resolved against
    `base_dir`, and the run directory for a reward stage's model), generation settings. Raises KitError naming the
    stage (`where`) and the key."""
    spec = stage.eval
    if spec is None:
        return None
    where = f"{where}: eval"
    if stage.spec.output != "policy":
        raise KitError(f"{where}: held-out evaluation generates with a policy, and a {stage.type} stage trains "
                       f"a scorer; remove eval: (its pair accuracy is eval_data: / eval_fraction:)")
    given = spec.generation.model_dump(exclude_unset=True) if spec.generation is not None else {}
    settings = check_generation({"show": 0, **given}, where)  # no sample lines inside the dashboard unless asked
    rewards = load_eval_rewards(spec.rewards, base_dir, where, run_dir)
    data = spec.data.model_copy(update={"limit": min(spec.data.limit or spec.limit, spec.limit)})
    rows = read_rows(data, where)
    check_eval_rows(rows, rewards, where, data.path)
    rows = apply_system_prompt(rows, spec.system_prompt, where, data.path)
    return HeldOutPlan(spec=spec, rows=rows, rewards=rewards, settings=settings, where=where, seed=seed)


def describe_held_out(plan: HeldOutPlan | None) -> dict[str, Any]:
    """For a stage's describe (--dry-run, preflight): one line of what its checked `eval:` will do."""
    if plan is None:
        return {}
    scored = ([plan.metric.replace("_", " ")] if plan.metric == "exact_match" else []) + [r.name for r in plan.rewards]
    return {"eval": f"{len(plan.rows)} held-out rows at step 0, every {plan.spec.every} steps and the last: "
                    f"{', '.join(scored)} ({'greedy' if plan.settings['temperature'] == 0 else 'sampled'}, "
                    f"n={plan.settings['n']}, max_new_tokens {plan.settings['max_new_tokens']})"}


# --- the model as it was found ---------------------------------------------------------------------------------

@contextlib.contextmanager
def untouched(model) -> Iterator[None]:
    """Run the body and put back what it may change that training reads: the RNG states (Python, NumPy, torch CPU and
    CUDA), each module's train / eval flag, the active adapter and `use_cache`."""
    import numpy
    import torch

    states = (random.getstate(), numpy.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    modes = [(module, module.training) for module in model.modules()]
    adapter = getattr(model, "active_adapter", None)
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
        for module, training in modes:
            module.training = training
        if adapter is not None and getattr(model, "active_adapter", None) != adapter:
            model.set_adapter(adapter)
        if config is not None and use_cache is not None:
            config.use_cache = use_cache


# --- the evaluations of one stage -------------------------------------------------------------------------------

@dataclass
class HeldOut:
    """The held-out evaluations of one stage: when to run, what they scored (in metrics.jsonl), the best step."""

    plan: HeldOutPlan | None
    metrics_path: Path
    log: Any
    dashboard: StageDashboard | None = None
    seconds: list[float] = field(default_factory=list)  # the evaluations this process ran
    started: float = field(default_factory=time.time)

    @property
    def every(self) -> int:
        return self.plan.spec.every if self.plan is not None else 0

    def due(self, step: int, max_steps: int) -> bool:
        return self.plan is not None and (step % self.every == 0 or step >= max_steps)

    def logged(self) -> list[dict[str, Any]]:
        """The evaluations in metrics.jsonl (this run's and, after a resume, those before it), one per step."""
        if self.plan is None or not self.metrics_path.exists():
            return []
        key = PREFIX + self.plan.metric
        rows = {row["step"]: row for row in read_jsonl(self.metrics_path) if key in row and "step" in row}
        return [rows[step] for step in sorted(rows)]

    def best(self) -> dict[str, Any] | None:
        """The best evaluation so far (the earliest of equal scores)."""
        key = PREFIX + self.plan.metric if self.plan is not None else ""
        scored = [row for row in self.logged() if isinstance(row.get(key), (int, float))]
        return max(scored, key=lambda row: (row[key], -row["step"])) if scored else None

    def evaluate(self, model, tokenizer, step: int) -> dict[str, Any]:
        """Score the live policy at `step`, log the figures and return them (empty on the other processes of a
        multi-process run: the main process evaluates, the others wait for it at the next step)."""
        if self.plan is None or not dist.is_main_process():
            return {}
        plan = self.plan
        started = time.time()
        with untouched(model):
            summary, _ = evaluate_rows(model, tokenizer, plan.rows, plan.settings, plan.rewards, seed=plan.seed,
                                       log=self.log, where=plan.where)
        self.seconds.append(time.time() - started)
        figures = {PREFIX + key: value for key, value in summary.items()
                   if key in ("exact_match", "reward") or key.startswith(("pass@", "rewards/"))
                   and not key.endswith("/scored")}
        figures[PREFIX + "seconds"] = round(self.seconds[-1], 3)
        line = f"held-out at step {step}: {summary['headline']} ({self.seconds[-1]:.1f}s)"
        if self.dashboard is not None:
            self.dashboard.held_out(step, figures, line)
        else:
            self.log(line)
        return figures

    def summarize(self, summary: dict[str, Any]) -> dict[str, Any]:
        """The stage's DONE summary with the held-out figures: first, best (and its step and checkpoint), last, and
        the cost; its headline gains the held-out curve. Also said on the console."""
        rows = self.logged()
        if self.plan is None or not rows:
            return summary
        key, best = PREFIX + self.plan.metric, self.best()
        cost = self.cost()
        out = {**summary, "eval_metric": self.plan.metric, "eval_steps": [row["step"] for row in rows],
               "eval_first": rows[0][key], "eval_last": rows[-1][key], "eval_best": best[key] if best else None,
               "eval_best_step": best["step"] if best else None,
               "eval_best_checkpoint": best_checkpoint(self.metrics_path.parent, best["step"]) if best else None,
               **cost}
        curve = (f"held-out {self.plan.metric.replace('_', ' ')} {format_score(out['eval_first'])} -> "
                 f"{format_score(out['eval_last'])} (best {format_score(out['eval_best'])} at step "
                 f"{out['eval_best_step']})")
        out["headline"] = f"{summary['headline']}; {curve}" if summary.get("headline") else curve
        if cost.get("eval_seconds_each") is not None:
            self.log(f"{curve}; {len(self.seconds)} evaluations, {cost['eval_seconds_each']:.1f}s each, "
                     f"{cost['eval_share']:.0%} of the stage's training time")
        return out

    def cost(self) -> dict[str, Any]:
        """Seconds per evaluation and their share of the time since the stage built its trainer (this process)."""
        if not self.seconds:
            return {"eval_seconds_each": None, "eval_share": None}
        elapsed = max(time.time() - self.started, 1e-9)
        return {"eval_seconds_each": round(sum(self.seconds) / len(self.seconds), 3),
                "eval_share": round(sum(self.seconds) / elapsed, 4)}


def best_checkpoint(stage_dir: Path, step: int) -> str | None:
    """Where the best step's weights are: its checkpoint's folder name, or None when no checkpoint holds them."""
    from kitcli.rundir import StageDir

    folder = StageDir(stage_dir).checkpoints / f"checkpoint-{step}"
    return folder.name if folder.is_dir() else None


def held_out_evaluator(plan: HeldOutPlan | None, metrics_path: Path, log,
                       dashboard: StageDashboard | None = None) -> HeldOut:
    """The stage's held-out evaluations (a HeldOut that does nothing without a plan), for a loop of its own."""
    return HeldOut(plan, metrics_path, log, dashboard)


# --- TRL trainers -----------------------------------------------------------------------------------------------

def attach_held_out(trainer, plan: HeldOutPlan | None, metrics_path: Path, log) -> HeldOut:
    """Evaluate the trainer's live policy at step 0, every `every` steps and at the last step (a TrainerCallback
    added after the kit's progress callback, whose dashboard shows and logs the figures)."""
    dashboard = next((cb.dashboard for cb in trainer.callback_handler.callbacks if hasattr(cb, "dashboard")), None)
    held_out = held_out_evaluator(plan, metrics_path, log, dashboard)
    if held_out.plan is not None:
        trainer.add_callback(make_held_out_callback(held_out, trainer.processing_class))
    return held_out


def make_held_out_callback(held_out: HeldOut, tokenizer):
    from transformers import TrainerCallback

    class HeldOutCallback(TrainerCallback):
        """Scores the policy on the held-out rows; marks the best step for transformers' checkpoint rotation."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            held_out.started = time.time()
            if state.global_step == 0:  # a resumed run has its evaluations up to the checkpoint in metrics.jsonl
                self.evaluate(state, model, 0)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if held_out.due(state.global_step, state.max_steps):
                self.evaluate(state, model, state.global_step)

        def evaluate(self, state, model, step: int) -> None:
            key = PREFIX + held_out.plan.metric
            figures = held_out.evaluate(model, tokenizer, step)
            best = held_out.best()
            if figures and best is not None and best["step"] == step and step > 0:
                state.best_global_step, state.best_metric = step, figures[key]  # kept when checkpoints rotate

    return HeldOutCallback()
