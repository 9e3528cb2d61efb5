"""Request latency in the CPU replay (issue 33, item 1): queue wait and time to first token
counted alike on both sides, the stand-in worker's map time, and the 1.02x parity rule.

vLLM 0.26's real scheduler and Proxima's real connector and policy; the worker is the
replay's stand-in (:class:`proxima.replay.elastic.ReplayWorker`), timed as the H200's."""

from __future__ import annotations

import json

import pytest

from proxima.cli import main
from proxima.vllm import elastic_v1
from proxima.replay.table import LATENCY_PARITY, format_table, parity_checks
from proxima.replay.result import LATENCY_FIELDS

LATENCY = LATENCY_FIELDS
elastic_only = pytest.mark.skipif(bool(elastic_v1.unsupported_reason("scheduler")),
                                  reason=str(elastic_v1.unsupported_reason("scheduler")))


def replay(tmp_path, *argv):
    """The replay's report; its exit status is the parity line's (1: a check failed)."""
    out = tmp_path / "r.json"
    code = main(["replay", "--no-progress", "--json", str(out), *argv])
    report = json.loads(out.read_text())
    assert code == (0 if all(report["checks"].values()) else 1)
    return report


@elastic_only
def test_idle_steps_of_a_release_delay_count_in_steps_but_not_in_latency(tmp_path, capsys):
    """`--requests 3 --elastic`: the elastic side steps through its 10 s release delay (400
    steps) after the load, stock does not; the busy steps and every request's wait and
    time to first token are the same, and parity holds. Started at one granule
    (--kv-initial): the default's start-up size (twice the warm-up) would be excess from
    start-up, its delay running from the first step, not from the load's end."""
    report = replay(tmp_path, "--workload", "chat", "--requests", "3", "--elastic",
                    "--map-gbps", "0", "--granule-blocks", "32",   # 2 MiB: there is a release
                    "--kv-initial", "64MiB")
    s, p = report["results"]["stock"], report["results"]["proxima"]
    assert p["steps"] - s["steps"] == 400                 # 10 s / 25 ms of idle steps
    assert p["busy_steps"] == s["busy_steps"] > 0
    for key in LATENCY:
        assert p[key] == s[key], key
    assert s["ttft_p50_steps"] >= 1                       # a token comes at a step's end
    assert all(report["checks"][f"{k.removesuffix('_steps')}_within_{LATENCY_PARITY}x"]
               for k in LATENCY)
    table = capsys.readouterr().out
    assert "busy_steps" in table and "ttft_p99_steps" in table
    assert "parity checks: all passed" in table


def test_latency_of_a_stock_run_and_a_non_elastic_proxima_run_is_the_same(tmp_path):
    """Proxima's pool without --elastic schedules as stock does, step for step: so do its
    requests' waits."""
    report = replay(tmp_path, "--workload", "pressure", "--requests", "60", "--num-blocks",
                    "300")
    s, p = report["results"]["stock"], report["results"]["proxima"]
    assert s["preemptions"] > 0
    assert s["queue_wait_p99_steps"] > s["queue_wait_p50_steps"]   # requests did queue
    for key in (*LATENCY, "busy_steps", "queue_wait_steps", "ttft_steps"):
        assert p[key] == s[key], key
    n = s["ttft_steps"]["n"]
    assert n == s["completed"] == 60
    assert s["ttft_steps"]["max"] >= s["ttft_p99_steps"] >= s["ttft_p50_steps"] >= 1


def _granules(n_granules=16):
    from proxima.memory.channel import UNMAPPED, ElasticChannel

    ch = ElasticChannel(n_granules * 32, 32)
    ch.state[1:] = bytes([UNMAPPED]) * (n_granules - 1)
    return ch


@elastic_only
def test_the_stand_in_worker_reports_a_map_once_the_h200_would_have_done_it():
    """64 MiB granules at 25 GB/s: 2.68 ms each. Twelve of them (32.2 ms) handed over at
    the start of step 0 (25 ms a step) are reported in step 1's output, not step 0's. Eight
    more handed over in step 1 would take 21.5 ms alone (done within step 1) but wait for
    the twelve (one mapping thread): done at 53.7 ms, in step 2's output. Unmaps take
    time on the same thread."""
    from proxima.replay.elastic import ReplayWorker

    ch = _granules(32)
    B, dt = 64 << 20, 0.025
    worker = ReplayWorker(ch, None, B, map_gbps=25.0, unmap_gbps=50.0)
    ch.map(1, 12)
    worker.submit(type("M", (), {"batch": ch.build()})(), 0 * dt)
    ch.map(13, 8)
    worker.submit(type("M", (), {"batch": ch.build()})(), 1 * dt)
    assert worker.report(1 * dt) is None                  # step 0's output: not yet
    first = worker.report(2 * dt)                         # step 1's: the first batch only
    assert [seq for seq, _ in first.report.applied] == [0]
    assert first.report.mapped_granules == 13
    assert first.report.map_seconds == pytest.approx(12 * B / 25e9)
    ch.on_report(first.report)
    assert ch.count(0) == 13                              # MAPPED: allocatable now
    second = worker.report(3 * dt)
    assert [seq for seq, _ in second.report.applied] == [1]
    assert second.report.map_seconds == pytest.approx(20 * B / 25e9)
    ch.on_report(second.report)
    ch.unmap(1, 20)
    worker.submit(type("M", (), {"batch": ch.build()})(), 3 * dt)
    assert worker.report(4 * dt) is None                  # 26.8 ms of unmaps: step 4
    third = worker.report(5 * dt)
    assert third.report.unmap_seconds == pytest.approx(20 * B / 50e9)
    assert third.report.mapped_granules == 1


@elastic_only
def test_without_map_time_every_batch_is_reported_in_the_step_that_carried_it():
    from proxima.replay.elastic import ReplayWorker

    ch = _granules()
    worker = ReplayWorker(ch, None, 64 << 20, map_gbps=0.0)
    ch.map(1, 15)
    worker.submit(type("M", (), {"batch": ch.build()})(), 7 * 0.025)
    meta = worker.report(8 * 0.025)
    assert meta is not None and meta.report.map_seconds == 0.0
    assert meta.report.mapped_granules == 16


@elastic_only
def test_a_slow_map_makes_requests_wait_and_parity_says_so(tmp_path, capsys):
    """Bursts that grow the pool from its minimum (--kv-initial: one granule, not the
    default's start-up size, twice the warm-up), with a worker mapping at 0.5 GB/s (a
    64 MiB granule in 134 ms, five steps): requests wait for the maps, and the parity line
    fails on request latency while the other checks still pass. At the H200's rate the
    worker's map seconds are the granules mapped over it."""
    args = ["--workload", "bursts", "--requests", "120", "--num-blocks", "2048",
            "--release-delay", "2", "--elastic", "--kv-initial", "64MiB"]
    slow = replay(tmp_path, *args, "--map-gbps", "0.5")
    table = capsys.readouterr().out
    s, p = slow["results"]["stock"], slow["results"]["proxima"]
    assert p["completed"] == s["completed"] == 120
    assert p["ttft_p99_steps"] > LATENCY_PARITY * s["ttft_p99_steps"]
    assert slow["checks"]["ttft_p99_within_1.02x"] is False
    assert slow["checks"]["no_blocks_leaked"] is True
    parity = table.strip().splitlines()[-1]
    assert parity.startswith("parity checks: FAILED (") and "ttft_p99_within_1.02x" in parity
    e = p["elastic"]
    B = e["bytes_per_granule"]
    assert e["worker_map_seconds"] == pytest.approx(e["granules_mapped"] * B / 0.5e9)
    assert "worker map" in table

    h200 = replay(tmp_path, *args)      # the default: the H200's rate for this granule
    assert h200["elastic"]["map_gbps"] == 25.0 * 8        # 256 blocks: 16 MiB a layer
    e = h200["results"]["proxima"]["elastic"]
    assert e["worker_map_seconds"] == pytest.approx(e["granules_mapped"] * B / 200e9)
    assert h200["results"]["proxima"]["ttft_p99_steps"] < p["ttft_p99_steps"]


def _side(**figures):
    base = {"completed": 10, "steps": 120, "peak_running": 4, "blocks_per_run": 1.0,
            "single_run_fraction": 1.0, "preemptions": 0, "prefix_hit_rate": 0.5,
            "blocks_leaked": 0,
            "scheduler_ms_per_step": 1.0, "busy_steps": 100, "queue_wait_p50_steps": 0,
            "queue_wait_p99_steps": 50, "ttft_p50_steps": 10, "ttft_p99_steps": 100}
    return {**base, **figures}


@pytest.mark.parametrize("proxima, failed", [
    ({}, []),
    ({"ttft_p99_steps": 102}, []),                                 # 1.02x: still parity
    ({"ttft_p99_steps": 103}, ["ttft_p99_within_1.02x"]),
    ({"ttft_p50_steps": 11, "queue_wait_p99_steps": 52},
     ["queue_wait_p99_within_1.02x", "ttft_p50_within_1.02x"]),
    ({"queue_wait_p50_steps": 1}, ["queue_wait_p50_within_1.02x"]),    # stock's 0: only 0
    ({"ttft_p99_steps": 90, "queue_wait_p99_steps": 10}, []),          # faster is fine
])
def test_parity_fails_when_request_latency_is_above_1_02x_stocks(proxima, failed):
    results = {"stock": _side(), "proxima": _side(**proxima)}
    checks = parity_checks(results)
    assert sorted(k for k, v in checks.items() if v is False) == failed
    line = format_table({"results": results, "checks": checks}).splitlines()[-1]
    if failed:
        assert line.startswith(f"parity checks: FAILED ({', '.join(failed)})")
    else:
        assert line.startswith("parity checks: all passed")


def test_a_driver_without_latency_figures_keeps_the_old_checks():
    """The V0 driver measures no request latency: no latency check, none failed."""
    side = {k: v for k, v in _side().items() if k not in LATENCY}
    checks = parity_checks({"stock": side, "proxima": side})
    assert not any("within_1.02x" in k for k in checks)


@pytest.mark.parametrize("argv, message", [
    (["--elastic", "--map-gbps", "-1"], "--map-gbps: '-1' is out of range: give GB/s (0: at once) from 0"),
    (["--elastic", "--map-gbps", "nan"], "--map-gbps: 'nan' is not finite"),
])
def test_a_bad_map_rate_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["replay", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
