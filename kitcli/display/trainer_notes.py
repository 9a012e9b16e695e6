"""What a GRPO / GSPO stage's DONE records about its trainer, as the report's lines: the definition of the logged `kl`,
a pad token the kit replaced, and Unsloth's speed paths (sequence packing, shared-prefix attention) with the
difference Unsloth's own self-check measured (kitcli/training/unsloth_grpo.py writes the record)."""

from __future__ import annotations

from typing import Any

PATH_LABELS = {"sequence_packing": "sequence packing",
               "shared_prefix_attention": "shared-prefix attention (PrefixGrouper)"}


def speed_path_line(label: str, path: dict[str, Any]) -> str:
    """One path: whether Unsloth used it, as set, and what its self-check measured against the plain forward."""
    used = "used" if path.get("used") else "not used"
    text = f"{label}: {used} (setting: {path.get('setting', '?')})"
    if path.get("checks"):
        text += (f"; Unsloth's self-check: largest log-prob difference {path['max_difference']:.4f} nats over "
                 f"{path['checks']} check(s) (it accepts < {path.get('tolerance', 0.7):g})")
    if path.get("events"):
        text += "; " + "; ".join(path["events"])
    return text


def trainer_notes(done: dict[str, Any]) -> list[str]:
    """The report's bullet lines for a stage's DONE (none for a stage without the record)."""
    lines = []
    if done.get("kl_metric"):
        lines.append(f"- kl: {done['kl_metric']}")
    pad = done.get("pad_token")
    if pad:
        lines.append(f"- pad token: {pad['from']!r} -> {pad['to']!r} ({pad['why']})")
    for key, path in (done.get("speed_paths") or {}).items():
        lines.append(f"- {speed_path_line(PATH_LABELS.get(key, key), path)}")
    return lines + [""] if lines else []
