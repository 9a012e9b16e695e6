"""Training machinery the stages share: the trainer factory, TRL config building, checkpoints and resume,
progress callbacks, interrupts.
May import: display/, recipe/, models/, data/, rewards/, tools/, the ground."""
