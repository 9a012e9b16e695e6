"""What a stage runs with: its part of the recipe, its directory, the outputs of the stages before it, and where
to say things. The runner makes one per stage; stages read it and never reach back into the runner.

`ctx.stage` is the stage's validated section (its type's pydantic model, kitcli/stages/<type>.py: `ctx.stage.train`,
`ctx.stage.data.path`, `ctx.stage.system_prompt`), as the recipe validated it; `ctx.section` is the same object.
`ctx.spec` is its type's StageSpec; `ctx.model`, `ctx.lora` and `ctx.seed` are the recipe's; `ctx.config` the trainer
config preflight built from its `train:` (`ctx.trainer_config(build)`), which its run() trains with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitcli.rundir import StageDir

if TYPE_CHECKING:
    from rich.console import Console

    from kitcli.recipe.load import Recipe
    from kitcli.recipe.schema import LoraSpec, ModelSpec
    from kitcli.recipe.stage_spec import StageSpec


@dataclass
class StageContext:
    recipe: Recipe
    stage: Any  # the stage's section: its type's pydantic model (a kitcli.recipe.schema.StageSection)
    run_dir: Path
    console: Console
    outputs: dict[str, Path] = field(default_factory=dict)  # earlier stage name -> its directory
    config: Any = None  # its trainer config: the one preflight built, which `kit run` hands to run()

    @property
    def section(self) -> Any:
        """The stage's section (the same object as `stage`)."""
        return self.stage

    @property
    def spec(self) -> StageSpec:
        return self.stage.spec

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def stage_dir(self) -> Path:
        return self.run_dir / self.name

    @property
    def dir(self) -> StageDir:
        return StageDir(self.stage_dir)

    @property
    def where(self) -> str:
        return f"{self.recipe.source}: stage '{self.name}'"

    @property
    def model(self) -> ModelSpec:
        return self.recipe.model

    @property
    def lora(self) -> LoraSpec | None:
        return self.recipe.lora

    @property
    def seed(self) -> int:
        return self.recipe.seed

    @property
    def init_dir(self) -> Path | None:
        init = self.stage.init
        return self.outputs[init] if init else None

    def output(self, stage_name: str) -> StageDir:
        return StageDir(self.outputs[stage_name])

    def trainer_config(self, build: Callable[[], Any]) -> Any:
        """The stage's trainer config, built once from its section: the one preflight built and checked (kit run
        passes it on), else built now and kept, so describe() and run() train with the same object."""
        if self.config is None:
            self.config = build()
        return self.config

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)
