"""`kit check`'s row for the settings that trade exactness for speed: Unsloth's speed paths in a GRPO / GSPO stage
(sequence packing and shared-prefix attention, each accepted by Unsloth's own self-check at up to 0.7 nats per token;
kitcli/recipe/unsloth_spec.py), as the stage's `unsloth:` keys set them. Read from the recipe only: no torch."""

from __future__ import annotations

from kitcli.recipe.schema import declared
from kitcli.recipe.stage_context import StageContext
from kitcli.run.findings import Finding
from kitcli.training.unsloth_grpo import LABELS, SPEED_PATHS, VERIFY_TOLERANCE


def speed_findings(ctx: StageContext) -> list[Finding]:
    """One row for a stage that has the `unsloth:` key (the types Unsloth's GRPO trainer trains), none otherwise."""
    chosen = declared(ctx.stage, "unsloth")
    if chosen is None:
        return []
    on = [LABELS[path] for path in SPEED_PATHS if getattr(chosen, path)]
    off = [LABELS[path] for path in SPEED_PATHS if not getattr(chosen, path)]
    figures = ", ".join([*(f"{label} on" for label in on), *(f"{label} off" for label in off)])
    if not on:
        return [Finding(ctx.name, "exactness vs speed", "ok", figures, "log-probs from the padded forward, as TRL "
                                                                         "computes them (slower on a GPU)")]
    keys = ", ".join(f"{path}: false" for path in SPEED_PATHS if getattr(chosen, path))
    return [Finding(ctx.name, "exactness vs speed", "info", figures + " (Unsloth's GRPO trainer, on a GPU)",
                    f"{' and '.join(on)} trade exactness for speed: Unsloth keeps each after its own self-check, "
                    f"which allows up to {VERIFY_TOLERANCE:g} nats per token (packed rows against one row at a time, "
                    f"the shared prefix against packed rows); DONE and the report record what ran and the difference "
                    f"it measured; unsloth: {{{keys}}} for the padded forward TRL uses")]
