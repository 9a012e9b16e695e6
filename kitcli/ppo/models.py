"""The four models of PPO on one copy of the base weights (docs/ppo.md), and their forward passes.

The policy is the LoRA adapter `default`; the reference is a frozen copy of the starting adapter (`reference`), or
the base with adapters disabled when the stage starts from the base; the critic is the adapter `critic` plus a
value head; a reward stage's seq-cls adapter and score head become the frozen adapter `reward` when it was trained
on the same base in the same form, otherwise its merged model is loaded beside it (a second copy, reported).
"""

from __future__ import annotations

import copy
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kitcli.errors import KitError
from kitcli.models.backend import cuda_available, four_bit
from kitcli.rundir import StageDir

POLICY, REFERENCE, CRITIC, REWARD = "default", "reference", "critic", "reward"


@dataclass
class RewardSource:
    """The recipe's `reward_model:`: an earlier reward stage (its name and directory) or a model directory."""

    weight: float
    stage: str | None = None
    stage_dir: Path | None = None
    path: Path | None = None

    @property
    def name(self) -> str:
        return self.stage or str(self.path)


@dataclass
class RewardModel:
    """Scores (prompt, response text) pairs. `adapter` set: the frozen adapter + score head on the shared base;
    else `model` is a separate sequence-classification model (its own copy of base weights)."""

    tokenizer: Any
    name: str
    weight: float
    head: Any = None
    adapter: str | None = None
    model: Any = None


@dataclass
class PPOModels:
    model: Any  # the PeftModel holding the one base and every adapter
    tokenizer: Any
    value_head: Any
    reference: str | None  # adapter name, or None: the base with adapters disabled
    reward_model: RewardModel | None
    trainable: list  # the policy's and critic's LoRA weights and the value head
    base_copies: int
    layout: list[str]
    backend: str


# --- adapters ---------------------------------------------------------------------------------------------------

def adapter_state(model, name: str) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def copy_adapter(model, source: str, name: str) -> None:
    """A new adapter `name` with the same settings and weights as `source`."""
    from peft import set_peft_model_state_dict

    model.add_adapter(name, copy.deepcopy(model.peft_config[source]))
    set_peft_model_state_dict(model, adapter_state(model, source), adapter_name=name)


def adapter_parameters(model, name: str) -> list:
    return [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]


def use_adapter(models: PPOModels, name: str) -> None:
    """Activate one adapter; PEFT's set_adapter freezes the others, so the trained weights are unfrozen again."""
    models.model.set_adapter(name, inference_mode=name not in (POLICY, CRITIC))
    for parameter in models.trainable:
        parameter.requires_grad_(True)


def decoder_body(model):
    """The transformer under the LM head (hidden states without the vocabulary projection)."""
    base = model.get_base_model()
    return getattr(base, base.base_model_prefix)


def disable_dropout(model) -> None:
    """Dropout off everywhere, so a response's old and new log-probabilities agree before any update."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


# --- setup ------------------------------------------------------------------------------------------------------

def reward_shares_base(reward_stage_dir: Path, policy_quantized: bool, load_in_4bit: bool | None) -> bool:
    """A reward stage's adapter can sit on the policy's base when it was trained on that base in the same form.
    Reward models train as sequence classification, which is 4-bit only on a GPU (Unsloth's CPU loader cannot
    do it: reward_models.load_reward_model), so on a CPU a 4-bit policy base gets the merged reward model instead."""
    if not (StageDir(reward_stage_dir).adapter / "adapter_model.safetensors").is_file():
        return False  # fully fine-tuned reward model: only the merged model exists
    reward_quantized = cuda_available() and four_bit(load_in_4bit)
    return reward_quantized == policy_quantized


def setup_models(model_spec: Any, lora: Any, *, seed: int, init_dir: Path | None,
                 init_name: str | None, reward: RewardSource | None, where: str,
                 log: Callable[[str], None]) -> PPOModels:
    """Load the base once with the policy adapter (from `init_dir`, the stage `init_name`'s output, or fresh) and
    add the reference, critic and reward model around it. `model_spec` and `lora` are the recipe's validated
    `model:` and `lora:` sections, read by their attributes."""
    from kitcli.models.backend import load_stage_policy

    loaded = load_stage_policy(model_spec, lora=lora, seed=seed, init_from=init_dir, log=log)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not hasattr(model, "peft_config"):
        raise KitError(f"{where}: PPO trains LoRA adapters on one shared base; full fine-tuning (lora: false, or "
                       f"an init stage saved as a full model) is not supported")
    form = f"{'4-bit' if loaded.load_in_4bit else loaded.dtype} base"
    layout = [f"policy: adapter '{POLICY}' (trained)"]
    if init_name is not None:
        copy_adapter(model, POLICY, REFERENCE)
        reference = REFERENCE
        layout.append(f"reference: adapter '{REFERENCE}', a frozen copy of stage '{init_name}''s adapter")
    else:
        reference = None
        layout.append("reference: the base with adapters disabled")
    copy_adapter(model, POLICY, CRITIC)
    hidden = model.get_base_model().config.get_text_config().hidden_size
    torch.manual_seed(seed)
    value_head = torch.nn.Linear(hidden, 1).to(model.device)
    torch.nn.init.normal_(value_head.weight, std=1.0 / math.sqrt(hidden + 1))
    torch.nn.init.zeros_(value_head.bias)
    layout.append(f"critic: adapter '{CRITIC}' (a copy of the policy's starting weights) + value head "
                  f"Linear({hidden}, 1) (trained)")
    reward_model, copies = None, 1
    if reward is not None:
        reward_model, line = load_reward_model(model, tokenizer, reward, model_spec, loaded.load_in_4bit, where, log)
        copies += reward_model.model is not None
        layout.append(line)
    disable_dropout(model)
    trainable = adapter_parameters(model, POLICY) + adapter_parameters(model, CRITIC) + list(value_head.parameters())
    models = PPOModels(model=model, tokenizer=tokenizer, value_head=value_head, reference=reference,
                       reward_model=reward_model, trainable=trainable, base_copies=copies,
                       layout=[f"{copies} cop{'y' if copies == 1 else 'ies'} of base weights ({form})", *layout],
                       backend=loaded.backend)
    for name in model.peft_config:
        if name not in (POLICY, CRITIC):
            for parameter in adapter_parameters(model, name):
                parameter.requires_grad_(False)
    use_adapter(models, POLICY)
    if reference is not None:
        check_reference(model, where)
    for line in models.layout:
        log(f"memory: {line}")
    return models


def load_reward_model(model, tokenizer, reward: RewardSource, model_spec: Any, policy_quantized: bool,
                      where: str, log: Callable[[str], None]) -> tuple[RewardModel, str]:
    """The reward model as the frozen adapter `reward` on the shared base, or loaded beside it; and its layout line."""
    from kitcli.models.reward_models import attach_reward_adapter, load_seq_cls_scorer

    stage = StageDir(reward.stage_dir) if reward.stage_dir is not None else None
    if stage is not None and reward_shares_base(stage.path, policy_quantized, model_spec.load_in_4bit):
        head = attach_reward_adapter(model, stage.adapter, REWARD)
        return (RewardModel(tokenizer=tokenizer, name=reward.name, weight=reward.weight, head=head, adapter=REWARD),
                f"reward model: adapter '{REWARD}' + score head of stage '{reward.stage}' (frozen)")
    path = stage.merged if stage is not None else Path(reward.path)
    if not (path / "config.json").is_file():
        raise KitError(f"{where}: reward stage '{reward.stage}' left no merged model in {path}; re-run it with "
                       f"--force")
    scorer, scorer_tokenizer = load_seq_cls_scorer(path, dtype=model_spec.dtype, log=log)
    why = "its adapter was trained on the base in another precision" if stage is not None and stage.adapter.is_dir() \
        else "its own weights"
    return (RewardModel(tokenizer=scorer_tokenizer, name=reward.name, weight=reward.weight, model=scorer),
            f"reward model: {path} loaded separately ({why}; a second copy of base weights)")


def check_reference(model, where: str) -> None:
    """The reference adapter must be exactly the policy's starting weights (it is made before any step) and frozen."""
    policy, reference = adapter_state(model, POLICY), adapter_state(model, REFERENCE)
    frozen = not any(p.requires_grad for p in adapter_parameters(model, REFERENCE))
    if policy.keys() != reference.keys() or not frozen or \
            not all(torch.equal(policy[k], reference[k]) for k in policy):
        raise KitError(f"{where}: the PPO reference adapter is not a frozen copy of the starting policy; this "
                       f"TRL/PEFT version copies adapters differently than kit expects")


def check_reward_tokenizer(policy_tokenizer, reward_tokenizer, conversational: bool, name: str, where: str) -> None:
    """Responses reach a reward model as text, re-tokenized by its own tokenizer through its chat template;
    a different tokenizer without a chat template cannot be given a conversation."""
    same = policy_tokenizer.get_vocab() == reward_tokenizer.get_vocab()
    if not same and conversational and not getattr(reward_tokenizer, "chat_template", None):
        raise KitError(f"{where}: reward model {name} has a different tokenizer from the policy's and no chat "
                       f"template, so the conversations cannot be re-tokenized for it; use a reward model trained "
                       f"on this policy's base, or one whose tokenizer has a chat template")


# --- forward passes ---------------------------------------------------------------------------------------------

def position_ids(attention_mask):
    """Positions that skip left padding, as generate() numbers them."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def hidden_states(models: PPOModels, input_ids, attention_mask):
    out = decoder_body(models.model)(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids(attention_mask), use_cache=False)
    return out.last_hidden_state


def response_logits(models: PPOModels, input_ids, attention_mask, prompt_length: int):
    """Logits at the positions that predict the response tokens (for the active adapter)."""
    hidden = hidden_states(models, input_ids, attention_mask)[:, prompt_length - 1:-1]
    return models.model.get_output_embeddings()(hidden)


def response_values(models: PPOModels, input_ids, attention_mask, prompt_length: int):
    """V(s_t) for each response token a_t: the value head on the hidden state of the token before it."""
    hidden = hidden_states(models, input_ids, attention_mask)[:, prompt_length - 1:-1]
    return models.value_head(hidden.to(models.value_head.weight.dtype)).squeeze(-1)


def policy_logprobs(models: PPOModels, input_ids, attention_mask, prompt_length: int, temperature: float,
                    adapter: str | None = POLICY, with_entropy: bool = False):
    """log pi(a_t | s_t) of the response tokens under `adapter` (None: the base with adapters disabled)."""
    from kitcli.ppo.losses import entropy_from_logits, token_logprobs

    def compute():
        logits = response_logits(models, input_ids, attention_mask, prompt_length)
        logprobs = token_logprobs(logits, input_ids[:, prompt_length:], temperature)
        return (logprobs, entropy_from_logits(logits, temperature)) if with_entropy else logprobs

    if adapter is None:
        with models.model.disable_adapter():
            return compute()
    use_adapter(models, adapter)
    return compute()


def reference_logprobs(models: PPOModels, input_ids, attention_mask, prompt_length: int, temperature: float):
    return policy_logprobs(models, input_ids, attention_mask, prompt_length, temperature, adapter=models.reference)


# --- saving -----------------------------------------------------------------------------------------------------

def save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def save_critic(models: PPOModels, stage_dir: Path) -> Path:
    """<stage_dir>/critic/: the critic adapter in PEFT format and value_head.safetensors."""
    final = StageDir(stage_dir).critic
    staging = stage_dir / "critic.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    models.model.peft_config[CRITIC].save_pretrained(str(staging))
    save_safetensors(adapter_state(models.model, CRITIC), staging / "adapter_model.safetensors")
    save_safetensors(models.value_head.state_dict(), staging / "value_head.safetensors")
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final
