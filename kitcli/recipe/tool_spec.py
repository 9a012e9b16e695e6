"""The `tools:` and `environment:` keys of a GRPO or GSPO stage: functions the model may call while it generates
(TRL's multi-turn GRPO), and a stateful environment whose methods are tools.

    tools: [calculator, {name: search_file, args: {path: notes.txt}}, my_tools.py:lookup]
    environment: my_env.py:Maze          # TRL's environment_factory: a class with reset() and tool methods
    train: {max_tool_calling_iterations: 4}

Tools are named as rewards are (a `kit.tools` entry point, `module:function`, `path/to/file.py:function`); the tool
library is the top-level `tools/` package, and kitcli/training/tool_use.py loads and checks them before any model
loads. Only a stage type whose section has these fields takes them: TRL 1.15's RLOOTrainer has no `tools=` or
`environment_factory=`, so an rloo stage does not (nor do sft, dpo, kto, reward or ppo stages; an eval stage takes
`tools:` for its run with tools). A misplaced key is refused by kitcli/recipe/schema.py `misplaced_keys`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from kitcli.recipe.filter_spec import FilteredSection
from kitcli.recipe.schema import Section, fail


class ToolSpec(Section):
    """A tool: a built-in name, `module:function`, or `path/to/file.py:function`."""

    name: str = Field(description="Which tool (`kit tools list`).")
    args: dict[str, Any] = Field(default_factory=dict, description="A tool factory's arguments (e.g. search_file's "
                                                                   "path).")
    timeout: Annotated[float, Field(gt=0, le=3600)] = Field(30.0, description="Seconds a call may take before it "
                                                                              "fails (the model reads the failure).")

    @model_validator(mode="before")
    @classmethod
    def shorthand(cls, raw: Any) -> Any:
        return {"name": raw} if isinstance(raw, str) else raw


class ToolsSection(FilteredSection):
    """An RL stage whose model may call tools while it generates (TRL's GRPOTrainer `tools=` and
    `environment_factory=`)."""

    tools: list[ToolSpec] = Field(default_factory=list, description="Functions the model may call while it "
                                                                    "generates (`kit tools list`).")
    environment: str | None = Field(None, description="A stateful environment, path/to/file.py:Class or "
                                                      "module:Class, with reset() and tool methods (one instance per "
                                                      "rollout).")

    @field_validator("tools", mode="before")
    @classmethod
    def tool_list(cls, raw: Any) -> Any:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise fail("'tools' must be a list of tool names or mappings (e.g. tools: [calculator])")
        return raw

    @field_validator("environment")
    @classmethod
    def class_reference(cls, value: str | None) -> str | None:
        if value is not None and ":" not in value:
            raise fail(f"environment '{value}' must be path/to/file.py:Class or module:Class")
        return value

    @model_validator(mode="after")
    def no_filter_with_environment(self):
        if self.environment and self.filter is not None:
            raise fail("filter: samples the starting policy with the stage's tools: but cannot run an environment: "
                       "(TRL makes one instance per rollout); remove filter: (or the environment)")
        return self
