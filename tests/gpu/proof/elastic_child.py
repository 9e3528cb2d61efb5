"""One engine job of the elastic KV proof (driver: tests/gpu/proof/elastic_proof.py).

    python3 tests/gpu/proof/elastic_child.py identity --mode stock|proxima|elastic|elastic-auto --out F
    python3 tests/gpu/proof/elastic_child.py burst --out F --progress F --go F
    python3 tests/gpu/proof/elastic_child.py throughput --out F

Runs in its own process (vLLM starts its engine core from here -- forked, so it inherits
Proxima's patches from :func:`proxima.engines.plugin.register` even where Proxima's entry
point is not installed; this process never touches CUDA). Writes its results as JSON to --out when done (and what it has, when it fails).
Model: the Llama-3.1-8B-shaped config with dummy weights (PROXIMA_PROOF_MODEL, default
/tmp/vllm-kit/dummy-llama); prompts are token ids.
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

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

MODEL = os.environ.get("PROXIMA_PROOF_MODEL", "/tmp/vllm-kit/dummy-llama")
KV_30K = 30720 * 131072            # 30,720 tokens of Llama-3.1-8B's KV (3.75 GiB)
GiB = 1 << 30


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

    from proxima.engines.elastic_v1 import connector_config

    return KVTransferConfig(**connector_config(options))


def build(mode: str, stats_dir: Path, **kw):
    """An LLM of ``mode``: stock, proxima (allocator only), elastic (forced safe cycles,
    strict LRU: the schedule stays stock's), elastic-auto (the default policy)."""
    os.environ["PROXIMA_STATS_FILE"] = str(stats_dir / f"{mode}-status.json")
    os.environ["PROXIMA_ALLOCATOR"] = "0" if mode == "stock" else "1"
    os.environ["PROXIMA_ELASTIC"] = "1" if mode.startswith("elastic") else "0"
    if mode == "stock":
        os.environ["PROXIMA_OBSERVE"] = "0"
    from proxima.engines import plugin

    plugin.register()                      # as vLLM's entry point would, in this process
    from vllm import LLM

    options = dict(kw.pop("elastic_options", {}) or {})
    if mode == "elastic":
        options = {"policy": "fixed", "eviction": "lru", "force_cycle_every": 4,
                   "force_cycle_hold": 2, "force_cycle_granules": 8, **options}
    if mode.startswith("elastic"):
        options.setdefault("stats_file", str(stats_dir / f"{mode}-elastic.json"))
        kw["kv_transfer_config"] = connector(options)
    return LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, seed=0,
               disable_log_stats=False, enable_prefix_caching=True, **kw)


def preemptions(llm) -> int | None:
    values = [m.value for m in llm.get_metrics() if getattr(m, "name", "") ==
              "vllm:num_preemptions" and isinstance(getattr(m, "value", None), (int, float))]
    return int(sum(values)) if values else None


def generate(llm, requests, held=True):
    from vllm import SamplingParams

    from proxima.bench.offline import hold_arrivals

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

def job_identity(args, result: dict) -> None:
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    extra = {}
    if args.mode == "elastic-auto":
        extra["elastic_options"] = {"release_delay_s": 2.0}
    t0 = time.time()
    llm = build(args.mode, stats, kv_cache_memory_bytes=KV_30K, max_model_len=4096,
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


def job_burst(args, result: dict) -> None:
    """Burst; say "peak" (the driver's taker measures the GPU's free memory now); idle until
    the workers report the mapped KV at the minimum and say "released" (the taker measures
    again and allocates what came back); when the taker is done ("go"), burst again: the
    mapped KV must regrow."""
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    delay = float(args.delay)
    options = {"policy": "auto", "min_bytes": GiB, "release_delay_s": delay,
               "stats_file": str(stats / "elastic.json")}
    t0 = time.time()
    llm = build("elastic-burst", stats, kv_cache_memory_bytes=16 * GiB, max_model_len=2048,
                max_num_seqs=256, gpu_memory_utilization=0.5, elastic_options=options)
    result["start_s"] = round(time.time() - t0, 1)
    elastic_file = stats / "elastic.json"
    progress = Path(args.progress)
    samples: list = []
    stop = threading.Event()

    def reported():
        e = read(elastic_file) or {}
        return (e.get("reported_mapped") or 0) * (e.get("bytes_per_granule") or 0), e

    def sample():
        while not stop.is_set():
            got, e = reported()
            if e:
                samples.append((round(time.time() - t0, 2), e.get("mapped_bytes"), got))
            time.sleep(0.25)

    threading.Thread(target=sample, daemon=True).start()

    def wait(pred, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got, e = reported()
            if pred(got):
                return got, e
            time.sleep(0.2)
        return reported()

    def say(**fields):
        progress.write_text(json.dumps(fields))

    rng = random.Random(5)
    start_mapped, e = wait(lambda m: 0 < m <= 2 * GiB, 30)
    result["mapped_at_start_bytes"] = start_mapped
    floor = e.get("min_bytes") or GiB
    result["min_bytes"] = floor
    outs, elapsed = generate(llm, [(tokens(rng, 512), 256) for _ in range(256)], held=False)
    t_end = time.monotonic()
    peak = max((s[2] for s in samples), default=0)
    peak = max(peak, reported()[0])
    result["burst1"] = {"elapsed_s": round(elapsed, 2), "peak_mapped_bytes": peak,
                        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    say(phase="peak", mapped=peak)
    low, e = wait(lambda m: 0 < m <= floor, delay + 30)
    result["released"] = {
        "mapped_bytes": low, "seconds_after_burst": round(time.monotonic() - t_end, 2),
        "delay_s": delay, "bytes_returned": e.get("bytes_returned"),
        "shrinks": e.get("shrinks"), "worker_unmap_seconds": e.get("worker_unmap_seconds"),
        "worker_map_seconds": e.get("worker_map_seconds")}
    say(phase="released", released=max(0, peak - low), mapped=low)
    go = Path(args.go)
    end = time.monotonic() + 90
    while not go.exists() and time.monotonic() < end:
        time.sleep(0.2)
    result["taker_done"] = go.exists()
    samples_before = len(samples)
    outs, elapsed = generate(llm, [(tokens(rng, 512), 256) for _ in range(256)], held=False)
    time.sleep(0.6)
    peak2 = max([s[2] for s in samples[samples_before:]] + [reported()[0]])
    _, e = reported()
    result["burst2"] = {"elapsed_s": round(elapsed, 2), "peak_mapped_bytes": peak2,
                        "grows": e.get("grows"), "failed_grows": e.get("failed_grows"),
                        "worker_map_seconds": e.get("worker_map_seconds")}
    stop.set()
    result["timeline"] = samples[::max(1, len(samples) // 200)]
    shutdown(llm)


def job_throughput(args, result: dict) -> None:
    """Steady load: stock, then elastic (default policy), each engine running the same
    requests twice (prefix cache reset between): the two stock passes are stock's spread
    against itself."""
    from proxima.workloads import make_workload

    specs = make_workload("sharegpt", int(args.requests), seed=3).requests
    requests = [(list(s.prompt_token_ids), s.max_tokens) for s in specs]
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    for mode in ("stock", "elastic-auto"):
        t0 = time.time()
        llm = build(mode, stats, max_model_len=8192, gpu_memory_utilization=0.85)
        entry = result.setdefault(mode, {"start_s": round(time.time() - t0, 1), "passes": []})
        for _ in range(2):
            outs, elapsed = generate(llm, requests)
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            entry["passes"].append({"elapsed_s": round(elapsed, 3),
                                    "output_tokens_per_s": round(out_tokens / elapsed, 1)})
            llm.reset_prefix_cache()
        shutdown(llm)
        time.sleep(1.0)
        if mode != "stock":
            entry["elastic"] = read(stats / f"{mode}-elastic.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=("identity", "burst", "throughput"))
    ap.add_argument("--mode", default="stock")
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", default=None)
    ap.add_argument("--go", default=None)
    ap.add_argument("--delay", default="3")
    ap.add_argument("--requests", default="400")
    args = ap.parse_args()
    result: dict = {"job": args.job, "mode": args.mode}
    code = 0
    try:
        {"identity": job_identity, "burst": job_burst, "throughput": job_throughput}[args.job](
            args, result)
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON, then exit 1
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    Path(args.out).write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
