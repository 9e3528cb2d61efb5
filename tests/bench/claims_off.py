"""Contiguity with and without claims (issue 12: keep claims as checked state, or drop
them?), on the replays of docs/benchmarks.md section 1:

    ./dev python -m tests.bench.claims_off

"off" gives no new run a claim (``RunAllocator._take`` is called with claim 0): ``room``
still chooses where a run goes but leaves nothing behind it for later placements. Prints
Proxima's blocks per run and single-run fraction for both; stock is unaffected.
"""

from __future__ import annotations

from proxima.allocator import RunAllocator
from proxima.replay.driver_v1 import run_replay
from proxima.workloads import make_workload

CASES = [("chat", 55735, True), ("sharegpt", 55735, True), ("multiturn", 55735, True),
         ("pressure", 1920, True), ("sharegpt", 55735, False), ("pressure", 1920, False)]


def contiguity(name: str, num_blocks: int, prefix_caching: bool) -> tuple[float, float]:
    r = run_replay(make_workload(name, None, seed=0), proxima=True, num_blocks=num_blocks,
                   enable_prefix_caching=prefix_caching)
    return r["blocks_per_run"], r["single_run_fraction"]


def main() -> None:
    take = RunAllocator._take
    for name, num_blocks, prefix_caching in CASES:
        on = contiguity(name, num_blocks, prefix_caching)
        RunAllocator._take = lambda self, a, b, c, d, claim=0: take(self, a, b, c, d, 0)
        try:
            off = contiguity(name, num_blocks, prefix_caching)
        finally:
            del RunAllocator._take          # FreeRuns._take again
        label = name + ("" if prefix_caching else " --no-prefix-caching")
        print(f"{label:30} blocks per run: claims {on[0]:6.2f}, none {off[0]:6.2f};  "
              f"single-run fraction: claims {on[1]:.3f}, none {off[1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
