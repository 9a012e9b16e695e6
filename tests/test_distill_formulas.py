"""The on-policy distillation loss the kit trains with (TRL's DistillationTrainer), recomputed here from both models'
logits.

Each test builds the trainer exactly as the stage does (`kitcli/stages/distill.py` build_trainer: the teacher an SFT
stage's adapter on the base, frozen; the student a LoRA policy starting from the same adapter), moves the student off
the teacher, lets the student sample completions (of several lengths: the padding must be masked) as a training step
does, and takes the loss and its gradient the trainer computes on them (helpers.trainer_loss). It records what TRL
hands to its divergence function (each model's hidden states at the completion tokens and its LM head) and
recomputes, in float64, with p = softmax(z / T):

    beta 0: KL(p_t || p_s)      beta 1: KL(p_s || p_t)
    else:   beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
    loss  = sum of the divergence over the completion tokens / the number of completion tokens

with beta and T the literals of each case. The logits are the recorded hidden states times the head, rounded first
to the dtype the forward ran in (TRL's kernel projects the autocast dtype's values in float32), so in both precision
modes the comparison is float32 arithmetic against float64. That those are the right logits is checked on its own:
they equal an independent forward of each model over each unpadded prompt + completion (in bf16 within the measured
bf16 gap, helpers.PrecisionGap). On a CPU the divergence runs in the kit's torch_divergence (TRL's kernel is
CUDA / XPU only); on a GPU the same test checks TRL's Triton kernel. Both trainer families (TRL's own class and
Unsloth's generated one, which keeps TRL's loss) and both precision modes (conftest.precision).
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers import (
    DATA,
    SFT_8_STEPS,
    PrecisionGap,
    forward_precision,
    move_policy,
    run_cli,
    stage_context,
    trainer_loss,
    write_recipe,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("family")]  # every test builds two models, on both families

BATCH = 6
CASES = [pytest.param(0.0, 1.0, id="forward-kl"), pytest.param(0.5, 0.5, id="jsd-t0.5"),
         pytest.param(1.0, 1.5, id="reverse-kl-t1.5")]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    """The teacher: a short SFT run of the base model."""
    root = tmp_path_factory.mktemp("sft")
    run_cli("run", write_recipe(root / "r.yaml", [SFT_8_STEPS]), "--output", root / "run")
    return root / "run"


@pytest.fixture
def gpu_precision_here(precision, monkeypatch):
    """helpers.emulate_gpu_precision for the distill stage's config too (build_config with on_gpu=True in bf16)."""
    from kitcli.stages import distill

    if precision == "bf16" and not torch.cuda.is_available():
        build = distill.build_config
        monkeypatch.setattr(distill, "build_config",
                            lambda *a, _build=build, **kw: _build(*a, **{**kw, "on_gpu": True}))
    return precision


def built_trainer(in_tmp, sft_run, family: str, beta: float, temperature: float):
    from kitcli.stages import distill
    from kitcli.training.trainers import is_unsloth_class

    stage = {"name": "distill", "type": "distill", "init": "sft", "teacher": {"stage": "sft"},
             "data": {"path": str(DATA / "arithmetic_prompts.jsonl"), "limit": 16},
             "train": {"max_steps": 1, "beta": beta, "temperature": temperature, "max_completion_length": 12,
                       "per_device_train_batch_size": BATCH}}
    ctx = stage_context(write_recipe(in_tmp / "r.yaml", [SFT_8_STEPS, stage]), "distill", sft_run)
    trainer, _, teacher = distill.build_trainer(ctx)
    assert is_unsloth_class(type(trainer)) == (family == "unsloth"), type(trainer)
    assert trainer.teacher_model is teacher.model and not any(p.requires_grad for p in teacher.model.parameters())
    return trainer


def divergence(z_s, z_t, beta: float, temperature: float):
    """Per token, the generalised Jensen-Shannon divergence of the two distributions at the temperature."""
    log_s, log_t = torch.log_softmax(z_s / temperature, -1), torch.log_softmax(z_t / temperature, -1)
    p_s, p_t = log_s.exp(), log_t.exp()
    if beta == 0.0:
        return (p_t * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (p_s * (log_s - log_t)).sum(-1)
    log_m = torch.log((1 - beta) * p_s + beta * p_t)
    return beta * (p_t * (log_t - log_m)).sum(-1) + (1 - beta) * (p_s * (log_s - log_m)).sum(-1)


def capture_divergence_inputs(monkeypatch, captured: dict) -> None:
    """Record what TRL's loss hands its divergence function (it looks the class up at every call)."""
    from trl.kernels import chunked_divergence

    function = chunked_divergence.ChunkedDivergenceFunction

    def apply(student_hidden, *args):
        device = student_hidden.device.type
        student_hidden.retain_grad()
        captured.update(args=(student_hidden, *args), dtype=torch.get_autocast_dtype(device)
                        if torch.is_autocast_enabled(device) else None)
        return function.apply(student_hidden, *args)

    monkeypatch.setattr(chunked_divergence, "ChunkedDivergenceFunction", types.SimpleNamespace(apply=apply))


def projected(hidden, weight, bias, dtype):
    """Logits in float64 from the values the forward's dtype holds (the head's bias, if any, likewise)."""
    def held(x):
        return None if x is None else (x.detach().to(dtype) if dtype is not None else x.detach()).double()

    z = held(hidden) @ held(weight).T
    return z if bias is None else z + held(bias)


def independent_logits(model, batch) -> torch.Tensor:
    """The logits at every completion token (the rows the loss counts, in order), from a plain forward of each
    unpadded prompt + completion."""
    rows = []
    with torch.no_grad():
        for i in range(batch["prompt_ids"].shape[0]):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
            completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
            ids = torch.cat([prompt, completion])[None].to(model.device)
            with forward_precision():
                logits = model(input_ids=ids).logits[0].float()
            rows.append(logits[len(prompt) - 1:len(prompt) + len(completion) - 1])
    return torch.cat(rows)


@pytest.mark.parametrize("beta, temperature", CASES)
def test_distillation_loss_and_gradient_are_the_generalised_jsd(in_tmp, sft_run, family, gpu_precision_here,
                                                                monkeypatch, beta, temperature):
    trainer = built_trainer(in_tmp, sft_run, family, beta, temperature)
    student, teacher = trainer.model, trainer.teacher_model
    move_policy(student, 0.1, seed=0)  # off the teacher, which is where it starts
    torch.manual_seed(0)
    with torch.no_grad():  # the student samples, as at the start of a training step
        batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in range(BATCH)])
    mask = batch["completion_mask"]
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max(), lengths  # completions of several lengths: the padding is masked
    assert int(batch["num_items_in_batch"]) == int(mask.sum())

    captured: dict = {}
    capture_divergence_inputs(monkeypatch, captured)
    student.train()
    loss = trainer_loss(trainer, batch, student)
    loss.backward()
    h_s, w_s, b_s, h_t, w_t, b_t, _, _, scale_s, cap_s, scale_t, cap_t = captured["args"]
    assert (scale_s, cap_s, scale_t, cap_t) == (1.0, None, 1.0, None)  # the tiny model scales and caps nothing
    assert h_s.shape[0] == h_t.shape[0] == int(mask.sum())  # one row per completion token
    dtype = captured["dtype"]
    z_s, z_t = projected(h_s, w_s, b_s, dtype), projected(h_t, w_t, b_t, dtype)

    # The logits are each model's at the completion tokens: an independent forward of every unpadded sequence. The
    # trainer's accelerator wrapped the teacher's forward in its autocast (the loss calls the backbone, not that
    # forward); the plain forward is put back so that the precision mode decides it, as the student's.
    teacher = trainer.accelerator.unwrap_model(teacher, keep_fp32_wrapper=False)
    gap = PrecisionGap(lambda: {"student": independent_logits(student, batch),
                                "teacher": independent_logits(teacher, batch)})
    for name, model, z in (("student", student, z_s), ("teacher", teacher, z_t)):
        apart = (independent_logits(model, batch).double().cpu() - z.cpu()).abs().max().item()
        assert apart <= 1e-4 + gap.input_tolerance(name), (name, apart, str(gap))

    # The loss: the divergence summed over the completion tokens over their count, in float32 against float64.
    tokens = int(mask.sum())
    expected = (divergence(z_s, z_t, beta, temperature).sum() / tokens).item()
    assert expected > 1e-3  # the student is off the teacher: there is something to learn
    assert abs(loss.item() - expected) <= 1e-5 * max(1.0, abs(expected)), (loss.item(), expected)
    for other_beta, other_temperature in ((0.25 if beta == 0.0 else beta / 2, temperature), (beta, temperature * 1.5)):
        other = (divergence(z_s, z_t, other_beta, other_temperature).sum() / tokens).item()
        assert abs(other - expected) > 100 * 1e-5 * max(1.0, abs(expected))  # a wrong beta or T would show

    # The gradient, at the student's hidden states (the rest is the model's own backward): the formula's, in float64.
    held = (h_s.detach().to(dtype) if dtype is not None else h_s.detach()).double().requires_grad_()
    z = held @ (w_s.detach().to(dtype) if dtype is not None else w_s.detach()).double().T
    wanted, = torch.autograd.grad(divergence(z, z_t, beta, temperature).sum() / tokens, held)
    # TRL's GPU kernel rounds the logits' gradient to bf16 before its float32 matmul; the CPU path rounds nothing
    rounding = 2 ** -8 if dtype is not None and torch.cuda.is_available() else 1e-5
    difference = (h_s.grad.double().cpu() - wanted.cpu()).abs().max().item()
    assert difference <= rounding * wanted.abs().max().item(), (difference, wanted.abs().max().item())
    assert any(p.grad is not None and p.grad.abs().max() > 0 for n, p in student.named_parameters()
               if "lora_A" in n)  # it reaches the adapter
    assert all(p.grad is None for p in teacher.parameters())  # and not the teacher
