"""One module per stage type; each has `describe(ctx)` (for --dry-run) and `run(ctx)` (returns a summary)."""
