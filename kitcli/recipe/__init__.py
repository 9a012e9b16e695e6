"""What a recipe is: loading and overrides, the typed schema, the stage-type registry, the TRL config fields, the
editor schema, the context a stage runs with.
May import: models/ (facts of a model name), data/, the ground."""
