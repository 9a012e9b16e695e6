"""GPU check: do the conformance tests that fail on Unsloth's GPU path fail from precision, or from a real
difference? Each loss is compared with its formula twice, in bf16 (as the kit and the tests run on a GPU) and in
float32; the results go to JSON after every step, each failure with its text.

    KIT_CAP_S=300 bash bench/offline_run.sh bench/gpu_check.py     # on the lent GPU (bench/GPU.md, command 0)
    UNSLOTH_GRPO_SEQ_PACKING=0 UNSLOTH_GRPO_PREFIX_GROUPER=0 KIT_CAP_S=240 bash bench/offline_run.sh \
        bench/gpu_check.py --parts grpo                             # the same, packing and PrefixGrouper off
    python bench/gpu_check.py --reduced                             # anywhere: on the CPU, fewer cases, ~30 s

Results: gpu-check.json (gpu-check-reduced.json with --reduced) under --results ($OUT where it is set, else
bench/results), written first and again after each step. A step is "ok" with its values, "failed" with its error
text and traceback (the values it measured before failing kept), "skipped: needs CUDA", "skipped: out of time", or
"not run" (with why: the step it needs failed, or the command was stopped before it). The steps, in order:
- dpo / bradley_terry: the trainer; the tests' batch, left on the CPU, handed to it (on a GPU only: the error the
  tests hit there); the loss with the batch on the model's device against the formula computed one unpadded
  sequence at a time in bf16 autocast and in float32 (|difference| beside the tests' CPU and GPU tolerances).
- grpo_kl (beta 0.5), dapo, gspo (--reduced: grpo_kl only): the trainer, then the case in bf16 (Unsloth's loss
  autocast latched to bf16, the formula's forwards under bf16 autocast; on a CPU, CPU autocast emulates the GPU's)
  and in float32 (no autocast): the training flag after generation; the per-token log-prob gap between bf16 and
  float32 forwards, and between the trainer's own scorer (and reference) and the formula's forward; |loss
  difference| and the gradient elements outside the tests' tolerance at scale 1 (the CPU's), 10 and 300 (the
  GPU's); the metrics bucket the loss logged to (the tests read "eval"); for grpo_kl the KL averaged both ways
  (token-weighted, as TRL logs it, and per-sequence), also on the batch with its completions cut to different
  lengths, beside the logged one; Unsloth's packing and PrefixGrouper self-verify lines (UNSLOTH_ENABLE_LOGGING).
- verdict, per case: float32 close at scale <= 10 while bf16 is not => precision only; float32 still far => a real
  difference (then rerun with packing and PrefixGrouper off). bench/GPU.md says how to read the rest.
The fixtures are those of the conformance tests that failed on the H200 (tests/test_rl_formulas.py,
tests/test_preference_formulas.py), written out here so that the check runs from the wheelhouse alone (no pytest,
nothing from tests/).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# Before unsloth is imported (it reads them once): its self-verify lines, and Unsloth's generated trainers on a CPU
# too (what a GPU runs; kitcli/training/trainers.py).
os.environ.setdefault("UNSLOTH_ENABLE_LOGGING", "1")
os.environ.setdefault("KIT_TRAINERS", "unsloth")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--reduced" in sys.argv[1:]:  # read before torch is imported: torch.compile's compile time is most of a CPU run
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # (40 of its 60 s on 2 cores), and eager gives the same numbers

import torch
import unsloth  # noqa: F401  (before transformers, TRL and PEFT, as in a real run)
import yaml
from common import RESULTS, ROOT, save

# Off sys.path once common is imported: bench/ (this script's folder) holds a rewards.py that would hide the kit's
# `rewards` package (an editable install's finder comes after every sys.path entry).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

BUDGET_S = 280  # the whole check on one GPU (bench/offline_run.sh passes what KIT_CAP_S leaves after the install)
DATA = ROOT / "examples" / "data"
# The conformance tests' fixture (tests/helpers.py: TINY_MODEL, SMALL_LORA; tests/test_rl_formulas.py)
TINY_MODEL = {"name": "tiny", "max_seq_length": 128, "load_in_4bit": True, "dtype": "float32"}
SMALL_LORA = {"r": 8, "alpha": 16, "dropout": 0.0,
              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
GROUPS, G = 2, 4
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.5, 0.0]
TEMPERATURE = 0.8
PREF_ROWS = 6
DPO_BETA = 0.3
# The tests' tolerances on a CPU; on a GPU they are 300 times looser (tests/helpers.py precision_scale).
DPO_TOLERANCE, BT_TOLERANCE, GPU_SCALE = 1e-4, 1e-5, 300
GRPO_CASES = {  # name -> (stage type, variant, train overrides), as the tests build them; the most telling first
    "grpo_kl": ("grpo", "grpo", {"beta": 0.5}),
    "dapo": ("grpo", "dapo", {"mask_truncated_completions": False}),
    "gspo": ("gspo", None, {"per_device_train_batch_size": GROUPS * G // 4}),
}
ON_GPU = torch.cuda.is_available()


class OutOfTime(BaseException):
    """The check's budget ran out in the middle of a step (not an Exception: no library's `except Exception` may
    swallow it)."""


def on_alarm(signum, frame):
    raise OutOfTime("out of time: the check's budget ran out in this step")


class Steps:
    """The check's steps in order, each recorded in the JSON as it ends (its values, or its failure's text); the
    JSON lists every planned step from the start, so a run stopped from outside still says where it was."""

    def __init__(self, names: list[str], name: str, results: Path, budget: float, payload: dict):
        self.started = time.time()
        self.deadline = self.started + budget
        self.name, self.results = name, results
        self.payload = {**payload, "budget_s": budget, "finished": False,
                        "steps": [{"step": n, "status": "not run", "why": "the check was stopped before it"}
                                  for n in names]}
        self.by_name = {s["step"]: s for s in self.payload["steps"]}
        self.write()

    def write(self) -> None:
        self.payload["seconds"] = round(time.time() - self.started, 1)
        save(self.name, self.payload, self.results)

    def run(self, name: str, fn, needs_cuda: bool = False, needs: str | None = None) -> None:
        """Run `fn(values)` as step `name`, `values` being the dict it fills as it measures (kept if it fails)."""
        entry = self.by_name[name]
        del entry["why"]
        left = self.deadline - time.time()
        if needs is not None and self.by_name[needs]["status"] != "ok":
            entry.update(status="not run", why=f"it needs step {needs!r}, which did not end ok")
        elif needs_cuda and not ON_GPU:
            entry["status"] = "skipped: needs CUDA"
        elif left < 1:
            entry["status"] = "skipped: out of time"
        else:
            self.measure(entry, fn, left)
        print(f"[{time.time() - self.started:6.1f}s] {name}: {entry['status']}"
              + "".join(f" {json.dumps(entry[k], default=str)}" for k in ("why", "values", "error") if k in entry),
              flush=True)
        self.write()

    def measure(self, entry: dict, fn, left: float) -> None:
        values: dict = {}
        entry.update(status="running", values=values)
        self.write()
        started = time.time()
        log = UnslothLines()
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(max(1, int(left)))
        try:
            with contextlib.redirect_stdout(log):
                fn(values)
            entry["status"] = "ok"
        except (Exception, OutOfTime) as error:  # noqa: BLE001  (the error's text is the result)
            entry.update(status="failed", error=f"{type(error).__name__}: {error}"[:3000],
                         traceback=traceback.format_exc()[-4000:])
        finally:
            signal.alarm(0)
        if log.lines:
            values["unsloth_log"] = log.lines[-20:]
        entry["seconds"] = round(time.time() - started, 1)


class UnslothLines(io.TextIOBase):
    """stdout during a step: passed through, and Unsloth's "[Unsloth] ..." lines kept (its packing and
    PrefixGrouper self-verify differences are printed, not returned)."""

    def __init__(self):
        self.out = sys.stdout
        self.lines: list[str] = []
        self.partial = ""

    def write(self, text: str) -> int:
        self.out.write(text)
        self.partial += text
        *done, self.partial = self.partial.split("\n")
        self.lines.extend(line.strip() for line in done if line.lstrip().startswith("[Unsloth]"))
        return len(text)

    def flush(self) -> None:
        self.out.flush()


# --- the formulas' forwards, in one precision or the other ---------------------------------------------------------


def precision(model, bf16: bool):
    """bf16 autocast on the model's device (what tests/helpers.py forward_precision gives on a GPU), or none."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(model.device.type, dtype=torch.bfloat16)


def policy_logps(model, batch: dict, bf16: bool) -> torch.Tensor:
    """log pi(o_t | q, o_<t) of each completion token at the sampling temperature, one padded forward."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with precision(model, bf16):
        logits = model(input_ids=ids, attention_mask=mask).logits
    n = batch["completion_ids"].shape[1]
    logits = logits[:, -n - 1:-1, :].float() / TEMPERATURE
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def completion_logprob(model, prompt_ids: list[int], completion_ids: list[int], bf16: bool) -> torch.Tensor:
    """log pi(completion | prompt): one unpadded sequence, the completion tokens' log-probs summed."""
    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    with precision(model, bf16):
        logits = model(input_ids=ids).logits[0].float()
    token_logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return token_logps[len(prompt_ids) - 1:].sum()


def masked_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    gap = (a - b).abs() * mask
    return {"mean": (gap.sum() / mask.sum()).item(), "max": gap.max().item()}


def clipped(ratio, advantage, low, high):
    return torch.min(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)


def loss_and_grads(loss: torch.Tensor, model) -> tuple[float, list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.item(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def compare(trainer_side: tuple, formula_side: tuple, magnitude: float = 1.0) -> dict:
    """The trainer's loss and gradients against the formula's, and how many break the tests' tolerances
    (loss rel 1e-4, gradients rtol 1e-3, atol 1e-7 x magnitude) at scale 1 (a CPU), 10 and 300 (a GPU)."""
    (loss_a, grads_a), (loss_b, grads_b) = trainer_side, formula_side
    diffs = [(a - b).abs() for a, b in zip(grads_a, grads_b)]
    out = {"loss_trainer": loss_a, "loss_formula": loss_b, "loss_abs_diff": abs(loss_a - loss_b),
           "grad_max_abs_diff": max(d.max().item() for d in diffs),
           "grad_max_abs": max(b.abs().max().item() for b in grads_b), "grad_elems": sum(d.numel() for d in diffs)}
    for scale in (1, 10, 300):
        out[f"loss_ok_scale{scale}"] = abs(loss_a - loss_b) <= max(1e-4 * scale * abs(loss_b), 1e-7 * scale * magnitude)
        out[f"grad_elems_failing_scale{scale}"] = sum(
            (d > 1e-7 * scale * magnitude + 1e-3 * scale * b.abs()).sum().item() for d, b in zip(diffs, grads_b))
    return out


def tensor_list(t: torch.Tensor) -> list:
    return t.detach().cpu().tolist()


# --- preference losses: DPO and Bradley-Terry ------------------------------------------------------------------------


def stage_context(work: Path, stages: list[dict], name: str, rewards_code: str | None = None):
    from rich.console import Console

    from kitcli.recipe.load import load_recipe
    from kitcli.recipe.stage_context import StageContext

    work.mkdir(parents=True, exist_ok=True)
    if rewards_code:
        (work / "fixed_rewards.py").write_text(rewards_code)
    path = work / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "gpu-check", "seed": 0, "model": TINY_MODEL, "lora": SMALL_LORA,
                                    "stages": stages}, sort_keys=False))
    recipe = load_recipe(str(path))
    return StageContext(recipe, recipe.stage(name), work / "run", Console(quiet=True),
                        {s.name: work / "run" / s.name for s in recipe.stages})


def describe_model(trainer, values: dict) -> None:
    model = trainer.model
    values["trainer"] = type(trainer).__name__
    values["device"] = str(model.device)
    values["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    values["trainable_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})


def on_device(trainer, rows: list[dict]) -> dict:
    batch = trainer.data_collator(rows)
    return {k: v.to(trainer.model.device) if torch.is_tensor(v) else v for k, v in batch.items()}


def build_dpo(work: Path, values: dict) -> dict:
    from kitcli.stages import dpo

    stage = {"name": "dpo", "type": "dpo", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
             "eval_fraction": 0, "train": {"beta": DPO_BETA, "max_steps": 1}}
    trainer, _, reference = dpo.build_trainer(stage_context(work / "dpo", [stage], "dpo"))
    describe_model(trainer, values)
    values["reference"] = str(reference)
    torch.manual_seed(0)
    with torch.no_grad():  # the policy moved off its reference, as the test does
        for name, param in trainer.model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param))
    return {"trainer": trainer, "rows": [trainer.train_dataset[i] for i in range(PREF_ROWS)]}


def build_bradley_terry(work: Path, values: dict) -> dict:
    from kitcli.stages import reward

    stage = {"name": "rm", "type": "reward", "data": {"path": str(DATA / "arithmetic_prefs.jsonl"), "limit": 16},
             "eval_fraction": 0, "train": {"max_steps": 1}}
    trainer, loaded = reward.build_trainer(stage_context(work / "rm", [stage], "rm"))
    describe_model(trainer, values)
    values["backend"] = loaded.backend
    trainer.model.eval()
    return {"trainer": trainer, "rows": [trainer.train_dataset[i] for i in range(PREF_ROWS)]}


def tests_cpu_batch(state: dict, values: dict) -> None:
    """What the tests do: the collated batch, left on the CPU, handed to compute_loss (nothing moves it to the GPU
    on a single-GPU load). The error it raises is the measurement."""
    trainer = state["trainer"]
    try:
        with torch.no_grad():
            values["loss"] = trainer.compute_loss(trainer.model, trainer.data_collator(state["rows"])).item()
        values["error"] = None
    except Exception as error:  # noqa: BLE001
        values["error"] = f"{type(error).__name__}: {error}"[:1500]


def dpo_loss(state: dict, values: dict) -> None:
    """-log sigmoid(beta ((pw - rw) - (pl - rl))), each log-prob from one unpadded sequence, against TRL's loss on the
    batch moved to the model's device."""
    import torch.nn.functional as F

    from kitcli.models.backend import load_policy

    trainer, rows = state["trainer"], state["rows"]
    model = trainer.model
    with torch.no_grad():
        values["trl_loss"] = trl_loss = trainer.compute_loss(model, on_device(trainer, rows)).item()
    reference = load_policy("tiny", max_seq_length=TINY_MODEL["max_seq_length"], load_in_4bit=True, lora=None,
                            dtype="float32", trainable=False, log=lambda _: None).model
    model.eval()
    for label, bf16 in (("bf16", True), ("fp32", False)):
        with torch.no_grad():
            losses = []
            for r in rows:
                pw, pl, rw, rl = (completion_logprob(m, r["prompt_ids"], r[key], bf16)
                                  for m, key in ((model, "chosen_ids"), (model, "rejected_ids"),
                                                 (reference, "chosen_ids"), (reference, "rejected_ids")))
                losses.append(-F.logsigmoid(DPO_BETA * ((pw - rw) - (pl - rl))))
        values[f"formula_{label}"] = torch.stack(losses).mean().item()
        values[f"abs_diff_{label}"] = abs(values[f"formula_{label}"] - trl_loss)
    values["tolerance_cpu"], values["tolerance_gpu"] = DPO_TOLERANCE, DPO_TOLERANCE * GPU_SCALE


def bradley_terry_loss(state: dict, values: dict) -> None:
    """-log sigmoid(r_chosen - r_rejected), each reward from one unpadded sequence, against TRL's loss on the batch
    moved to the model's device."""
    import torch.nn.functional as F

    trainer, rows = state["trainer"], state["rows"]
    model = trainer.model
    with torch.no_grad():
        values["trl_loss"] = trl_loss = trainer.compute_loss(model, on_device(trainer, rows)).item()
        for label, bf16 in (("bf16", True), ("fp32", False)):
            with precision(model, bf16):
                chosen, rejected = (
                    torch.stack([model(input_ids=torch.tensor([r[key]], device=model.device)).logits[0, 0]
                                 for r in rows]).float() for key in ("chosen_ids", "rejected_ids"))
            values[f"formula_{label}"] = (-F.logsigmoid(chosen - rejected)).mean().item()
            values[f"abs_diff_{label}"] = abs(values[f"formula_{label}"] - trl_loss)
    values["tolerance_cpu"], values["tolerance_gpu"] = BT_TOLERANCE, BT_TOLERANCE * GPU_SCALE


# --- GRPO-family losses ----------------------------------------------------------------------------------------------


def build_grpo(work: Path, stage_type: str, variant: str | None, train: dict):
    from kitcli.stages import grpo, gspo

    rewards = textwrap.dedent(f"""
        SCORES = {SCORES!r}

        def fixed(prompts, completions, **kwargs):
            return SCORES[: len(completions)]
    """)
    stage = {"name": "rl", "type": stage_type, "data": str(DATA / "arithmetic_prompts.jsonl"),
             "rewards": ["fixed_rewards.py:fixed"],
             "train": {"per_device_train_batch_size": GROUPS * G, "num_generations": G, "max_completion_length": 6,
                       "temperature": TEMPERATURE, **train}}
    if variant:
        stage["variant"] = variant
    ctx = stage_context(work, [stage], "rl", rewards)
    module = gspo if stage_type == "gspo" else grpo
    trainer, _, _ = grpo.build_trainer(ctx, module.VARIANTS[variant or module.DEFAULT_VARIANT])
    return trainer


def generation_batch(trainer) -> dict:
    rows = [trainer.train_dataset[i] for i in range(GROUPS)]
    trainer.model.eval()
    torch.manual_seed(0)
    return trainer._generate_and_score_completions([row for row in rows for _ in range(G)])


def with_old_logps(model, batch: dict, spread: float, bf16: bool, offsets: torch.Tensor | None = None) -> dict:
    """Old log-probs = current - a fixed random shift per token (plus `offsets` per sequence), as the tests make."""
    with torch.no_grad():
        current = policy_logps(model, batch, bf16)
    noise = torch.rand(current.shape, generator=torch.Generator().manual_seed(1))
    shift = ((noise * 2 - 1) * spread).to(current.device)
    if offsets is not None:
        shift = shift + offsets.to(current.device).unsqueeze(1)
    return {**batch, "old_per_token_logps": current - shift}


def logged(trainer) -> dict:
    """The metrics the last compute_loss logged, by bucket ("train" or "eval")."""
    return {bucket: {k: v[-1] for k, v in trainer._metrics[bucket].items() if v and k in (
        "kl", "clip_ratio/region_mean", "cispo_clip_ratio")} for bucket in ("train", "eval")
        if isinstance(trainer._metrics.get(bucket), dict) and trainer._metrics[bucket]}


def grpo_trainer(work: Path, name: str, values: dict) -> dict:
    """The case's trainer, built once for both precisions, its policy moved off its reference where a KL term is
    checked (before sampling: the reference log-probs must still be the start's)."""
    stage_type, variant, train = GRPO_CASES[name]
    trainer = build_grpo(work / name, stage_type, variant, train)
    describe_model(trainer, values)
    config = trainer.args
    values["config"] = {"loss_type": config.loss_type, "beta": config.beta, "epsilon": config.epsilon,
                        "epsilon_high": config.epsilon_high,
                        "importance_sampling_level": getattr(config, "importance_sampling_level", None),
                        "bf16": config.bf16, "fp16": config.fp16}
    if config.beta:
        move_policy(trainer.model, 0.025)
    return {"trainer": trainer, "stage_type": stage_type}


def grpo_case(state: dict, bf16: bool, values: dict) -> None:
    trainer, stage_type = state["trainer"], state["stage_type"]
    # Latch Unsloth's loss autocast (unsloth/models/rl_replacements.py _unsloth_grpo_autocast, read at every scoring
    # pass): bf16 as the kit's GPU config sets it (on a CPU, CPU autocast emulates it), or none at all.
    trainer._autocast_enabled, trainer._autocast_dtype = bf16, torch.bfloat16 if bf16 else None
    trainer._autocast_force_float32 = False
    values["autocast"] = f"{trainer.model.device.type} bfloat16" if bf16 else "none (float32)"
    values["float32_matmul_precision"] = torch.get_float32_matmul_precision()  # "high": TF32 on a GPU
    model, config = trainer.model, trainer.args
    raw = generation_batch(trainer)
    values["training_after_generation"] = model.training
    values["completion_lengths"] = tensor_list(raw["completion_mask"].sum(1))
    spread = 5e-4 if stage_type == "gspo" else 0.4
    offsets = torch.linspace(-1.5e-3, 1.5e-3, GROUPS * G) if stage_type == "gspo" else None
    batch = with_old_logps(model, raw, spread, bf16, offsets)
    mask = batch["completion_mask"].float()
    n = batch["completion_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        formula_bf16, formula_fp32 = policy_logps(model, batch, True), policy_logps(model, batch, False)
        values["logp_gap_bf16_vs_fp32_forward"] = masked_gap(formula_bf16, formula_fp32, mask)
        scorer = trainer._get_per_token_logps_and_entropies(model, ids, attention, n)[0]
        if scorer is None:
            values["logp_gap_trainer_scorer_vs_formula"] = "the trainer's scorer returned None (efficient path)"
        else:
            values["logp_gap_trainer_scorer_vs_formula"] = masked_gap(
                scorer[:, -n:].float(), formula_bf16 if bf16 else formula_fp32, mask)

    logps = policy_logps(model, batch, bf16)
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    advantages = batch["advantages"]
    magnitude = 1.0
    if stage_type == "gspo":
        sequence_ratio = torch.exp(((logps - batch["old_per_token_logps"]) * mask).sum(1) / mask.sum(1))
        ours = -clipped(sequence_ratio, advantages, config.epsilon, config.epsilon_high).mean()
    else:
        per_token = clipped(ratio, advantages.unsqueeze(1), config.epsilon, config.epsilon_high)
        if config.beta:
            with torch.no_grad(), model.disable_adapter():
                start = policy_logps(model, batch, bf16)
            values["logp_gap_trainer_reference_vs_formula"] = masked_gap(
                batch["ref_per_token_logps"][:, -n:].float(), start, mask)
            log_ref = start - logps
            kl = torch.exp(log_ref) - log_ref - 1
            per_token = per_token - config.beta * kl
            values["kl_token_mean"] = ((kl * mask).sum() / mask.sum()).item()
            values["kl_sequence_mean"] = ((kl * mask).sum(1) / mask.sum(1)).mean().item()
        if config.loss_type == "grpo":
            ours = -((per_token * mask).sum(1) / mask.sum(1)).mean()
        else:  # dapo, bnpo
            ours = -(per_token * mask).sum() / mask.sum()
    values.update(compare(loss_and_grads(trainer.compute_loss(model, batch), model),
                          loss_and_grads(ours, model), magnitude))
    values["logged"] = logged(trainer)
    values["logged_bucket"] = sorted(values["logged"])
    if config.beta:
        values["kl_metric_varied_lengths"] = kl_metric_varied_lengths(trainer, batch, bf16)


def move_policy(model, size: float, seed: int = 0) -> None:
    """The trained adapter moved off its start, as training would (tests/helpers.py move_policy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(size * torch.randn(param.shape, generator=generator).to(param))


def kl_metric_varied_lengths(trainer, batch: dict, bf16: bool) -> dict:
    """The logged KL against both averages on the same batch with completions cut to different lengths (padded
    after the cut, so TRL's mask and Unsloth's "token != pad" mask agree): TRL logs the token-weighted mean, Unsloth
    (unsloth_zoo rl_replacements) the mean of per-sequence means; they differ only where lengths differ."""
    model = trainer.model
    n = batch["completion_ids"].shape[1]
    keep = torch.tensor([n - (i % 3) * 2 for i in range(batch["completion_ids"].shape[0])], device=model.device)
    keep = torch.minimum(keep, batch["completion_mask"].sum(1)).clamp(min=1)
    cut = torch.arange(n, device=model.device)[None, :] < keep[:, None]
    pad = trainer.processing_class.pad_token_id
    short = {**batch, "completion_ids": torch.where(cut, batch["completion_ids"], pad),
             "completion_mask": batch["completion_mask"] * cut}
    mask = short["completion_mask"].float()
    with torch.no_grad():
        logps = policy_logps(model, short, bf16)
        with model.disable_adapter():
            start = policy_logps(model, short, bf16)
        kl = torch.exp(start - logps) - (start - logps) - 1
    trainer.compute_loss(model, short)  # with autograd on, as in training (Unsloth's no-grad path is another)
    token_mean = ((kl * mask).sum() / mask.sum()).item()
    sequence_mean = ((kl * mask).sum(1) / mask.sum(1)).mean().item()
    found = logged(trainer)
    value = next((b["kl"] for b in found.values() if "kl" in b), None)
    closest = None
    if value is not None:
        gaps = {"token-weighted (TRL)": abs(value - token_mean), "per-sequence (Unsloth)": abs(value - sequence_mean)}
        closest = min(gaps, key=gaps.get)
    return {"lengths": tensor_list(mask.sum(1)), "token_mean": token_mean, "sequence_mean": sequence_mean,
            "logged": value, "logged_is_closest_to": closest}


# --- verdicts -------------------------------------------------------------------------------------------------------


def grpo_verdict(bf16: dict | None, fp32: dict | None) -> str:
    def close(v: dict, scale: int) -> bool:
        return v.get(f"loss_ok_scale{scale}") is True and v.get(f"grad_elems_failing_scale{scale}") == 0

    if not fp32 or "loss_ok_scale1" not in fp32:
        return "unknown: the float32 case did not finish"
    if close(fp32, 1) or close(fp32, 10):
        if bf16 and "loss_ok_scale1" in bf16 and not close(bf16, 1):
            return "precision only: float32 matches the formula (scale <= 10), bf16 does not at scale 1"
        return "same: float32 matches the formula (scale <= 10)" + ("" if bf16 else "; bf16 not measured")
    return ("a real difference: float32 is still outside the tolerance at scale 10 (rerun with "
            "UNSLOTH_GRPO_SEQ_PACKING=0 UNSLOTH_GRPO_PREFIX_GROUPER=0)")


def pref_verdict(v: dict | None) -> str:
    if not v or "abs_diff_fp32" not in v:
        return "unknown: the loss step did not finish"
    if v["abs_diff_fp32"] <= 10 * v["tolerance_cpu"]:
        bf16_far = v["abs_diff_bf16"] > v["tolerance_cpu"]
        return "precision only: float32 matches, bf16 does not" if bf16_far else "same: both match"
    return "a real difference: float32 is outside 10 x the CPU tolerance"


def verdicts(steps: Steps, cases: list[str], values: dict) -> None:
    def got(name: str) -> dict | None:
        entry = steps.by_name.get(name)
        return entry.get("values") if entry else None

    for pref in ("dpo", "bradley_terry"):
        if f"{pref}: loss, batch on the model's device" in steps.by_name:
            values[pref] = pref_verdict(got(f"{pref}: loss, batch on the model's device"))
    for case in cases:
        values[case] = grpo_verdict(got(f"{case}/bf16"), got(f"{case}/fp32"))


# --- the plan ---------------------------------------------------------------------------------------------------------


def environment() -> dict:
    import importlib.metadata as metadata

    versions = {}
    for name in ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "accelerate"):
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"gpu": torch.cuda.get_device_name(0) if ON_GPU else None,
            "cuda": torch.version.cuda if ON_GPU else None, "versions": versions,
            "unsloth_env": {k: os.environ.get(k, "unset (default on)") for k in (
                "UNSLOTH_GRPO_SEQ_PACKING", "UNSLOTH_GRPO_PREFIX_GROUPER")},
            "kit_trainers": os.environ.get("KIT_TRAINERS")}


class Step(NamedTuple):
    name: str
    measure: Callable[[dict], None]  # fills the step's values
    needs_cuda: bool = False
    needs: str | None = None  # an earlier step that must have ended ok (the one that built the trainer)


def plan(parts: list[str], reduced: bool, work: Path) -> list[Step]:
    """The steps in order; a trainer is built once per case, in a step of its own, for the steps after it."""
    built: dict = {}
    steps: list[Step] = []
    if "pref" in parts:
        for case, build, loss in (("dpo", build_dpo, dpo_loss),
                                  ("bradley_terry", build_bradley_terry, bradley_terry_loss)):
            trainer = f"{case}: trainer"
            steps += [Step(trainer, lambda v, c=case, b=build: built.__setitem__(c, b(work, v))),
                      Step(f"{case}: the tests' batch left on the CPU", lambda v, c=case: tests_cpu_batch(built[c], v),
                           needs_cuda=True, needs=trainer),
                      Step(f"{case}: loss, batch on the model's device", lambda v, c=case, f=loss: f(built[c], v),
                           needs=trainer)]
    if "grpo" in parts:
        for case in ["grpo_kl"] if reduced else list(GRPO_CASES):
            trainer = f"{case}: trainer"
            steps.append(Step(trainer, lambda v, c=case: built.__setitem__(c, grpo_trainer(work, c, v))))
            steps += [Step(f"{case}/{'bf16' if bf16 else 'fp32'}", lambda v, c=case, b=bf16: grpo_case(built[c], b, v),
                           needs=trainer) for bf16 in (True, False)]
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="the CPU version: one GRPO case (grpo_kl), not three")
    parser.add_argument("--parts", nargs="+", choices=["pref", "grpo"], default=["pref", "grpo"],
                        help="pref: DPO and Bradley-Terry; grpo: dapo, grpo with KL, gspo (default both)")
    parser.add_argument("--results", type=Path, default=Path(os.environ.get("OUT") or RESULTS),
                        help="folder for the JSON (default $OUT, else bench/results)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for the whole check (default {BUDGET_S}; twice that with --reduced)")
    args = parser.parse_args()
    budget = args.budget_s or BUDGET_S * (2 if args.reduced else 1)
    work = Path(tempfile.mkdtemp(prefix="kit-gpu-check-"))
    planned = plan(args.parts, args.reduced, work)
    cases = [case for case in GRPO_CASES if any(step.name == f"{case}/fp32" for step in planned)]
    steps = Steps([step.name for step in planned] + ["verdict"], "gpu-check-reduced" if args.reduced else "gpu-check",
                  args.results, budget, {"environment": environment(), "reduced": args.reduced, "parts": args.parts})
    try:
        for step in planned:
            steps.run(step.name, step.measure, needs_cuda=step.needs_cuda, needs=step.needs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steps.deadline = max(steps.deadline, time.time() + 5)  # the verdict only reads the steps: always given its turn
    steps.run("verdict", lambda v: verdicts(steps, cases, v))
    steps.payload["finished"] = True
    steps.write()
    for case, verdict in steps.by_name["verdict"].get("values", {}).items():
        print(f"{case:14} {verdict}")
    failed = [s["step"] for s in steps.payload["steps"] if s["status"] == "failed"]
    print(f"gpu check: {len(failed)} of {len(steps.payload['steps'])} steps failed"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}; "
          f"results: {args.results / (steps.name + '.json')}")


if __name__ == "__main__":
    main()
