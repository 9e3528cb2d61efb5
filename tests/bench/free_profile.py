"""How vLLM's frees reach the buddy allocator, measured on a replay (issue 12, item 2).

vLLM frees a request's blocks tail first (``SingleTypeKVCacheManager.free`` reverses the
table so the tail is evicted first); blocks without a prefix-cache hash reach
``ProximaFreeQueue.prepend_n`` in that order. This replays a workload through vLLM's real
scheduler with Proxima and reports how many ranges the buddy gave back (one per maximal
piece of consecutive ids it was handed), how many ids, and the time spent in
``prepend_n``:

    ./dev python -m tests.bench.free_profile --workload sharegpt --no-prefix-caching
"""

from __future__ import annotations

import argparse
import time

from proxima.allocator import RunAllocator
from proxima.vllm import vllm_v1
from proxima.replay.driver_v1 import run_replay
from proxima.workloads import WORKLOADS, make_workload


def profile(workload: str, requests: int | None, prefix_caching: bool, num_blocks: int) -> dict:
    counts = {"prepend_calls": 0, "prepend_ids": 0, "prepend_seconds": 0.0, "ranges": 0}
    cls = RunAllocator
    original_give_back = cls._give_back_range
    original_prepend = vllm_v1.ProximaFreeQueue.prepend_n
    inside = [False]

    def give_back(self, start, end):
        if inside[0]:
            counts["ranges"] += 1
        return original_give_back(self, start, end)

    def prepend_n(self, blocks):
        counts["prepend_calls"] += 1
        counts["prepend_ids"] += len(blocks)
        inside[0] = True
        t0 = time.perf_counter()
        try:
            return original_prepend(self, blocks)
        finally:
            counts["prepend_seconds"] += time.perf_counter() - t0
            inside[0] = False

    cls._give_back_range = give_back
    vllm_v1.ProximaFreeQueue.prepend_n = prepend_n
    try:
        result = run_replay(make_workload(workload, requests, seed=0), proxima=True,
                            num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    finally:
        cls._give_back_range = original_give_back
        vllm_v1.ProximaFreeQueue.prepend_n = original_prepend
    counts["completed"] = result["completed"]
    counts["blocks_per_run"] = result["blocks_per_run"]
    return counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=55735)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="runs; prepend_n time: median")
    args = parser.parse_args(argv)
    runs = [profile(args.workload, args.requests, not args.no_prefix_caching, args.num_blocks)
            for _ in range(args.repeat)]
    seconds = sorted(r["prepend_seconds"] for r in runs)[len(runs) // 2]
    r = runs[0]
    each = ", ".join(f"{x['prepend_seconds'] * 1000:.1f}" for x in runs)
    print(f"{args.workload}, prefix caching {'off' if args.no_prefix_caching else 'on'}: "
          f"{r['completed']} requests completed, prepend_n called {r['prepend_calls']} times "
          f"with {r['prepend_ids']} ids, {r['ranges']} ranges given back to the buddy, "
          f"prepend_n {seconds * 1000:.1f} ms in all (median of {len(runs)}: "
          f"{each}), "
          f"blocks per run {r['blocks_per_run']:.2f}")


if __name__ == "__main__":
    main()
