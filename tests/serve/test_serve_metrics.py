"""Proxima's Prometheus metrics come from the engine's status file, read at each scrape."""

from __future__ import annotations


import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxima.allocator import RunAllocator
from proxima.vllm.status import write_status
from proxima.serve.metrics import ProximaCollector


def scrape(path) -> dict:
    registry = CollectorRegistry()
    registry.register(ProximaCollector(path=lambda: path, clock=lambda: 1_000.0))
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def a_fragmented_pool() -> RunAllocator:
    pool = RunAllocator(1000)
    runs = [pool.allocate(n) for n in (7, 30, 5, 100, 3)]
    pool.free(runs[1])
    pool.free(runs[3])
    return pool


def test_gauges_follow_the_status_file(tmp_path):
    pool = a_fragmented_pool()
    stats = pool.stats()
    path = tmp_path / "engine-status.json"
    write_status({"active": True, "engine": "vllm-v1", "num_blocks": 1000, "block_size": 16,
                  "allocator": stats, "num_evictable": 12,
                  "running_blocks_per_run": [1.0, 1.5, 3.0, 8.0, 200.0],
                  "alloc_seconds_total": 0.25, "steps": 500, "invariants_ok": True}, path)
    got = scrape(path)
    g = lambda name, **labels: got[(name, tuple(sorted(labels.items())))]
    assert g("proxima_active") == 1
    assert g("proxima_blocks") == 1000
    assert g("proxima_free_blocks") == pool.num_free == stats["num_free"]
    assert g("proxima_largest_free_run_blocks") == pool.largest_free_run
    assert g("proxima_fragmentation_index") == pytest.approx(pool.fragmentation)
    assert g("proxima_free_runs") == pool.num_free_runs > 1
    for order, count in enumerate(stats["free_runs_by_order"]):
        assert g("proxima_free_runs_by_order", order=str(order)) == count
    assert g("proxima_evictable_blocks") == 12
    assert g("proxima_running_requests") == 5
    # the histogram of running requests: cumulative counts per upper bound
    assert g("proxima_blocks_per_run_bucket", le="1.0") == 1
    assert g("proxima_blocks_per_run_bucket", le="2.0") == 2
    assert g("proxima_blocks_per_run_bucket", le="4.0") == 3
    assert g("proxima_blocks_per_run_bucket", le="8.0") == 4
    assert g("proxima_blocks_per_run_bucket", le="128.0") == 4
    assert g("proxima_blocks_per_run_bucket", le="+Inf") == 5
    assert g("proxima_blocks_per_run_gsum") == pytest.approx(213.5)
    assert g("proxima_allocator_seconds_total") == 0.25
    assert g("proxima_scheduler_steps_total") == 500
    assert g("proxima_allocator_seconds_per_step") == pytest.approx(0.0005)
    assert g("proxima_invariants_ok") == 1
    assert 0 <= g("proxima_status_age_seconds")


def test_each_scrape_reads_the_latest_snapshot(tmp_path):
    path = tmp_path / "s.json"
    pool = RunAllocator(64)
    write_status({"active": True, "allocator": pool.stats()}, path)
    assert scrape(path)[("proxima_free_blocks", ())] == 64
    pool.allocate(10)
    write_status({"active": True, "allocator": pool.stats(), "invariants_ok": False}, path)
    got = scrape(path)
    assert got[("proxima_free_blocks", ())] == 54
    assert got[("proxima_invariants_ok", ())] == 0


def test_no_status_file_exposes_only_proxima_active_0(tmp_path):
    got = scrape(tmp_path / "missing.json")
    assert got == {("proxima_active", ()): 0}
    assert scrape(None) == {("proxima_active", ()): 0}


def test_status_age(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"active": false, "time": 990.0}')
    got = scrape(path)
    assert got[("proxima_active", ())] == 0
    assert got[("proxima_status_age_seconds", ())] == 10.0


def test_compaction_figures_appear_when_the_engine_compacts(tmp_path):
    path = tmp_path / "s.json"
    write_status({"active": True, "allocator": RunAllocator(64).stats()}, path)
    assert not any(name.startswith("proxima_compaction") for name, _ in scrape(path))
    compaction = {"mode": "auto", "relocations": 120, "bytes_moved": 120 * 2 << 20,
                  "steps_with_moves": 7, "live_moved": 50, "cached_moved": 60,
                  "gpu_ms": {"p50": 0.05, "p99": 0.4, "max": 0.5},
                  "plan_ms": {"p50": None, "p99": None, "max": None}}
    write_status({"active": True, "allocator": RunAllocator(64).stats(),
                  "compaction": compaction}, path)
    got = scrape(path)
    g = lambda name, **labels: got[(name, tuple(sorted(labels.items())))]
    assert g("proxima_compaction_block_copies_total") == 120
    assert g("proxima_compaction_bytes_total") == 120 * 2 << 20
    assert g("proxima_compaction_moving_steps_total") == 7
    assert g("proxima_compaction_live_blocks_moved_total") == 50
    assert g("proxima_compaction_cached_blocks_moved_total") == 60
    assert g("proxima_compaction_stall_gpu_ms", quantile="0.5") == 0.05
    assert g("proxima_compaction_stall_gpu_ms", quantile="0.99") == 0.4
    assert not any(name == "proxima_compaction_plan_ms" for name, _ in got)   # no samples
