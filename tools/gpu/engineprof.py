"""Where an engine's time goes, for the proof drivers: a diagnostic, not a result.

:func:`install` (in the proof child, before the ``LLM`` is built: vLLM forks its engine
core from there, so the patches are inherited) wraps a few of vLLM 0.26's engine-core
methods with wall-clock timers, and starts in the engine core a sampler of its main
thread's Python stack. Every ``every_s`` the engine core appends one JSON line to
``<prefix>-engine.jsonl``: the time, each phase's cumulative (calls, seconds), and the
sampler's cumulative counts by function (where the main thread was: ``leaf``; what was on
its stack: ``incl``). :func:`start_sampler` does the same for the calling process alone
(the child's own loop, ``<prefix>-client.jsonl``). :func:`window` diffs two lines around
a span of the run and keeps the top entries.

Phases (vLLM 0.26, V1 engine core, async scheduling's batch queue):
``schedule`` (the scheduler, Proxima's connector hooks included), ``execute_model`` and
``sample_tokens`` (with vLLM's default executor for one GPU, ``uni``, the in-process worker
preparing and launching the step; with ``mp`` only handing it to the worker's process),
``wait`` (waiting for a step's sampled tokens: the GPU-bound part with ``uni``; with ``mp``
whatever of the worker's step did not overlap the scheduler's), ``update_from_output``, ``input``
(new requests and aborts taken in) and ``step`` (one ``step_with_batch_queue``, all of it);
within them ``allocate_slots`` (called per scheduled request), ``get_new_blocks``,
``free_blocks`` and Proxima's ``connector_meta``; within ``allocate_slots`` the
coordinator's ``num_blocks_to_allocate``, ``allocate_new_blocks`` (the managers', Proxima's
wrapper included, so ``get_new_blocks`` too) and ``cache_blocks``; Proxima's status
snapshots (``status_publish``, every call, most of which only look at the clock) and the
connector's ``write_stats``; within ``execute_model`` the V2 model runner's
``prepare_inputs``, its forward by CUDA-graph mode (``forward_full_graph``,
``forward_piecewise``: the latter runs each attention layer eagerly, and with a KV
connector that layer's two hooks) and a connector's ``kv_pre_forward`` and
``kv_post_forward``. A wrapper costs ~1 us a call, alike for every engine.
A method missing in this vLLM is skipped, named in the first line (``missing``).
``worker_execute`` is the worker's ``execute_model`` wherever it runs; a worker with a process
of its own (``mp``) writes its phases to ``<prefix>-worker.jsonl`` (its engine-core lines
stay in ``-engine.jsonl``); it is forked from the engine core, so it has the patches.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time

PHASES = (
    ("step", "vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("step_sync", "vllm.v1.engine.core", "EngineCore", "step"),
    ("input", "vllm.v1.engine.core", "EngineCore", "_process_input_queue"),
    ("schedule", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("update_from_output", "vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("execute_model", "vllm.v1.executor.uniproc_executor", "UniProcExecutor", "execute_model"),
    ("sample_tokens", "vllm.v1.executor.uniproc_executor", "UniProcExecutor", "sample_tokens"),
    ("wait", "vllm.v1.executor.uniproc_executor", "AsyncOutputFuture", "result"),
    # the same three with the worker in a process of its own (distributed_executor_backend
    # mp): handing the step to the worker, and waiting for its answer
    ("execute_model", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor",
     "execute_model"),
    ("sample_tokens", "vllm.v1.executor.multiproc_executor", "MultiprocExecutor",
     "sample_tokens"),
    ("wait", "vllm.v1.executor.multiproc_executor", "FutureWrapper", "result"),
    # the worker's own step, in whichever process runs it (the engine core's with uni)
    ("worker_execute", "vllm.v1.worker.gpu_worker", "Worker", "execute_model"),
    # inside schedule() / update_from_output(): where a KV pool's own work shows
    ("allocate_slots", "vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots"),
    ("get_new_blocks", "vllm.v1.core.block_pool", "BlockPool", "get_new_blocks"),
    ("free_blocks", "vllm.v1.core.block_pool", "BlockPool", "free_blocks"),
    ("connector_meta", "proxima.vllm.elastic_connector", "ProximaElasticConnector",
     "build_connector_meta"),
    # inside allocate_slots (per scheduled request): the coordinator's three calls
    ("num_blocks_to_allocate", "vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
     "get_num_blocks_to_allocate"),
    ("allocate_new_blocks", "vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
     "allocate_new_blocks"),
    ("cache_blocks", "vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator",
     "cache_blocks"),
    # inside the worker's execute_model (the V2 model runner): its input preparation, the
    # forward by CUDA-graph mode (a piecewise one runs each attention layer eagerly, with a KV
    # connector's two per-layer hooks), and a connector's calls around the forward
    ("prepare_inputs", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),
    ("forward_full_graph", "vllm.v1.worker.gpu.cudagraph_utils", "ModelCudaGraphManager",
     "run_fullgraph"),
    ("forward_piecewise", "vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager",
     "run_pw_graph"),
    ("kv_pre_forward", "vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "pre_forward"),
    ("kv_post_forward", "vllm.v1.worker.gpu.kv_connector", "ActiveKVConnector", "post_forward"),
    # Proxima's status snapshots (PROXIMA_STATS_FILE) and the connector's stats file
    ("status_publish", "proxima.vllm.status", "StatusWriter", "publish"),
    ("write_stats", "proxima.vllm.elastic_connector", "ProximaElasticConnector",
     "write_stats"),
)


class _State:
    def __init__(self, path: str, every_s: float, period_s: float,
                 worker_path: str | None = None) -> None:
        self.path, self.every_s, self.period_s = path, every_s, period_s
        self.worker_path = worker_path or path
        # "engine": this process runs the engine core's steps; "worker": only a worker's
        # (executor mp: its lines go to a file of its own); None: neither yet
        self.role: str | None = None
        self.pid = os.getpid()
        self.main = threading.get_ident()
        self.phases: dict[str, list] = {}
        self.leaf: dict[str, int] = {}
        self.incl: dict[str, int] = {}
        self.samples = 0
        self.last = 0.0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if period_s > 0:                # 0: the phase timers alone (no sampler, no GIL share)
            threading.Thread(target=self._sample, name="proof-sampler", daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.wait(self.period_s):
            frame = sys._current_frames().get(self.main)
            if frame is None:
                continue
            seen = set()
            leaf = None
            depth = 0
            while frame is not None and depth < 80:
                code = frame.f_code
                key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
                if leaf is None:
                    leaf = key
                seen.add(key)
                frame = frame.f_back
                depth += 1
            with self.lock:
                self.samples += 1
                self.leaf[leaf] = self.leaf.get(leaf, 0) + 1
                for key in seen:
                    self.incl[key] = self.incl.get(key, 0) + 1

    def add(self, name: str, seconds: float) -> None:
        entry = self.phases.get(name)
        if entry is None:
            entry = self.phases[name] = [0, 0.0]
        entry[0] += 1
        entry[1] += seconds

    def maybe_dump(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        with self.lock:
            line = {"t": now, "pid": self.pid, "samples": self.samples,
                    "phases": {k: [v[0], round(v[1], 6)] for k, v in self.phases.items()},
                    "leaf": dict(self.leaf), "incl": dict(self.incl)}
        with open(self.worker_path if self.role == "worker" else self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


_state: _State | None = None
_config: dict = {}


def _here() -> _State | None:
    """This process's state, made on first use (a forked engine core starts its own)."""
    global _state
    if not _config:
        return None
    if _state is None or _state.pid != os.getpid():
        _state = _State(_config["engine"], _config["every_s"], _config["period_s"],
                        _config.get("worker"))
    return _state


def _wrap(name: str, original):
    def timed(*args, **kwargs):
        state = _here()
        if state is None or threading.get_ident() != state.main:
            return original(*args, **kwargs)
        if name in ("step", "step_sync"):
            state.role = "engine"
        elif name == "worker_execute" and state.role is None:
            state.role = "worker"
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            state.add(name, time.perf_counter() - began)
            if name in ("step", "step_sync") or state.role == "worker":
                state.maybe_dump()
    timed.__wrapped__ = original
    return timed


def install(prefix: str, every_s: float = 1.0, period_s: float = 0.004) -> list[str]:
    """Patch the engine-core phases; lines go to ``<prefix>-engine.jsonl`` from the process
    that runs them (the engine core). ``period_s``: the stack sampler's period (0: no
    sampler; it costs a Python-bound engine ~20% of its throughput, the timers ~nothing).
    Returns the phases this vLLM lacks."""
    _config.update(engine=f"{prefix}-engine.jsonl", worker=f"{prefix}-worker.jsonl",
                   every_s=every_s, period_s=period_s)
    if "missing" in _config:              # patched already (another engine of this process)
        return _config["missing"]
    found = set()
    for name, module, cls, method in PHASES:
        try:
            klass = getattr(importlib.import_module(module), cls)
            original = klass.__dict__[method]
        except (ImportError, AttributeError, KeyError):
            continue
        setattr(klass, method, _wrap(name, original))
        _config.setdefault("patched", []).append((klass, method, original))
        found.add(name)
    # a phase is missing when no executor's method for it was found
    missing = _config["missing"] = list(dict.fromkeys(n for n, *_ in PHASES if n not in found))
    return missing


def flush() -> None:
    """Write this process's line now (tests; the engine core writes from its steps)."""
    state = _here()
    if state is not None:
        state.maybe_dump(force=True)


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    global _state
    for klass, method, original in reversed(_config.get("patched", [])):
        setattr(klass, method, original)
    _config.clear()
    if _state is not None:
        _state.stop.set()
    _state = None


def start_sampler(path: str, every_s: float = 1.0, period_s: float = 0.004):
    """Sample this process's calling thread (no phases) into ``path``; returns a
    ``dump()`` to call from that thread now and then (it writes at most every ``every_s``)."""
    state = _State(path, every_s, period_s)

    def dump(force: bool = False) -> None:
        state.maybe_dump(force)

    dump.stop = state.stop.set
    return dump


def read(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def window(lines: list[dict], start: float, end: float, top: int = 40) -> dict | None:
    """The difference between the last line at or before ``start`` and the last at or
    before ``end`` (``time.time()`` seconds): phases as calls, total and mean ms, and the
    ``top`` functions by samples (leaf and inclusive) as shares of the samples."""
    before = [x for x in lines if x["t"] <= start]
    upto = [x for x in lines if x["t"] <= end]
    if not before or not upto or upto[-1]["t"] <= before[-1]["t"]:
        return None
    a, b = before[-1], upto[-1]
    span = b["t"] - a["t"]
    phases = {}
    for k, (n, s) in b["phases"].items():
        n0, s0 = a["phases"].get(k, [0, 0.0])
        if n - n0:
            phases[k] = {"calls": n - n0, "s": round(s - s0, 3),
                         "mean_ms": round(1e3 * (s - s0) / (n - n0), 3),
                         "share": round((s - s0) / span, 4)}
    samples = b["samples"] - a["samples"]

    def diff(key):
        d = {f: c - a[key].get(f, 0) for f, c in b[key].items()}
        best = sorted(((c, f) for f, c in d.items() if c > 0), reverse=True)[:top]
        return [[f, round(c / samples, 4)] for c, f in best] if samples else []

    return {"from_t": a["t"], "to_t": b["t"], "span_s": round(span, 3), "samples": samples,
            "phases": phases, "leaf": diff("leaf"), "incl": diff("incl")}
