"""PPO stage: RLHF with a learned critic, GAE and a per-token KL penalty against a frozen reference, as the
reference page's "RLHF with PPO" states it. TRL 1.15 ships no PPO trainer, so the loop is written out here and
the arithmetic lives in `kitcli/ppo_math.py`.

    kit run tiny-ppo
    kit run recipes/qwen3-4b-ppo.yaml --dry-run

One PPO step: sample one response per prompt of a batch (the rollout); score each response (a reward model
trained earlier, `reward_model: <stage>`, and/or reward functions, `rewards:`, as in GRPO); compute the policy's and
the reference's log-probabilities and the critic's values V(s_t); shape the rewards (score at the last token minus
beta * r_t^KL at every token); GAE advantages and returns; then `num_ppo_epochs` passes over `num_mini_batches`
mini-batches update the policy (clipped surrogate) and the critic (clipped value loss).

Memory (docs/ppo.md): one copy of the base weights serves every model. The policy is the LoRA adapter `default`;
the reference is a frozen copy of the starting adapter (`init:`, typically SFT) named `reference`, or the base with
adapters disabled when there is no `init:`; the critic is the adapter `critic` plus a value head; a reward stage's
seq-cls adapter and score head become the frozen adapter `reward` when it was trained on the same base (same
quantization); otherwise its merged model is loaded beside it (a second copy, reported).

Outputs: `adapter/` (the policy, PEFT format), `critic/` (adapter + value_head.safetensors), `metrics.jsonl`,
`checkpoints/checkpoint-N/` every `save_steps` (adapters, value head, optimizer, step, RNG; a re-run resumes).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from kitcli import interrupt
from kitcli.backend import cuda_available, load_stage_policy, resolve_model_path, save_model
from kitcli.data import read_rows, require_columns
from kitcli.errors import KitError, did_you_mean
from kitcli.rundir import StageDir
from kitcli.progress import StageDashboard, read_metrics
from kitcli.checkpoints import resume_checkpoint
from kitcli.context import StageContext
from kitcli.schema import DataSpec, RewardedSection, StageSpec
from kitcli.trl_config import build_config

POLICY, REFERENCE, CRITIC, REWARD = "default", "reference", "critic", "reward"
REWARD_ARGS = {"prompts", "completions", "completion_ids", "kwargs"}


# --- configuration ----------------------------------------------------------------------------------------------

@dataclass
class PPOConfig:
    """Settings of a PPO stage (the recipe's `train:` block), named as in TRL's PPOConfig where it has them."""

    # Length of the run and batches
    max_steps: int = field(default=-1, metadata={"help": "PPO steps; each samples one rollout batch and updates on "
                                                         "it. -1: num_train_epochs passes over the prompts."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the prompts when max_steps is -1."})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Prompts per rollout (one response "
                                                                           "each)."})
    num_mini_batches: int = field(default=1, metadata={"help": "Mini-batches each rollout is split into per PPO "
                                                               "epoch; must divide per_device_train_batch_size."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout (its mini-batches)."})
    # Optimisation (one AdamW over the policy adapter, the critic adapter and the value head)
    learning_rate: float = field(default=3e-5, metadata={"help": "Peak learning rate."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "linear, cosine, constant or "
                                                                       "constant_with_warmup, over optimizer steps."})
    warmup_steps: int = field(default=0, metadata={"help": "Optimizer steps of linear warmup."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the gradient norm of all trained weights."})
    optim: str = field(default="adamw_torch", metadata={"help": "adamw_torch, adamw_torch_fused (torch's fused "
                                                                "kernel), or adamw_8bit (bitsandbytes, GPU)."})
    # The PPO objective
    kl_coef: float = field(default=0.05, metadata={"help": "beta: weight of the per-token KL penalty "
                                                           "log pi(a|s) - log pi_ref(a|s) in the reward (initial value "
                                                           "when adaptive_kl_ctrl)."})
    adaptive_kl_ctrl: bool = field(default=False, metadata={"help": "Adapt beta towards kl_target (Ziegler et al., "
                                                                    "2019)."})
    kl_target: float = field(default=6.0, metadata={"help": "Target KL per response (sum over its tokens) of the "
                                                            "adaptive controller."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon (responses) of the adaptive controller."})
    cliprange: float = field(default=0.2, metadata={"help": "epsilon of the clipped surrogate: the ratio is "
                                                            "clipped to [1 - cliprange, 1 + cliprange]."})
    cliprange_value: float = field(default=0.2, metadata={"help": "How far a new value may move from the "
                                                                  "rollout's value before the value loss clips it."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "lambda of GAE."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Normalise each rollout's advantages to mean 0, "
                                                                    "variance 1 over its tokens."})
    missing_eos_penalty: float | None = field(default=None, metadata={"help": "Subtracted from the score of a "
                                                                              "response that hit response_length "
                                                                              "without an end-of-sequence token."})
    # Generation
    response_length: int = field(default=64, metadata={"help": "Most new tokens per response; prompt tokens + "
                                                               "response_length must fit model.max_seq_length."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature; log-probabilities are taken "
                                                              "under the same softmax(logits / temperature)."})
    # Logging and saving
    logging_steps: int = field(default=1, metadata={"help": "Log (metrics.jsonl and a progress line) every N steps."})
    save_steps: int = field(default=20, metadata={"help": "Save a resumable checkpoint every N steps."})
    save_total_limit: int = field(default=2, metadata={"help": "Checkpoints kept (the newest)."})
    # Set by the kit
    bf16: bool = field(default=False, metadata={"help": "Set by the kit: bfloat16 autocast on a GPU that has it."})
    fp16: bool = field(default=False, metadata={"help": "Set by the kit: float16 autocast on other GPUs."})
    use_cpu: bool = field(default=False, metadata={"help": "Set by the kit: True without a GPU."})
    output_dir: str = field(default="", metadata={"help": "Set by the kit: <stage>/checkpoints."})
    seed: int = field(default=42, metadata={"help": "Set by the kit: the recipe's seed."})
    data_seed: int = field(default=42, metadata={"help": "Set by the kit: the recipe's seed."})

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), str(f.type))
        positive = ("per_device_train_batch_size", "num_mini_batches", "num_ppo_epochs", "response_length",
                    "logging_steps", "save_steps", "save_total_limit", "kl_horizon")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("learning_rate", "temperature", "cliprange", "cliprange_value", "kl_target", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"train.{name} must be above 0, got {getattr(self, name)}")
        for name in ("kl_coef", "vf_coef", "weight_decay", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must not be negative, got {getattr(self, name)}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"train.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.cliprange >= 1:
            raise ValueError(f"train.cliprange must be below 1 (the ratio is clipped to [1 - eps, 1 + eps]), "
                             f"got {self.cliprange}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"train.max_steps must be a positive number of PPO steps, or -1, got {self.max_steps}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ValueError(f"train.num_train_epochs must be above 0, got {self.num_train_epochs}")
        if self.per_device_train_batch_size % self.num_mini_batches:
            raise ValueError(f"train.num_mini_batches ({self.num_mini_batches}) must divide "
                             f"train.per_device_train_batch_size ({self.per_device_train_batch_size})")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"train.lr_scheduler_type must be one of {', '.join(SCHEDULERS)}, "
                             f"got {self.lr_scheduler_type!r}{did_you_mean(self.lr_scheduler_type, SCHEDULERS)}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"train.optim must be one of {', '.join(OPTIMIZERS)}, got {self.optim!r}")

    @property
    def mini_batch_size(self) -> int:
        return self.per_device_train_batch_size // self.num_mini_batches


SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit")
TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_type(name: str, value: Any, annotation: str) -> None:
    optional = annotation.endswith("| None")
    if optional and value is None:
        return
    expected = TYPES[annotation.replace("| None", "").strip()]
    if (isinstance(value, bool) and bool not in expected) or not isinstance(value, expected):
        kind = annotation.replace("| None", "or null").replace("float", "a number").replace("int", "an integer")
        raise ValueError(f"train.{name} must be {kind}, got {value!r}")


def stage_defaults(ctx: StageContext, on_gpu: bool | None = None) -> dict[str, Any]:
    """PPOConfig's defaults are the kit's PPO defaults; they win over the kit's trainer-wide ones of the same name
    (precision and optimizer stay per device)."""
    device_keys = {"bf16", "fp16", "use_cpu", "optim", "output_dir", "seed", "data_seed"}
    return {f.name: f.default for f in dataclasses.fields(PPOConfig) if f.name not in device_keys}


def make_config(ctx: StageContext) -> PPOConfig:
    config = build_config(PPOConfig, stage_defaults=stage_defaults(ctx), train=ctx.stage.get("train", {}),
                          where=ctx.where, output_dir=ctx.dir.checkpoints, seed=ctx.seed,
                          on_gpu=cuda_available())
    limit = ctx.model["max_seq_length"]
    if config.response_length >= limit:
        raise KitError(f"{ctx.where}: train.response_length {config.response_length} does not fit "
                       f"model.max_seq_length {limit} (it holds the prompt and the response); lower "
                       f"response_length or raise max_seq_length")
    return config


# --- references, rewards and data -------------------------------------------------------------------------------

def reward_model_spec(ctx: StageContext) -> dict[str, Any] | None:
    """`reward_model:` as the recipe validated it: {stage or path, weight} (kitcli/schema.py)."""
    spec = ctx.stage.get("reward_model")
    if spec is None:
        return None
    return {"weight": float(spec["weight"]), **({"stage": spec["stage"]} if spec.get("stage") else
                                                {"path": Path(spec["path"])})}


def load_reward_functions(ctx: StageContext):
    from rewards.registry import load_rewards

    return load_rewards(ctx.stage.get("rewards") or [], ctx.recipe.base_dir, f"{ctx.where}: rewards")


def load_rows(ctx: StageContext, key: str = "data") -> list[dict[str, Any]]:
    spec = ctx.stage[key]
    rows = read_rows(spec, f"{ctx.where}: {key}")
    require_columns(rows, [["prompt"]], f"{ctx.where}: {key}", spec["path"])
    for index, row in enumerate(rows):
        if row.get("prompt") in (None, "", []):
            raise KitError(f"{ctx.where}: row {index} of '{spec['path']}' has an empty prompt; every row needs a "
                           f"prompt (a string or a list of messages)")
    return rows


def check_reward_columns(ctx: StageContext, rewards, rows: list[dict[str, Any]], key: str = "data") -> None:
    """A reward's required keyword arguments (e.g. exact_match's `answer`) must be dataset columns."""
    for reward in rewards:
        try:
            parameters = inspect.signature(reward.fn).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in parameters:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty or p.name in REWARD_ARGS:
                continue
            if p.name not in rows[0]:
                raise KitError(f"{ctx.where}: reward '{reward.name}' needs the column '{p.name}', which "
                               f"'{ctx.stage[key]['path']}' does not have (columns: {', '.join(sorted(rows[0]))}); "
                               f"add it or map one with columns:")


def check_reward_tokenizer(ctx: StageContext, policy_tokenizer, reward_tokenizer, conversational: bool,
                           name: str) -> None:
    """Responses reach a reward model as text, re-tokenized by its own tokenizer through its chat template;
    a different tokenizer without a chat template cannot be given a conversation."""
    same = policy_tokenizer.get_vocab() == reward_tokenizer.get_vocab()
    if not same and conversational and not getattr(reward_tokenizer, "chat_template", None):
        raise KitError(f"{ctx.where}: reward model {name} has a different tokenizer from the policy's and no chat "
                       f"template, so the conversations cannot be re-tokenized for it; use a reward model trained "
                       f"on this policy's base, or one whose tokenizer has a chat template")


def describe(ctx: StageContext) -> dict[str, Any]:
    from kitcli.backend import choose_backend, prepare_backend

    prepare_backend(choose_backend(ctx.model["backend"]))
    rewards = load_reward_functions(ctx)
    config = make_config(ctx)
    local = Path(ctx.stage["data"]["path"]).is_file()
    rows: Any = "hub dataset, read when the stage runs"
    if local:
        loaded_rows = load_rows(ctx)
        check_reward_columns(ctx, rewards, loaded_rows)
        rows = len(loaded_rows)
        if rows < config.per_device_train_batch_size:
            raise KitError(f"{ctx.where}: data has {rows} prompts, fewer than train.per_device_train_batch_size "
                           f"{config.per_device_train_batch_size}; lower it or give more prompts")
    if "eval_data" in ctx.stage and Path(ctx.stage["eval_data"]["path"]).is_file():
        check_reward_columns(ctx, rewards, load_rows(ctx, "eval_data"), "eval_data")
    spec = reward_model_spec(ctx)
    if spec is not None and "path" in spec and local:
        policy_dir = Path(resolve_model_path(ctx.model["name"], ctx.seed))
        if policy_dir.is_dir():
            from transformers import AutoTokenizer

            check_reward_tokenizer(ctx, AutoTokenizer.from_pretrained(str(policy_dir)),
                                   AutoTokenizer.from_pretrained(str(spec["path"])),
                                   isinstance(load_rows(ctx)[0]["prompt"], list), f"'{spec['path']}'")
    listed = [f"{r.name} (weight {r.weight:g}, {r.source})" for r in rewards]
    if spec is not None:
        listed.append(f"reward model {spec.get('stage') or spec.get('path')} (weight {spec['weight']:g})")
    return {"init": ctx.stage.get("init") or "base model", "data": ctx.stage["data"]["path"], "rows": rows,
            "eval_data": ctx.stage["eval_data"]["path"] if "eval_data" in ctx.stage else None,
            "rewards": listed, "PPOConfig": dataclasses.asdict(config)}


# --- models on one base -----------------------------------------------------------------------------------------

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


def adapter_state(model, name: str) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}


def copy_adapter(model, source: str, name: str) -> None:
    """A new adapter `name` with the same settings and weights as `source`."""
    import copy

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
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def reward_shares_base(ctx: StageContext, rm_dir: Path, policy_quantized: bool) -> bool:
    """A reward stage's adapter can sit on the policy's base when it was trained on that base in the same form.
    Reward models train as sequence classification, which is 4-bit only on a GPU (Unsloth's CPU loader cannot
    do it: backend.load_reward_model), so on a CPU a 4-bit policy base gets the merged reward model instead."""
    if not (StageDir(rm_dir).adapter / "adapter_model.safetensors").is_file():
        return False  # fully fine-tuned reward model: only the merged model exists
    reward_quantized = cuda_available() and ctx.model["load_in_4bit"]
    return reward_quantized == policy_quantized


def setup_models(ctx: StageContext, config: PPOConfig) -> PPOModels:
    """Load the base once with the policy adapter and add the reference, critic and reward model around it."""
    import torch

    from kitcli.backend import attach_reward_adapter, load_seq_cls_scorer

    loaded = load_stage_policy(ctx.model, lora=ctx.recipe.data["lora"], seed=ctx.seed, init_from=ctx.init_dir,
                               log=ctx.log)
    model, tokenizer = loaded.model, loaded.tokenizer
    if not hasattr(model, "peft_config"):
        raise KitError(f"{ctx.where}: PPO trains LoRA adapters on one shared base; full fine-tuning (lora: false, or "
                       f"an init stage saved as a full model) is not supported")
    form = f"{'4-bit' if loaded.load_in_4bit else loaded.dtype} base"
    layout = [f"policy: adapter '{POLICY}' (trained)"]
    init = ctx.stage.get("init")
    if init is not None:
        copy_adapter(model, POLICY, REFERENCE)
        reference = REFERENCE
        layout.append(f"reference: adapter '{REFERENCE}', a frozen copy of stage '{init}''s adapter")
    else:
        reference = None
        layout.append("reference: the base with adapters disabled")
    copy_adapter(model, POLICY, CRITIC)
    hidden = model.get_base_model().config.get_text_config().hidden_size
    torch.manual_seed(ctx.seed)
    value_head = torch.nn.Linear(hidden, 1).to(model.device)
    torch.nn.init.normal_(value_head.weight, std=1.0 / math.sqrt(hidden + 1))
    torch.nn.init.zeros_(value_head.bias)
    layout.append(f"critic: adapter '{CRITIC}' (a copy of the policy's starting weights) + value head "
                  f"Linear({hidden}, 1) (trained)")
    copies = 1
    reward_model = None
    spec = reward_model_spec(ctx)
    if spec is not None:
        if "stage" in spec and reward_shares_base(ctx, ctx.outputs[spec["stage"]], loaded.load_in_4bit):
            head = attach_reward_adapter(model, ctx.output(spec["stage"]).adapter, REWARD)
            reward_model = RewardModel(tokenizer=tokenizer, name=spec["stage"], weight=spec["weight"], head=head,
                                       adapter=REWARD)
            layout.append(f"reward model: adapter '{REWARD}' + score head of stage '{spec['stage']}' (frozen)")
        else:
            path = ctx.output(spec["stage"]).merged if "stage" in spec else spec["path"]
            if not (path / "config.json").is_file():
                raise KitError(f"{ctx.where}: reward stage '{spec['stage']}' left no merged model in {path}; re-run "
                               f"it with --force")
            scorer, scorer_tokenizer = load_seq_cls_scorer(path, dtype=ctx.model["dtype"], log=ctx.log)
            name = spec.get("stage") or str(path)
            reward_model = RewardModel(tokenizer=scorer_tokenizer, name=name, weight=spec["weight"], model=scorer)
            copies = 2
            adapter = "stage" in spec and ctx.output(spec["stage"]).adapter.is_dir()
            why = "its adapter was trained on the base in another precision" if adapter else "its own weights"
            layout.append(f"reward model: {path} loaded separately ({why}; a second copy of base weights)")
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
        check_reference(model, ctx.where)
    for line in models.layout:
        ctx.log(f"memory: {line}")
    return models


def check_reference(model, where: str) -> None:
    """The reference adapter must be exactly the policy's starting weights (it is made before any step) and frozen."""
    import torch

    policy, reference = adapter_state(model, POLICY), adapter_state(model, REFERENCE)
    frozen = not any(p.requires_grad for p in adapter_parameters(model, REFERENCE))
    if policy.keys() != reference.keys() or not frozen or \
            not all(torch.equal(policy[k], reference[k]) for k in policy):
        raise KitError(f"{where}: the PPO reference adapter is not a frozen copy of the starting policy; this "
                       f"TRL/PEFT version copies adapters differently than kit expects")


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
    from kitcli.ppo_math import entropy_from_logits, token_logprobs

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


# --- rewards ----------------------------------------------------------------------------------------------------

def prompt_texts(tokenizer, prompts: list[Any]) -> list[str]:
    from kitcli.evaluate import prompt_text

    return [prompt_text(tokenizer, p) for p in prompts]


def reward_model_inputs(reward_model: RewardModel, prompts: list[Any], completions: list[str]):
    """The conversation (or text) as the reward stage saw it: TRL's RewardTrainer applies the chat template to
    prompt + assistant turn; plain text gets the end-of-sequence token appended."""
    tokenizer = reward_model.tokenizer
    sequences = []
    for prompt, completion in zip(prompts, completions):
        if isinstance(prompt, list):
            ids = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": completion}],
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(str(prompt) + completion + tokenizer.eos_token)["input_ids"]  # as TRL: `text=` call
        sequences.append(list(ids))
    return sequences


def score_with_reward_model(models: PPOModels, prompts: list[Any], completions: list[str], batch_size: int):
    import torch

    reward_model = models.reward_model
    sequences = reward_model_inputs(reward_model, prompts, completions)
    pad = reward_model.tokenizer.pad_token_id
    device = models.model.device if reward_model.adapter else reward_model.model.device
    scores = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start:start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=device)
        with torch.no_grad():
            if reward_model.adapter:
                use_adapter(models, reward_model.adapter)
                hidden = hidden_states(models, ids, mask)
                last = hidden[torch.arange(len(chunk), device=device), mask.sum(1) - 1]
                scores.append(reward_model.head(last.to(reward_model.head.weight.dtype)).squeeze(-1).float())
            else:
                scores.append(reward_model.model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    use_adapter(models, POLICY)
    return torch.cat(scores)


def score_responses(models: PPOModels, reward_fns, rewards, rows: list[dict[str, Any]], completions: list[str],
                    batch_size: int) -> tuple[Any, dict[str, float]]:
    """score = sum of weight * reward over the reward functions and the reward model (None counts as 0)."""
    import torch

    prompts = [row["prompt"] for row in rows]
    conversational = isinstance(prompts[0], list)
    shown = [[{"role": "assistant", "content": c}] for c in completions] if conversational else completions
    columns = {k: [row.get(k) for row in rows] for k in rows[0] if k != "prompt"}
    total = torch.zeros(len(rows))
    metrics: dict[str, float] = {}
    for fn, reward in zip(reward_fns, rewards):
        values = fn(prompts=prompts, completions=shown, **columns)
        scored = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
        metrics[f"rewards/{reward.name}/mean"] = float(torch.nanmean(scored)) if (~scored.isnan()).any() else math.nan
        total += reward.weight * torch.nan_to_num(scored, nan=0.0)
    if models.reward_model is not None:
        scored = score_with_reward_model(models, prompts, completions, batch_size).cpu()
        metrics["rewards/reward_model/mean"] = float(scored.mean())
        total += models.reward_model.weight * scored
    return total, metrics


# --- rollout ----------------------------------------------------------------------------------------------------

@dataclass
class Rollout:
    input_ids: Any  # [B, P + R]: left-padded prompts, then the responses (padding after the end)
    attention_mask: Any
    prompt_length: int
    mask: Any  # [B, R] 1 for response tokens up to and including the end-of-sequence token
    logprobs: Any
    ref_logprobs: Any
    values: Any
    scores: Any
    entropy: Any
    completions: list[str]
    has_eos: Any


def generate_responses(models: PPOModels, rows: list[dict[str, Any]], config: PPOConfig):
    """Sample one response per prompt from the policy: full softmax at `temperature` (no top-k / top-p)."""
    import torch

    tokenizer = models.tokenizer
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        batch = tokenizer(prompt_texts(tokenizer, [r["prompt"] for r in rows]), return_tensors="pt", padding=True,
                          add_special_tokens=False).to(models.model.device)
    finally:
        tokenizer.padding_side = padding_side
    use_adapter(models, POLICY)
    models.model.eval()
    with torch.no_grad():
        output = models.model.generate(
            **batch, max_new_tokens=config.response_length, do_sample=True, temperature=config.temperature,
            top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True)
    prompt_length = batch["input_ids"].shape[1]
    responses = output[:, prompt_length:]
    is_eos = responses == tokenizer.eos_token_id
    has_eos = is_eos.any(1)
    first_eos = torch.where(has_eos, is_eos.float().argmax(1), torch.full_like(has_eos, responses.shape[1] - 1,
                                                                               dtype=torch.long))
    mask = (torch.arange(responses.shape[1], device=responses.device)[None, :] <= first_eos[:, None]).long()
    attention_mask = torch.cat([batch["attention_mask"], mask], dim=1)
    texts = [tokenizer.decode(r[: int(m.sum())], skip_special_tokens=True) for r, m in zip(responses, mask)]
    return output, attention_mask, prompt_length, mask.float(), texts, has_eos


def make_rollout(models: PPOModels, rows, config: PPOConfig, reward_fns, rewards) -> tuple[Rollout, dict]:
    import torch

    ids, attention_mask, prompt_length, mask, texts, has_eos = generate_responses(models, rows, config)
    scores, metrics = score_responses(models, reward_fns, rewards, rows, texts, config.mini_batch_size)
    scores = scores.to(ids.device)
    if config.missing_eos_penalty is not None:
        scores = scores - config.missing_eos_penalty * (~has_eos).float()
    chunks = {"logprobs": [], "entropy": [], "ref": [], "values": []}
    with torch.no_grad(), autocast(config, ids.device):
        for start in range(0, len(rows), config.mini_batch_size):
            part = slice(start, start + config.mini_batch_size)
            args = (ids[part], attention_mask[part], prompt_length)
            logprobs, entropy = policy_logprobs(models, *args, config.temperature, with_entropy=True)
            chunks["logprobs"].append(logprobs)
            chunks["entropy"].append(entropy)
            chunks["ref"].append(reference_logprobs(models, *args, config.temperature))
            use_adapter(models, CRITIC)
            chunks["values"].append(response_values(models, *args).float())
    use_adapter(models, POLICY)
    rollout = Rollout(input_ids=ids, attention_mask=attention_mask, prompt_length=prompt_length, mask=mask,
                      logprobs=torch.cat(chunks["logprobs"]), ref_logprobs=torch.cat(chunks["ref"]),
                      values=torch.cat(chunks["values"]) * mask, scores=scores, entropy=torch.cat(chunks["entropy"]),
                      completions=texts, has_eos=has_eos)
    return rollout, metrics


# --- one PPO step -----------------------------------------------------------------------------------------------

def autocast(config: PPOConfig, device):
    """The mixed precision of every policy, reference and critic forward (rollout and update alike), so the first
    update's ratio is exactly 1 and the value clip is centred on values of the same precision."""
    import contextlib

    import torch

    if config.bf16 or config.fp16:
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16 if config.bf16 else torch.float16)
    return contextlib.nullcontext()


def ppo_step(models: PPOModels, rollout: Rollout, config: PPOConfig, kl_ctl, optimizer, scheduler, scaler,
             step: int) -> dict[str, float]:
    """KL-shaped rewards, GAE, then num_ppo_epochs x num_mini_batches updates of the policy and the critic."""
    import torch

    from kitcli.ppo_math import (clipped_surrogate_loss, clipped_value_loss, explained_variance, gae,
                                 kl_shaped_rewards, masked_mean, masked_whiten)

    mask = rollout.mask
    rewards, kl = kl_shaped_rewards(rollout.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_ctl.value)
    advantages, returns = gae(rewards, rollout.values, mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    stats: dict[str, list[float]] = {k: [] for k in ("policy", "value", "clipfrac", "approxkl", "vclipfrac", "ratio")}
    generator = torch.Generator().manual_seed(config.seed * 100003 + step)
    args = (rollout.input_ids, rollout.attention_mask)
    models.model.train()
    for _ in range(config.num_ppo_epochs):
        order = torch.randperm(len(mask), generator=generator).to(mask.device)
        for start in range(0, len(mask), config.mini_batch_size):
            mb = order[start:start + config.mini_batch_size]
            ids, attention = args[0][mb], args[1][mb]
            with autocast(config, ids.device):
                use_adapter(models, POLICY)
                logprobs = policy_logprobs(models, ids, attention, rollout.prompt_length, config.temperature)
                policy = clipped_surrogate_loss(logprobs, rollout.logprobs[mb], advantages[mb], mask[mb],
                                                config.cliprange)
            scaler.scale(policy.loss).backward()
            with autocast(config, ids.device):
                use_adapter(models, CRITIC)
                values = response_values(models, ids, attention, rollout.prompt_length).float()
                value_loss, value_clipfrac = clipped_value_loss(values, rollout.values[mb], returns[mb], mask[mb],
                                                                config.cliprange_value)
            scaler.scale(config.vf_coef * value_loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(models.trainable, config.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
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
    metrics = {
        "objective/scores": float(rollout.scores.mean()),
        "objective/kl": float(kl_per_response.mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((rollout.scores + non_score).mean()),
        "policy/entropy": float(masked_mean(rollout.entropy, mask)),
        "loss/policy": sum(stats["policy"]) / len(stats["policy"]),
        "loss/value": sum(stats["value"]) / len(stats["value"]),
        "policy/clipfrac": sum(stats["clipfrac"]) / len(stats["clipfrac"]),
        "policy/approxkl": sum(stats["approxkl"]) / len(stats["approxkl"]),
        "policy/ratio": sum(stats["ratio"]) / len(stats["ratio"]),
        "val/clipfrac": sum(stats["vclipfrac"]) / len(stats["vclipfrac"]),
        "val/explained_variance": explained_variance(rollout.values, returns, mask),
        "val/mean": float(masked_mean(rollout.values, mask)),
        "kl_coef": kl_ctl.value,
        "response_length": float(mask.sum(1).mean()),
        "eos_fraction": float(rollout.has_eos.float().mean()),
        "learning_rate": scheduler.get_last_lr()[0],
    }
    kl_ctl.update(metrics["objective/kl"], len(mask))
    return metrics


# --- optimizer, checkpoints -------------------------------------------------------------------------------------

def make_optimizer(models: PPOModels, config: PPOConfig, total_updates: int):
    import torch
    from transformers import get_scheduler

    kwargs = {"lr": config.learning_rate, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": config.weight_decay}
    if config.optim == "adamw_8bit" and cuda_available():
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(models.trainable, **kwargs)
    else:
        optimizer = torch.optim.AdamW(models.trainable, fused=config.optim == "adamw_torch_fused" or None, **kwargs)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=config.warmup_steps,
                              num_training_steps=total_updates)
    scaler = torch.amp.GradScaler("cuda", enabled=config.fp16 and cuda_available())
    return optimizer, scheduler, scaler


def save_safetensors(tensors: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def save_checkpoint(ctx: StageContext, models: PPOModels, optimizer, scheduler, kl_ctl, step: int,
                    config: PPOConfig) -> Path:
    """checkpoints/checkpoint-N: both adapters, the value head, optimizer + scheduler, the KL coefficient and the
    RNG states; written under a temporary name and renamed, then older ones beyond save_total_limit removed."""
    import numpy as np
    import torch

    root = ctx.dir.checkpoints
    final = root / f"checkpoint-{step}"
    staging = root / f"checkpoint-{step}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_safetensors(adapter_state(models.model, POLICY), staging / "policy_adapter.safetensors")
    save_safetensors(adapter_state(models.model, CRITIC), staging / "critic_adapter.safetensors")
    save_safetensors(models.value_head.state_dict(), staging / "value_head.safetensors")
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, staging / "optimizer.pt")
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, staging / "rng.pt")
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step, "kl_coef": kl_ctl.value}))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    kept = sorted((p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                  key=lambda p: int(p.name.split("-")[-1]))
    for old in kept[: -config.save_total_limit]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(checkpoint: Path, models: PPOModels, optimizer, scheduler, kl_ctl) -> int:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from kitcli.checkpoints import load_into

    where = f"stage checkpoint {checkpoint}"
    load_into(models.model, load_file(str(checkpoint / "policy_adapter.safetensors")), POLICY, where)
    load_into(models.model, load_file(str(checkpoint / "critic_adapter.safetensors")), CRITIC, where)
    models.value_head.load_state_dict(load_file(str(checkpoint / "value_head.safetensors")))
    state = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = torch.load(checkpoint / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    kl_ctl.value = saved["kl_coef"]
    return int(saved["global_step"])


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


# --- the loop ---------------------------------------------------------------------------------------------------

def check_prompt_lengths(ctx: StageContext, tokenizer, rows: list[dict[str, Any]], config: PPOConfig,
                         key: str = "data") -> None:
    limit = ctx.model["max_seq_length"] - config.response_length
    for index, text in enumerate(prompt_texts(tokenizer, [r["prompt"] for r in rows])):
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length > limit:
            raise KitError(f"{ctx.where}: the prompt of row {index} of '{ctx.stage[key]['path']}' is {length} tokens; "
                           f"with train.response_length {config.response_length} it exceeds model.max_seq_length "
                           f"{ctx.model['max_seq_length']}; raise max_seq_length or lower response_length")


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


def evaluate_held_out(models: PPOModels, rows, reward_fns, rewards, config: PPOConfig) -> dict[str, float]:
    """Greedy responses to the held-out prompts: mean score, and exact match where rows have an `answer`."""
    from kitcli.evaluate import exact_match, generate

    use_adapter(models, POLICY)
    completions = generate(models.model, models.tokenizer, [r["prompt"] for r in rows],
                           max_new_tokens=config.response_length, batch_size=max(config.mini_batch_size, 16),
                           temperature=0.0, seed=config.seed)
    scores, per_source = score_responses(models, reward_fns, rewards, rows, completions, config.mini_batch_size)
    figures = {"eval/score": float(scores.mean()), **{f"eval/{k}": v for k, v in per_source.items()}}
    if "answer" in rows[0]:
        figures["eval/exact_match"] = sum(exact_match(c, r["answer"]) for c, r in zip(completions, rows)) / len(rows)
    return figures


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in rows[0]]
    out = {}
    for key in keys:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


def rollout_samples(rows, rollout: Rollout) -> list[dict[str, Any]]:
    """A few (prompt, response, score) triples for the dashboard and completions.jsonl."""
    samples = []
    for row, completion, score in list(zip(rows, rollout.completions, rollout.scores.tolist()))[:3]:
        prompt = row["prompt"][-1]["content"] if isinstance(row["prompt"], list) else str(row["prompt"])
        samples.append({"prompt": prompt, "completion": completion, "reward": score})
    return samples


def train(ctx: StageContext, config: PPOConfig, models: PPOModels, rows, reward_fns, rewards,
          eval_rows=None, resume: Path | None = None) -> dict[str, Any]:
    """The PPO loop from the last checkpoint (if any) to the last step, or until a stop is requested (then a
    checkpoint is saved); returns figures for the summary."""
    from transformers import set_seed

    from kitcli.ppo_math import KLController

    steps = total_steps(config, len(rows))
    updates = steps * config.num_ppo_epochs * config.num_mini_batches
    optimizer, scheduler, scaler = make_optimizer(models, config, updates)
    kl_ctl = KLController(config.kl_coef, config.adaptive_kl_ctrl, config.kl_target, config.kl_horizon)
    set_seed(config.seed)
    metrics_path = ctx.dir.metrics
    step = 0
    if resume is not None:
        step = load_checkpoint(resume, models, optimizer, scheduler, kl_ctl)
    else:
        metrics_path.unlink(missing_ok=True)
    dashboard = StageDashboard(ctx.name, metrics_path, ctx.console, stage_type="ppo")
    dashboard.begin(steps, step)
    before = after = None
    pending: list[dict[str, float]] = []
    seconds: list[float] = []
    try:
        if resume is None and eval_rows:
            before = evaluate_held_out(models, eval_rows, reward_fns, rewards, config)
            dashboard.log(0, before)
        while step < steps:
            started = time.time()
            batch = batch_rows(rows, step, config)
            rollout, reward_metrics = make_rollout(models, batch, config, reward_fns, rewards)
            row = {**ppo_step(models, rollout, config, kl_ctl, optimizer, scheduler, scaler, step), **reward_metrics}
            step += 1
            seconds.append(time.time() - started)
            row["seconds_per_step"] = seconds[-1]
            pending.append(row)
            dashboard.advance(step)
            if step % config.logging_steps == 0 or step == steps:
                logged = {**mean_rows(pending), "episode": step * config.per_device_train_batch_size}
                dashboard.log(step, logged, samples=rollout_samples(batch, rollout))
                pending = []
            if interrupt.requested() or (step % config.save_steps == 0 and step < steps):
                interrupt.check_free_disk(ctx.dir.checkpoints, interrupt.checkpoint_bytes(models.model),
                                          f"checkpoint-{step}")
                save_checkpoint(ctx, models, optimizer, scheduler, kl_ctl, step, config)
                if interrupt.requested():
                    break
        if eval_rows and not interrupt.requested():
            after = evaluate_held_out(models, eval_rows, reward_fns, rewards, config)
            dashboard.log(step, after)
    finally:
        dashboard.end(step)
    if before is None and eval_rows:
        before = next((r for r in read_metrics(metrics_path) if r.get("step") == 0 and "eval/score" in r), None)
    return {"steps": step, "resumed_from": resume.name if resume else None, "eval_before": before,
            "eval_after": after, "seconds_per_step": sum(seconds) / len(seconds) if seconds else None}


def run(ctx: StageContext) -> dict[str, Any]:
    from rewards.guard import RewardStats, guard_rewards

    config = make_config(ctx)
    rows = load_rows(ctx)
    rewards = load_reward_functions(ctx)
    check_reward_columns(ctx, rewards, rows)
    eval_rows = load_rows(ctx, "eval_data") if "eval_data" in ctx.stage else None
    if eval_rows:
        check_reward_columns(ctx, rewards, eval_rows, "eval_data")
    if len(rows) < config.per_device_train_batch_size:
        raise KitError(f"{ctx.where}: data has {len(rows)} prompts, fewer than train.per_device_train_batch_size "
                       f"{config.per_device_train_batch_size}; lower it or give more prompts")
    resume = resume_checkpoint(ctx, ctx.dir.metrics, dataclasses.asdict(config))
    models = setup_models(ctx, config)
    if models.reward_model is not None:
        check_reward_tokenizer(ctx, models.tokenizer, models.reward_model.tokenizer,
                               isinstance(rows[0]["prompt"], list), f"'{models.reward_model.name}'")
    check_prompt_lengths(ctx, models.tokenizer, rows, config)
    if eval_rows:
        check_prompt_lengths(ctx, models.tokenizer, eval_rows, config, "eval_data")
    reward_fns = guard_rewards(rewards, RewardStats())
    result = train(ctx, config, models, rows, reward_fns, rewards, eval_rows, resume)
    if interrupt.requested():
        return result  # the runner reports the stop; the checkpoint resumes it
    save_critic(models, ctx.stage_dir)
    for name in list(models.model.peft_config):
        if name != POLICY:
            models.model.delete_adapter(name)
    save_model(models.model, models.tokenizer, ctx.stage_dir)
    logged = [r for r in read_metrics(ctx.dir.metrics) if "objective/scores" in r]
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


class PPOSection(RewardedSection):
    """RLHF with PPO (the kit's own loop): a critic with GAE, a per-token KL penalty, clipped surrogate."""

    type: Literal["ppo"]
    eval_data: DataSpec | None = Field(None, description="Held-out prompts scored before and after training.")
    config: ClassVar[str] = "PPOConfig"


SPEC = StageSpec(
    type="ppo", module=__name__, section=PPOSection,
    summary="RLHF with PPO, written in kit: per-token KL to the frozen reference, a critic with GAE",
    output="policy", init_from=("policy",), rl=True,
    metrics=(("objective/scores", "score"), ("rewards/*/mean", "*"), ("objective/kl", "kl"),
             ("objective/non_score_reward", "non_score"), ("loss/policy", "pg_loss"), ("loss/value", "vf_loss"),
             ("policy/entropy", "entropy"), ("policy/clipfrac", "clipfrac"), ("policy/approxkl", "approxkl"),
             ("val/explained_variance", "explained_var"), ("eval/score", "eval_score"),
             ("eval/exact_match", "eval_exact_match")),
    panels=(("score", "mean score", ("objective/scores", "rewards/*/mean", "objective/rlhf_reward")),
            ("KL to the reference", "KL", ("objective/kl", "policy/approxkl")),
            ("losses", "loss", ("loss/policy", "loss/value")),
            ("entropy", "nats per token", ("policy/entropy",)),
            ("clip fractions", "fraction", ("policy/clipfrac", "val/clipfrac")),
            ("value function", "explained variance", ("val/explained_variance",)),
            ("held-out", "score", ("eval/score", "eval/exact_match"))),
    launcher=None, launcher_refusal="kit's PPO loop is a single-process loop (no DDP); run PPO recipes without "
                                    "--launcher",
    memory_settings=("per_device_train_batch_size", "num_mini_batches", "response_length"),
    defaults=stage_defaults, checkpoint_files=("policy_adapter.safetensors", "critic_adapter.safetensors",
                                               "value_head.safetensors", "optimizer.pt", "rng.pt",
                                               "trainer_state.json"), rows=load_rows)
