"""What the sampling stages (GRPO, GSPO, RLOO: kitcli/stages/grpo.py builds all three) share in their sections and
StageSpecs: the kit's ranges and choices for their config fields, how they are shown, what decides their memory."""

from __future__ import annotations

from kitcli.recipe.config_fields import AT_LEAST_ONE, FRACTION, NOT_NEGATIVE, POSITIVE, TRAINING_RANGES, Range
from kitcli.recipe.stage_spec import Display, Memory

# The kit's ranges and choices for the sampling stages' config fields (GRPOConfig, RLOOConfig), which TRL neither
# declares nor checks (a value outside them fails deep inside the trainer, or trains nothing).
SAMPLING_RANGES: dict[str, Range] = {
    **TRAINING_RANGES, "max_completion_length": AT_LEAST_ONE, "num_generations": Range(2),
    "generation_batch_size": AT_LEAST_ONE, "steps_per_generation": AT_LEAST_ONE, "num_iterations": AT_LEAST_ONE,
    "temperature": POSITIVE, "top_p": Range(0, True, 1), "top_k": NOT_NEGATIVE, "min_p": FRACTION,
    "repetition_penalty": POSITIVE, "epsilon": POSITIVE, "epsilon_high": POSITIVE, "beta": NOT_NEGATIVE,
    "delta": POSITIVE, "top_entropy_quantile": Range(0, True, 1), "sapo_temperature_pos": POSITIVE,
    "sapo_temperature_neg": POSITIVE, "vespo_k_pos": NOT_NEGATIVE, "vespo_k_neg": NOT_NEGATIVE,
    "vespo_lambda_pos": POSITIVE, "vespo_lambda_neg": POSITIVE}
SAMPLING_CHOICES: dict[str, tuple] = {
    "loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
    "scale_rewards": ("group", "batch", "none", True, False), "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"), "vllm_mode": ("server", "colocate")}

# How the sampling stages (GRPO, GSPO, RLOO) are shown and what decides their memory.
RL_DISPLAY = Display(
    metrics=(("reward", "reward"), ("rewards/*/mean", "*"), ("reward_std", "reward_std"),
             ("frac_reward_zero_std", "zero_std_frac"), ("kl", "kl"), ("clip_ratio/region_mean", "clip_ratio"),
             ("completions/mean_length", "length"), ("entropy", "entropy"),
             ("tools/call_frequency", "tool_calls"), ("tools/failure_frequency", "tool_failures")),  # with tools:
    panels=(("reward", "mean reward", ("reward", "rewards/*/mean")),
            ("reward spread", "value", ("reward_std", "frac_reward_zero_std")),
            ("KL to the reference", "KL", ("kl",)),
            ("completion length", "tokens", ("completions/mean_length", "completions/min_length",
                                             "completions/max_length")),
            ("entropy", "nats per token", ("entropy",)),
            ("clipped importance ratios", "fraction of tokens", ("clip_ratio/region_mean", "clip_ratio/low_mean",
                                                                "clip_ratio/high_mean")),
            ("truncated completions (hit max_completion_length)", "fraction", ("completions/clipped_ratio",)),
            ("tool calls", "per completion; failed share", ("tools/call_frequency", "tools/failure_frequency")),
            ("loss", "loss", ("loss",))))
RL_MEMORY = Memory(settings=("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                             "generation_batch_size", "max_completion_length"), reference="beta")
