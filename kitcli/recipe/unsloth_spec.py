"""A GRPO / GSPO stage's `unsloth:` section: Unsloth's two speed paths for scoring completions, each of which trades
exactness for speed, and a switch to turn each off.

    unsloth: {sequence_packing: false, shared_prefix_attention: false}   # the exact padded forward

On a GPU Unsloth's generated GRPO trainer scores a batch of completions on packed rows (one varlen row per batch,
no padding) and, for the completions of one prompt, with the prompt computed once (shared-prefix attention, its
PrefixGrouper). It accepts each after a self-check against the plain forward that allows up to 0.7 nats per token
(unsloth_zoo/rl_replacements.py, unsloth/utils/prefix_grouper.py). What the trainer did with them, and the difference
its check measured, is recorded in the stage's DONE and the report (kitcli/training/unsloth_grpo.py). TRL's own
GRPOTrainer (a CPU run) has neither path: there the keys change nothing, and the stage says so.
"""

from __future__ import annotations

from pydantic import Field, model_serializer, model_validator

from kitcli.recipe.schema import Section, fail


class UnslothSpec(Section):
    """Unsloth's speed paths in a GRPO / GSPO stage (its generated trainer, on a GPU)."""

    sequence_packing: bool = Field(True, description="Score completions on packed rows (Unsloth's default on a GPU; "
                                                     "self-checked to 0.7 nats per token). false: the padded "
                                                     "forward.")
    shared_prefix_attention: bool = Field(True, description="Compute a prompt once for its group of completions "
                                                            "(Unsloth's PrefixGrouper; needs sequence_packing; "
                                                            "self-checked to 0.7 nats per token). false: off.")

    @model_validator(mode="after")
    def prefix_needs_packing(self) -> UnslothSpec:
        if "shared_prefix_attention" in self.model_fields_set and self.shared_prefix_attention \
                and not self.sequence_packing:
            raise fail("shared_prefix_attention needs sequence_packing (Unsloth's PrefixGrouper runs on the "
                       "packed rows); set shared_prefix_attention: false, or sequence_packing: true")
        return self

    @model_serializer(mode="wrap")
    def as_written(self, handler):
        """The keys the recipe set (what an unset one means, Unsloth deciding, is the recipe's too): the lock's dump
        reads back as this same section, where a written shared_prefix_attention is checked against packing."""
        return {key: value for key, value in handler(self).items() if key in self.model_fields_set}


def unsloth_field():
    """The `unsloth:` key of a stage type trained by Unsloth's generated GRPO trainer on a GPU."""
    return Field(default_factory=UnslothSpec,
                 description="Unsloth's speed paths (a GPU): sequence_packing, shared_prefix_attention; false turns "
                             "one off for the exact padded forward.")
