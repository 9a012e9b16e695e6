"""`eval:` on a training stage: held-out evaluation while it trains (kitcli/training/held_out.py runs it).

    - name: grpo
      type: grpo
      data: examples/data/arithmetic_rl.jsonl
      rewards: [exact_match]
      eval:
        data: examples/data/arithmetic_eval.jsonl   # prompt, and answer for exact match
        every: 10                                     # optimizer steps between evals (also step 0 and the last)
        limit: 100                                    # the first N rows (default 100)
        generation: {max_new_tokens: 16}              # an eval stage's generation keys and defaults (greedy)
        rewards: [format]                             # each reward's mean, as an eval stage scores it

The section's data, generation and reward types are kitcli/recipe/schema.py's (DataSpec, GenerationSpec,
RewardSpec). schema.py names this section in TrainingSection, so this module cannot import schema.py when it loads:
it takes those three types as type parameters, and TrainingSection declares `HeldOutSpec[DataSpec, GenerationSpec,
RewardSpec]`. What needs the reward registry (names, their columns) is checked by kitcli/training/held_out.py
before any model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

DataT = TypeVar("DataT")
GenerationT = TypeVar("GenerationT")
RewardT = TypeVar("RewardT")
DEFAULT_LIMIT = 100


class HeldOutSpec(BaseModel, Generic[DataT, GenerationT, RewardT]):
    """Held-out evaluation of the live policy at step 0, every `every` steps and at the end of a training stage."""

    model_config = ConfigDict(extra="forbid", strict=True)  # as every recipe mapping (schema.Section)

    data: DataT = Field(description="Held-out rows: prompt, and answer for exact match.")
    every: Annotated[int, Field(gt=0)] = Field(description="Optimizer steps between two evaluations.")
    limit: Annotated[int, Field(gt=0)] = Field(DEFAULT_LIMIT, description="Score only the first N rows.")
    generation: GenerationT | None = Field(None, description="How to generate (an eval stage's keys; greedy).")
    rewards: list[RewardT] = Field(default_factory=list, description="Rewards to average over the completions.")
    system_prompt: str | None = Field(None, description="A system message put before every prompt.")

    @field_validator("rewards", mode="before")
    @classmethod
    def reward_list(cls, raw: Any) -> Any:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise _fail("eval.rewards must be a list of reward names or mappings")
        return raw

    @field_serializer("generation")
    def generation_as_written(self, generation: Any, info: FieldSerializationInfo) -> Any:
        """The generation keys the recipe set: an unset `show` is 0 here (no sample lines inside the dashboard), not
        an eval stage's 3, so the lock's dump reads back as this same section."""
        return None if generation is None else generation.model_dump(mode=info.mode, exclude_unset=True)

    @model_validator(mode="after")
    def something_to_score(self, info: ValidationInfo) -> HeldOutSpec:
        """Exact match needs an `answer` column: without rewards, a local file without one is refused here."""
        spec = self.data.model_dump()  # type: ignore[attr-defined]  (a DataSpec)
        if self.rewards or not Path(spec["path"]).is_file():
            return self
        from kitcli.data.rows import read_rows
        from kitcli.errors import KitError

        try:
            first = read_rows({**spec, "limit": 1}, "data")[0]
        except KitError as error:
            raise _fail(error.message) from None
        if "answer" not in first:
            raise _fail(f"data '{spec['path']}' has no 'answer' column for exact match and no rewards are listed, "
                        f"so there is nothing to score; add the column (map yours with data: {{columns: "
                        f"{{your_column: answer}}}}) or list rewards: under eval:")
        return self


def _fail(message: str):
    """schema.fail's one-line fault (the same error type and fields), made here: this module cannot import schema.py,
    which imports it."""
    from pydantic_core import PydanticCustomError

    return PydanticCustomError("kit", "{message}", {"message": message, "where": None})
