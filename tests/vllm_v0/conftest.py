"""Fixtures for the card-stack tests (vLLM 0.6.x, V0 engine, on CPU). Helpers are in
helpers.py; every test module starts with ``helpers.card_stack_or_skip()``."""

from __future__ import annotations

import pytest


@pytest.fixture
def clean_activation(monkeypatch):
    """No PROXIMA_* variable set, vLLM's own block manager installed before and after."""
    from proxima.vllm import vllm_v0
    for name in ("PROXIMA_ALLOCATOR", "PROXIMA_OBSERVE", "PROXIMA_ALLOW_UNTESTED_VLLM",
                 "PROXIMA_STATS_FILE"):
        monkeypatch.delenv(name, raising=False)
    vllm_v0.deactivate()
    yield vllm_v0
    vllm_v0.deactivate()


