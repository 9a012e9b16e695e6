"""Models: the one backend choice and loader, reward-model loading, GGUF in and out, the embedded tiny model,
generation. Imports data/, rewards/ and the ground; never recipe/, training/, stages/, run/ or commands/."""
