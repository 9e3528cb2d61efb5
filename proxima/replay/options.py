"""`proxima replay`'s inputs: its flags (``add_arguments``, the --help text and its
bounds) and their checks (:func:`validate`), every one made before the first scheduler is
built: sizes against their bounds (the pool and the prompts are built in memory), the
--elastic values through :mod:`proxima.config`, --json / --plot as writable file names.
A bad value is one line (:class:`~proxima.errors.UserError`, exit 2). Running the replay
and reporting it is :mod:`proxima.replay.cli`.
"""

from __future__ import annotations

from proxima.config import MAX_BYTES, MAX_DELAY_S, MAX_REPEAT, MAX_SHARE
from proxima.errors import UserError
from proxima.ioutil import check_distinct_paths, check_output_path
from proxima.replay.elastic import MAP_GBPS_H200, UNMAP_GBPS_H200
from proxima.workloads import MAX_REQUESTS, TWO_ENGINE_REQUESTS, TWO_ENGINE_WORKLOADS, \
    WORKLOADS, check_sizes

DEFAULT_NUM_BLOCKS = 55735            # stock vLLM 0.26, Llama-3.1-8B, one H200, util 0.9
PRESSURE_NUM_BLOCKS = 1920            # 30,720 tokens: the GPU baseline's pressure run
# vLLM builds one Python object per block (~250 bytes, ~8 s per million blocks here).
MAX_NUM_BLOCKS = 4_194_304
# The replay's stand-in model is a Llama config whose max_position_embeddings is 131,072:
# vLLM refuses a longer --max-model-len for it.
REPLAY_MAX_MODEL_LEN = 131_072
# --elastic: after the last request the replay steps idle until the release delay has run
# out (release delay / step seconds steps, ~4 ms each on a loaded CPU): bounded, not a hang.
MAX_IDLE_STEPS = 20_000
MAX_STEP_SECONDS = 60.0
MAX_MAP_GBPS = 100_000.0      # --map-gbps: far above any GPU (the H200 maps at ~25)
SIZE_UNITS = ("bytes, or KiB MiB GiB TiB (1024^n) / KB MB GB TB (1000^n), any case, not a "
              "bare G; at most 1024TiB")

COLUMNS = """\
the table (one row per figure; columns: stock, proxima, proxima/stock):
  completed              requests that finished (must be equal)
  steps                  scheduler steps until the last request finished (--elastic:
                         proxima's steps marked * include idle ones, with no request,
                         waiting out --release-delay to give memory back; its ratio *
                         is then of the steps with requests)
  peak_running           most requests running in one step
  preemptions            preemptions over the run (a running request's KV blocks
                         taken back to make room; it is computed again later)
  prefix_hit_rate        prompt tokens found in the prefix cache / tokens looked up
  blocks_per_run         KV blocks per contiguous run of block ids, over every finished
                         request's final block table (1.0 = fully scattered; higher is
                         more contiguous; a request in one run counts all its blocks)
  single_run_fraction    share of finished requests whose blocks form ONE run
  scheduler_ms_per_step  CPU time of schedule() + update_from_output() per step
                         (median over --repeat runs)
  reclaimable_granule_fraction  (V1) mean over steps of the share of granules (--granule-
                         blocks ids) holding no live block: memory an elastic pool can
                         give back
  packed_ideal_fraction  (V1) the same if the live blocks were packed into the fewest
                         granules
  mapped_granule_fraction  (with --elastic) mean share of the granules mapped
  busy_steps             (V1) steps that scheduled tokens: idle steps left out on both
                         sides (with --elastic, Proxima's side also steps through idle
                         time while a release waits for its delay: counted in steps)
  queue_wait_p50_steps, queue_wait_p99_steps
                         (V1) per finished request, steps from its arrival to the first
                         step that schedules its tokens: p50, p99
  ttft_p50_steps, ttft_p99_steps
                         (V1) per finished request, steps from its arrival to the end of
                         the step that samples its first token: p50, p99
                         (latency in steps of one clock, the same on both sides: a request
                         never waits through idle time; with --elastic a step lasts
                         --step-seconds, map time included)
then the parity checks (same completed count, no more preemptions than stock, prefix-hit
rate within 0.005, no block leaked; V1: request latency, the p50 and p99 of queue wait and
of TTFT each at most 1.02x stock's) and the scheduler time ratio.

--engines 2: one table of both sides, the static split and elastic, each figure in total
and per engine (A, B); latency in steps of the shared clock; finish_steps: the step the
last request finished; mean and peak mapped KV per engine. Then the comparison line:
alternating-bursts, elastic must beat the static split (TTFT p99 lower, finished no
later); steady, it must tie (queue wait and TTFT p50 and p99, and finish_steps, each at
most 1.02x); both, the same completions, no block leaked, never more KV mapped than
--gpu-kv.

exit status:
  0    done, every parity check passed
  1    done, but a parity check FAILED: the table, --json and --plot are still written,
       and stderr names the failed checks (--engines 2: a comparison check)
  2    bad input (one line, nothing run or written)
  130  interrupted (Ctrl-C, SIGINT), 143 terminated (SIGTERM): the repeats already
       finished are kept (their table printed, --json and --plot written, "partial":
       true); with --repeat K each finished repeat is announced on stderr"""


def add_arguments(p) -> None:
    p.epilog = COLUMNS
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS + TWO_ENGINE_WORKLOADS,
                     help="generated workload (default: chat; with --engines 2: "
                          f"alternating-bursts; {' and '.join(TWO_ENGINE_WORKLOADS)} need "
                          f"--engines 2)")
    src.add_argument("--trace", metavar="FILE",
                     help="JSONL trace, one request per line: prompt_len, output_len[, prefix_id, "
                          "prefix_len, arrival_step] (default: none, use --workload)")
    p.add_argument("--requests", type=int, metavar="N",
                   help=f"number of requests; with --trace its first N (default per workload: "
                        f"chat 100, sharegpt 1000, multiturn 400, pressure 500, bursts 800; "
                        f"--engines 2: {TWO_ENGINE_REQUESTS} over both engines; at most "
                        f"{MAX_REQUESTS:,})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the generated prompts")
    p.add_argument("--num-blocks", type=int, metavar="B",
                   help=f"KV blocks in the pool (default {DEFAULT_NUM_BLOCKS}; "
                        f"{PRESSURE_NUM_BLOCKS} for pressure; at most {MAX_NUM_BLOCKS:,})")
    p.add_argument("--block-size", type=int, default=16, metavar="T", help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=1024, metavar="N",
                   help="vLLM's cap on requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, metavar="T",
                   help="vLLM's cap on tokens scheduled in one step")
    p.add_argument("--max-model-len", type=int, default=8192, metavar="T",
                   help=f"longest prompt + output in tokens (default: 8192; at most "
                        f"{REPLAY_MAX_MODEL_LEN:,})")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="switch vLLM's prefix cache off (default: prefix caching on)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="vLLM 0.2x's AsyncScheduler with its engine loop's batch queue of two, "
                        "as a GPU engine runs by default (V1 only; default: off, one step at "
                        "a time)")
    p.add_argument("--granule-blocks", type=int, default=None, metavar="G",
                   help="block ids per granule, the unit KV memory is mapped and given back "
                        "in: the reclaimable rows count granules without a live block "
                        "(32 = 2 MiB of a Llama-3.1-8B layer's KV, 64 KiB pages; V1 only) "
                        "(default: 32; with --elastic the product's own choice, the largest "
                        "of 512, 256, 128, 64, 32 that leaves the pool at least 8 granules)")
    p.add_argument("--engines", type=int, default=1, metavar="N",
                   help="1: one engine, stock vs Proxima; 2: two engines sharing one simulated "
                        "GPU of --gpu-kv, each with vLLM's real scheduler, Proxima's elastic "
                        "connector and policy and the GPU's ledger, against a static split "
                        "(two stock engines, half the GPU's KV each); the elastic flags apply "
                        "to each engine (V1 only)")
    p.add_argument("--elastic", action="store_true",
                   help="run Proxima's side in elastic KV mode (V1 only): the pool places by "
                        "granule and, with --elastic-policy auto, memory grows and shrinks "
                        "with the load through the real connector and policy (no GPU: a "
                        "stand-in worker confirms the maps)")
    p.add_argument("--elastic-policy", choices=("auto", "fixed"), default="auto",
                   help="with --elastic: auto grows and shrinks; fixed keeps the whole pool "
                        "mapped (placement alone)")
    p.add_argument("--eviction", default="auto", metavar="SPEC",
                   help="with --elastic (checked always): how far eviction may depart from "
                        "LRU: auto (learnt reuse horizon), auto:Q (its quantile), age:N "
                        "(steps), window:W (blocks), lru (strict)")
    p.add_argument("--kv-min", metavar="SIZE",
                   help=f"with --elastic: least KV memory kept mapped, e.g. 4GiB ({SIZE_UNITS}; "
                        f"the replay's KV is shaped like Llama-3.1-8B's: 2 MiB per block; "
                        f"default: 0)")
    p.add_argument("--kv-initial", metavar="SIZE",
                   help=f"with --elastic: KV memory mapped at start-up, what is not wanted "
                        f"going back after --release-delay ({SIZE_UNITS}; default: what "
                        f"vLLM's warm-up maps, grown before the first request to twice it "
                        f"where the simulated GPU has room, at least --kv-min)")
    p.add_argument("--kv-max", metavar="SIZE",
                   help=f"with --elastic: most KV memory mapped ({SIZE_UNITS}; default: the "
                        f"pool)")
    p.add_argument("--headroom", default=0.10, metavar="F",
                   help=f"with --elastic: free share of the live blocks kept mapped, 0 to "
                        f"{MAX_SHARE}")
    p.add_argument("--release-delay", default=10.0, metavar="S",
                   help=f"with --elastic: seconds free memory must be in excess before "
                        f"release, 0 to {MAX_DELAY_S} and at most {MAX_IDLE_STEPS:,} steps of "
                        f"--step-seconds (the replay steps idle until the release)")
    p.add_argument("--step-seconds", default=0.025, metavar="S",
                   help=f"with --elastic: the policy's clock per scheduler step, seconds above "
                        f"0, at most {MAX_STEP_SECONDS:g}")
    p.add_argument("--map-gbps", default=None, metavar="R",
                   help=f"with --elastic: GB/s the stand-in worker maps KV at; a map's "
                        f"granules are allocatable only once it is done, on the clock of "
                        f"--step-seconds a step (default: {MAP_GBPS_H200:g} x the granule's "
                        f"bytes per layer / 2 MiB: the H200's {MAP_GBPS_H200:g} GB/s with "
                        f"2 MiB per layer, ~3 s per 78 GB burst, issue 33, and a map costs "
                        f"per physical allocation, tools/gpu/map_rate.py; unmaps at "
                        f"{UNMAP_GBPS_H200:g} GB/s scaled alike; 0: maps and unmaps done at "
                        f"once)")
    p.add_argument("--gpu-kv", metavar="SIZE",
                   help=f"with --elastic: room the simulated GPU has for this engine's KV (maps "
                        f"beyond it fail, as when another process holds the memory; "
                        f"{SIZE_UNITS}; default: the pool); with --engines 2: the GPU's KV "
                        f"room the two engines share (default 16GiB)")
    p.add_argument("--compaction", metavar="MODE",
                   help="Proxima's runs with KV compaction planned after every schedule() "
                        "(copies counted, not made): 1 (the policy; V1 only; default: off)")
    p.add_argument("--compaction-budget-mib", type=int, metavar="M",
                   help="compaction's budget per step, MiB of Llama-3.1-8B blocks (2 MiB "
                        "each over 32 layers; default 256)")
    p.add_argument("--preemption-mode", choices=("swap", "recompute"),
                   help="how vLLM's V0 engine preempts (V0 only; default: vLLM's choice, "
                        "recompute for single sequences)")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help=f"run each allocator K times, alternating (scheduler time: median); "
                        f"1 to {MAX_REPEAT:,}")
    p.add_argument("--json", metavar="PATH",
                   help="write the figures as JSON (default: none)")
    p.add_argument("--plot", metavar="PATH.png",
                   help="write a PNG: runs per finished request, free space over time "
                        "(default: none)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: a bar on stderr)")


def validate(args) -> None:
    """Everything that can be checked before any work: numbers, bounds, output paths."""
    from proxima.replay import two_engines

    two_engines.check_choice(args)
    for name in ("requests", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 1 <= args.repeat <= MAX_REPEAT:
        raise UserError(f"--repeat must be from 1 to {MAX_REPEAT:,}, got {args.repeat}")
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise UserError(f"--block-size must be a power of two from 1 to 128, got {args.block_size}")
    check_sizes(args.requests, args.max_model_len)
    if args.trace is not None and not args.trace.strip():
        raise UserError(f"--trace needs a file name, got {args.trace!r}")
    if args.compaction_budget_mib is not None and args.compaction_budget_mib < 1:
        raise UserError(f"--compaction-budget-mib must be >= 1, got "
                        f"{args.compaction_budget_mib}")
    if args.compaction_budget_mib is not None and args.compaction_budget_mib > MAX_BYTES >> 20:
        raise UserError(f"--compaction-budget-mib {args.compaction_budget_mib:,} is above the "
                        f"bound of {MAX_BYTES >> 20:,} (1024TiB): use at most that")
    if args.compaction_budget_mib is not None and args.compaction is None:
        raise UserError("--compaction-budget-mib needs --compaction")
    if args.compaction is not None:
        from proxima.vllm.activation import compaction_mode

        try:
            args.compaction = compaction_mode(args.compaction)
        except ValueError:
            raise UserError(f"--compaction must be 1, got "
                            f"{args.compaction!r}") from None
        if args.compaction is None:
            raise UserError("--compaction 0 is no compaction: drop --compaction")
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise UserError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be >= "
                        f"--max-num-seqs ({args.max_num_seqs}), as vLLM requires")
    if args.max_model_len > REPLAY_MAX_MODEL_LEN:
        raise UserError(f"--max-model-len {args.max_model_len:,} is above the bound of "
                        f"{REPLAY_MAX_MODEL_LEN:,} (the stand-in model's context): use at most "
                        f"{REPLAY_MAX_MODEL_LEN:,}")
    if args.num_blocks is not None and args.num_blocks > MAX_NUM_BLOCKS:
        raise UserError(f"--num-blocks {args.num_blocks:,} is above the bound of "
                        f"{MAX_NUM_BLOCKS:,} (vLLM builds one object per block in memory): "
                        f"use at most {MAX_NUM_BLOCKS:,}")
    if args.granule_blocks is not None and args.granule_blocks < 1:
        raise UserError(f"--granule-blocks must be >= 1, got {args.granule_blocks}")
    if args.granule_blocks is not None and args.granule_blocks > MAX_NUM_BLOCKS:
        raise UserError(f"--granule-blocks {args.granule_blocks:,} is above the bound of "
                        f"{MAX_NUM_BLOCKS:,} (--num-blocks' bound): use at most "
                        f"{MAX_NUM_BLOCKS:,}")
    elastic_flags = [f for f, v in (("--kv-min", args.kv_min), ("--kv-max", args.kv_max),
                                    ("--kv-initial", args.kv_initial),
                                    ("--gpu-kv", args.gpu_kv)) if v is not None]
    if elastic_flags and not args.elastic and args.engines == 1:
        raise UserError(f"{elastic_flags[0]} needs --elastic")
    spec = elastic_spec(args)       # checked without --elastic too: refused, not ignored
    args.elastic_spec = spec if args.elastic or args.engines == 2 else None
    if args.engines == 2:
        two_engines.validate(args, spec, MAX_NUM_BLOCKS)
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot", suffix=".png")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'proxima[plot]'") from None
    check_distinct_paths({"--json": args.json, "--plot": args.plot},
                         inputs={"--trace": args.trace})


def elastic_spec(args):
    """The --elastic options as the replay's :class:`~proxima.replay.elastic.ElasticReplay`
    (every value checked first, by :mod:`proxima.config`: one line for a bad one)."""
    from proxima import config
    from proxima.replay.elastic import ElasticReplay

    config.parse_eviction(args.eviction, "--eviction")
    sizes = {flag: config.parse_size(value, flag)
             for flag, value in (("--kv-min", args.kv_min), ("--kv-max", args.kv_max),
                                 ("--kv-initial", args.kv_initial),
                                 ("--gpu-kv", args.gpu_kv)) if value is not None}
    headroom = config.parse_number(args.headroom, "--headroom", most=MAX_SHARE,
                                   unit="a share of the live blocks")
    delay = config.parse_number(args.release_delay, "--release-delay", most=MAX_DELAY_S,
                                unit="seconds")
    step = config.parse_number(args.step_seconds, "--step-seconds", most=MAX_STEP_SECONDS,
                               unit="seconds", above=True)
    if delay / step > MAX_IDLE_STEPS:
        raise UserError(f"--release-delay {delay:g} is {delay / step:,.0f} steps of "
                        f"--step-seconds {step:g}, above the bound of {MAX_IDLE_STEPS:,} (the "
                        f"replay steps idle until the release): lower --release-delay or "
                        f"raise --step-seconds")
    map_gbps = None if args.map_gbps is None else config.parse_number(
        args.map_gbps, "--map-gbps", most=MAX_MAP_GBPS, unit="GB/s (0: at once)")
    if "--kv-max" in sizes and sizes["--kv-max"] < sizes.get("--kv-min", 0):
        raise UserError(f"--kv-max {args.kv_max} is below --kv-min {args.kv_min}")
    extra = {}
    if "--kv-initial" in sizes:
        initial = sizes["--kv-initial"]
        if initial < sizes.get("--kv-min", 0):
            raise UserError(f"--kv-initial {args.kv_initial} is below --kv-min {args.kv_min}")
        if "--kv-max" in sizes and initial > sizes["--kv-max"]:
            raise UserError(f"--kv-initial {args.kv_initial} is above --kv-max {args.kv_max}")
        extra["initial_bytes"] = initial
    return ElasticReplay(policy=args.elastic_policy, eviction=args.eviction,
                         min_bytes=sizes.get("--kv-min", 0), max_bytes=sizes.get("--kv-max"),
                         headroom=headroom, release_delay_s=delay, step_seconds=step,
                         gpu_bytes=sizes.get("--gpu-kv"),
                         map_gbps=map_gbps, extra=extra)
