"""What a stage runs with: its part of the recipe, its directory, the outputs of the stages before it, and where
to say things. The runner makes one per stage; stages read it and never reach back into the runner.

`ctx.section` is the stage's validated section (its type's pydantic model: `ctx.section.train`,
`ctx.section.data.path`, `ctx.section.system_prompt`), which stages read; `ctx.stage` is the same stage as the
plain dict the lock file, the report and the checks record."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kitcli.rundir import StageDir

if TYPE_CHECKING:
    from rich.console import Console

    from kitcli.recipe.load import Recipe


@dataclass
class StageContext:
    recipe: Recipe
    stage: dict[str, Any]
    run_dir: Path
    console: Console
    outputs: dict[str, Path] = field(default_factory=dict)  # earlier stage name -> its directory

    @property
    def name(self) -> str:
        return self.stage["name"]

    @cached_property
    def section(self) -> Any:
        """The stage's section, typed: the recipe already validated it, so this cannot fail on a loaded recipe."""
        from kitcli.recipe import stage_types

        section = stage_types.spec(self.stage["type"]).section
        return section.model_validate(self.stage, context={"base_dir": self.recipe.base_dir})

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
    def model(self) -> dict[str, Any]:
        return self.recipe.data["model"]

    @property
    def seed(self) -> int:
        return self.recipe.data["seed"]

    @property
    def init_dir(self) -> Path | None:
        init = self.stage.get("init")
        return self.outputs[init] if init else None

    def output(self, stage_name: str) -> StageDir:
        return StageDir(self.outputs[stage_name])

    def log(self, message: str) -> None:
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)
