"""What a stage does, in the numbers that decide memory.

`stage_settings` resolves a stage's settings the way the stage resolves them on a GPU (kitcli/training/trl_config.py's
`build_config`): its trainer config's own defaults < `COMMON_DEFAULTS` < the GPU's device defaults < the stage type's
`defaults(ctx, on_gpu=True)` from the registry < the recipe's `train:`. What the stage type is (whether it generates
completions, has a critic, trains on preference pairs, trains a score head or only evaluates) comes from its
`StageSpec`; nothing here repeats a stage's default values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
# kitcli.training.trl_config.device_defaults(on_gpu=True) on a GPU with bfloat16, written out because `kit plan`
# imports no torch (tests/test_plan.py checks that the two agree)
GPU_DEVICE_DEFAULTS: dict[str, Any] = {"use_cpu": False, "bf16": True, "fp16": False, "optim": "adamw_8bit"}


@dataclass
class Settings:
    """One stage's memory-relevant settings. `stage_settings` sets every field from the recipe and the stage type;
    the defaults here describe one 16-bit-activation sequence at a time, for building an estimate by hand."""

    stage_type: str = "sft"
    backend: str = "unsloth"  # unsloth | transformers
    load_in_4bit: bool = True
    dtype_bytes: int = 2
    lora_r: int | None = 16
    lora_targets: list[str] | str = "all-linear"
    optim: str = "adamw_8bit"
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    seq_len: int = 1024  # max_length (sft/dpo/reward) or prompt + completion (RL)
    gradient_checkpointing: bool = True
    # RL and eval generation
    prompt_len: int = 0
    completion_len: int = 0
    num_generations: int = 0
    steps_per_generation: int = 1
    generation_batch_size: int | None = None
    beta: float = 0.0
    reward_model: bool = False
    critic: bool = False
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    eval_batch_size: int = 0
    tool_rounds: int = 0  # max_tool_calling_iterations of a stage with tools (0: no tools)
    frozen_model: str | None = None  # a frozen model beside the policy (a distillation teacher): its name or path

    @property
    def completions_at_once(self) -> int:
        """Completions one process generates in one call: TRL's local generation batch."""
        if self.generation_batch_size:
            return self.generation_batch_size
        return self.per_device_train_batch_size * self.steps_per_generation

    @property
    def checkpointing(self) -> str:
        if not self.gradient_checkpointing:
            return "off"
        return "offloaded" if self.backend == "unsloth" else "on"

    # What the stage type is, from its StageSpec

    @property
    def spec(self):
        from kitcli.recipe import stage_types

        return stage_types.spec(self.stage_type)

    @property
    def rl(self) -> bool:
        """It generates completions as it trains."""
        return self.spec.rl

    @property
    def evaluates(self) -> bool:
        """It only generates (no training)."""
        return self.spec.evaluates

    @property
    def pairs(self) -> bool:
        """It trains on preference pairs: chosen and rejected go through the model together."""
        from kitcli.stages.pairs import PreferenceSection

        return issubclass(self.spec.section, PreferenceSection)

    @property
    def scorer(self) -> bool:
        """It trains a score head (its output is a scorer), so there are no vocabulary-sized logits."""
        return self.spec.output == "scorer"

    @property
    def memory_settings(self) -> tuple[str, ...]:
        """The `train:` fields that decide its memory."""
        return self.spec.memory.settings


def has_critic(spec) -> bool:
    """The kit's own RL loop (no TRL trainer): PPO, whose critic is a second adapter and a value head."""
    return spec.rl and spec.trainer is None


def config_defaults(spec) -> dict[str, Any]:
    """The stage's trainer config's own defaults (read from its source, nothing imported): what a field that neither
    the kit nor the recipe sets holds."""
    if spec.config is None:
        return {}
    from kitcli.recipe.config_fields import MISSING, config_fields

    return {name: f.default for name, f in config_fields(spec.config).items() if f.default is not MISSING}


def plan_context(recipe, stage):
    """The StageContext a stage type's plan callables read (its defaults, its frozen model): no run directory."""
    from rich.console import Console

    from kitcli.recipe.stage_context import StageContext

    return StageContext(recipe, stage, Path("kit-plan-run"), Console(quiet=True))


def stage_values(recipe, stage) -> dict[str, Any]:
    """The stage's config values as it builds them on a GPU (kitcli.training.trl_config.build_config's layers)."""
    from kitcli.recipe.schema import declared
    from kitcli.training.trl_config import COMMON_DEFAULTS

    spec = stage.spec
    own = {}
    if spec.defaults is not None:  # they read only ctx.model, ctx.stage and the recipe
        own = spec.defaults(plan_context(recipe, stage), on_gpu=True)
    return {**config_defaults(spec), **COMMON_DEFAULTS, **GPU_DEVICE_DEFAULTS, **own,
            **(declared(stage, "train") or {})}


def stage_settings(recipe, stage, backend: str) -> Settings:
    """Settings as the stage (its typed section) will run them on a GPU (the values `kit run --dry-run` prints
    there)."""
    from kitcli.recipe.schema import declared

    model, lora = recipe.model, recipe.lora
    spec = stage.spec
    seq = model.max_seq_length
    values = stage_values(recipe, stage)
    critic = has_critic(spec)
    if critic:  # kitcli/stages/ppo.py: one response per prompt of a rollout, trained in mini-batches of it
        rollout = int(values["per_device_train_batch_size"])
        values.update(num_generations=1, max_completion_length=values["response_length"], beta=values["kl_coef"],
                      generation_batch_size=rollout,
                      per_device_train_batch_size=max(1, rollout // int(values["num_mini_batches"])))
    if spec.rl and values.get("steps_per_generation") is None:  # TRL's rule (GRPOConfig.__post_init__), one process
        generation = values.get("generation_batch_size")
        values["steps_per_generation"] = (int(generation) // int(values["per_device_train_batch_size"]) if generation
                                          else values["gradient_accumulation_steps"])
    settings = Settings(
        stage_type=stage.type, backend=backend, load_in_4bit=model.load_in_4bit is not False and lora is not None,
        dtype_bytes=DTYPE_BYTES.get(model.dtype, 2),
        lora_r=lora.r if lora else None, lora_targets=lora.target_modules if lora else [],
        optim=str(values["optim"]), per_device_train_batch_size=int(values["per_device_train_batch_size"]),
        gradient_accumulation_steps=int(values.get("gradient_accumulation_steps", 1)),
        seq_len=int(values.get("max_length") or seq), gradient_checkpointing=bool(values.get(
            "gradient_checkpointing", True)), beta=float(values.get("beta") or 0.0),
        frozen_model=spec.memory.frozen_model(plan_context(recipe, stage)) if spec.memory.frozen_model else None,
    )
    if spec.rl:
        completion = int(values["max_completion_length"])
        prompt = max(seq - completion, 128)
        vllm = {key: cast(values[key]) for key, cast in (("use_vllm", bool), ("vllm_mode", str),
                                                          ("vllm_gpu_memory_utilization", float)) if key in values}
        settings = replace(settings, prompt_len=prompt, completion_len=completion, seq_len=prompt + completion,
                           num_generations=int(values.get("num_generations", 1)),  # distillation: one each
                           steps_per_generation=int(values["steps_per_generation"]),
                           generation_batch_size=values.get("generation_batch_size"),
                           reward_model=declared(stage, "reward_model") is not None, critic=critic, **vllm)
    if spec.evaluates:
        from kitcli.recipe.schema import GenerationSpec

        given = declared(stage, "generation")
        generation = (given or GenerationSpec()).model_dump()
        settings = replace(settings, prompt_len=seq, completion_len=int(generation["max_new_tokens"]),
                           eval_batch_size=int(generation["batch_size"]), gradient_checkpointing=False,
                           load_in_4bit=model.load_in_4bit is not False)  # planned for a GPU
    if declared(stage, "tools") or declared(stage, "environment"):
        settings = with_tools(settings, stage, values)
    return settings


def with_tools(settings: Settings, stage, values: dict[str, Any]) -> Settings:
    """A stage with tools. GRPO / GSPO: TRL 1.15 caps a completion, tool results included, at max_completion_length
    (its tool loop drops a result that would pass it and cuts the next reply to fit), so the planned prompt +
    completion already holds the whole multi-turn sequence. Eval: each round generates up to max_new_tokens on the
    whole conversation so far, uncapped, so the generated part grows to (rounds + 1) x max_new_tokens."""
    from kitcli.training.tool_use import DEFAULT_ITERATIONS

    if settings.rl:
        return replace(settings, tool_rounds=int(values.get("max_tool_calling_iterations") or DEFAULT_ITERATIONS))
    rounds = int(stage.max_tool_calling_iterations)  # an eval stage's (its default: DEFAULT_ITERATIONS)
    return replace(settings, tool_rounds=rounds, completion_len=(rounds + 1) * settings.completion_len)


def tool_note(settings: Settings) -> str | None:
    """What the plan of a stage with tools counts, in a line."""
    if not settings.tool_rounds:
        return None
    if settings.rl:
        return (f"tools: up to {settings.tool_rounds} rounds of calls per completion; TRL caps a completion, tool "
                f"results included, at max_completion_length ({settings.completion_len} tokens), so the multi-turn "
                f"sequence fits the planned prompt + completion ({settings.seq_len} tokens, the tool schemas in the "
                f"prompt) and needs no more memory; each round generates again (more time, not more memory)")
    return (f"tools: up to {settings.tool_rounds} rounds of calls, each reply up to max_new_tokens on the whole "
            f"conversation so far: planned as {settings.completion_len} generated tokens after the prompt "
            f"(the tool results' own tokens are not counted)")
