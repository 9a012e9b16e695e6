"""What a CPU (or a CI job) needs of torch and TRL that a GPU does not: TRL's Triton log-prob kernel routed to torch
off the GPU, and torch's custom-op aliasing check kept a warning for Inductor's own pool op. The backend sets them
(kitcli/models/backend.py prepare_backend; kitcli/training/trainer_classes.py for Unsloth's forced trainers)."""

from __future__ import annotations

import os


def allow_inductor_pool_aliasing() -> None:
    """torch 2.14 checks, at the first call of a compiled function, that no custom op returns an alias of its
    input, and makes a violation an error instead of a warning when the environment variable CI is set. Inductor's
    own memory-pool op (`inductor::_alloc_from_pool`) fails that check in Unsloth's compiled GRPO/GSPO loss on a
    CPU, so a kit run inside a CI job (GitHub Actions sets CI=true) died where the same run elsewhere trains. The
    op is torch's, not the user's: keep it a warning. TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING=1 still wins."""
    if "TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING" in os.environ:
        return
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # another torch: nothing to relax
        return
    if hasattr(functorch_config, "error_on_custom_op_aliasing"):
        functorch_config.error_on_custom_op_aliasing = False


def route_trl_fused_head_off_gpu() -> None:
    """TRL 1.15's SFT and GRPO trainers compute token log-probabilities with a Triton kernel that runs on CUDA only
    (Unsloth's CPU backend reroutes it; plain transformers + PEFT does not). Off the GPU, compute them with torch."""
    from trl.trainer import utils as trl_utils

    kernel = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if getattr(kernel, "_kit_dispatch", False) or getattr(kernel, "_unsloth_cpu_dispatch", False):
        return

    class DeviceDispatch:
        _kit_dispatch = True

        @staticmethod
        def apply(hidden, *args, **kwargs):
            if kernel is not None and hidden.device.type in ("cuda", "xpu"):
                return kernel.apply(hidden, *args, **kwargs)
            return torch_token_log_probs(hidden, *args, **kwargs)

    trl_utils._ChunkedLogProbFunction = DeviceDispatch


def torch_token_log_probs(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                          logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
    """The outputs of TRL's `ChunkedLogProbFunction` (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1;
    None where not asked for) in plain torch. It materialises the [tokens, vocabulary] logits: fine at CPU sizes."""
    import torch

    logits = torch.nn.functional.linear(hidden, weight.to(hidden.dtype),
                                        None if bias is None else bias.to(hidden.dtype)).float() * logit_scale
    if final_logit_softcapping:
        logits = final_logit_softcapping * torch.tanh(logits / final_logit_softcapping)
    logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1) if "entropy" in outputs else None
    squares = torch.logsumexp(2 * logprobs, dim=-1).detach() if "log_sum_sq_probs" in outputs else None
    mean = logits.mean(-1).detach() if "mean_logits" in outputs else None
    top1 = (logits.argmax(-1) == targets).detach() if "is_top1" in outputs else None
    return chosen, entropy, squares, mean, top1
