"""pytest-benchmark: Proxima's allocator vs vLLM 0.26's FreeKVCacheBlockQueue, same trace.

Recorded figures come from:
    ./dev test tests/bench/test_allocator_bench.py --benchmark-enable -q
which also prints the ratio of time per op. Under the default ``--benchmark-disable``
(CI) each replay runs once, as a correctness check of the trace on both allocators.
"""

import pytest

from tests.bench.alloc_trace import make_trace, replay_proxima, replay_vllm

NUM_BLOCKS = 55735
TRACE = make_trace()
RESULTS: dict[str, float] = {}


def _bench(benchmark, name, fn):
    n = benchmark.pedantic(fn, args=(TRACE, NUM_BLOCKS), rounds=5, iterations=1,
                           warmup_rounds=1)
    assert n == len(TRACE)
    if benchmark.stats is not None and not benchmark.disabled:
        RESULTS[name] = benchmark.stats.stats.median / len(TRACE)


@pytest.mark.benchmark(group="allocator-trace")
def test_proxima_allocator(benchmark):
    _bench(benchmark, "proxima", replay_proxima)


@pytest.mark.benchmark(group="allocator-trace")
def test_vllm_free_queue(benchmark):
    pytest.importorskip("vllm")
    _bench(benchmark, "vllm", replay_vllm)


def test_zz_ratio_of_time_per_op(capsys):
    if len(RESULTS) < 2:
        pytest.skip("benchmarks disabled: run with --benchmark-enable to get the ratio")
    ratio = RESULTS["proxima"] / RESULTS["vllm"]
    with capsys.disabled():
        print(f"\ntime per op over {len(TRACE)} ops: proxima {RESULTS['proxima'] * 1e6:.3f} us, "
              f"vLLM FreeKVCacheBlockQueue {RESULTS['vllm'] * 1e6:.3f} us, "
              f"ratio {ratio:.3f}")
    assert ratio > 0
