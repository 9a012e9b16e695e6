"""The `filter:` key of an RL stage (grpo, gspo, rloo): difficulty filtering before training.

    filter: {k: 8, min_pass: 0.1, max_pass: 0.9}

The stage samples k completions of each prompt from its starting policy, scores them with its own rewards and keeps
the prompts whose pass rate lies in [min_pass, max_pass] (kitcli/training/filtering.py does it; `kit data filter`
writes the kept rows to a file). A stage type accepts `filter:` when its section model has the field, as these do.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from kitcli.recipe.schema import RewardedSection, Section, fail


class FilterSpec(Section):
    """Difficulty filtering (kitcli/training/filtering.py): keep the prompts the starting policy passes sometimes."""

    k: Annotated[int, Field(ge=2)] = Field(8, description="Samples per prompt (a pass rate needs at least 2).")
    min_pass: Annotated[float, Field(ge=0, le=1)] = Field(0.1, description="Lowest pass rate kept.")
    max_pass: Annotated[float, Field(ge=0, le=1)] = Field(0.9, description="Highest pass rate kept.")
    pass_reward: str | None = Field(None, description="The reward whose score decides a pass (default: the "
                                                      "weighted total of every reward reaching its highest value).")
    pass_score: float | None = Field(None, description="The score that passes (default: the reward's declared "
                                                       "maximum, e.g. 1.0 for exact_match).")

    @model_validator(mode="after")
    def bounds(self) -> FilterSpec:
        if self.min_pass > self.max_pass:
            raise fail(f"min_pass {self.min_pass:g} is above max_pass {self.max_pass:g}, so no "
                       f"prompt could be kept; give min_pass <= max_pass (e.g. 0.1 and 0.9)")
        return self


class FilteredSection(RewardedSection):
    """An RL stage whose prompts can be filtered by difficulty before training."""

    filter: FilterSpec | None = Field(None, description="Keep the prompts whose pass rate over k samples of the "
                                                        "starting policy lies in [min_pass, max_pass].")
