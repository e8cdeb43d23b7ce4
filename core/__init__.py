"""Outrider: speculative decoding for GGUF language models, assembled from plugins."""

__version__ = "0.1.0"
