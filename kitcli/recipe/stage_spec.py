"""What a stage type is: the `StageSpec` its module declares, read by every other module.

A stage type's module (`kitcli/stages/<type>.py`, or a plugin's, docs/extending.md) holds everything the kit knows
about it: its recipe section, the trainer and config classes it builds (wherever they live: `trl.trainer`,
`trl.experimental`, a plugin package), how its rows reach the model, what it costs in memory, what a resume
restores, how it is shown. `kit check`, `kit plan`, the runner and the displays ask these fields; none of them keeps
a table of stage types or compares a type's name. What belongs together is one small dataclass: `Rows` (how its
rows reach the model), `Memory` (what `kit plan` counts), `Resume`, `Display`, `Launcher`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

RESUMED = "every adapter's weights, the optimizer, the scheduler, the RNG states and the data position"


@dataclass(frozen=True)
class Rows:
    """How a stage type's rows reach the model: what `kit check` measures and the dry run shows."""

    # "prompts" (it generates the rest: prompt + room for new tokens), "text" (supervised targets: whole rows, and the
    # stop token after a reply), "pairs" (prompt + chosen / rejected / completion). None: kit check has no length
    # check for it, and says so.
    shape: Literal["prompts", "text", "pairs"] | None = None
    read: Callable[[Any], list[dict[str, Any]]] | None = None  # its prompts as it reads them: (StageContext) -> rows
    as_trained: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None  # file rows -> trainer rows


@dataclass(frozen=True)
class Memory:
    """What decides a stage type's memory: `kit plan` counts it, an out-of-memory error names the settings."""

    settings: tuple[str, ...] = ()  # the train: fields that decide it
    reference: Literal["always", "beta", "never"] = "never"  # a frozen reference: always, when train.beta > 0, never
    # A second, frozen model it loads beside the policy (a distillation teacher): (StageContext) -> the model name or
    # path whose architecture it has (the recipe's model.name for an adapter an earlier stage trained). kit plan
    # counts its weights and its forward pass.
    frozen_model: Callable[[Any], str] | None = None


@dataclass(frozen=True)
class Resume:
    """What a stage's checkpoint holds and a resume restores (for DONE and the report)."""

    restores: str = RESUMED
    files: tuple[str, ...] = ()  # what its own checkpoints hold (none: a trainer stage's, transformers' set)


@dataclass(frozen=True)
class Display:
    """How a stage type is shown: the dashboard's metrics and the report's figures."""

    metrics: tuple[tuple[str, str], ...] = ()  # (logged key, dashboard label); `*` matches part of a key
    panels: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # report figures: (title, y label, keys)


@dataclass(frozen=True)
class Launcher:
    """Whether a stage type runs under `kit run --launcher` (N processes)."""

    runs: str | None = None  # how it runs there; None: it does not
    refusal: str = ""  # why not


@dataclass(frozen=True)
class StageSpec:
    """What a stage type is, declared once in its module and read by every other module."""

    type: str
    module: str  # the module with describe(ctx) -> dict and run(ctx) -> summary
    section: type  # its recipe keys, their types and ranges (a kitcli.recipe.schema.StageSection)
    summary: str  # one line: what it runs
    output: Literal["policy", "scorer", "none"]  # what a later stage's init: / reward_model: can use
    init_from: tuple[str, ...] = ("policy",)  # the outputs it may start from
    # The classes it trains with, "module:Class": TRL's (Unsloth's generated ones replace them where Unsloth patches
    # that module), an experimental one or a plugin's. None: its own loop (PPO), or no training (eval).
    trainer: str | None = None
    config: str | None = None
    rows: Rows = field(default_factory=Rows)
    groups: bool = False  # samples a group of completions per prompt (num_generations): batch and signal checks
    rl: bool = False  # samples completions while training (dashboard samples, RL alarms)
    evaluates: bool = False  # scores a model (its DONE holds the scores the before/after table shows)
    memory: Memory = field(default_factory=Memory)
    resume: Resume = field(default_factory=Resume)
    display: Display = field(default_factory=Display)
    launcher: Launcher = field(default_factory=Launcher)
    refused_keys: dict[str, str] = field(default_factory=dict)  # why it has no such key (e.g. "tools": ...)
    defaults: Callable[..., dict[str, Any]] | None = None  # its config defaults: (StageContext, on_gpu=None) -> dict
    order: int = 200  # where it is listed (help, messages, schemas): the kit's own in pipeline order, plugins after

    def __post_init__(self) -> None:
        """The section knows its spec (`stage.spec` of a validated stage): its `train:` check reads the config class
        from it, and whoever holds a typed stage asks it what the type is."""
        self.section.spec = self
        _declared[self.type] = self

    @property
    def config_name(self) -> str | None:
        return self.config.rsplit(":", 1)[1] if self.config else None


_declared: dict[str, StageSpec] = {}  # type -> the StageSpec this process declared for it last


def declared_specs() -> list[StageSpec]:
    """Every StageSpec this process has declared (its module imported: the registry, kitcli/recipe/stage_types.py,
    imports them all when a recipe is loaded), in their `order`. For the libraries below the stages, which must not
    import the registry: kitcli/training/trainer_classes.py remembers TRL's own classes of these before Unsloth
    replaces them."""
    return sorted(_declared.values(), key=lambda spec: (spec.order, spec.type))


def split_path(path: str) -> tuple[str, str]:
    """'package.module:Class' -> ('package.module', 'Class')."""
    module, _, name = path.partition(":")
    return module, name
