"""kit: single-GPU LoRA post-training recipes (SFT, reward model, DPO, GRPO, GSPO, PPO) on Unsloth and TRL."""

__version__ = "0.1.0"
