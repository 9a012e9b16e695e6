"""Datasets: reading rows with their file and line, and the kit's synthetic datasets. Imports only the ground."""
