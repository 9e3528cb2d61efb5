"""How the first steps' arrivals alone move the preemption count of a pressure run.

On the GPU, ``LLM.generate`` hands vLLM's engine core its requests over a socket while the
core is already scheduling, so how many of them the first step sees depends on timing.
This replays the same requests through vLLM's real AsyncScheduler on CPU (the engine
loop's batch queue of two, as on the GPU), with the first ``M`` requests arriving at step 0
and the rest at step 1 or 2, for stock and for Proxima.

    ./dev python -m tests.bench.arrival_split [--requests 500] [--num-blocks 1920]

Recorded output: docs/results/replay/pressure-arrival-split.txt (docs/benchmarks.md §3.1).
"""

from __future__ import annotations

import argparse
import dataclasses

from proxima.workloads import Workload, make_workload

FIRST = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377)


def split_arrivals(workload: Workload, first: int, rest_step: int) -> Workload:
    """``workload`` with its first ``first`` requests arriving at step 0, the rest at
    ``rest_step``."""
    requests = [dataclasses.replace(r, arrival_step=0 if i < first else rest_step)
                for i, r in enumerate(workload.requests)]
    return Workload(workload.name, requests, workload.concurrency)


def preemptions(workload: Workload, num_blocks: int) -> dict[str, int]:
    from proxima.replay.driver_v1 import run_replay

    return {side: run_replay(workload, proxima=side == "proxima", num_blocks=num_blocks,
                             async_scheduling=True).preemptions
            for side in ("stock", "proxima")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--num-blocks", type=int, default=1920)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    workload = make_workload("pressure", args.requests, seed=args.seed)
    print(f"pressure, {args.requests} requests, {args.num_blocks} blocks, async scheduling")
    for first in (f for f in FIRST if f < args.requests):
        for rest_step in (1, 2):
            got = preemptions(split_arrivals(workload, first, rest_step), args.num_blocks)
            print(f"first {first:3d} at step 0, rest at step {rest_step}: preemptions "
                  f"stock {got['stock']} proxima {got['proxima']}", flush=True)


if __name__ == "__main__":
    main()
