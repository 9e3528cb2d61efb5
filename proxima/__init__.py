"""Proxima: contiguous KV-cache memory for vLLM."""

__version__ = "0.1.0"
