"""Models: the one backend choice and loader, reward-model loading, GGUF in and out, the embedded tiny model,
generation.
May import: data/, rewards/, the ground."""
