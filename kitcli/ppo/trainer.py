"""The PPO loop on accelerate: rollouts, PPO steps, logging, and checkpoints that resume exactly.

accelerate provides the autocast of every forward (`accelerator.autocast()`, the same for the rollout and the
update), backward and gradient clipping (with its loss scaler under fp16), the optimizer and scheduler wrappers,
and checkpoint state (`save_state` / `load_state`, kitcli/ppo/checkpoint.py: optimizer, scheduler, RNG states, the
two LoRA adapters, the value head and the KL coefficient; never the base weights).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kitcli.display.dashboard import StageDashboard
from kitcli.ppo.checkpoint import load_checkpoint, register_checkpoint_state, save_checkpoint
from kitcli.ppo.config import PPOConfig
from kitcli.ppo.losses import (
    KLController,
    clipped_surrogate_loss,
    clipped_value_loss,
    explained_variance,
    gae,
    kl_shaped_rewards,
    masked_mean,
    masked_whiten,
)
from kitcli.ppo.models import CRITIC, POLICY, PPOModels, policy_logprobs, response_values, use_adapter
from kitcli.ppo.rollout import Rollout, evaluate_held_out, make_rollout, rollout_samples
from kitcli.training import interrupt
from kitcli.training.held_out import HeldOut
from kitcli.training.progress import read_metrics


@contextlib.contextmanager
def accelerated(config: PPOConfig) -> Iterator[Any]:
    """An Accelerator with the config's mixed precision for the length of a PPO run. accelerate keeps one state per
    process and refuses a second precision in it; when a trainer earlier in this process set another one (a test
    that forces bf16 on a CPU), that state is set aside for the run and put back afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    saved = dict(shared) if shared and shared.get("_mixed_precision") != config.mixed_precision else None
    if saved is not None:
        shared.clear()
    try:
        yield Accelerator(mixed_precision=config.mixed_precision)
    finally:
        if saved is not None:
            shared.clear()
            shared.update(saved)


def make_optimizer(models: PPOModels, config: PPOConfig, total_updates: int, accelerator):
    """One AdamW over the policy adapter, the critic adapter and the value head, and its schedule, prepared by
    accelerate (which steps the loss scaler under fp16)."""
    from transformers import get_scheduler

    kwargs = {"lr": config.learning_rate, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": config.weight_decay}
    if config.optim == "adamw_8bit" and torch.cuda.is_available():
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(models.trainable, **kwargs)
    else:
        optimizer = torch.optim.AdamW(models.trainable, fused=config.optim == "adamw_torch_fused" or None, **kwargs)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps,
                              num_training_steps=total_updates)
    return accelerator.prepare(optimizer, scheduler)


# --- one PPO step -----------------------------------------------------------------------------------------------

def ppo_step(models: PPOModels, rollout: Rollout, config: PPOConfig, kl_ctl: KLController, optimizer, scheduler,
             accelerator, step: int) -> dict[str, float]:
    """KL-shaped rewards, GAE, then num_ppo_epochs x num_mini_batches updates of the policy and the critic."""
    mask = rollout.mask
    rewards, kl = kl_shaped_rewards(rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_ctl.value)
    advantages, returns = gae(rewards, rollout.values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    stats: dict[str, list[float]] = {k: [] for k in ("policy", "value", "clipfrac", "approxkl", "vclipfrac", "ratio")}
    generator = torch.Generator().manual_seed(config.seed * 100003 + step)
    models.model.train()
    for _ in range(config.num_ppo_epochs):
        order = torch.randperm(len(mask), generator=generator).to(mask.device)
        for start in range(0, len(mask), config.mini_batch_size):
            mb = order[start:start + config.mini_batch_size]
            ids, attention = rollout.input_ids[mb], rollout.attention_mask[mb]
            with accelerator.accumulate():  # one optimizer step per mini-batch
                with accelerator.autocast():
                    logprobs = policy_logprobs(models, ids, attention, rollout.prompt_length, config.temperature)
                    policy = clipped_surrogate_loss(logprobs, rollout.logprobs[mb], advantages[mb], mask[mb],
                                                    config.cliprange)
                accelerator.backward(policy.loss)
                with accelerator.autocast():
                    use_adapter(models, CRITIC)
                    values = response_values(models, ids, attention, rollout.prompt_length).float()
                    value_loss, value_clipfrac = clipped_value_loss(values, rollout.values[mb], returns[mb],
                                                                    mask[mb], config.cliprange_value)
                accelerator.backward(config.vf_coef * value_loss)
                if config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(models.trainable, config.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            for key, value in (("policy", policy.loss), ("value", value_loss), ("clipfrac", policy.clipfrac),
                               ("approxkl", policy.approx_kl), ("vclipfrac", value_clipfrac),
                               ("ratio", policy.ratio)):
                stats[key].append(float(value.detach()))
    models.model.eval()
    use_adapter(models, POLICY)
    kl_per_response = kl.sum(1)
    non_score = -kl_ctl.value * kl_per_response
    mean = {key: sum(values) / len(values) for key, values in stats.items()}
    metrics = {
        "objective/scores": float(rollout.scores.mean()),
        "objective/kl": float(kl_per_response.mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((rollout.scores + non_score).mean()),
        "policy/entropy": float(masked_mean(rollout.entropy, mask)),
        "loss/policy": mean["policy"],
        "loss/value": mean["value"],
        "policy/clipfrac": mean["clipfrac"],
        "policy/approxkl": mean["approxkl"],
        "policy/ratio": mean["ratio"],
        "val/clipfrac": mean["vclipfrac"],
        "val/explained_variance": explained_variance(rollout.values, returns, mask),
        "val/mean": float(masked_mean(rollout.values, mask)),
        "kl_coef": kl_ctl.value,
        "response_length": float(mask.sum(1).mean()),
        "eos_fraction": float(rollout.has_eos.float().mean()),
        "learning_rate": scheduler.get_last_lr()[0],
    }
    kl_ctl.update(metrics["objective/kl"], len(mask))
    return metrics


# --- the loop ---------------------------------------------------------------------------------------------------

def total_steps(config: PPOConfig, n_rows: int) -> int:
    if config.max_steps > 0:
        return config.max_steps
    return max(1, math.ceil(config.num_train_epochs * (n_rows // config.per_device_train_batch_size)))


def batch_rows(rows: list[dict[str, Any]], step: int, config: PPOConfig) -> list[dict[str, Any]]:
    """The prompts of PPO step `step`: a seeded shuffle per pass over the data, full batches only (so a resumed
    run draws the same batches)."""
    per_pass = len(rows) // config.per_device_train_batch_size
    epoch, index = divmod(step, per_pass)
    order = list(range(len(rows)))
    random.Random(config.seed + epoch).shuffle(order)
    chosen = order[index * config.per_device_train_batch_size:(index + 1) * config.per_device_train_batch_size]
    return [rows[i] for i in chosen]


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    out = {}
    for key in rows[0]:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


def train(config: PPOConfig, models: PPOModels, rows: list[dict[str, Any]], reward_fns, rewards, *,
          dashboard: StageDashboard, checkpoint_dir: Path, eval_rows: list[dict[str, Any]] | None = None,
          resume: Path | None = None, held_out: HeldOut | None = None) -> dict[str, Any]:
    """The PPO loop from `resume` (a checkpoint, if any) to the last step, or until a stop is requested (then a
    checkpoint is saved); logs through `dashboard` and returns figures for the summary. A checkpoint at the last
    step (saved only when a stop came during it) trains nothing: the held-out evaluation after training and the
    figures follow, as in an uninterrupted run, but for seconds_per_step (None: no step ran in this process).
    `held_out` (a stage's `eval:`, kitcli/training/held_out.py) scores the policy at step 0, every `every` steps and
    the last, with the semantics of the TRL stages' callback; the checkpoint of its best step is kept in rotation."""
    from accelerate.utils import set_seed

    steps = total_steps(config, len(rows))
    updates = steps * config.num_ppo_epochs * config.num_mini_batches
    kl_ctl = KLController(config.kl_coef, config.adaptive_kl_ctrl, config.kl_target, config.kl_horizon)
    before = after = None
    pending: list[dict[str, float]] = []
    seconds: list[float] = []
    with accelerated(config) as accelerator:
        optimizer, scheduler = make_optimizer(models, config, updates, accelerator)
        register_checkpoint_state(accelerator, models, kl_ctl)
        set_seed(config.seed)
        step = load_checkpoint(accelerator, resume) if resume is not None else 0
        dashboard.begin(steps, step)
        try:
            if resume is None and eval_rows:
                before = evaluate_held_out(models, eval_rows, reward_fns, rewards, config)
                dashboard.log(0, before)
            if held_out is not None:
                held_out.dashboard = dashboard
                if resume is None:
                    held_out.evaluate(models.model, models.tokenizer, 0)
            while step < steps:
                started = time.time()
                batch = batch_rows(rows, step, config)
                rollout, reward_metrics = make_rollout(models, batch, config, reward_fns, rewards, accelerator)
                row = {**ppo_step(models, rollout, config, kl_ctl, optimizer, scheduler, accelerator, step),
                       **reward_metrics}
                step += 1
                seconds.append(time.time() - started)
                row["seconds_per_step"] = seconds[-1]
                pending.append(row)
                dashboard.advance(step)
                if held_out is not None and held_out.due(step, steps):
                    held_out.evaluate(models.model, models.tokenizer, step)
                if step % config.logging_steps == 0 or step == steps:
                    logged = {**mean_rows(pending), "episode": step * config.per_device_train_batch_size}
                    dashboard.log(step, logged, samples=rollout_samples(batch, rollout))
                    pending = []
                if interrupt.requested() or (step % config.save_steps == 0 and step < steps):
                    interrupt.check_free_disk(checkpoint_dir, interrupt.checkpoint_bytes(models.model),
                                              f"checkpoint-{step}")
                    best = held_out.best() if held_out is not None else None
                    save_checkpoint(accelerator, checkpoint_dir, step, config.save_total_limit, steps,
                                    best_step=best["step"] if best else None)
                    if interrupt.requested():
                        break
            if eval_rows and not interrupt.requested():
                after = evaluate_held_out(models, eval_rows, reward_fns, rewards, config)
                dashboard.log(step, after)
        finally:
            dashboard.end(step)
    if before is None and eval_rows:  # resumed: the evaluation before training, as logged (without the row's clock)
        before = next(({k: v for k, v in r.items() if k not in ("step", "time")}
                       for r in read_metrics(dashboard.metrics_path) if r.get("step") == 0 and "eval/score" in r), None)
    return {"steps": step, "resumed_from": resume.name if resume else None, "eval_before": before,
            "eval_after": after, "seconds_per_step": sum(seconds) / len(seconds) if seconds else None}


def summarize(result: dict[str, Any], logged: list[dict[str, Any]], models: PPOModels) -> dict[str, Any]:
    """The stage's DONE summary: the loop's figures, the memory layout, the first and last logged score, and a
    headline (score, KL, held-out score and exact match before -> after, copies of the base)."""
    logged = [r for r in logged if "objective/scores" in r]
    summary = {**result, "backend": models.backend, "base_copies": models.base_copies, "memory": models.layout,
               "first_score": logged[0]["objective/scores"] if logged else None,
               "last_score": logged[-1]["objective/scores"] if logged else None,
               "last_kl": logged[-1]["objective/kl"] if logged else None}
    parts = []
    if logged:
        parts.append(f"score {summary['first_score']:.3f} -> {summary['last_score']:.3f}, kl {summary['last_kl']:.3f}")
    before, after = result["eval_before"], result["eval_after"]
    if before and after:
        parts.append(f"eval score {before['eval/score']:.3f} -> {after['eval/score']:.3f}")
        if "eval/exact_match" in after:
            parts.append(f"eval exact match {before['eval/exact_match']:.2f} -> {after['eval/exact_match']:.2f}")
    parts.append(f"{models.base_copies} base cop{'y' if models.base_copies == 1 else 'ies'}")
    summary["headline"] = "; ".join(parts)
    return summary
