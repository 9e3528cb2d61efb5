"""How fast can a GPU's KV memory be mapped and given back through CUDA VMM? (issue 33, item 2)

Elastic KV maps a burst's KV one granule at a time: for each granule, one ``cuMemCreate`` of
the GPU's allocation granularity (2 MiB) and one ``cuMemMap`` per region (a region is one KV
tensor: one per layer), then one ``cuMemSetAccess`` per region and run, and a zero fill. This
driver times that path and the candidates that could make it faster, on the bare driver
(``proxima.memory.driver.CudaDriver``, no vLLM, no torch):

- ``chunk K``: one physical allocation of K granules per region (K x fewer create/map calls;
  the cost: memory can then only be given back K granules at a time);
- ``threads T``: T threads mapping disjoint granules at once (does the driver serialise?);
- the parts: create alone, map alone, set-access, zero, unmap+release.

Every variant maps the same bytes (``--gib``) over ``--regions`` regions, and reports GB/s
(10^9 bytes per second), best and median of ``--repeat``. Output: one table on stdout and
``map_rate.json`` in ``--out``.

    python3 tools/gpu/map_rate.py --out $OUT --gib 32 --regions 32 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from proxima.memory.driver import CudaDriver  # noqa: E402


class Pool:
    """One reserved range of ``regions`` regions, each ``units`` granules long."""

    def __init__(self, drv: CudaDriver, regions: int, units: int) -> None:
        self.drv, self.regions, self.units = drv, regions, units
        self.g = drv.granularity()
        self.region_bytes = units * self.g
        self.base = drv.reserve(regions * self.region_bytes, self.g)
        self.handles: list[tuple[int, int, int]] = []     # (ptr, size, handle)
        self.stream = drv.new_stream()

    def addr(self, region: int, unit: int) -> int:
        return self.base + region * self.region_bytes + unit * self.g

    def map_units(self, units: range, chunk: int, out: list, parts: dict | None = None) -> None:
        drv, g = self.drv, self.g
        drv.use_device()
        for start in range(units.start, units.stop, chunk):
            k = min(chunk, units.stop - start)
            for r in range(self.regions):
                t0 = time.perf_counter()
                h = drv.create(k * g)
                t1 = time.perf_counter()
                drv.map(self.addr(r, start), k * g, h)
                t2 = time.perf_counter()
                out.append((self.addr(r, start), k * g, h))
                if parts is not None:
                    parts["create"] += t1 - t0
                    parts["map"] += t2 - t1

    def grant_and_zero(self, parts: dict | None = None, zero: bool = True) -> None:
        drv = self.drv
        t0 = time.perf_counter()
        for r in range(self.regions):
            drv.set_access(self.addr(r, 0), self.region_bytes)
        t1 = time.perf_counter()
        if zero:
            for r in range(self.regions):
                drv.zero(self.addr(r, 0), self.region_bytes, self.stream)
            drv.stream_synchronize(self.stream)
        t2 = time.perf_counter()
        if parts is not None:
            parts["set_access"] += t1 - t0
            parts["zero"] += t2 - t1

    def unmap_all(self, parts: dict | None = None) -> None:
        drv = self.drv
        drv.synchronize()
        t0 = time.perf_counter()
        for ptr, size, h in self.handles:
            drv.unmap(ptr, size)
            drv.release(h)
        if parts is not None:
            parts["unmap_release"] += time.perf_counter() - t0
        self.handles = []

    def close(self) -> None:
        if self.handles:
            self.unmap_all()
        self.drv.destroy_stream(self.stream)
        self.drv.free_addresses(self.base, self.regions * self.region_bytes)


def one_run(drv: CudaDriver, regions: int, units: int, chunk: int, threads: int,
            zero: bool = True) -> dict:
    pool = Pool(drv, regions, units)
    parts = {"create": 0.0, "map": 0.0, "set_access": 0.0, "zero": 0.0, "unmap_release": 0.0}
    try:
        t0 = time.perf_counter()
        if threads == 1:
            pool.map_units(range(units), chunk, pool.handles, parts)
        else:
            # disjoint slices of whole chunks, one per thread
            per = -(-units // threads)
            per = -(-per // chunk) * chunk
            outs = [[] for _ in range(threads)]
            errors: list[BaseException] = []

            def work(i: int) -> None:
                try:
                    pool.map_units(range(i * per, min(units, (i + 1) * per)), chunk, outs[i])
                except BaseException as exc:       # surfaced below
                    errors.append(exc)

            ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for o in outs:
                pool.handles.extend(o)
            if errors:
                raise errors[0]
        t_created = time.perf_counter()
        pool.grant_and_zero(parts, zero=zero)
        t_mapped = time.perf_counter()
        pool.unmap_all(parts)
        t_done = time.perf_counter()
    finally:
        pool.close()
    nbytes = regions * units * pool.g
    return {"bytes": nbytes, "map_s": t_mapped - t0, "create_map_s": t_created - t0,
            "unmap_s": t_done - t_mapped, "map_gbps": nbytes / (t_mapped - t0) / 1e9,
            "unmap_gbps": nbytes / (t_done - t_mapped) / 1e9,
            "parts_s": {k: round(v, 4) for k, v in parts.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="gpu-out", help="folder for map_rate.json")
    p.add_argument("--gib", type=float, default=32.0, help="GiB mapped by each variant")
    p.add_argument("--regions", type=int, default=32, help="KV tensors (one per layer)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each variant")
    p.add_argument("--chunks", default="1,2,4,8,16,32", help="granules per physical allocation")
    p.add_argument("--threads", default="1,2,4,8", help="mapping threads (chunk 1)")
    p.add_argument("--device", type=int, default=0)
    a = p.parse_args(argv)
    drv = CudaDriver(a.device)
    drv.use_device()
    g = drv.granularity()
    units = int(a.gib * 2**30) // (a.regions * g)
    free, total = drv.mem_info()
    if units < 1 or units * a.regions * g > free * 0.9:
        print(f"map_rate: --gib {a.gib} does not fit the GPU's free memory "
              f"({free / 2**30:.1f} GiB); give a smaller --gib", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    variants = [("chunk", int(c), 1, True) for c in a.chunks.split(",")]
    variants += [("threads", 1, int(t), True) for t in a.threads.split(",") if int(t) > 1]
    variants += [("nozero", 1, 1, False)]
    result = {"granularity": g, "regions": a.regions, "units": units,
              "bytes": units * a.regions * g, "gpu_total": total, "variants": []}
    one_run(drv, a.regions, min(units, 64), 1, 1)          # warm the driver
    print(f"granularity {g} B, {a.regions} regions x {units} granules = "
          f"{units * a.regions * g / 1e9:.1f} GB per run", flush=True)
    print(f"{'variant':<14}{'map GB/s':>10}{'median':>9}{'unmap GB/s':>12}  parts (s, best run)")
    for kind, chunk, threads, zero in variants:
        runs = [one_run(drv, a.regions, units, chunk, threads, zero) for _ in range(a.repeat)]
        best = max(runs, key=lambda r: r["map_gbps"])
        name = {"chunk": f"chunk {chunk}", "threads": f"threads {threads}",
                "nozero": "no zero"}[kind]
        row = {"variant": name, "chunk": chunk, "threads": threads, "zero": zero,
               "map_gbps_best": round(best["map_gbps"], 2),
               "map_gbps_median": round(statistics.median(r["map_gbps"] for r in runs), 2),
               "unmap_gbps_best": round(max(r["unmap_gbps"] for r in runs), 2),
               "runs": runs}
        result["variants"].append(row)
        print(f"{name:<14}{row['map_gbps_best']:>10.1f}{row['map_gbps_median']:>9.1f}"
              f"{row['unmap_gbps_best']:>12.1f}  {best['parts_s']}", flush=True)
        with open(os.path.join(a.out, "map_rate.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
