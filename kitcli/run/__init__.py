"""Running a recipe: the runner (stage after stage, resume, DONE) and the multi-process launcher. It reaches the
stage modules only through the stage-type registry (recipe/stage_types.py), by name.
May import: training/, display/, recipe/, models/, data/, rewards/, the ground."""
