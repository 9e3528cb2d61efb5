"""Fixtures shared by the test folders."""

import logging

import pytest


@pytest.fixture
def log_records():
    """``log_records(name, level=INFO)``: the list of records logger ``name`` emits from
    then on to the test's end, ``level`` up (a handler on the logger itself: vLLM's loggers
    and proxima serve's do not propagate to the root, where caplog listens)."""
    attached = []

    def attach(name: str, level: int = logging.INFO) -> list:
        records = []
        handler = logging.Handler(level)
        handler.emit = records.append
        log = logging.getLogger(name)
        attached.append((log, handler, log.level))
        log.addHandler(handler)
        if log.level == logging.NOTSET or log.level > level:
            log.setLevel(level)
        return records

    yield attach
    for log, handler, old_level in reversed(attached):
        log.removeHandler(handler)
        log.setLevel(old_level)


@pytest.fixture
def proxima_log(log_records):
    """The records Proxima's engine logger ("vllm.proxima") emits during the test, INFO up."""
    return log_records("vllm.proxima")
