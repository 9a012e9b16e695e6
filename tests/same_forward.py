"""The formula tests' check on the trainer's own numbers (docs/conformance.md): what a trainer's loss read from its
own forward pass, recorded while it computes the loss, and the formula evaluated on exactly those tensors.

Against an independent forward pass (the test's own), a bf16 trainer and a bf16 test differ by two roundings of every
log-prob, which a tolerance must allow and which hides errors the size of a wrong beta or epsilon. Evaluated on the
trainer's own log-probs and rewards (the same tensors, with their graph), the formula and the trainer's loss differ
only by the rounding of the formula's own arithmetic: float32's, in either precision mode, where the trainer computes
its loss in float32 (every trainer here but the reward model, whose rewards and loss are bf16 under autocast: there
the allowance is the rounding of bf16 arithmetic, rounding_tolerance). The formula's gradient, taken through the
trainer's own forward, is the trainer's gradient up to the same rounding.

Each comparison is recorded (KIT_CONFORMANCE_LOG, a JSON line per comparison: test, check, difference, tolerance):
tests/mutants.py reads it to report by how much a broken trainer misses (docs/conformance.md's margins).
"""

from __future__ import annotations

import contextlib
import json
import os

CONFORMANCE_LOG = "KIT_CONFORMANCE_LOG"
# float32 rounding of a loss computed twice in a different order (the float32 mode's tolerances, tests/
# test_rl_formulas.assert_same): relative to the loss, and absolute per unit of the loss's terms' magnitude
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-7
GRAD_RTOL, GRAD_ATOL = 1e-3, 1e-7
# unit roundoff: a result rounded to the type is within this much of the exact one, relatively (8 bits of precision
# in bf16, 7 stored; 24 in float32)
BF16_UNIT, FLOAT32_UNIT = 2.0 ** -8, 2.0 ** -24


def compared(check: str, difference: float, tolerance: float) -> bool:
    """Whether `difference` is within `tolerance`; recorded, with the test's id, where KIT_CONFORMANCE_LOG says."""
    path = os.environ.get(CONFORMANCE_LOG)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        with open(path, "a") as log:
            log.write(json.dumps({"test": test, "check": check, "difference": difference,
                                  "tolerance": tolerance}) + "\n")
    return difference <= tolerance


@contextlib.contextmanager
def recorded_calls(owner, name: str):
    """For the block, every call of `owner.name` (a method of one object, or a function or class of a module) as
    (args, kwargs, result), in order; the call itself is unchanged. A class is recorded through its `apply` (a
    torch.autograd.Function)."""
    calls: list[tuple[tuple, dict, object]] = []
    original = getattr(owner, name)
    own = name in vars(owner)

    def call(function, args, kwargs):
        result = function(*args, **kwargs)
        calls.append((args, kwargs, result))
        return result

    if isinstance(original, type):
        replacement = type(name, (), {"apply": staticmethod(lambda *a, **k: call(original.apply, a, k))})
    else:
        def replacement(*args, **kwargs):
            return call(original, args, kwargs)
    setattr(owner, name, replacement)
    try:
        yield calls
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def recorded_forwards(model):
    """For the block, every forward pass of `model` (a torch module) as (keyword arguments, output), in order."""
    forwards: list[tuple[dict, object]] = []
    hook = model.register_forward_hook(lambda module, args, kwargs, output: forwards.append((kwargs, output)),
                                       with_kwargs=True)
    try:
        yield forwards
    finally:
        hook.remove()


def float32_tolerance(expected: float, magnitude: float = 1.0) -> float:
    """A loss computed twice in float32 from the same inputs: LOSS_RTOL of it, or LOSS_ATOL per unit of its terms'
    magnitude (a sum that cancels keeps the rounding of its terms), whichever is larger (as pytest.approx)."""
    return max(LOSS_RTOL * abs(expected), LOSS_ATOL * magnitude)


def rounding_tolerance(formula, inputs: dict, unit: float = BF16_UNIT) -> float:
    """How far `formula` computed in a lower precision (every operation's result rounded to it: relative error up to
    `unit`, bf16's 2^-8) can be from the same formula in float32, on the same inputs, to first order: the sum over
    every intermediate value v it marks (it takes `rounded`, and passes each operation's result through it) of
    |d formula / d v| * unit * |v|."""
    import torch

    marked = []

    def rounded(value):
        marked.append(value)
        return value

    leaves = {name: value.detach().float().requires_grad_() for name, value in inputs.items()}
    value = formula(**leaves, rounded=rounded)
    grads = torch.autograd.grad(value, marked, allow_unused=True)
    return unit * sum((g.abs() * v.detach().abs()).sum().item() for g, v in zip(grads, marked) if g is not None)


def arithmetic_tolerance(formula, inputs: dict, dtype) -> float:
    """The rounding of `formula`'s own arithmetic when the trainer computes it in `dtype` and the test in float32, on
    the same inputs: in bf16 twice rounding_tolerance (the trainer's rounding, and an order of operations other
    than the formula's); in float32 float32_tolerance."""
    import torch

    if dtype == torch.bfloat16:
        return 2 * rounding_tolerance(formula, inputs, BF16_UNIT)
    return float32_tolerance(formula(**{name: value.detach().float() for name, value in inputs.items()}).item())


def assert_loss_is_the_formula(check: str, trainer_value: float, formula_value: float, tolerance: float) -> None:
    difference = abs(trainer_value - formula_value)
    assert compared(check, difference, tolerance), (
        f"{check}: the trainer's {trainer_value!r} against the formula's {formula_value!r} on the trainer's own "
        f"inputs: {difference:.3e} apart, tolerance {tolerance:.3e}")


def gradient(loss, params, keep: bool = False) -> list:
    """d loss / d params (0 where a parameter does not reach the loss, or the loss has no gradient at all: a trainer
    that detached it fails the comparison, not the test's own arithmetic). `keep`: the graph, for a second one."""
    import torch

    if not loss.requires_grad:
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=keep)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def assert_gradient_is_the_formulas(check: str, trainer_grads, formula_grads, magnitude: float = 1.0) -> None:
    """Element by element |a - b| <= GRAD_ATOL * magnitude + GRAD_RTOL * |b| (torch.testing.assert_close's rule);
    the element furthest from it is the one recorded."""
    import torch

    worst = (-1.0, 0.0, 0.0)  # (difference / tolerance, difference, tolerance) of the element furthest off
    for a, b in zip(trainer_grads, formula_grads):
        tolerance = GRAD_ATOL * magnitude + GRAD_RTOL * b.abs()
        ratio = (a - b).abs() / tolerance
        index = int(torch.argmax(ratio))  # (where no element differs: the first, with its tolerance)
        if ratio.view(-1)[index].item() > worst[0]:
            worst = (ratio.view(-1)[index].item(), (a - b).abs().view(-1)[index].item(),
                     tolerance.view(-1)[index].item())
    assert compared(check, worst[1], worst[2]), (
        f"{check}: the trainer's gradient against the formula's, through the same forward: an element "
        f"{worst[1]:.3e} apart, tolerance {worst[2]:.3e} ({worst[0]:.1f} times)")
