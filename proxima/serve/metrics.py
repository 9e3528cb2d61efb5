"""Proxima's Prometheus metrics, read from the engine's status file at each scrape.

The block pool lives in the engine-core process; the API server only sees the JSON snapshot
the engine writes (:mod:`proxima.vllm.status`). A custom collector turns the latest
snapshot into metric families when ``/metrics`` is scraped, so there is nothing to update
and nothing stale to reset. Registered once per process in the registry vLLM's ``/metrics``
serves (prometheus_client's default registry in a one-API-server setup).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily,
                                    GaugeMetricFamily, Metric)
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from proxima.vllm.status import read_status

# Blocks per run of a running request: 1 = every block its own run (scattered), N = all of a
# request's N blocks in one run. Powers of two up to the longest runs worth telling apart.
BLOCKS_PER_RUN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


class ProximaCollector(Collector):
    """Metric families from the status file at ``path()`` (None: no file, only proxima_active)."""

    def __init__(self, path: Callable[[], Path | None] | None = None,
                 clock: Callable[[], float] = time.time):
        from proxima.vllm.status import stats_path

        self._path = path or stats_path
        self._clock = clock

    def describe(self) -> list[Metric]:
        # Returning no descriptions keeps registration from calling collect() (a file read).
        return []

    def collect(self) -> Iterator[Metric]:
        path = self._path()
        status = read_status(path) if path is not None else None
        active = bool(status and status.get("active"))
        yield _gauge("proxima_active", "1 when the engine reports Proxima's block pool active",
                     1 if active else 0)
        if not status:
            return
        if "time" in status:
            yield _gauge("proxima_status_age_seconds",
                         "seconds since the engine last wrote its status",
                         max(0.0, self._clock() - float(status["time"])))
        alloc = status.get("allocator") or {}
        for key, name, doc in (
                ("num_blocks", "proxima_blocks", "blocks in the KV-cache pool"),
                ("num_free", "proxima_free_blocks", "free blocks in the pool"),
                ("largest_free_run", "proxima_largest_free_run_blocks",
                 "length of the longest run of consecutive free blocks"),
                ("fragmentation", "proxima_fragmentation_index",
                 "1 - largest free run / free blocks (0 = all free blocks in one run)"),
                ("num_free_runs", "proxima_free_runs",
                 "maximal runs of consecutive free blocks")):
            if alloc.get(key) is not None:
                yield _gauge(name, doc, alloc[key])
        by_order = alloc.get("free_runs_by_order")
        if by_order:
            family = GaugeMetricFamily(
                "proxima_free_runs_by_order",
                "free runs whose length is in [2**order, 2**(order+1)) blocks", labels=["order"])
            for order, count in enumerate(by_order):
                family.add_metric([str(order)], float(count))
            yield family
        if status.get("num_evictable") is not None:
            yield _gauge("proxima_evictable_blocks",
                         "free blocks that still hold a cached prefix", status["num_evictable"])
        runs = status.get("running_blocks_per_run")
        if runs is not None:
            yield _gauge("proxima_running_requests", "running requests in the last snapshot",
                         len(runs))
            yield blocks_per_run_histogram(runs)
        seconds, steps = status.get("alloc_seconds_total"), status.get("steps")
        if seconds is not None:
            yield CounterMetricFamily("proxima_allocator_seconds",
                                      "time spent in Proxima's allocator", value=float(seconds))
        if steps is not None:
            yield CounterMetricFamily("proxima_scheduler_steps",
                                      "scheduler steps the engine has run", value=float(steps))
        if seconds is not None and steps:
            yield _gauge("proxima_allocator_seconds_per_step",
                         "allocator time per scheduler step, mean since the engine started "
                         "(rate(proxima_allocator_seconds_total) / "
                         "rate(proxima_scheduler_steps_total) for a recent window)",
                         float(seconds) / float(steps))
        yield from _elastic_metrics(status.get("elastic"))
        yield from compaction_metrics(status.get("compaction"))
        if "invariants_ok" in status:
            yield _gauge("proxima_invariants_ok",
                         "1 when the engine's last allocator invariant check passed",
                         1 if status["invariants_ok"] else 0)


#: elastic KV memory: (status key, metric name, kind, help)
ELASTIC_METRICS = (
    ("mapped_bytes", "proxima_kv_mapped_bytes", "gauge",
     "KV memory backed by GPU memory now (elastic KV)"),
    ("used_bytes", "proxima_kv_used_bytes", "gauge",
     "KV memory holding blocks in use by requests"),
    ("reclaimable_bytes", "proxima_kv_reclaimable_bytes", "gauge",
     "mapped KV memory in granules without a live block (can be given back)"),
    ("pool_bytes", "proxima_kv_pool_bytes", "gauge",
     "the KV pool's reserved size (the most that can be mapped)"),
    ("min_bytes", "proxima_kv_min_bytes", "gauge", "the configured minimum of mapped KV memory"),
    ("max_bytes", "proxima_kv_max_bytes", "gauge", "the configured maximum of mapped KV memory"),
    ("short", "proxima_kv_short", "gauge",
     "1 while the last grow could not be backed (another process holds the GPU memory)"),
    ("grows", "proxima_kv_grows", "counter", "grow decisions (maps sent)"),
    ("shrinks", "proxima_kv_shrinks", "counter", "shrink decisions (unmaps sent)"),
    ("failed_grows", "proxima_kv_failed_grows", "counter",
     "granules the GPU could not back when asked"),
    ("bytes_returned", "proxima_kv_returned_bytes", "counter",
     "KV memory given back to the GPU"),
    ("evicted_cached", "proxima_kv_evicted_cached_blocks", "counter",
     "cached prefix blocks evicted because their memory was given back"),
)


def _elastic_metrics(elastic) -> Iterator[Metric]:
    if not isinstance(elastic, dict):
        return
    for key, name, kind, doc in ELASTIC_METRICS:
        value = elastic.get(key)
        if value is None or isinstance(value, str):
            continue
        if kind == "counter":
            yield CounterMetricFamily(name, doc, value=float(value))
        else:
            yield _gauge(name, doc, float(value))
def compaction_metrics(c: dict | None) -> Iterator[Metric]:
    """KV compaction's figures (``"compaction"`` in the status, when it is on): block
    copies, bytes, moving steps, and the stall it adds per moving step (p50/p99 of the
    workers' GPU time and of the scheduler's planning time, over recent steps)."""
    if not c:
        return
    for key, name, doc in (
            ("relocations", "proxima_compaction_block_copies",
             "KV blocks copied by compaction (every layer)"),
            ("bytes_moved", "proxima_compaction_bytes", "bytes of KV copied by compaction"),
            ("steps_with_moves", "proxima_compaction_moving_steps",
             "scheduler steps whose forward was preceded by compaction copies"),
            ("live_moved", "proxima_compaction_live_blocks_moved",
             "blocks in use moved (their requests' block tables rewritten)"),
            ("cached_moved", "proxima_compaction_cached_blocks_moved",
             "cached free blocks moved with their prefix-cache entries")):
        if c.get(key) is not None:
            yield CounterMetricFamily(name, doc, value=float(c[key]))
    for key, name, doc in (
            ("gpu_ms", "proxima_compaction_stall_gpu_ms",
             "GPU time of a moving step's compaction (copies and table writes), ms"),
            ("plan_ms", "proxima_compaction_plan_ms",
             "scheduler time of a step's compaction planning, ms")):
        sample = c.get(key) or {}
        if sample.get("p50") is not None:
            family = GaugeMetricFamily(name, doc, labels=["quantile"])
            family.add_metric(["0.5"], float(sample["p50"]))
            family.add_metric(["0.99"], float(sample["p99"]))
            yield family


def blocks_per_run_histogram(values: list[float]) -> GaugeHistogramMetricFamily:
    """A gauge histogram: the distribution now, not a running total (requests come and go)."""
    buckets, count = [], 0
    ordered = sorted(float(v) for v in values)
    for bound in BLOCKS_PER_RUN_BUCKETS:
        while count < len(ordered) and ordered[count] <= bound:
            count += 1
        buckets.append((str(float(bound)), float(count)))
    buckets.append(("+Inf", float(len(ordered))))
    return GaugeHistogramMetricFamily(
        "proxima_blocks_per_run",
        "blocks per contiguous run of each running request (higher = more contiguous)",
        buckets=buckets, gsum_value=float(sum(ordered)))


_registered: dict[int, ProximaCollector] = {}


def register(registry: CollectorRegistry = REGISTRY) -> ProximaCollector:
    """Register the collector once per registry (the app factory may run more than once)."""
    if id(registry) not in _registered:
        _registered[id(registry)] = ProximaCollector()
        registry.register(_registered[id(registry)])
    return _registered[id(registry)]


def add_to_vllm0_app(app) -> None:
    """vLLM 0.6 with its multiprocessing front end (the default) serves ``/metrics`` from a
    registry of its own (a MultiProcessCollector over ``PROMETHEUS_MULTIPROC_DIR``, where the
    engine process writes), not from the default registry: mount the same exposition with
    Proxima's collector added. Without that directory (engine in this process) vLLM 0.6
    serves the default registry, where :func:`register` already put Proxima's collector."""
    import os
    import re

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    from prometheus_client import make_asgi_app, multiprocess
    from starlette.routing import Mount

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(ProximaCollector())
    routes = app.router.routes
    for i, route in enumerate(routes):
        if isinstance(route, Mount) and route.path == "/metrics":
            mount = Mount("/metrics", make_asgi_app(registry=registry))
            mount.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as vLLM 0.6 (no 307)
            routes[i] = mount
            return
