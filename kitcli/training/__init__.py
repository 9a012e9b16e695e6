"""Training machinery the stages share: the trainer factory, TRL config building, checkpoints and resume,
progress callbacks, interrupts. Imports display, recipe, models, data and the ground; never stages/, run/, commands/."""
