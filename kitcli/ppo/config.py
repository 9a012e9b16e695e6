"""PPOConfig: the settings of a PPO stage (the recipe's `train:` block), named as in TRL's (old) PPOConfig.

Each field's type and range is checked for every stage by kitcli/recipe/config_fields.py (with the PPO section's
train_ranges and train_choices, kitcli/stages/ppo.py) before
anything loads; `__post_init__` keeps only the rules between fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Set per device by the kit (kitcli/training/trl_config.py), not PPO defaults.
DEVICE_KEYS = {"bf16", "fp16", "use_cpu", "optim", "output_dir", "seed", "data_seed"}


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
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the gradient norm of all trained weights "
                                                                "(0: no clipping, as in the other stages)."})
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
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ValueError(f"train.num_train_epochs must be above 0, got {self.num_train_epochs}")
        if self.num_mini_batches < 1 or self.per_device_train_batch_size % self.num_mini_batches:
            raise ValueError(f"train.num_mini_batches ({self.num_mini_batches}) must divide "
                             f"train.per_device_train_batch_size ({self.per_device_train_batch_size})")

    @property
    def mini_batch_size(self) -> int:
        return self.per_device_train_batch_size // self.num_mini_batches

    @property
    def mixed_precision(self) -> str:
        """accelerate's name for the autocast of every forward: bf16, fp16 or no."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "no"


def ppo_defaults() -> dict[str, Any]:
    """PPOConfig's defaults are the kit's PPO defaults; they win over the kit's trainer-wide ones of the same name
    (precision, optimizer and the values the kit sets stay per device and run)."""
    return {f.name: f.default for f in dataclasses.fields(PPOConfig) if f.name not in DEVICE_KEYS}
