"""Weights in and out: canonical per-layer weights, the packed layout, importers and file formats."""
