"""The two-engine replay's pure parts (no vLLM): its workloads and the shared GPU's rule
that a map succeeds only while both engines' workers together hold less than the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from proxima.errors import UserError
from proxima.memory.channel import ElasticChannel
from proxima.memory.ops import Report
from proxima.replay.shared_gpu import Gpu, GpuWorker
from proxima.workloads import TWO_BURST_GAP_STEPS, TWO_OUTPUT, TWO_PROMPT, \
    make_two_engine_workload


def test_both_shapes_replay_the_same_requests_one_list_per_engine():
    bursts = make_two_engine_workload("alternating-bursts", 60, seed=3)
    steady = make_two_engine_workload("steady", 60, seed=3, in_flight=7)
    for a, b in zip(bursts.engines, steady.engines):
        assert [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in a.requests] == \
            [(r.request_id, r.prompt_token_ids, r.max_tokens) for r in b.requests]
    a, b = bursts.engines
    assert len(a.requests) == len(b.requests) == 30
    assert {r.request_id[0] for r in a.requests} == {"A"}
    for r in a.requests + b.requests:
        assert TWO_PROMPT[0] <= r.prompt_len <= TWO_PROMPT[1]
        assert TWO_OUTPUT[0] <= r.max_tokens <= TWO_OUTPUT[1]
    # the engines' prompts differ (each its own system prompts)
    assert a.requests[0].prompt_token_ids[:256] != b.requests[0].prompt_token_ids[:256]
    assert steady.engines[0].concurrency == 7 and bursts.engines[0].concurrency is None
    assert all(r.arrival_step == 0 for w in steady.engines for r in w.requests)


def test_alternating_bursts_take_turns_a_then_b_three_times():
    a, b = make_two_engine_workload("alternating-bursts", 288).engines
    gap = TWO_BURST_GAP_STEPS
    for engine, first in ((a, 0), (b, 1)):
        bursts = sorted({r.arrival_step // gap for r in engine.requests})
        assert bursts == [first, first + 2, first + 4]
        for k in bursts:
            arrivals = [r.arrival_step for r in engine.requests if r.arrival_step // gap == k]
            assert len(arrivals) == 48 and max(arrivals) - k * gap <= 50


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="chat"), "unknown two-engine workload 'chat'"),
    (dict(name="steady", requests=1, in_flight=1), "leaves an engine without requests"),
    (dict(name="steady", max_model_len=2048, in_flight=1), "--max-model-len 2048 is too short"),
])
def test_bad_two_engine_workloads_are_refused_in_one_line(kwargs, message):
    with pytest.raises(UserError, match=message):
        make_two_engine_workload(**kwargs)


def _engine(gpu, granules=8):
    ch = ElasticChannel(granules * 4, 4)
    ch.state[1:] = bytes([1]) * (granules - 1)      # granule 0 mapped, as at start-up
    return ch, GpuWorker(gpu, ch, bytes_per_granule=1 << 20, map_gbps=0, unmap_gbps=0)


def test_a_map_beyond_the_gpu_fails_whichever_engine_holds_the_memory():
    gpu = Gpu(granules=6, bytes_per_granule=1 << 20)
    ch_a, a = _engine(gpu)
    ch_b, b = _engine(gpu)
    assert gpu.held() == 2 and gpu.memory() == (4 << 20, 6 << 20)

    def deliver(ch, worker):
        worker.submit(SimpleNamespace(batch=ch.build()), 0.0)
        _, entry, mapped, _, _ = worker.queued.popleft()
        ch.on_report(Report((entry,), mapped, ch.granule_blocks))
        return entry[1]                           # the failed (first, count) ranges

    def send(ch, worker, first, count):
        ch.map(first, count)
        return deliver(ch, worker)

    assert send(ch_a, a, 1, 3) == ()              # A: 4 granules, B: 1
    assert send(ch_b, b, 1, 3) == ((2, 2),)       # B gets one more, the GPU is full
    assert len(a.mapped) + len(b.mapped) == 6 == gpu.held()
    gpu.sample()
    assert gpu.peak_granules == 6
    ch_a.unmap(2, 2)                              # A gives two back: B may map them
    deliver(ch_a, a)
    assert b.capacity - len(b.mapped) == 2
    assert send(ch_b, b, 2, 2) == () and gpu.held() == 6
