"""One module per stage type, each with `describe(ctx)` (for --dry-run) and `run(ctx)` (returns a summary); and
pairs.py, the preference-pair helpers that the reward, DPO and KTO stages share.
May import: ppo/, training/, display/, recipe/, models/, data/, rewards/, the ground."""
