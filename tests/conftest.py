"""Fixtures shared by the test folders."""

import logging

import pytest


@pytest.fixture
def proxima_log():
    """The records Proxima's engine logger ("vllm.proxima") emits during the test, INFO up."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.proxima")
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(old_level)
