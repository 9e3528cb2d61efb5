"""One engine job of the elastic KV proof (driver: tools/gpu/elastic_proof.py).

    python3 tools/gpu/elastic_child.py identity --mode stock|proxima|elastic|elastic-auto --out F
    python3 tools/gpu/elastic_child.py burst --out F --progress F --go F
    python3 tools/gpu/elastic_child.py throughput --out F [--modes M,M] [--load steady|passes]
        [--concurrency 256 --warmup-s 10 --windows 2 --window-s 20 --drain-s 5]
        [--release --progress F --go F] [--start-after F [--turns N --turn-dir D]] [--step-log]
    (every job) [--executor uni|mp] [--tp N]

Runs in its own process (vLLM starts its engine core from here -- forked, so it inherits
Proxima's patches from :func:`proxima.vllm.plugin.register` even where Proxima's entry
point is not installed; this process never touches CUDA). Writes its results as JSON to --out when done (and what it has, when it fails).
Model: the Llama-3.1-8B-shaped config with dummy weights (PROXIMA_PROOF_MODEL, default
tools/gpu/dummy-llama); prompts are token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = os.environ.get("PROXIMA_PROOF_MODEL", str(ROOT / "tools" / "gpu" / "dummy-llama"))
KV_30K = 30720 * 131072            # 30,720 tokens of Llama-3.1-8B's KV (3.75 GiB)
GiB = 1 << 30
EXECUTOR = None     # --executor: vLLM's distributed_executor_backend (None: vLLM's choice)
TP = 1              # --tp: vLLM's tensor_parallel_size, the first TP visible GPUs
BUILT: list = []    # the executor vLLM chose for each engine built here, in order


def tokens(rng, n):
    return [rng.randrange(3, 32000) for _ in range(n)]


def identity_phases():
    """Phase 1: light (16 requests, shared prefixes): the forced cycles release memory
    mid-run. Phase 2: pressure (200 requests, shared prefixes) on a 30k-token pool:
    preemptions and prefix hits."""
    rng = random.Random(13)
    prefixes = [tokens(rng, 256) for _ in range(8)]
    light = []
    for i in range(16):
        body = tokens(rng, rng.randrange(64, 320))
        light.append(((prefixes[i % 4] + body) if i % 2 else body, 96))
    heavy = []
    for i in range(200):
        body = tokens(rng, rng.randrange(128, 768))
        prompt = prefixes[i % 8] + body if i % 2 == 0 else body
        heavy.append((prompt, rng.randrange(96, 224)))
    return {"light": light, "pressure": heavy}


def connector(options: dict):
    from vllm.config import KVTransferConfig

    from proxima.vllm.elastic_v1 import connector_config

    return KVTransferConfig(**connector_config(options))


def build(mode: str, stats_dir: Path, **kw):
    """An LLM of ``mode``: stock, proxima (allocator only), elastic (forced safe cycles,
    strict LRU: the schedule stays stock's), elastic-auto (the default policy), elastic-off
    (the connector and the VMM-backed KV, the whole pool mapped, no policy: what elastic
    mode costs before any grow or shrink), elastic-fixed (that, plus the granule-aware
    pool's placement and eviction, still all mapped), elastic-compacted (the default policy
    with KV compaction's auto mode, issue 14)."""
    os.environ["PROXIMA_STATS_FILE"] = str(stats_dir / f"{mode}-status.json")
    os.environ["PROXIMA_ALLOCATOR"] = "0" if mode == "stock" else "1"
    os.environ["PROXIMA_ELASTIC"] = "1" if mode.startswith("elastic") else "0"
    if mode == "stock":
        os.environ["PROXIMA_OBSERVE"] = "0"
    from proxima.vllm import plugin

    plugin.register()                      # as vLLM's entry point would, in this process
    from vllm import LLM

    options = dict(kw.pop("elastic_options", {}) or {})
    if mode == "elastic":
        from tests.support import forced      # the repository root is on sys.path

        options = {"policy": "fixed", "eviction": "lru",
                   "compactor": forced.cycles(every=4, hold=2, granules=8), **options}
    elif mode == "elastic-off":
        options = {"policy": "off", **options}
    elif mode == "elastic-fixed":
        options = {"policy": "fixed", **options}
    elif mode == "elastic-compacted":
        options = {"compaction": {"mode": "1"}, **options}
    if mode.startswith("elastic"):
        options.setdefault("stats_file", str(stats_dir / f"{mode}-elastic.json"))
        kw["kv_transfer_config"] = connector(options)
    if EXECUTOR:
        # mp: the worker (input preparation, launches) in a process of its own, beside the
        # engine core's scheduler; uni (vLLM's default for one GPU): both on one thread
        kw["distributed_executor_backend"] = EXECUTOR
    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, seed=0,
              disable_log_stats=False, enable_prefix_caching=True, tensor_parallel_size=TP,
              **kw)
    BUILT.append(executor_of(llm))
    return llm


def executor_of(llm) -> str | None:
    """The executor vLLM chose for ``llm`` (``distributed_executor_backend``: uni, mp)."""
    try:
        return str(llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
    except AttributeError:
        return None


def preemptions(llm) -> int | None:
    values = [m.value for m in llm.get_metrics() if getattr(m, "name", "") ==
              "vllm:num_preemptions" and isinstance(getattr(m, "value", None), (int, float))]
    return int(sum(values)) if values else None


def generate(llm, requests, held=True):
    from vllm import SamplingParams

    from proxima.bench.offline_engine import hold_arrivals

    if held:
        hold_arrivals(llm)          # the first step sees every request: same schedule
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for _, m in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return outs, elapsed


def read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def shutdown(llm) -> None:
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


# ----------------------------------------------------------------------------- jobs

def save(args, result: dict) -> None:
    tmp = Path(f"{args.out}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)


def job_identity(args, result: dict) -> None:
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    extra = {}
    if args.mode == "elastic-auto":
        extra["elastic_options"] = {"release_delay_s": 2.0}
    if args.gpu_memory_utilization:     # engines started side by side: each checks its share
        extra["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.time()
    # KV_30K // TP a GPU: each holds 1/TP of every token's KV heads, so the pool stays
    # 30,720 tokens (and the pressure phase preempts) on any number of GPUs
    llm = build(args.mode, stats, kv_cache_memory_bytes=KV_30K // TP, max_model_len=4096,
                max_num_seqs=128, **extra)
    result["start_s"] = round(time.time() - t0, 1)
    for name, requests in identity_phases().items():
        before = preemptions(llm)
        outs, elapsed = generate(llm, requests)
        after = preemptions(llm)
        result[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": [o.num_cached_tokens or 0 for o in outs],
            "preemptions": None if before is None or after is None else after - before,
            "elapsed_s": round(elapsed, 3)}
        time.sleep(1.0)                     # idle: open forced cycles complete
    shutdown(llm)
    time.sleep(1.0)
    result["elastic"] = read(stats / f"{args.mode}-elastic.json")
    status = read(stats / f"{args.mode}-status.json")
    result["status_active"] = bool(status and status.get("active"))


class Release:
    """The release protocol of sub-proof (b), on an elastic engine that has just served load:
    say "peak" (the driver's taker measures the GPU's free memory now); idle until the
    workers report the mapped KV at the minimum and say "released" (the taker measures again
    and allocates what came back); when the taker is done ("go"), load again: the mapped KV
    must regrow. A sampler thread follows the workers' mapped bytes from the stats file from
    the moment the object exists (without progress/go files it is only that sampler: the
    timeline of a run that is not followed by the protocol)."""

    def __init__(self, elastic_file: Path, progress: Path | None, go: Path | None,
                 t0: float) -> None:
        self.file, self.progress, self.go, self.t0 = elastic_file, progress, go, t0
        self.samples: list = []
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def reported(self):
        e = read(self.file) or {}
        return (e.get("reported_mapped") or 0) * (e.get("bytes_per_granule") or 0), e

    def _sample(self) -> None:
        while not self.stop.is_set():
            got, e = self.reported()
            if e:     # (t, mapped, workers' mapped, mapping granules, free, wanted, grows,
                #          step ms p50 / max and connector ms max over the last 256 steps)
                step, conn = e.get("step_ms") or {}, e.get("connector_ms") or {}
                self.samples.append((round(time.time() - self.t0, 2), e.get("mapped_bytes"), got,
                                     e.get("mapping_granules"), e.get("free_blocks"),
                                     e.get("wanted_free_blocks"), e.get("grows"),
                                     step.get("p50"), step.get("max"), conn.get("max")))
            time.sleep(0.25)

    def wait(self, pred, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got, e = self.reported()
            if pred(got):
                return got, e
            time.sleep(0.2)
        return self.reported()

    def say(self, **fields) -> None:
        self.progress.write_text(json.dumps(fields))

    def peak_since(self, first: int = 0) -> int:
        return max([s[2] for s in self.samples[first:]] + [self.reported()[0]])

    def run(self, result: dict, delay: float, floor: int, t_end: float, load) -> None:
        """After a load that ended at ``t_end``: release, hand over to the taker, regrow
        with ``load()`` (returns (outputs, elapsed))."""
        peak = self.peak_since()
        result["burst1"] = {**result.get("burst1", {}), "peak_mapped_bytes": peak}
        self.say(phase="peak", mapped=peak)
        low, e = self.wait(lambda m: 0 < m <= floor, delay + 30)
        result["released"] = {
            "mapped_bytes": low, "seconds_after_burst": round(time.monotonic() - t_end, 2),
            "delay_s": delay, "bytes_returned": e.get("bytes_returned"),
            "shrinks": e.get("shrinks"), "worker_unmap_seconds": e.get("worker_unmap_seconds"),
            "worker_map_seconds": e.get("worker_map_seconds")}
        self.say(phase="released", released=max(0, peak - low), mapped=low)
        end = time.monotonic() + 90
        while not self.go.exists() and time.monotonic() < end:
            time.sleep(0.2)
        result["taker_done"] = self.go.exists()
        first = len(self.samples)
        outs, elapsed = load()
        time.sleep(0.6)
        _, e = self.reported()
        result["burst2"] = {"elapsed_s": round(elapsed, 2), "peak_mapped_bytes": self.peak_since(first),
                            "grows": e.get("grows"), "failed_grows": e.get("failed_grows"),
                            "worker_map_seconds": e.get("worker_map_seconds")}
        self.stop.set()
        result["timeline"] = thin(self.samples)


def job_burst(args, result: dict) -> None:
    """A 16 GiB elastic pool with a 1 GiB minimum: a burst, then :class:`Release`."""
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    delay = float(args.delay)
    options = {"policy": "auto", "min_bytes": GiB, "release_delay_s": delay,
               "stats_file": str(stats / "elastic.json")}
    t0 = time.time()
    llm = build("elastic-burst", stats, kv_cache_memory_bytes=16 * GiB, max_model_len=2048,
                max_num_seqs=256, gpu_memory_utilization=0.5, elastic_options=options)
    result["start_s"] = round(time.time() - t0, 1)
    rel = Release(stats / "elastic.json", Path(args.progress), Path(args.go), t0)
    rng = random.Random(5)
    start_mapped, e = rel.wait(lambda m: 0 < m <= 2 * GiB, 30)
    result["mapped_at_start_bytes"] = start_mapped
    floor = e.get("min_bytes") or GiB
    result["min_bytes"] = floor

    def load():
        return generate(llm, [(tokens(rng, 512), 256) for _ in range(256)], held=False)

    outs, elapsed = load()
    result["burst1"] = {"elapsed_s": round(elapsed, 2),
                        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    rel.run(result, delay, floor, time.monotonic(), load)
    shutdown(llm)


def thin(samples: list, keep: int = 300) -> list:
    """Every n-th sample, about ``keep`` of them, the first one included."""
    return samples[::max(1, len(samples) // keep)]


def closed_loop(engine, requests, concurrency: int, *, params, render=None, warmup_s=10.0,
                windows=2, window_s=20.0, drain_s=5.0, clock=time.monotonic,
                on_window=None, step_log=None) -> dict:
    """A steady load on an offline engine (vLLM V1 ``LLMEngine``: ``add_request``, ``step``,
    ``has_unfinished_requests``, ``abort_request``): ``concurrency`` requests in flight, the
    next of ``requests`` ((prompt token ids, max tokens), cycled in list order) added as soon
    as one finishes. ``params(max_tokens)`` must ask for DELTA outputs, so that each step's
    outputs carry only the tokens it generated; ``render(prompt ids)`` is what add_request
    takes (default: a token-id prompt dict).

    Time is cut into a warm-up window (window 0, ``warmup_s``) and ``windows`` measurement
    windows of ``window_s``; a step's tokens count in the window where the step ended. After
    the last window nothing more is submitted and the running requests drain for at most
    ``drain_s`` s (what is left is aborted; its tokens so far count in "drain").
    ``on_window(index, window)`` is called as each window closes. ``step_log`` (a list)
    gets ``(clock at the step's end, output tokens of the step)`` for every step: what the
    driver's interleaved slices (``elastic_proof.py --d-interleave``) are counted from."""
    if not requests:
        raise ValueError("closed_loop: no requests to submit")
    if concurrency < 1:
        raise ValueError(f"closed_loop: concurrency {concurrency} must be at least 1")
    render = render or (lambda ids: {"prompt_token_ids": list(ids)})
    t0 = clock()
    bounds = [t0, t0 + warmup_s] + [t0 + warmup_s + (k + 1) * window_s for k in range(windows)]
    end = bounds[-1]
    wins = [{"window": i, "kind": "warmup" if i == 0 else "measure",
             "start_s": round(bounds[i] - t0, 3), "end_s": round(bounds[i + 1] - t0, 3),
             "output_tokens": 0, "steps": 0, "finished": 0, "submitted": 0}
            for i in range(windows + 1)]
    drain = {"output_tokens": 0, "steps": 0, "finished": 0, "aborted": 0}
    in_flight: dict[str, int] = {}           # request id -> its index in ``requests``
    submitted, peak, closed = 0, 0, 0

    def where(t):
        if t >= end:
            return drain
        i = 0
        while bounds[i + 1] <= t:
            i += 1
        return wins[i]

    def close(closed, t):            # windows that ended by ``t``, each reported once
        while closed <= windows and t >= bounds[closed + 1]:
            w = wins[closed]
            w["output_tokens_per_s"] = round(w["output_tokens"] / (bounds[closed + 1] -
                                                                    bounds[closed]), 1)
            if on_window is not None:
                on_window(closed, w)
            closed += 1
        return closed

    while True:
        now = clock()
        if now < end:
            while len(in_flight) < concurrency:
                i = submitted % len(requests)
                prompt, max_tokens = requests[i]
                rid = f"steady-{submitted}"
                engine.add_request(rid, render(prompt), params(max_tokens))
                in_flight[rid] = i
                where(now)["submitted"] += 1
                submitted += 1
            peak = max(peak, len(in_flight))
        elif in_flight and now >= end + drain_s:
            drain["aborted"] = len(in_flight)
            engine.abort_request(list(in_flight))
            in_flight.clear()
        if now >= end and not in_flight:
            break
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"closed_loop: the engine has no unfinished request but "
                               f"{len(in_flight)} are in flight")
        outputs = engine.step()
        t = clock()
        bucket = where(t)
        bucket["steps"] += 1
        got = 0
        for out in outputs:
            if out.request_id not in in_flight:
                continue
            got += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                del in_flight[out.request_id]
                bucket["finished"] += 1
        bucket["output_tokens"] += got
        if step_log is not None:
            step_log.append((round(t, 4), got))
        closed = close(closed, t)
    closed = close(closed, clock())
    drain["seconds"] = round(clock() - end, 3)
    return {"windows": wins, "drain": drain, "submitted": submitted, "peak_in_flight": peak,
            "completed": sum(w["finished"] for w in wins) + drain["finished"],
            "concurrency": concurrency, "requests_listed": len(requests)}


def steady(llm, requests, args, entry: dict, result: dict, t0: float, sampler=None) -> None:
    """:func:`closed_loop` on ``llm``'s engine; ``entry["steady"]`` grows window by window
    (saved as each closes), with the engine's preemptions since the start at each boundary.
    Windows' start_s/end_s count from ``started_s``, which is on the clock of the elastic
    engine's ``timeline`` (seconds since the engine's build began; from ``sampler``, a
    :class:`Release`, saved with each window too)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    def params(max_tokens):
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)

    preprocess = getattr(llm, "_preprocess_cmpl_one", None)   # vLLM's own rendering
    render = (lambda ids: preprocess({"prompt_token_ids": list(ids)})) if callable(
        preprocess) else None
    first = preemptions(llm)
    run = entry["steady"] = {"started_s": round(time.time() - t0, 2), "windows": [],
                             "preemptions_at_start": first}
    client = None
    if getattr(args, "profile_prefix", None):
        import engineprof

        client = engineprof.start_sampler(f"{args.profile_prefix}-client.jsonl",
                                          period_s=args.profile_period)
        client(True)
    epoch = time.time()

    def on_window(index, window):
        if client is not None:
            client(True)
        now = preemptions(llm)
        run["windows"].append({**window, "preemptions": None if now is None or first is None
                               else now - first, "ended_s": round(time.time() - t0, 2)})
        if sampler is not None:
            entry["timeline"] = thin(sampler.samples)
        save(args, result)                  # what is done survives a timeout

    log = [] if getattr(args, "step_log", False) else None
    done = closed_loop(llm.llm_engine, requests, int(args.concurrency), params=params,
                       render=render, warmup_s=float(args.warmup_s), windows=int(args.windows),
                       window_s=float(args.window_s), drain_s=float(args.drain_s),
                       on_window=on_window, step_log=log)
    last = preemptions(llm)
    run.update({k: v for k, v in done.items() if k != "windows"},
               preemptions=None if last is None or first is None else last - first,
               ended_s=round(time.time() - t0, 2))
    if log is not None:
        run["step_log"] = log
    if client is not None:
        entry["profile"] = profile(args.profile_prefix, epoch, run["windows"])
    save(args, result)


def profile(prefix: str, epoch: float, windows: list) -> dict:
    """``--profile``: the engine core's phases and stack samples (with ``--executor mp`` the
    worker process's too, as ``worker``), and the child's own loop's samples, over the
    warm-up window and over the measurement windows together (:mod:`engineprof`; seconds
    since the loop began -> wall clock at ``epoch``)."""
    import engineprof

    if not windows:
        return {"error": "no window closed"}
    warm_end, first, last = windows[0]["end_s"], windows[min(1, len(windows) - 1)], windows[-1]
    out = {}
    for side in ("engine", "worker", "client"):
        lines = engineprof.read(f"{prefix}-{side}.jsonl")
        if side == "worker" and not lines:      # the worker has a process of its own only
            continue                            # with --executor mp
        out[side] = {"warmup": engineprof.window(lines, epoch, epoch + warm_end),
                     "measure": engineprof.window(lines, epoch + first["start_s"],
                                                  epoch + last["end_s"])}
    return out


def passes(llm, requests, args, entry: dict, result: dict, t0: float, sampler=None) -> None:
    """``--load passes``: the same requests twice as held passes (prefix cache reset
    between): bursts with a tail, not a steady load (the elastic policy may release memory
    in a pass's tail and grow it again in the next)."""
    entry["passes"] = []
    for _ in range(2):
        outs, elapsed = generate(llm, requests)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        entry["passes"].append({"elapsed_s": round(elapsed, 3),
                                "output_tokens_per_s": round(out_tokens / elapsed, 1),
                                "ended_s": round(time.time() - t0, 2)})
        llm.reset_prefix_cache()
        if sampler is not None:
            entry["timeline"] = thin(sampler.samples)
        save(args, result)                   # what is done survives a timeout


def job_throughput(args, result: dict) -> None:
    """Throughput of each engine of ``--modes`` (default stock, then elastic with its default
    policy) under the same ShareGPT-like requests: ``--load steady`` (default) a closed loop
    of ``--concurrency`` requests in flight (:func:`steady`), its windows are the engine's
    spread against itself; ``--load passes`` two held passes (:func:`passes`). Elastic
    engines carry a sampler of their stats file (``timeline``). With ``--release`` (sub-proof
    (b) on the same engine), the elastic engine (1 GiB minimum, ``--delay`` s) then gives its
    memory back and regrows (:class:`Release`; its second load: the first 300 requests,
    not held)."""
    from proxima.workloads import make_workload

    specs = make_workload("sharegpt", int(args.requests), seed=3).requests
    requests = [(list(s.prompt_token_ids), s.max_tokens) for s in specs]
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    result["load"] = args.load
    for mode in args.modes.split(","):
        t0 = time.time()
        kw = {}
        release = args.release and mode != "stock"
        if release:
            kw["elastic_options"] = {"min_bytes": GiB, "release_delay_s": float(args.delay)}
        if args.profile or args.phases:
            import engineprof

            args.profile_prefix = str(stats / f"{mode}-prof")
            args.profile_period = 0.004 if args.profile else 0.0     # 0: phases alone
            missing = engineprof.install(args.profile_prefix, period_s=args.profile_period)
            result.setdefault("profile_missing", {})[mode] = missing
        if args.kv_gib:                 # engines side by side: each its own fixed KV
            kw["kv_cache_memory_bytes"] = int(args.kv_gib * GiB)
        llm = build(mode, stats, max_model_len=8192,
                    gpu_memory_utilization=args.gpu_memory_utilization or 0.85, **kw)
        entry = result.setdefault(mode, {"start_s": round(time.time() - t0, 1)})
        if args.start_after:
            entry["waited_s"] = start_together(Path(args.start_after))
        rel = None
        if mode != "stock":
            rel = Release(stats / f"{mode}-elastic.json",
                          Path(args.progress) if release else None,
                          Path(args.go) if release else None, t0)
        if args.turns:
            take_turns(llm, requests, args, entry, result, t0, rel, mode)
        else:
            (steady if args.load == "steady" else passes)(llm, requests, args, entry, result,
                                                          t0, rel)
        if rel is not None:
            entry["timeline"] = thin(rel.samples)
            save(args, result)
        if release:
            e = read(stats / f"{mode}-elastic.json") or {}
            result["min_bytes"] = e.get("min_bytes") or GiB
            rel.run(result, float(args.delay), result["min_bytes"], time.monotonic(),
                    lambda: generate(llm, requests[:300], held=False))
        elif rel is not None:
            rel.stop.set()
        shutdown(llm)
        time.sleep(1.0)
        if mode != "stock":
            entry["elastic"] = read(stats / f"{mode}-elastic.json")


def take_turns(llm, requests, args, entry: dict, result: dict, t0: float, sampler,
               mode: str) -> None:
    """``--turns N``: engines side by side take turns with the GPU: this one runs its
    :func:`steady` load only in its turns, idle (no request) while the others run theirs.
    For each k < N it waits for ``TURN_DIR/turn-k-MODE`` (the driver makes it), runs the
    load on the k-th of N equal parts of ``requests`` (no prompt comes round twice, so no
    turn is served from what another turn cached), then makes ``TURN_DIR/done-k-MODE``.
    ``entry["turns"]``: each turn's run, as :func:`steady` records one."""
    turn_dir = Path(args.turn_dir)
    part = len(requests) // args.turns
    entry["turns"] = []
    for k in range(args.turns):
        wait_for(turn_dir / f"turn-{k}-{mode}", TURN_TIMEOUT_S)
        turn = {"turn": k, "began_s": round(time.time() - t0, 2)}
        entry["turns"].append(turn)            # saved with the result as steady goes
        steady(llm, requests[k * part:(k + 1) * part], args, turn, result, t0, sampler)
        (turn_dir / f"done-{k}-{mode}").write_text("done")


TURN_TIMEOUT_S = 900.0     # the longest a turn's engine waits for its turn


def wait_for(path: Path, timeout: float) -> float:
    """Wait until ``path`` exists (RuntimeError after ``timeout`` s); the seconds waited."""
    began = time.monotonic()
    while not path.exists():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"{path} did not appear within {timeout:.0f}s")
        time.sleep(0.05)
    return round(time.monotonic() - began, 2)


def start_together(go: Path, timeout: float = 300.0) -> float:
    """``--start-after FILE``: say this engine is built (``FILE.ready-<pid>``) and wait until
    FILE exists (the driver makes it once every engine side by side is ready), so that
    their loads run at the same time. Returns the seconds waited."""
    Path(f"{go}.ready-{os.getpid()}").write_text("ready")
    try:
        return wait_for(go, timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"--start-after: {exc}") from None


def cpu_list(text: str) -> set[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (ValueError for anything else)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list (want e.g. 0-7 or 0,2,4): {part!r}")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    if not cpus:
        raise ValueError("no CPU listed")
    return cpus


def positive(kind, zero: bool = False):
    """An argparse type: a number of ``kind`` above zero (or zero too), else one clear error
    line."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < 0 or (value == 0 and not zero):
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"want {what} {'of 0 or more' if zero else 'above 0'}, got {text!r}")
        return value
    return parse


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=("identity", "burst", "throughput"))
    ap.add_argument("--mode", default="stock")
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None)
    ap.add_argument("--go", default=None)
    ap.add_argument("--delay", default="3", help="(b) release delay, s (default: %(default)s)")
    ap.add_argument("--requests", type=positive(int), default=3000,
                    help="throughput: ShareGPT-like requests listed (seed 3; steady cycles "
                         "them) (default: %(default)s)")
    ap.add_argument("--modes", default="stock,elastic-auto",
                    help="throughput: engines, one after the other (default: %(default)s)")
    ap.add_argument("--load", choices=("steady", "passes"), default="steady",
                    help="throughput: a closed loop (steady) or two held passes of all the "
                         "requests (passes) (default: %(default)s)")
    ap.add_argument("--concurrency", type=positive(int), default=256,
                    help="steady: requests in flight (default: %(default)s)")
    ap.add_argument("--warmup-s", type=positive(float), default=10.0,
                    help="steady: warm-up window 0, reported apart (default: %(default)s)")
    ap.add_argument("--windows", type=positive(int), default=2,
                    help="steady: measurement windows (default: %(default)s)")
    ap.add_argument("--window-s", type=positive(float), default=20.0,
                    help="steady: seconds per measurement window (default: %(default)s)")
    ap.add_argument("--drain-s", type=positive(float, zero=True), default=5.0,
                    help="steady: after the windows, seconds the running requests may take "
                         "to finish before the rest is aborted (default: %(default)s)")
    ap.add_argument("--release", action="store_true",
                    help="throughput: then (b)'s release protocol on the elastic engine "
                         "(--progress, --go) (default: off)")
    ap.add_argument("--profile", action="store_true",
                    help="throughput, steady: time the engine core's phases and sample its "
                         "stack and this loop's (tools/gpu/engineprof.py; a "
                         "diagnostic) (default: off)")
    ap.add_argument("--phases", action="store_true",
                    help="throughput, steady: --profile's phase timers alone, without the "
                         "stack sampler (which slows the engine) (default: off)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--kv-gib", type=positive(float), default=None,
                    help="throughput: each engine's KV fixed at this many GiB (engines side "
                         "by side; default: gpu_memory_utilization 0.85 profiled)")
    ap.add_argument("--start-after", default=None, metavar="FILE",
                    help="throughput: once built, wait for FILE before the load (engines "
                         "side by side start their loads together) (default: none)")
    ap.add_argument("--turns", type=positive(int, zero=True), default=0,
                    help="throughput, steady, with --start-after: the load in N turns, each "
                         "begun when the driver makes --turn-dir's turn-K-MODE file (engines "
                         "side by side take turns with the GPU) (default: 0, one load)")
    ap.add_argument("--turn-dir", default=None, metavar="DIR",
                    help="--turns: where the turn and done files are (default: none)")
    ap.add_argument("--step-log", action="store_true",
                    help="throughput, steady: record each step's end (monotonic clock) and "
                         "output tokens in the result (the driver's --d-interleave counts its "
                         "slices from them) (default: off)")
    ap.add_argument("--executor", choices=("uni", "mp"), default=None,
                    help="every engine's vLLM executor (distributed_executor_backend): uni "
                         "runs the worker on the engine core's thread, mp in a process of "
                         "its own, beside the scheduler (default: vLLM's choice, uni for one "
                         "GPU)")
    ap.add_argument("--cpus", default=None, metavar="LIST",
                    help="run on these CPUs only, e.g. 0-7 or 0,2,4 (the engine core's "
                         "process inherits them) (default: wherever the OS puts it)")
    ap.add_argument("--tp", type=positive(int), default=1, metavar="N",
                    help="every engine's tensor_parallel_size, on the first N visible GPUs "
                         "(above 1: the mp executor; identity's KV is split over them, "
                         "30,720 tokens in all) (default: %(default)s)")
    args = ap.parse_args()
    if args.tp > 1 and args.executor == "uni":
        ap.error(f"--tp {args.tp} needs the mp executor (uni runs one worker): leave "
                 f"--executor out or give mp")
    if args.cpus:
        try:
            os.sched_setaffinity(0, cpu_list(args.cpus))
        except (ValueError, OSError) as exc:
            ap.error(f"--cpus {args.cpus!r}: {exc}")
    if args.turns and not (args.turn_dir and args.start_after and args.load == "steady"
                           and len(args.modes.split(",")) == 1):
        ap.error("--turns needs --turn-dir, --start-after, --load steady and one engine in "
                 "--modes")
    global EXECUTOR, TP
    EXECUTOR, TP = args.executor or ("mp" if args.tp > 1 else None), args.tp
    # the executor asked for; once engines are built, the one vLLM chose for them
    result: dict = {"job": args.job, "mode": args.mode, "executor": EXECUTOR or "default",
                    "tp": TP}
    code = 0
    try:
        {"identity": job_identity, "burst": job_burst, "throughput": job_throughput}[args.job](
            args, result)
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON, then exit 1
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    if BUILT:
        result["executor"] = ",".join(dict.fromkeys(map(str, BUILT)))
    save(args, result)
    return code


if __name__ == "__main__":
    sys.exit(main())
