"""pytest plugin of tools/vllm_tests.py: vLLM's own tests, run with stock's or Proxima's pool.

Loaded by ``-p vllm_tests_plugin`` (tools/ on PYTHONPATH) in a tree of vLLM's test sources.

``PROXIMA_POOL=1``: Proxima is activated as in a serving engine (``vllm_v1.activate()``:
every pool vLLM's KV-cache coordinator builds -- the scheduler's, the simple CPU offload's
-- is Proxima's), and a test that builds a pool by the name
``vllm.v1.core.block_pool.BlockPool`` gets Proxima's too: the name is rebound in the test
modules after collection and, during each test, in ``vllm.v1.core.block_pool`` itself (for
imports inside test functions). Unset: stock vLLM, nothing touched.

Either way, ``$VLLM_TESTS_REPORT`` (a path) receives one JSON object: for each test id its
outcome (passed, failed, error, skipped, xfailed, xpassed), the last line of its failure
and how many Proxima pools it built (0 under stock: a test that built none did not
exercise Proxima). While the run lasts, ``$VLLM_TESTS_REPORT.partial`` has one such entry a
line, as each test ends (removed at the end)."""

from __future__ import annotations

import json
import os
import sys

import pytest

def _cpu_platform() -> None:
    """vLLM's CPU platform, as on vLLM's own CPU test runs (its CI runs the cpu_test tests on
    a CPU build): the installed wheel is a CUDA build and this machine has no GPU, so vLLM
    would find no device type. Done at import, before vLLM's conftest reads the platform;
    the same for both pools."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not platforms.current_platform.device_type:      # vLLM found none
        platforms.current_platform = CpuPlatform()


if os.environ.get("VLLM_TESTS_CPU_PLATFORM") == "1":
    _cpu_platform()

_proxima = None      # ProximaBlockPool while active
_stock = None        # vLLM's BlockPool
_built = [0]         # Proxima pools built so far
_results: dict[str, dict] = {}
_partial = None      # $VLLM_TESTS_REPORT.partial: one line per test as it ends


def pytest_configure(config) -> None:
    global _proxima, _stock, _partial
    path = os.environ.get("VLLM_TESTS_REPORT")
    if path:
        _partial = open(path + ".partial", "w")
    if os.environ.get("PROXIMA_POOL") != "1":
        return
    os.environ.setdefault("PROXIMA_ALLOW_UNTESTED_VLLM", "1")
    from vllm.v1.core.block_pool import BlockPool

    from proxima.vllm import vllm_v1

    vllm_v1.activate()
    _stock, _proxima = BlockPool, vllm_v1.ProximaBlockPool
    init = _proxima.__init__

    def counted_init(self, *args, **kwargs):
        _built[0] += 1
        init(self, *args, **kwargs)

    _proxima.__init__ = counted_init


def pytest_collection_modifyitems(session, config, items) -> None:
    """vLLM's conftest cleans the distributed state and memory after every test unless the
    test is marked skip_global_cleanup ("a ~10x speedup for non-GPU unit tests", its
    comment says); no test here runs on a GPU or starts a distributed group: mark all."""
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def pytest_collection_finish(session) -> None:
    if _proxima is None:
        return
    for name, module in list(sys.modules.items()):
        if (name == "tests" or name.startswith("tests.") or name.startswith("test_")) \
                and getattr(module, "BlockPool", None) is _stock:
            module.BlockPool = _proxima


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _built[0]
    module = sys.modules["vllm.v1.core.block_pool"] if _proxima is not None else None
    if module is not None:
        module.BlockPool = _proxima
    try:
        yield
    finally:
        if module is not None:
            module.BlockPool = _stock
    entry = _results.setdefault(item.nodeid, {"outcome": "passed", "message": ""})
    entry["pools"] = _built[0] - before
    if _partial is not None:            # so that a run cut short still tells what it saw
        _partial.write(json.dumps({item.nodeid: entry}) + "\n")
        _partial.flush()


def pytest_runtest_logreport(report) -> None:
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when == "call":
        outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        return
    if entry["outcome"] in ("failed", "error") and report.when == "teardown":
        return                          # the call's failure is the one to keep
    entry["outcome"] = outcome
    if report.failed or report.skipped:
        longrepr = report.longrepr
        text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr or "")
        lines = [line for line in text.splitlines() if line.strip()]
        entry["message"] = (lines[-1] if lines else "")[:300]


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("VLLM_TESTS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, indent=0, sort_keys=True)
        _partial.close()
        os.unlink(path + ".partial")
