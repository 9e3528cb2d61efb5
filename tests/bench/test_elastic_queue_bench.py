"""pytest-benchmark: the elastic free queue alone, on the calls of (d)'s closed loop.

Recorded figures come from:
    ./dev test tests/bench/test_elastic_queue_bench.py --benchmark-enable -q -s -p no:cacheprovider
(``PROXIMA_BENCH_REQUESTS`` sets the replay's size, default 400; docs/benchmarks.md section
7.3 used 3,000). Each round replays the recorded calls on a fresh queue
(:mod:`tests.bench.elastic_trace`), the cyclic GC off; ``cold`` sums 100,000 floats between
two calls (the queue's code and data out of the cache, as in an engine). Under the default
``--benchmark-disable`` (CI) each replay runs once, as a check: every hand-out returns the
ids it returned when the calls were recorded.
"""

import gc
import os

import pytest

pytest.importorskip("vllm")

from tests.bench.elastic_trace import record, replay, setup  # noqa: E402

REQUESTS = int(os.environ.get("PROXIMA_BENCH_REQUESTS", "400"))
ROUNDS = 5


@pytest.fixture(scope="module")
def trace():
    from proxima.vllm import elastic_v1

    reason = elastic_v1.unsupported_reason("scheduler")
    if reason:
        pytest.skip(reason)
    return record(REQUESTS)


@pytest.mark.benchmark(group="elastic-queue")
@pytest.mark.parametrize("thrash", [0, 100_000], ids=["warm", "cold"])
def test_elastic_queue_replays_its_decisions(benchmark, trace, thrash, capsys):
    if thrash and benchmark.disabled:
        pytest.skip("the cold replay only times (run with --benchmark-enable)")
    kinds = {op[0] for op in trace["ops"]}
    # the load did what (d) does: hand-outs, frees with and without a hash, misses, ticks,
    # and the policy's grows
    assert {"pop", "append", "prepend", "miss", "tick", "mapped"} <= kinds

    def timed(trace, queue, blocks):
        gc.disable()
        try:
            return replay(trace, queue, blocks, thrash)
        finally:
            gc.enable()

    seconds, mismatches = benchmark.pedantic(
        timed, setup=lambda: ((trace, *setup(trace)), {}),
        rounds=1 if thrash else ROUNDS, iterations=1)
    assert mismatches == 0
    queue, blocks = setup(trace)
    replay(trace, queue, blocks)
    queue.check()                          # the buddy, the index and the tiers agree
    if not benchmark.disabled:
        pops = sum(1 for op in trace["ops"] if op[0] == "pop")
        with capsys.disabled():
            print(f"\n  {'cold' if thrash else 'warm'}: " + ", ".join(
                f"{k} {1e3 * v:.1f} ms" for k, v in sorted(seconds.items(), key=lambda x: -x[1]))
                + f"; {1e6 * seconds['pop'] / pops:.2f} us a hand-out")
