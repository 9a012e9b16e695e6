"""The VRAM planner behind `kit plan` (kitcli/commands/plan.py): architecture, settings, estimate, fit."""
