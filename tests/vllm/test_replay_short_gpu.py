"""When the GPU is short, no churn (issue 33, item 4), in the CPU replay: vLLM 0.26's real
scheduler, Proxima's real connector and policy, the stand-in worker on a simulated GPU
with room for fewer granules than the load asks for (``gpu_bytes``), mapping at the H200's
rate.

On the H200 an engine held below what it asked for (``--kv-min 30GiB`` beside another)
recorded 4,509 failed grows in 5 minutes and 11 s of worker map/unmap time. Here the same
situation, bounded: failed grows a minute and the worker's map and unmap seconds."""

from __future__ import annotations

import pytest

from proxima.vllm import elastic_v1

if elastic_v1.unsupported_reason("scheduler"):
    pytest.skip(elastic_v1.unsupported_reason("scheduler"), allow_module_level=True)

GiB = 1 << 30


def run(gpu_gib: float, min_gib: float, driver_free: bool):
    from proxima.replay import driver_v1
    from proxima.replay.elastic import MAP_GBPS_H200, ElasticReplay
    from proxima.workloads import make_workload

    spec = ElasticReplay(gpu_bytes=int(gpu_gib * GiB), min_bytes=int(min_gib * GiB),
                         release_delay_s=2.0, map_gbps=MAP_GBPS_H200,
                         driver_free=driver_free)
    result = driver_v1.run_replay(make_workload("bursts", 120, seed=0), proxima=True,
                                  num_blocks=2048, elastic=spec)
    return result, result.details["elastic"]


def test_a_minimum_the_gpu_cannot_back_costs_a_few_failed_grows_a_minute_not_one_a_second():
    """1 GiB of room and a 2 GiB minimum: every grow fails. Before the backoff the policy
    asked again every second (79 failed grows, 740 granules, in 139 simulated seconds:
    ~34 a minute); now 1, 2, 4, ... 30 s apart; and where the driver says what is free,
    not at all."""
    result, e = run(1, 2, driver_free=False)
    minutes = e["simulated_seconds"] / 60
    assert result.completed == 120 and result.blocks_leaked == 0
    assert 1 <= e["failed_grow_attempts"] <= 6 * minutes + 5     # the pauses' doubling
    assert e["failed_grows_per_minute"] <= 6
    assert e["worker_map_seconds"] + e["worker_unmap_seconds"] <= 0.001 * e["simulated_seconds"]
    assert e["mapped"] == 32                          # what it holds, it keeps

    result, e = run(1, 2, driver_free=True)
    assert result.completed == 120
    assert e["failed_grow_attempts"] == 0 and e["failed_grows"] == 0
    assert e["worker_map_seconds"] == 0.0


def test_a_load_beyond_the_gpu_grows_to_the_room_there_is_and_no_further():
    """3 GiB of room (48 granules) for a 4 GiB pool under bursts: the engine grows to the
    room and gives back between bursts; without the driver's word the failed grows stay a
    few a minute and the worker's map and unmap time under 1% of the run."""
    result, e = run(3, 0, driver_free=False)
    minutes = e["simulated_seconds"] / 60
    assert result.completed == 120 and result.blocks_leaked == 0
    assert e["grows"] >= 10 and e["shrinks"] >= 1 and e["bytes_returned"] > 0
    assert 1 <= e["failed_grow_attempts"] <= 6 * minutes + 5
    assert e["failed_grows_per_minute"] <= 6
    busy = e["worker_map_seconds"] + e["worker_unmap_seconds"]
    assert 0 < busy <= 0.01 * e["simulated_seconds"]
    # the worker's seconds are what it mapped and unmapped at the H200's rates, plus a
    # granule's map for each failed try (the part of a granule made and given back)
    from proxima.replay.elastic import MAP_GBPS_H200, UNMAP_GBPS_H200

    B = e["bytes_per_granule"]
    assert e["worker_map_seconds"] == pytest.approx(
        (e["granules_mapped"] + e["failed_grow_attempts"]) * B / (MAP_GBPS_H200 * 1e9))
    assert e["worker_unmap_seconds"] <= e["granules_unmapped"] * B / (UNMAP_GBPS_H200 * 1e9)
