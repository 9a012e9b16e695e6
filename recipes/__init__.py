"""Shipped recipes: one YAML file each; `kit recipes list` shows them."""
