"""Running a recipe: the runner (stage after stage, resume, DONE) and the multi-process launcher. Imports the
stage types through the registry, and training, display, recipe, models, data and the ground; never commands/."""
