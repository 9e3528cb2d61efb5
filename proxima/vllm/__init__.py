"""Thin adapters that put proxima.allocator inside an engine (one module per generation)."""
