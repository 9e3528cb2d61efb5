"""The (d) proof's diagnostic profiler (tools/gpu/engineprof.py) on vLLM 0.26's real
scheduler on CPU: its phase timers count every call of the wrapped methods, its window
differences count what happened between two lines, and its stack sampler sees where the
calling thread was. The engine-core phases (``step``, ``wait``) need a GPU engine; here the
scheduler's two phases run through the CPU replay."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))

import engineprof  # noqa: E402

pytest.importorskip("vllm.v1.core.sched.scheduler")


def replay_between_two_lines(prefix: str, workload: str, n: int, blocks: int):
    """A stock replay with a line written just before and just after it: (the replay's
    result, the lines, the time it began)."""
    from proxima.replay.driver_v1 import run_replay
    from proxima.workloads import make_workload

    engineprof.flush()
    time.sleep(0.01)
    began = time.time()
    result = run_replay(make_workload(workload, n), proxima=False, num_blocks=blocks)
    time.sleep(0.01)
    engineprof.flush()
    return result, engineprof.read(f"{prefix}-engine.jsonl"), began


@pytest.fixture
def installed(tmp_path):
    prefix = str(tmp_path / "run")
    missing = engineprof.install(prefix, period_s=0.002)
    yield prefix, missing
    engineprof.uninstall()


def test_phases_count_every_scheduler_call_and_the_window_counts_what_lies_between(installed):
    prefix, missing = installed
    assert "schedule" not in missing and "update_from_output" not in missing
    result, lines, began = replay_between_two_lines(prefix, "sharegpt", 150, 4000)
    assert len(lines) == 2
    w = engineprof.window(lines, began, time.time())
    assert w is not None
    steps = result.steps
    assert w["phases"]["schedule"]["calls"] == steps
    assert w["phases"]["update_from_output"]["calls"] == steps
    assert 0 < w["phases"]["schedule"]["s"] < w["span_s"]
    assert w["samples"] > 20
    incl = dict(w["incl"])
    assert incl.get("driver_v1.py:run_replay", 0) > 0.5      # the replay was on the stack
    assert incl.get("scheduler.py:schedule", 0) > 0
    # nothing is counted in a window before the first line
    assert engineprof.window(lines, began - 60, began - 30) is None


def test_uninstall_restores_the_scheduler(tmp_path):
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["schedule"]
    engineprof.install(str(tmp_path / "x"))
    assert Scheduler.__dict__["schedule"] is not original
    engineprof.install(str(tmp_path / "y"))              # a second engine: not wrapped twice
    assert Scheduler.__dict__["schedule"].__wrapped__ is original
    engineprof.uninstall()
    assert Scheduler.__dict__["schedule"] is original


def test_phase_timers_alone_take_no_samples(tmp_path):
    prefix = str(tmp_path / "phases")
    engineprof.install(prefix, period_s=0.0)
    try:
        result, lines, began = replay_between_two_lines(prefix, "chat", 20, 2000)
        w = engineprof.window(lines, began, time.time())
    finally:
        engineprof.uninstall()
    assert w["phases"]["schedule"]["calls"] == result.steps
    assert w["samples"] == 0 and w["leaf"] == [] and w["incl"] == []


def test_both_executors_are_timed_and_a_worker_process_writes_a_file_of_its_own(tmp_path):
    """With ``distributed_executor_backend="mp"`` the worker runs in a process of its own,
    forked from the engine core: its phases go to ``-worker.jsonl``, the engine core's stay
    in ``-engine.jsonl``, and neither executor's phases count as missing."""
    import json
    import os

    from vllm.v1.executor.multiproc_executor import FutureWrapper, MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.gpu_worker import Worker

    prefix = str(tmp_path / "mp")
    missing = engineprof.install(prefix, period_s=0.0)
    try:
        for name in ("execute_model", "sample_tokens", "wait", "worker_execute"):
            assert name not in missing
        for klass, method in [(UniProcExecutor, "execute_model"),
                              (MultiprocExecutor, "execute_model"),
                              (FutureWrapper, "result"), (Worker, "execute_model")]:
            assert hasattr(klass.__dict__[method], "__wrapped__"), (klass, method)
        pid = os.fork()
        if pid == 0:                 # the worker's process: a step of its own, then exit
            try:
                Worker.execute_model(object(), None)     # fails inside vLLM: still timed
            except Exception:  # noqa: BLE001
                pass
            os._exit(0)
        os.waitpid(pid, 0)
        engineprof.flush()           # this process: no step ran here, an engine-core file
    finally:
        engineprof.uninstall()
    worker = engineprof.read(f"{prefix}-worker.jsonl")
    engine = engineprof.read(f"{prefix}-engine.jsonl")
    assert [line["pid"] for line in worker] == [pid]
    assert worker[0]["phases"]["worker_execute"][0] == 1
    assert [line["pid"] for line in engine] == [os.getpid()]
    assert "worker_execute" not in json.dumps(engine)
