"""vLLM 0.26's batched KV copy to host memory: scattered blocks vs runs, default vs side stream.

    python3 -m proxima.bench.copy [--json PATH]

One request's KV on a Llama-3.1-8B-shaped cache (32 layers, 64 KiB pages, 128 blocks =
2,048 tokens = 4,096 pages = 256 MiB) is copied GPU -> pinned CPU by vLLM's own
``ops.swap_blocks_batch`` (``vllm/_custom_ops.py``; ``cuMemcpyBatchAsync`` on CUDA 12.8+),
the call vLLM's CPU offload worker makes (``vllm/v1/kv_offload/cpu/gpu_worker.py``: one
(src, dst, size) descriptor per page, on a stream of its own, source reads in stream order).
The request's blocks are placed in the GPU pool five ways:

* ``scattered``: no two blocks adjacent -- 4,096 descriptors of 64 KiB;
* ``stock-like``: runs of 2-3 blocks (2.4 on average, vLLM's own blocks per run in our
  replays) -- one descriptor per run per layer;
* ``proxima-like``: runs of 12 (Proxima's blocks per run on chat) -- one per run per layer;
* ``one run``: the whole request contiguous -- 32 descriptors;
* ``proxima-like, per block``: runs of 12, but one descriptor per page, as vLLM's offload
  worker builds them today (it does not merge adjacent pages).

Each is submitted on the legacy default stream and on a side stream (``torch.cuda.Stream``,
as the offload worker does). Two timings per call, both between CUDA events on that stream:

* ``call``: the stream idle when the call starts, as a lone offload finds it: the copies
  can only start as fast as the CPU submits them, so this is submit + copy as the GPU sees
  it, and the GB/s that one call achieves;
* ``DMA``: the stream held by a GPU sleep that outlasts the submission, the start event
  recorded after it: every descriptor is queued before the first byte moves, so this is the
  copy engines' own time and bandwidth (what a busy offload stream, already queued, sees).

Also the CPU time of the ``swap_blocks_batch`` call (submit) and the numpy time to build the
descriptors. The copied bytes are checked against
the GPU's. Needs a CUDA GPU and vLLM 0.26 (on the project's offline GPU host:
``PYTHONPATH=/tmp/site``); about 30 s.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from proxima.bench.script import script_main
from proxima.errors import UserError

LAYOUTS = {
    # name: (run-length pattern, repeated; None = one run), one descriptor per run?
    "scattered": ((1,), True),
    "stock-like": ((2, 3, 2, 3, 2), True),
    "proxima-like": ((12,), True),
    "one run": (None, True),
    "proxima-like, per block": ((12,), False),
}
STREAMS = ("legacy default", "side")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32, help="(default %(default)s)")
    p.add_argument("--page-kib", type=int, default=64,
                   help="bytes per block per layer, KiB (default %(default)s: Llama-3.1-8B, "
                        "16 tokens x 8 KV heads x 128 x K+V x bf16)")
    p.add_argument("--request-blocks", type=int, default=128,
                   help="blocks of the request (default %(default)s = 2,048 tokens)")
    p.add_argument("--gpu-blocks", type=int, default=1024,
                   help="blocks per layer in the GPU pool (default %(default)s)")
    p.add_argument("--reps", type=int, default=20,
                   help="timed calls per layout and stream, after 2 warm-up calls "
                        "(default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="placement seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")


def run_lengths(total: int, pattern: tuple[int, ...] | None) -> list[int]:
    """``pattern`` repeated until the lengths sum to ``total`` (the last run cut short)."""
    if pattern is None:
        return [total]
    out, i = [], 0
    while sum(out) < total:
        out.append(min(pattern[i % len(pattern)], total - sum(out)))
        i += 1
    return out


def place_runs(lengths: list[int], gpu_blocks: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """Runs ``(request offset, GPU block, length)`` in request order, laid out in the pool
    in a shuffled order with a gap of 1-3 blocks after each (so no two runs touch)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    start, gpu = rng.randint(0, 3), {}
    for i in order:
        gpu[i] = start
        start += lengths[i] + rng.randint(1, 3)
    if start > gpu_blocks:
        raise UserError(f"--gpu-blocks {gpu_blocks} is too small to place {sum(lengths)} blocks "
                        f"in {len(lengths)} separate runs: give at least {start}")
    return [(offsets[i], gpu[i], lengths[i]) for i in range(len(lengths))]


def descriptors(np, runs, gpu_bases, cpu_bases, page: int, per_run: bool):
    """(src, dst, size) int64 arrays, layer by layer: one descriptor per run per layer
    (``per_run``) or one per page, as vLLM's ``compute_sub_block_ptrs`` makes them."""
    if not per_run:
        runs = [(c + j, g + j, 1) for c, g, k in runs for j in range(k)]
    c, g, k = (np.array(x, dtype=np.int64) for x in zip(*runs))
    gb = np.asarray(gpu_bases, dtype=np.int64)[:, None]
    cb = np.asarray(cpu_bases, dtype=np.int64)[:, None]
    src = (gb + g[None, :] * page).ravel()
    dst = (cb + c[None, :] * page).ravel()
    size = np.broadcast_to(k[None, :] * page, (len(gpu_bases), len(k))).ravel()
    return src, dst, np.ascontiguousarray(size)


def _check_args(args) -> None:
    for flag in ("layers", "page_kib", "request_blocks", "gpu_blocks", "reps"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")


def _import_stack():
    try:
        import numpy as np
        import torch
    except ImportError as exc:
        raise UserError(f"needs {exc.name} (the GPU host's stack: torch with CUDA)") from None
    if not torch.cuda.is_available():
        raise UserError("needs an NVIDIA GPU: torch.cuda.is_available() is False here")
    try:
        import vllm
        from vllm import _custom_ops as ops
    except ImportError as exc:
        raise UserError(f"needs vLLM 0.26 ({exc}); on the offline GPU host: "
                        f"PYTHONPATH=/tmp/site (docs/benchmarks.md)") from None
    return np, torch, vllm, ops


def run(args) -> int:
    _check_args(args)
    from proxima.bench.report import check_writable, write_json
    check_writable(args.json, "--json")
    np, torch, vllm, ops = _import_stack()
    if not vllm.__version__.startswith("0.26"):
        print(f"warning: measured with vLLM {vllm.__version__}, not 0.26", file=sys.stderr)

    page = args.page_kib * 1024
    layers = args.layers
    gpu = [torch.empty((args.gpu_blocks, page), dtype=torch.uint8, device="cuda").random_(0, 255)
           for _ in range(layers)]
    cpu = [torch.zeros((args.request_blocks, page), dtype=torch.uint8, pin_memory=True)
           for _ in range(layers)]
    total_bytes = layers * args.request_blocks * page
    streams = {"legacy default": torch.cuda.default_stream(), "side": torch.cuda.Stream()}
    rng = random.Random(args.seed)
    print(f"{torch.cuda.get_device_name(0)}, vLLM {vllm.__version__}: one request = "
          f"{args.request_blocks} blocks x {layers} layers x {args.page_kib} KiB = "
          f"{total_bytes / 2**20:.0f} MiB, GPU -> pinned CPU, ops.swap_blocks_batch",
          flush=True)
    header = (f"{'layout':<25} {'blk/run':>7} {'descr.':>6} {'stream':<15} {'call ms':>7} "
              f"{'GB/s':>6} {'DMA ms':>7} {'GB/s':>6} {'submit ms':>9} {'build ms':>8}  check")
    print(header)
    print("-" * len(header), flush=True)

    hold = _sleep_cycles(torch, HOLD_S)
    rows = []
    for name, (pattern, per_run) in LAYOUTS.items():
        lengths = run_lengths(args.request_blocks, pattern)
        runs = place_runs(lengths, args.gpu_blocks, rng)
        t0 = time.perf_counter()
        src, dst, size = descriptors(np, runs, [t.data_ptr() for t in gpu],
                                     [t.data_ptr() for t in cpu], page, per_run)
        build_s = time.perf_counter() - t0
        src_t, dst_t, size_t = (torch.from_numpy(a.copy()).pin_memory() for a in (src, dst, size))
        assert int(size.sum()) == total_bytes
        gpu_ids = torch.tensor([g + j for _, g, k in runs for j in range(k)], device="cuda")
        for stream_name, stream in streams.items():
            row = {"layout": name, "blocks_per_run": args.request_blocks / len(lengths),
                   "runs": len(lengths), "descriptors": int(src.size), "stream": stream_name,
                   "bytes": total_bytes, "build_s": build_s}
            try:
                held = _time_calls(torch, ops, stream, src_t, dst_t, size_t, args.reps,
                                   lambda: None, hold_cycles=hold)
                row.update(_time_calls(torch, ops, stream, src_t, dst_t, size_t, args.reps,
                                       lambda: [c.zero_() for c in cpu]))
                row["check_ok"] = all(torch.equal(c, g.index_select(0, gpu_ids).cpu())
                                      for c, g in zip(cpu, gpu))
                row["call_s"] = row.pop("dma_s")
                row["call_s_min"], row["call_s_max"] = row.pop("dma_s_min"), row.pop("dma_s_max")
                row["call_gbps"] = total_bytes / row["call_s"] / 1e9
                row.update(dma_s=held["dma_s"], dma_s_min=held["dma_s_min"],
                           dma_s_max=held["dma_s_max"], held_submit_s=held["submit_s"])
                row["gbps"] = total_bytes / row["dma_s"] / 1e9
            except RuntimeError as exc:          # e.g. a stream the batch API refuses
                row.update(error=str(exc).splitlines()[0], check_ok=None)
            rows.append(row)
            if "error" in row:
                print(f"{name:<25} {row['blocks_per_run']:>7.1f} {row['descriptors']:>6} "
                      f"{stream_name:<15} error: {row['error']}", flush=True)
            else:
                print(f"{name:<25} {row['blocks_per_run']:>7.1f} {row['descriptors']:>6} "
                      f"{stream_name:<15} {row['call_s'] * 1e3:>7.2f} {row['call_gbps']:>6.1f} "
                      f"{row['dma_s'] * 1e3:>7.2f} {row['gbps']:>6.1f} "
                      f"{row['submit_s'] * 1e3:>9.3f} {build_s * 1e3:>8.3f}  "
                      f"{'ok' if row['check_ok'] else 'WRONG BYTES'}", flush=True)

    ok = all(r["check_ok"] is not False for r in rows)
    report = {"environment": _environment(torch, vllm),
              "config": {"layers": layers, "page_bytes": page,
                         "request_blocks": args.request_blocks, "gpu_blocks": args.gpu_blocks,
                         "bytes_per_call": total_bytes, "reps": args.reps, "seed": args.seed,
                         "direction": "GPU -> pinned CPU", "src_access_order": "stream"},
              "rows": rows, "checks_ok": ok}
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0 if ok else 1


HOLD_S = 0.05        # the GPU sleep that holds the stream while the CPU submits (>> 11 ms)


def _sleep_cycles(torch, seconds: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``seconds`` (calibrated)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)                    # warm-up (the first launch loads the kernel)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) * 1e-3))


def _time_calls(torch, ops, stream, src, dst, size, reps: int, reset,
                hold_cycles: int = 0) -> dict:
    """Median time between events on ``stream`` around the call, and CPU submit time, of
    ``reps`` calls after 2 warm-up calls; the last call's bytes stay in the destination for
    the check. ``hold_cycles``: a GPU sleep queued before the start event, so the whole
    batch is submitted before the GPU reaches it (the events then time the copies alone)."""
    dma, submit = [], []
    for i in range(reps + 2):
        if i == reps + 1:
            reset()                           # the checked call writes onto zeros
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if hold_cycles:
                torch.cuda._sleep(hold_cycles)
            start.record(stream)
            t0 = time.perf_counter()
            ops.swap_blocks_batch(src, dst, size, False)
            t1 = time.perf_counter()
            end.record(stream)
        end.synchronize()
        if i >= 2:
            dma.append(start.elapsed_time(end) * 1e-3)
            submit.append(t1 - t0)
    return {"dma_s": statistics.median(dma), "dma_s_min": min(dma), "dma_s_max": max(dma),
            "submit_s": statistics.median(submit), "submit_s_min": min(submit), "calls": reps}


def _environment(torch, vllm) -> dict:
    from proxima.bench.cli import environment
    env = environment(offline=False)
    env.update(torch=torch.__version__, cuda=torch.version.cuda, vllm=vllm.__version__,
               gpu=torch.cuda.get_device_name(0))
    return env


def main(argv: list[str] | None = None) -> int:
    return script_main("proxima.bench.copy", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
