"""pytest-benchmark: Proxima's allocator vs vLLM 0.26's FreeKVCacheBlockQueue, same trace.

Recorded figures come from:
    ./dev test tests/bench/test_allocator_bench.py --benchmark-enable -q -s -p no:cacheprovider
which also prints the ratios of time per op. Every round replays the whole trace on a
fresh pool (built outside the timed part), with the cyclic GC off for every side alike
(vLLM's engine freezes its heap; the 55,735 linked ``KVCacheBlock`` objects of vLLM's queue
otherwise draw full collections into its rounds). Under the default
``--benchmark-disable`` (CI) each replay runs once, as a check of what the trace did.
"""

import gc

import pytest

from tests.bench.alloc_trace import (Tally, make_trace, replay_proxima, replay_proxima_queue,
                                     replay_vllm, setup_proxima, setup_proxima_queue,
                                     setup_vllm)

NUM_BLOCKS = 55735
TRACE = make_trace()
ROUNDS = 7
RESULTS: dict[str, float] = {}
TALLIES: dict[str, Tally] = {}


ALLOCATED = sum(op[2] for op in TRACE if op[0] == "alloc")
def _bench(benchmark, name, setup, replay):
    def one_round():
        return (TRACE, setup(NUM_BLOCKS)), {}

    def timed(ops, pool):
        gc.disable()
        try:
            return replay(ops, pool)
        finally:
            gc.enable()

    tally = benchmark.pedantic(timed, setup=one_round, rounds=ROUNDS, iterations=1,
                               warmup_rounds=1)
    # What the trace did: every alloc served, every request freed whole, the claimed-back
    # blocks still held at the end, nothing else.
    assert tally.ops == len(TRACE) and tally.allocated == ALLOCATED
    assert tally.freed == tally.allocated
    assert 0 < tally.taken < len(TRACE) // 20
    assert tally.free_at_end == NUM_BLOCKS - 1 - tally.taken
    TALLIES[name] = tally
    if benchmark.stats is not None and not benchmark.disabled:
        RESULTS[name] = benchmark.stats.stats.median / len(TRACE)


@pytest.mark.benchmark(group="allocator-trace")
def test_proxima_allocator(benchmark):
    _bench(benchmark, "proxima", setup_proxima, replay_proxima)


@pytest.mark.benchmark(group="allocator-trace")
def test_proxima_free_queue(benchmark):
    pytest.importorskip("vllm")
    _bench(benchmark, "proxima-queue", setup_proxima_queue, replay_proxima_queue)


@pytest.mark.benchmark(group="allocator-trace")
def test_vllm_free_queue(benchmark):
    pytest.importorskip("vllm")
    _bench(benchmark, "vllm", setup_vllm, replay_vllm)


def test_zz_ratio_of_time_per_op(record_property, capsys):
    """The ratios compare like with like: all sides replayed the same operations in the
    same order and did the same work (equal tallies). The target is <= 1.10 (Proxima's
    allocator per op against vLLM's queue); it is recorded, not asserted (no timed
    assertion in tests: docs/benchmarks.md section 2 holds the figures)."""
    if len(TALLIES) < 3:
        pytest.skip("needs vLLM for the queue replays")
    assert TALLIES["proxima"] == TALLIES["vllm"] == TALLIES["proxima-queue"]
    if len(RESULTS) < 3:
        pytest.skip("benchmarks disabled: run with --benchmark-enable to get the ratios")
    ratio = RESULTS["proxima"] / RESULTS["vllm"]
    queue_ratio = RESULTS["proxima-queue"] / RESULTS["vllm"]
    assert all(0 < v < 1e-3 for v in RESULTS.values()), RESULTS     # a time per op, in s
    record_property("ratio", ratio)
    record_property("queue_ratio", queue_ratio)
    with capsys.disabled():
        print(f"\ntime per op over {len(TRACE)} ops (median of {ROUNDS} rounds): "
              f"vLLM FreeKVCacheBlockQueue {RESULTS['vllm'] * 1e6:.3f} us, "
              f"Proxima RunAllocator {RESULTS['proxima'] * 1e6:.3f} us (ratio {ratio:.3f}), "
              f"ProximaFreeQueue {RESULTS['proxima-queue'] * 1e6:.3f} us "
              f"(ratio {queue_ratio:.3f}); target <= 1.10")
