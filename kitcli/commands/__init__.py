"""Every `kit` command (Click), and nothing else: the top of the house; nothing imports it.
May import: run/, plan/, stages/, ppo/, training/, display/, recipe/, models/, data/, rewards/, tools/, the ground."""
