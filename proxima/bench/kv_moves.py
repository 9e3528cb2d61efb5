"""Bandwidth of moving KV blocks on the GPU: the Triton mover against torch.

    python3 -m proxima.bench.kv_moves [--json PATH] [--sweep]

On a KV cache shaped like Llama-3.1-8B's in vLLM 0.26 (32 layers, 8 KV heads, head 128,
block 16, bf16, FlashAttention's NHD layout: 64 KiB per block per layer, K and V together),
it moves batches of runs (1, 4, 16, 64, 256 runs of 16 blocks) and of scattered single
blocks (16, 128, 1,024; 128 blocks are one 2,048-token request), each three ways:

* ``triton``: :class:`proxima.kernels.KVBlockMover`, one launch for all layers;
* ``index``: torch ``index_select`` + ``index_copy_`` per layer (the mover's torch backend);
* ``runs``: one slice ``copy_`` per layer per run (runs merged where they continue).

Indices are uploaded before timing (a plan, as a caller that moves a batch prepares it);
the mover's planning time (validation + upload) is reported apart. Each timed call starts
with a cold L2 (a 256 MiB scratch write in between). Effective bandwidth counts bytes read
plus bytes written; the peak is a large torch device-to-device copy measured in the same
run. Each Triton result is checked against the sources before timing. Needs a CUDA GPU,
torch and Triton (no vLLM). About 30 s on an H200 (16 GiB of KV).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from proxima.bench.script import script_main
from proxima.errors import UserError

DEFAULTS = dict(layers=32, kv_heads=8, head_size=128, block_size=16, run_blocks=16,
                runs="1,4,16,64,256", singles="16,128,1024", budget_s=0.25, peak_mib=2048,
                seed=0)
SWEEP = [(8192, 8192, 4), (16384, 16384, 4), (16384, 4096, 4), (16384, 16384, 8),
         (32768, 32768, 8), (65536, 65536, 8)]          # (chunk, block, warps)
SCRATCH_BYTES = 256 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--layers", type=int, default=d["layers"], help="(default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=d["kv_heads"], help="(default %(default)s)")
    p.add_argument("--head-size", type=int, default=d["head_size"], help="(default %(default)s)")
    p.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per block (default %(default)s)")
    p.add_argument("--run-blocks", type=int, default=d["run_blocks"],
                   help="blocks per run in the run cases (default %(default)s)")
    p.add_argument("--runs", default=d["runs"],
                   help="numbers of runs per batch, comma-separated (default %(default)s)")
    p.add_argument("--singles", default=d["singles"],
                   help="numbers of scattered single blocks per batch (default %(default)s)")
    p.add_argument("--methods", default="triton,index,runs",
                   help="which of triton, index, runs to time (default %(default)s)")
    p.add_argument("--chunk-bytes", type=int, help="kernel bytes per program (default: the "
                   "mover's, 16384)")
    p.add_argument("--block-bytes", type=int, help="kernel bytes per load (default: chunk)")
    p.add_argument("--num-warps", type=int, help="kernel warps per program (default: 4)")
    p.add_argument("--sweep", action="store_true",
                   help=f"also time the kernel configurations {SWEEP} (chunk, load, warps) "
                        f"on the 64-run and 128-single cases")
    p.add_argument("--budget-s", type=float, default=d["budget_s"],
                   help="seconds of timing per case and method, at least 3 calls "
                        "(default %(default)s)")
    p.add_argument("--peak-mib", type=int, default=d["peak_mib"],
                   help="size of the peak-bandwidth copy (default %(default)s MiB)")
    p.add_argument("--seed", type=int, default=d["seed"], help="placement seed (default 0)")
    p.add_argument("--no-graphs", action="store_true",
                   help="skip the CUDA-graph timings (device time without launch overhead)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a functional dry run for tests (the kernel in Triton's "
                        "interpreter, wall-clock times that mean nothing; default cuda)")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise UserError(f"{flag} values must be >= 1, got {text!r}")
    return values


def make_cases(runs: list[int], singles: list[int], run_blocks: int, seed: int):
    """(name, src, dst, n) batches and the pool size they need: runs in random aligned
    slots (sources and destinations in different slots); single blocks on even ids, so no
    two are adjacent."""
    need = max([2 * k * run_blocks for k in runs] + [4 * m for m in singles] + [2])
    num_blocks = need + 2 * run_blocks
    rng = random.Random(seed)
    cases = []
    for k in runs:
        slots = rng.sample(range(num_blocks // run_blocks), 2 * k)
        cases.append((f"{k} x {run_blocks}-block runs", [s * run_blocks for s in slots[:k]],
                      [s * run_blocks for s in slots[k:]], [run_blocks] * k))
    for m in singles:
        ids = [2 * i for i in rng.sample(range(num_blocks // 2), 2 * m)]
        cases.append((f"{m} scattered blocks", ids[:m], ids[m:], [1] * m))
    return cases, num_blocks


class Timer:
    """Device time (CUDA events; wall clock on CPU) and CPU time of calls, each from a cold
    L2 (a scratch write in between)."""

    def __init__(self, torch, device: str, budget_s: float):
        self.torch, self.cuda, self.budget_s = torch, device == "cuda", budget_s
        self.scratch = torch.empty(SCRATCH_BYTES if self.cuda else 1 << 16, dtype=torch.uint8,
                                   device=device)

    def _span(self, fn) -> tuple[float, float]:
        """(device seconds, CPU seconds) of one call."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            return t, t
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        cpu = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3, cpu

    def measure(self, fn, min_reps: int = 3, max_reps: int = 200) -> dict:
        self._span(fn)                                  # warm-up (and compile)
        dev, cpu = [], []
        t_end = time.perf_counter() + self.budget_s
        while len(dev) < max_reps and (len(dev) < min_reps or time.perf_counter() < t_end):
            self.scratch.zero_()
            d, c = self._span(fn)
            dev.append(d)
            cpu.append(c)
        return {"gpu_s": statistics.median(dev), "gpu_s_min": min(dev),
                "cpu_s": statistics.median(cpu), "reps": len(dev)}


def peak_bandwidth(torch, timer: Timer, mib: int) -> dict:
    """Read+write bandwidth of one large device-to-device ``copy_``."""
    n = mib << 20
    a = torch.empty(n, dtype=torch.uint8, device=timer.scratch.device).random_(0, 255)
    b = torch.empty_like(a)
    res = timer.measure(lambda: b.copy_(a), min_reps=10, max_reps=10)
    del a, b
    return {"bytes_copied": n, "gpu_s": res["gpu_s"], "gbps": 2 * n / res["gpu_s"] / 1e9}


def _check(torch, views, plan) -> bool:
    src, dst = plan.pairs[0], plan.pairs[1]
    return all(torch.equal(v.index_select(0, dst), v.index_select(0, src)) for v in views)


def environment(torch) -> dict:
    from proxima.bench.cli import environment as base
    env = base(offline=False)
    env["torch"] = torch.__version__
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return env


def _rates(kind: str, res: dict, plan, peak: dict) -> dict:
    gbps = 2 * plan.bytes_moved / res["gpu_s"] / 1e9
    out = {f"{kind}_s": res["gpu_s"], f"{kind}_s_min": res["gpu_s_min"],
           f"{kind}_reps": res["reps"], f"gbps_{kind}": gbps,
           f"of_peak_{kind}": gbps / peak["gbps"]}
    if kind == "call":
        out["cpu_s"] = res["cpu_s"]
    return out


def _row_line(r: dict) -> str:
    def num(key, scale=1.0, fmt="{:.1f}"):
        return fmt.format(r[key] * scale) if key in r else "-"
    peaks = f"{num('of_peak_call', fmt='{:.2f}')} / {num('of_peak_graph', fmt='{:.2f}')}"
    vs = (f"{num('vs_best_torch_call', fmt='{:.2f}')} / "
          f"{num('vs_best_torch_graph', fmt='{:.2f}')}" if r["method"] == "triton" else "")
    return (f"{r['batch']:<22} {r['blocks']:>6} {r['bytes_moved'] / 2**20:>6.0f} "
            f"{r['method']:<6} {num('call_s', 1e6):>9} {num('cpu_s', 1e6):>8} "
            f"{num('graph_s', 1e6):>9} {num('gbps_call', fmt='{:.0f}'):>9} "
            f"{num('gbps_graph', fmt='{:.0f}'):>10} {peaks:>11} {vs:>13}")


def capture(torch, fn):
    """``fn`` captured in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _graph_rates(torch, timer: Timer, fn, plan, peak: dict, max_reps: int) -> dict:
    """Graph timings of ``fn``, or the reason it could not be captured (the run goes on)."""
    try:
        graph = capture(torch, fn)
    except RuntimeError as exc:
        torch.cuda.synchronize()
        return {"graph_error": str(exc).splitlines()[0]}
    return _rates("graph", timer.measure(graph.replay, max_reps=max_reps), plan, peak)


def run(args) -> int:
    runs = _int_list(args.runs, "--runs")
    singles = _int_list(args.singles, "--singles")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("triton", "index", "runs")]
    if bad or not methods:
        raise UserError(f"--methods takes triton, index, runs; got {args.methods!r}")
    for flag in ("layers", "kv_heads", "head_size", "block_size", "run_blocks", "peak_mib"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.budget_s > 0:
        raise UserError(f"--budget-s must be > 0, got {args.budget_s}")
    from proxima.bench.report import check_writable, write_json
    check_writable(args.json, "--json")
    try:
        import torch
    except ImportError:
        raise UserError("needs torch (and triton) with CUDA: pip install torch") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("needs an NVIDIA GPU: torch.cuda.is_available() is False here "
                        "(--device cpu is a functional dry run)")
    from proxima.kernels.layout import flash_attn_kv_caches, page_views
    from proxima.kernels.mover import KVBlockMover
    from proxima.kernels.moves import runs_of
    from proxima.kernels.reference import apply_runs_torch

    cases, num_blocks = make_cases(runs, singles, args.run_blocks, args.seed)
    kv = flash_attn_kv_caches(args.layers, num_blocks, args.block_size, args.kv_heads,
                              args.head_size, device=args.device, fill=False)
    views = page_views(kv)
    for v in views:
        v.random_()
    page = views[0].shape[1] * views[0].element_size()
    kw = {k: getattr(args, k) for k in ("chunk_bytes", "block_bytes", "num_warps")
          if getattr(args, k) is not None}
    try:
        mover = KVBlockMover(kv, backend="triton", **kw)
        torch_mover = KVBlockMover(kv, backend="torch")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    timer = Timer(torch, args.device, args.budget_s)
    peak = peak_bandwidth(torch, timer, args.peak_mib)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    print(f"{where}: {args.layers} layers x {num_blocks} blocks x "
          f"{page / 1024:g} KiB pages ({args.layers * num_blocks * page / 2**30:.1f} GiB); "
          f"device-to-device peak {peak['gbps']:.0f} GB/s (read+write, {args.peak_mib} MiB copy_)",
          flush=True)
    print(f"kernel: chunk {mover.chunk_words * mover.word_bytes} B, load "
          f"{mover.block_words * mover.word_bytes} B, {mover.num_warps} warps, "
          f"16-byte accesses: {mover.align16}", flush=True)

    graphs = args.device == "cuda" and not args.no_graphs
    rows, checks = [], {}
    header = (f"{'batch':<22} {'blocks':>6} {'MiB':>6} {'method':<6} {'call us':>9} "
              f"{'CPU us':>8} {'graph us':>9} {'GB/s call':>9} {'GB/s graph':>10} "
              f"{'of peak':>11} {'vs best torch':>13}")
    print("call: from the call to the moves done (launch included); graph: replay of the "
          "call captured in a CUDA graph\n(device time); GB/s = (bytes read + written) / time; "
          "of peak and vs best torch: call / graph")
    print(header)
    print("-" * len(header), flush=True)
    for name, src, dst, n in cases:
        t0 = time.perf_counter()
        plan = mover.plan(src, dst, n)
        plan_s = time.perf_counter() - t0
        for v in views:
            v.index_fill_(0, plan.pairs[1], 0)
        mover.apply(plan)
        checks[name] = _check(torch, views, plan)
        merged = runs_of(plan.pairs[0].tolist(), plan.pairs[1].tolist())
        fns = {"triton": lambda: mover.apply(plan),
               "index": lambda: torch_mover.apply(plan),
               "runs": lambda: apply_runs_torch(views, merged)}
        case_rows = []
        for m in methods:
            max_reps = 200 if m != "runs" else 50
            row = {"batch": name, "blocks": plan.num_moved, "runs": len(merged),
                   "bytes_moved": plan.bytes_moved, "method": m,
                   **_rates("call", timer.measure(fns[m], max_reps=max_reps), plan, peak)}
            if graphs:
                row.update(_graph_rates(torch, timer, fns[m], plan, peak, max_reps))
            if m == "triton":
                row["plan_s"] = plan_s
            case_rows.append(row)
        for kind in ("call", "graph"):
            torch_times = [r[f"{kind}_s"] for r in case_rows
                           if r["method"] != "triton" and f"{kind}_s" in r]
            for r in case_rows:
                if r["method"] == "triton" and torch_times and f"{kind}_s" in r:
                    r[f"vs_best_torch_{kind}"] = min(torch_times) / r[f"{kind}_s"]
        for r in case_rows:
            print(_row_line(r), flush=True)
        rows.extend(case_rows)
        if not checks[name]:
            print(f"  CHECK FAILED: {name}: destination pages differ from their sources",
                  flush=True)

    sweep = []
    if args.sweep:
        print("\nkernel configurations (chunk bytes, load bytes, warps):", flush=True)
        picked = [c for c in cases if c[0].startswith(("64 x", "128 scattered"))] or cases[-1:]
        for chunk, block, warps in SWEEP:
            m2 = KVBlockMover(kv, backend="triton", chunk_bytes=chunk, block_bytes=block,
                              num_warps=warps)
            for name, src, dst, n in picked:
                plan = m2.plan(src, dst, n)
                fn = lambda: m2.apply(plan)          # noqa: E731, B023 - used right here
                row = {"chunk_bytes": chunk, "block_bytes": block, "num_warps": warps,
                       "batch": name, **_rates("call", timer.measure(fn), plan, peak)}
                if graphs:
                    row.update(_graph_rates(torch, timer, fn, plan, peak, 200))
                sweep.append(row)
                key = "graph" if "graph_s" in row else "call"
                print(f"  {chunk:>6} {block:>6} {warps:>2}  {name:<22} "
                      f"{row[f'{key}_s'] * 1e6:>9.1f} us ({key}) {row[f'gbps_{key}']:>6.0f} GB/s "
                      f"{row[f'of_peak_{key}']:.2f} of peak", flush=True)

    ok = all(checks.values())
    print(f"\ncorrectness (destination == source after the Triton move): "
          f"{'all ok' if ok else 'FAILED'}", flush=True)
    report = {"environment": environment(torch),
              "config": {"layers": args.layers, "kv_heads": args.kv_heads,
                         "head_size": args.head_size, "block_size": args.block_size,
                         "dtype": "bfloat16", "layout": "FlashAttention NHD (vLLM 0.26)",
                         "page_bytes": page, "num_blocks": num_blocks,
                         "kernel": {"chunk_bytes": mover.chunk_words * mover.word_bytes,
                                    "block_bytes": mover.block_words * mover.word_bytes,
                                    "num_warps": mover.num_warps, "align16": mover.align16},
                         "budget_s": args.budget_s, "seed": args.seed,
                         "device": args.device},
              "peak": peak, "rows": rows, "sweep": sweep, "checks": checks,
              "checks_ok": ok}
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    return script_main("proxima.bench.kv_moves", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
