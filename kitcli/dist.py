"""The processes of one run: under `kit run --launcher accelerate --num-processes N` every process runs the recipe
and only the main one writes files; the others wait where it writes. The one module that reads the rank
environment; the process group and its barrier are accelerate's (`PartialState`), imported only when there are
several processes."""

from __future__ import annotations

import os
from typing import Any


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def barrier() -> None:
    """Wait for every process (a no-op in a single process). accelerate's PartialState initialises the process
    group if the trainer has not yet (gloo on CPU, nccl on GPUs)."""
    if world_size() <= 1:
        return
    from accelerate import PartialState

    PartialState().wait_for_everyone()


def gathered_state_dict(model) -> dict[str, Any] | None:
    """A full state dict of a model whose parameters are sharded across processes (DeepSpeed ZeRO-3, FSDP),
    gathered on every process (a collective: all must call it); None when nothing is sharded."""
    if world_size() <= 1:
        return None
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3":
        import deepspeed

        parameters = list(model.parameters())
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if is_main_process() else {}
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return None
