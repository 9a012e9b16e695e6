"""The VRAM planner behind `kit plan` (kitcli/commands/plan.py): architecture, settings, estimate, fit.
May import: stages/ (a stage's recipe section), training/, recipe/, models/, the ground."""
