"""`proxima replay --engines 2`: two engines sharing one simulated GPU, elastic KV against a
static split (issue 33, item 5); the run itself is :mod:`proxima.replay.shared_gpu`.

Both sides replay the same two request lists (one per engine, :func:`proxima.workloads.
make_two_engine_workload`) on the same shared step clock: the static split (two stock vLLM
engines, half the GPU's KV blocks each) first, then the elastic side (two Proxima engines
with the elastic connector and policy, growing and shrinking within ``--gpu-kv`` through
the GPU's ledger). The report compares them: per engine and in total, completions,
preemptions, queue wait and time to first token (p50, p99, in steps of the clock), the
time to finish, prefix hits, memory per engine over time. The comparison line:

* ``alternating-bursts``: elastic must beat the static split -- time to first token p99
  below static's, and the last request finished no later;
* ``steady``: elastic must tie -- queue wait and TTFT p50 and p99, and the time to finish,
  each at most 1.02x static's (:data:`proxima.replay.table.LATENCY_PARITY`; static's 0
  allows only 0);
* on both: the same completions, no block leaked, and never more KV mapped at once than
  the GPU holds.

A failed check is exit status 1 (the table, --json and --plot are still written).

``prefix_hit_rate`` is vLLM's own figure, per lookup: a request waiting for memory is
looked up again at every step it is tried, so two sides whose requests wait differently
weigh their requests differently. ``scheduled_tokens`` (prefill chunks, recomputed ones
included, and decodes) is the work each side did: the same outputs on both, so a lost
prefix hit or a preemption's recompute shows as more of it.

The steady load is sized from the GPU: each engine keeps as many requests in flight as its
static half holds at their mean full length (prompt + output), so it is the load the
static split is made for.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from proxima.errors import UserError
from proxima.ioutil import print_table, write_text_atomic
from proxima.replay.elastic import (ElasticReplay, auto_granule_blocks, check_runs_here,
                                    resolve_rates)
from proxima.replay.table import LATENCY_PARITY
from proxima.workloads import TWO_ENGINE_WORKLOADS, TWO_OUTPUT, TWO_PROMPT, \
    make_two_engine_workload

GiB = 1 << 30
DEFAULT_GPU_KV = 16 * GiB
LATENCY = ("queue_wait_p50_steps", "queue_wait_p99_steps", "ttft_p50_steps",
           "ttft_p99_steps")
#: options of the one-engine replay that --engines 2 does not take: (attribute, flag)
ONE_ENGINE_ONLY = (("num_blocks", "--num-blocks"), ("compaction", "--compaction"),
                   ("compaction_budget_mib", "--compaction-budget-mib"),
                   ("async_scheduling", "--async-scheduling"),
                   ("preemption_mode", "--preemption-mode"))


# ------------------------------------------------------------------------- input
def check_choice(args) -> None:
    """--engines, and the workload that goes with it (the default workload resolved)."""
    if args.engines not in (1, 2):
        raise UserError(f"--engines must be 1 or 2 (2: two engines sharing one simulated "
                        f"GPU), got {args.engines}")
    if args.workload is None and not args.trace:
        args.workload = "alternating-bursts" if args.engines == 2 else "chat"
    if args.engines == 1:
        if args.workload in TWO_ENGINE_WORKLOADS:
            raise UserError(f"--workload {args.workload} is a two-engine workload: add "
                            f"--engines 2")
        return
    if args.trace:
        raise UserError("--trace replays one engine: with --engines 2 use --workload "
                        f"{' or '.join(TWO_ENGINE_WORKLOADS)}")
    if args.workload not in TWO_ENGINE_WORKLOADS:
        raise UserError(f"--workload {args.workload} is a one-engine workload: with "
                        f"--engines 2 use {' or '.join(TWO_ENGINE_WORKLOADS)}")
    for name, flag in ONE_ENGINE_ONLY:
        if getattr(args, name, None) not in (None, False):
            raise UserError(f"{flag} is a one-engine option: drop it with --engines 2 (the "
                            f"pools come from --gpu-kv)" if name == "num_blocks" else
                            f"{flag} is a one-engine option: drop it with --engines 2")
    if args.repeat != 1:
        raise UserError(f"--repeat {args.repeat}: --engines 2 runs each side once (the "
                        f"replay is deterministic): drop --repeat")
    if args.elastic_policy != "auto":
        raise UserError(f"--elastic-policy {args.elastic_policy}: --engines 2 compares the "
                        f"auto policy with the static split: drop --elastic-policy")


def request_blocks(block_size: int) -> tuple[int, int]:
    """(largest, mean) blocks of one request of the two-engine workloads, at full length."""
    largest = -(-(TWO_PROMPT[1] + TWO_OUTPUT[1]) // block_size)
    mean = -(-(sum(TWO_PROMPT) + sum(TWO_OUTPUT)) // (2 * block_size))
    return largest, mean


def startup_granules(args, spec: ElasticReplay, gpu_blocks: int) -> int:
    """Granules one elastic engine maps at start-up: vLLM's warm-up (the connector's own
    count, :func:`proxima.vllm.elastic_v1.warmup_blocks`), --kv-min, --kv-initial."""
    from proxima.vllm.elastic_v1 import warmup_blocks

    # (a stand-in: its warm-up is counted as 0.26's, the same blocks at 5 tokens a block
    # or more; below, 0.33's warm-up writes a block more per request)
    vllm_config = SimpleNamespace(speculative_config=None, scheduler_config=SimpleNamespace(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))
    kv_config = SimpleNamespace(num_blocks=gpu_blocks, kv_cache_groups=[SimpleNamespace(
        kv_cache_spec=SimpleNamespace(block_size=args.block_size))])
    granule = args.granule_blocks * spec.block_bytes(args.block_size)
    warm = -(-(warmup_blocks(vllm_config, kv_config) + 1) // args.granule_blocks)
    initial = spec.extra.get("initial_bytes") or 0
    return max(1, warm, -(-spec.min_bytes // granule), -(-initial // granule))


def validate(args, spec: ElasticReplay, max_blocks: int) -> None:
    """--gpu-kv against the two sides' needs (after the common checks); sets
    ``args.gpu_kv_bytes``."""
    from proxima import config

    gpu = DEFAULT_GPU_KV if args.gpu_kv is None else config.parse_size(args.gpu_kv, "--gpu-kv")
    block = spec.block_bytes(args.block_size)
    blocks = gpu // block
    shown = args.gpu_kv or "16GiB (the default)"
    if blocks > max_blocks:
        raise UserError(f"--gpu-kv {shown} is {blocks:,} blocks of {block >> 20} MiB, above "
                        f"the bound of {max_blocks:,} (each elastic engine builds a pool of "
                        f"all of them): use at most {max_blocks * block // GiB}GiB")
    if args.granule_blocks is None:          # the product's own choice for this pool
        args.granule_blocks = auto_granule_blocks(blocks, args.block_size)
    resolve_rates(spec, args.granule_blocks, args.block_size)
    largest, _ = request_blocks(args.block_size)
    least = 2 * (largest + 1)
    if blocks < least:
        raise UserError(f"--gpu-kv {shown} is too small for two engines: each engine's half "
                        f"({blocks // 2:,} blocks of {block >> 20} MiB) must hold the "
                        f"workload's largest request ({largest} blocks) and the null "
                        f"block: use at least {-(-least * block // GiB)}GiB")
    granules = blocks // args.granule_blocks
    each = startup_granules(args, spec, blocks)
    if 2 * each > granules:
        granule = args.granule_blocks * block
        # vLLM's warm-up grows with the pool up to max_num_seqs' worth: the most it takes
        most = startup_granules(args, spec, max_blocks)
        raise UserError(f"--gpu-kv {shown} is too small for two elastic engines' minimums: "
                        f"each maps {each} granules of {granule >> 20} MiB at start-up "
                        f"(vLLM's warm-up, --kv-min, --kv-initial) and the GPU holds "
                        f"{granules}: use at least {-(-2 * most * granule // GiB)}GiB, or "
                        f"lower --kv-min / --kv-initial / --max-num-seqs")
    if spec.max_bytes is not None and spec.max_bytes < (largest + 1) * block:
        raise UserError(f"--kv-max {args.kv_max} cannot hold the workload's largest request "
                        f"({largest} blocks of {block >> 20} MiB): raise it")
    args.gpu_kv_bytes = gpu


# ------------------------------------------------------------------------- report
def _pct(values: list) -> dict:
    from proxima.vllm.status import percentiles

    return percentiles(values)


def _latency(queue: list, ttft: list) -> dict:
    q, t = _pct(queue), _pct(ttft)
    return {"queue_wait_p50_steps": q["p50"], "queue_wait_p99_steps": q["p99"],
            "ttft_p50_steps": t["p50"], "ttft_p99_steps": t["p99"]}


def _mean_mapped(timeline: list, column: int, end: int) -> float:
    """Time-weighted mean of one engine's mapped bytes over steps [0, end)."""
    if end <= 0:
        return float(timeline[0][column])
    total = 0
    for (at, *row), nxt in zip(timeline, timeline[1:] + [(end,)]):
        lo, hi = min(at, end), min(nxt[0], end)
        total += (hi - lo) * row[column - 1]
    return total / end


def side_report(result, step_seconds: float) -> dict:
    """One side's figures, per engine and in total (latency in steps of the clock)."""
    engines, queue_all, ttft_all = {}, [], []
    hits = queries = 0
    for i, e in enumerate(result.engines, 1):
        queue, ttft = e.waits()
        queue_all += queue
        ttft_all += ttft
        hits, queries = hits + e.prefix_hits, queries + e.prefix_queries
        engines[e.name] = {
            "requests": e.requests, "completed": e.completed, "preemptions": e.preemptions,
            **_latency(queue, ttft), "finish_steps": e.last_finish_tick,
            "busy_steps": e.busy_steps, "steps": e.steps,
            "scheduled_tokens": e.scheduled_tokens,
            "prefix_hit_rate": e.prefix_hits / e.prefix_queries if e.prefix_queries else 0.0,
            "mean_mapped_bytes": _mean_mapped(result.memory, i, result.finish_ticks),
            "peak_mapped_bytes": max(row[i] for row in result.memory),
            "final_mapped_bytes": result.memory[-1][i], "blocks_leaked": e.blocks_leaked}
        if e.elastic is not None:
            engines[e.name]["elastic"] = e.elastic
    total = {"requests": sum(e.requests for e in result.engines),
             "completed": sum(e.completed for e in result.engines),
             "preemptions": sum(e.preemptions for e in result.engines),
             **_latency(queue_all, ttft_all), "finish_steps": result.finish_ticks,
             "finish_seconds": result.finish_ticks * step_seconds,
             "prefix_hit_rate": hits / queries if queries else 0.0,
             "scheduled_tokens": sum(e.scheduled_tokens for e in result.engines),
             "peak_mapped_bytes": result.peak_mapped_bytes}
    return {"engines": engines, "total": total, "steps": result.ticks,
            "idle_cut": result.idle_cut, "memory_timeline": [list(r) for r in result.memory]}


def comparison_checks(workload: str, static: dict, elastic: dict, gpu_bytes: int) -> dict:
    s, e = static["total"], elastic["total"]
    checks = {"completed_equal": e["completed"] == s["completed"] == s["requests"],
              "no_blocks_leaked": all(x["blocks_leaked"] == 0 for side in (static, elastic)
                                      for x in side["engines"].values()),
              "gpu_kv_never_exceeded": e["peak_mapped_bytes"] <= gpu_bytes}
    if workload == "alternating-bursts":
        checks["ttft_p99_below_static"] = (e["ttft_p99_steps"] is not None
                                           and e["ttft_p99_steps"] < s["ttft_p99_steps"])
        checks["finish_not_later"] = e["finish_steps"] <= s["finish_steps"]
    else:
        for key in (*LATENCY, "finish_steps"):
            name = key.removesuffix("_steps")
            checks[f"{name}_within_{LATENCY_PARITY}x"] = (
                e[key] is not None and e[key] <= LATENCY_PARITY * s[key])
    return checks


def _gib(n) -> str:
    return f"{n / GiB:.2f}"


def format_table(report: dict) -> str:
    static, elastic = report["results"]["static"], report["results"]["elastic"]
    s, e = static["total"], elastic["total"]
    lines = [f"two engines, one GPU of {_gib(report['settings']['gpu_kv_bytes'])} GiB KV: "
             f"{report['workload']}, {report['requests']} requests",
             f"{'':28} {'static':>13} {'elastic':>13} {'elastic/static':>15}"]

    def row(label, a, b, fmt=str):
        ratio = f"{b / a:.3f}" if isinstance(a, (int, float)) and isinstance(
            b, (int, float)) and a else "-"
        lines.append(f"{label:28} {fmt(a) if a is not None else '-':>13} "
                     f"{fmt(b) if b is not None else '-':>13} {ratio:>15}")

    for key in ("completed", "preemptions", *LATENCY, "finish_steps"):
        row(key, s[key], e[key])
        for name in static["engines"]:
            row(f"  {name}", static["engines"][name][key], elastic["engines"][name][key])
    row("finish_seconds", s["finish_seconds"], e["finish_seconds"], lambda v: f"{v:.1f}")
    row("prefix_hit_rate", s["prefix_hit_rate"], e["prefix_hit_rate"], lambda v: f"{v:.4f}")
    row("scheduled_tokens", s["scheduled_tokens"], e["scheduled_tokens"])
    for key in ("mean_mapped_bytes", "peak_mapped_bytes"):
        for name in static["engines"]:
            row(f"{key.removesuffix('_bytes')}_GiB {name}", static["engines"][name][key],
                elastic["engines"][name][key], _gib)
    row("peak_mapped_GiB (both)", s["peak_mapped_bytes"], e["peak_mapped_bytes"], _gib)
    for name, x in elastic["engines"].items():
        m = x.get("elastic") or {}
        lines.append(f"elastic {name}: {m.get('grows', 0)} grows, {m.get('shrinks', 0)} "
                     f"shrinks, {m.get('failed_grow_attempts', 0)} failed, {m.get('yields', 0)} "
                     f"yields to the other's demand, {_gib(m.get('bytes_returned', 0))} GiB "
                     f"returned, {m.get('evicted_cached', 0)} cached blocks evicted by "
                     f"releases; worker map {m.get('worker_map_seconds', 0):.2f} s; "
                     f"{_gib(x['final_mapped_bytes'])} GiB mapped at the end")
    checks = report["checks"]
    failed = [k for k, v in checks.items() if not v]
    goal = "beat" if report["workload"] == "alternating-bursts" else \
        f"tie (within {LATENCY_PARITY}x)"
    lines.append(f"comparison (elastic must {goal} the static split): "
                 f"{'passed' if not failed else 'FAILED'} (TTFT p99 {e['ttft_p99_steps']} vs "
                 f"{s['ttft_p99_steps']} steps, finish {e['finish_steps']} vs "
                 f"{s['finish_steps']} steps; {', '.join(failed) or 'no check failed'})")
    return "\n".join(lines)


# ------------------------------------------------------------------------- the run
def run(args, driver, version: str, progress) -> int:
    """Run both sides, print the table, write --json / --plot; 1 when a check failed.
    ``progress(label, total, disabled)``: the replay's progress bar (or None)."""
    import dataclasses

    from proxima.replay.shared_gpu import run_side

    check_runs_here("--engines 2", driver, version)
    # as the real connector: no driver figure caps a grow (see shared_gpu)
    spec = dataclasses.replace(args.elastic_spec, driver_free=False)
    gpu = args.gpu_kv_bytes
    gpu_blocks = gpu // spec.block_bytes(args.block_size)
    in_flight = max(1, (gpu_blocks // 2) // request_blocks(args.block_size)[1])
    workload = make_two_engine_workload(args.workload, args.requests, seed=args.seed,
                                        max_model_len=args.max_model_len,
                                        in_flight=in_flight)
    n = sum(len(w.requests) for w in workload.engines)
    settings = dict(gpu_kv_bytes=gpu, gpu_blocks=gpu_blocks, block_size=args.block_size,
                    static_blocks_per_engine=gpu_blocks // 2,
                    granule_blocks=args.granule_blocks, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=args.max_model_len,
                    enable_prefix_caching=not args.no_prefix_caching,
                    step_seconds=spec.step_seconds)
    if args.workload == "steady":
        settings["in_flight_per_engine"] = in_flight
    print(f"proxima replay: two engines on one GPU of {_gib(gpu)} GiB KV ({gpu_blocks:,} "
          f"blocks of {args.block_size} tokens), {args.workload}, {n} requests, vLLM "
          f"{version} (schedulers on CPU, no model)", file=sys.stderr)
    common = dict(gpu_bytes=gpu, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, granule_blocks=args.granule_blocks,
                  enable_prefix_caching=not args.no_prefix_caching)
    results = {}
    head = {"workload": args.workload, "engines": 2, "requests": n, "seed": args.seed,
            "vllm_version": version, "settings": settings,
            "elastic": dataclasses.asdict(spec)}
    for side, elastic in (("static", None), ("elastic", spec)):
        bar = progress(side, n, args.no_progress)
        try:
            results[side] = run_side(workload.engines, elastic=elastic,
                                     progress=bar.update_to if bar else None, **common)
        except KeyboardInterrupt:        # Ctrl-C, or SIGTERM: keep the side finished
            if results and args.json:
                write_text_atomic(args.json, json.dumps(
                    {**head, "partial": True, "results": {
                        k: side_report(r, spec.step_seconds) for k, r in results.items()}},
                    indent=2) + "\n")
                print(f"proxima replay: interrupted during the {side} side: wrote the "
                      f"finished side to {args.json}", file=sys.stderr, flush=True)
            raise
        finally:
            if bar:
                bar.close()
    sides = {side: side_report(r, spec.step_seconds) for side, r in results.items()}
    report = {**head, "results": sides,
              "checks": comparison_checks(args.workload, sides["static"], sides["elastic"],
                                          gpu)}
    closed = print_table(format_table(report))
    if args.json:
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from proxima.replay.plot_two import write_plot

        write_plot(report, {side: sorted(t for e in r.engines for t in e.finish_ticks)
                            for side, r in results.items()}, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if closed:
        raise closed
    failed = [k for k, v in report["checks"].items() if not v]
    if failed:
        print(f"proxima replay: comparison checks FAILED: {', '.join(failed)} (the figures "
              f"above; exit status 1)", file=sys.stderr)
        return 1
    return 0
