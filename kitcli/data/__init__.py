"""Datasets: reading rows with their file and line, and the kit's synthetic datasets.
May import: the ground."""
