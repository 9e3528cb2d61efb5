"""`proxima replay`: one workload through vLLM's real scheduler on CPU, stock vs Proxima.

Both runs see the identical request list. With ``--repeat K`` the two allocators run
alternately K times each; counts must agree between repeats (the scheduler is
deterministic) and the scheduler time is the median of the K runs. The driver is the one
of the installed vLLM's engine generation (``driver_v1``, ``driver_v0``: the version
policy of :mod:`proxima.engines.activation` picks it); both return one
:class:`~proxima.replay.result.ReplayResult` per run.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

from proxima.errors import UserError
from proxima.replay.result import FIELDS, ReplayResult, combine
from proxima.workloads import WORKLOADS, load_trace, make_workload

DEFAULT_NUM_BLOCKS = 55735            # stock vLLM 0.26, Llama-3.1-8B, one H200, util 0.9
PRESSURE_NUM_BLOCKS = 1920            # 30,720 tokens: the GPU baseline's pressure run


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default="chat",
                     help="generated workload (default: chat)")
    src.add_argument("--trace", metavar="FILE",
                     help="JSONL trace: prompt_len, output_len[, prefix_id, prefix_len, arrival_step]")
    p.add_argument("--requests", type=int, help="number of requests (default per workload)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int,
                   help=f"KV blocks in the pool (default {DEFAULT_NUM_BLOCKS}; "
                        f"{PRESSURE_NUM_BLOCKS} for pressure)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="vLLM 0.2x's AsyncScheduler with its engine loop's batch queue of two, "
                        "as a GPU engine runs by default (V1 only; default: one step at a time)")
    p.add_argument("--preemption-mode", choices=("swap", "recompute"),
                   help="how vLLM's V0 engine preempts (V0 only; default: vLLM's choice, "
                        "recompute for single sequences)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each allocator K times, alternating (scheduler time: median)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG (runs per request, free-run timeline)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _validate(args) -> None:
    for name in ("requests", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "repeat"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise UserError(f"--block-size must be a power of two from 1 to 128, got {args.block_size}")
    for path in (args.json, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            raise UserError(f"cannot write {path}: directory {Path(path).parent} does not exist")


def _engine():
    """The replay driver for the installed vLLM's engine generation, once the version
    policy accepted it (:mod:`proxima.engines.activation`: tested, or untested with
    ``PROXIMA_ALLOW_UNTESTED_VLLM=1``)."""
    from proxima.engines import activation

    activation.check_environment()
    version = activation.installed_version("vllm")
    if version is None:
        raise UserError("vLLM is not installed: run ./dev proxima replay ..., or "
                        "pip install 'proxima[vllm]'")
    verdict = activation.judge(version, activation.installed_version("torch"))
    if not verdict.allowed:
        raise UserError(verdict.refusal(stock_hint="replay needs both allocators"))
    # vLLM's INFO lines (one set per scheduler built) would drown the table; a user's
    # own VLLM_LOGGING_LEVEL wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if verdict.engine == "v0":
        from proxima.replay import driver_v0 as driver
    else:
        from proxima.replay import driver_v1 as driver
    return driver, version


def run(args) -> int:
    _validate(args)
    if args.trace:
        workload = load_trace(args.trace, seed=args.seed, max_model_len=args.max_model_len)
        if args.requests:
            workload = type(workload)(workload.name, workload.requests[:args.requests],
                                      workload.concurrency)
    else:
        workload = make_workload(args.workload, args.requests, seed=args.seed,
                                 max_model_len=args.max_model_len)
    num_blocks = args.num_blocks or (PRESSURE_NUM_BLOCKS if args.workload == "pressure"
                                     and not args.trace else DEFAULT_NUM_BLOCKS)
    too_long = [r for r in workload.requests
                if -(-(r.prompt_len + r.max_tokens) // args.block_size) > num_blocks - 1]
    if too_long:
        raise UserError(f"request {too_long[0].request_id} needs more blocks than the pool "
                        f"has ({num_blocks} - 1 null block): raise --num-blocks")
    driver, version = _engine()
    engine_settings = _engine_settings(args, driver, version)
    settings = dict(num_blocks=num_blocks, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=not args.no_prefix_caching,
                    max_model_len=args.max_model_len, **engine_settings)
    print(f"proxima replay: {workload.name}, {len(workload.requests)} requests, "
          f"{num_blocks} blocks of {args.block_size} tokens, vLLM {version} "
          f"(scheduler on CPU, no model)", file=sys.stderr)
    runs: dict[str, list[ReplayResult]] = {"stock": [], "proxima": []}
    for rep in range(args.repeat):
        for label in ("stock", "proxima"):
            bar = _progress(f"{label} {rep + 1}/{args.repeat}", len(workload.requests),
                            disabled=args.no_progress)
            try:
                result = driver.run_replay(workload, proxima=label == "proxima",
                                           progress=bar.update_to if bar else None,
                                           timeline_every=25 if args.plot else 0, **settings)
            finally:
                if bar:
                    bar.close()
            runs[label].append(result)
    results = {label: combine(rs) for label, rs in runs.items()}
    report = {"workload": workload.name, "requests": len(workload.requests), "seed": args.seed,
              "vllm_version": version, "settings": settings, "repeat": args.repeat,
              "results": results, "checks": _checks(results)}
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from proxima.replay.plot import write_plot

        write_plot(report, {label: [r.as_dict() for r in rs] for label, rs in runs.items()},
                   args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


#: options only one engine generation's driver has: flag -> run_replay parameter
ENGINE_OPTIONS = {"async_scheduling": ("--async-scheduling", "vLLM's V1 engine"),
                  "preemption_mode": ("--preemption-mode", "vLLM's V0 engine")}


def _engine_settings(args, driver, version: str) -> dict:
    """The engine-specific options given, refused (one line) where this driver lacks them."""
    accepted = inspect.signature(driver.run_replay).parameters
    settings = {}
    for name, (flag, needs) in ENGINE_OPTIONS.items():
        value = getattr(args, name, None)
        if value in (None, False):
            continue
        if name not in accepted:
            raise UserError(f"{flag} needs {needs}; vLLM {version} runs the other one: "
                            f"drop {flag}")
        settings[name] = value
    return settings


def _checks(results: dict) -> dict:
    """The parity and contiguity targets of the V1 issue, evaluated on these figures."""
    s, p = results["stock"], results["proxima"]
    return {
        "completed_equal": p["completed"] == s["completed"],
        "preemptions_not_above_stock": p["preemptions"] <= s["preemptions"],
        "prefix_hit_rate_within_0.005": p["prefix_hit_rate"] >= s["prefix_hit_rate"] - 0.005,
        "scheduler_time_ratio": (p["scheduler_ms_per_step"] / s["scheduler_ms_per_step"]
                                 if s["scheduler_ms_per_step"] else None),
        "no_blocks_leaked": p["blocks_leaked"] == 0 and s["blocks_leaked"] == 0,
    }


def format_table(report: dict) -> str:
    s, p = report["results"]["stock"], report["results"]["proxima"]
    lines = [f"{'':24} {'stock':>12} {'proxima':>12} {'proxima/stock':>14}"]
    for key in FIELDS:
        a, b = s[key], p[key]
        ratio = f"{b / a:.3f}" if isinstance(a, (int, float)) and a else "-"
        fmt = (lambda v: f"{v:.4f}") if isinstance(a, float) else str
        lines.append(f"{key:24} {fmt(a):>12} {fmt(b):>12} {ratio:>14}")
    checks = report["checks"]
    ok = all(v for k, v in checks.items() if k != "scheduler_time_ratio")
    lines.append(f"parity checks: {'all passed' if ok else 'FAILED'} "
                 f"({', '.join(k for k, v in checks.items() if v is False) or 'none failed'}); "
                 f"scheduler time ratio {checks['scheduler_time_ratio']:.3f}")
    return "\n".join(lines)


class _Bar:
    def __init__(self, tqdm_bar):
        self._bar = tqdm_bar

    def update_to(self, done: int, total: int) -> None:
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress(label: str, total: int, disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return _Bar(tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False,
                     mininterval=0.5))
