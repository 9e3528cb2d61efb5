"""One engine job of the elastic KV proof (driver: tests/gpu/proof/elastic_proof.py).

    python3 tests/gpu/proof/elastic_child.py identity --mode stock|proxima|elastic|elastic-auto --out F
    python3 tests/gpu/proof/elastic_child.py burst --out F --progress F --go F
    python3 tests/gpu/proof/elastic_child.py throughput --out F [--modes M,M] [--release --progress F --go F]

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


class Release:
    """The release protocol of sub-proof (b), on an elastic engine that has just served load:
    say "peak" (the driver's taker measures the GPU's free memory now); idle until the
    workers report the mapped KV at the minimum and say "released" (the taker measures again
    and allocates what came back); when the taker is done ("go"), load again: the mapped KV
    must regrow. A sampler thread follows the workers' mapped bytes from the stats file."""

    def __init__(self, elastic_file: Path, progress: Path, go: Path, t0: float) -> None:
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
        result["timeline"] = self.samples[::max(1, len(self.samples) // 200)]


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


def job_throughput(args, result: dict) -> None:
    """Steady load: each engine of ``--modes`` (default stock, then elastic with its default
    policy) runs the same requests twice (prefix cache reset between): two passes of one
    engine are its spread against itself. With ``--release`` (sub-proof (b) on the same
    engine), the elastic engine (1 GiB minimum, ``--delay`` s) then gives its memory back
    and regrows (:class:`Release`)."""
    from proxima.workloads import make_workload

    specs = make_workload("sharegpt", int(args.requests), seed=3).requests
    requests = [(list(s.prompt_token_ids), s.max_tokens) for s in specs]
    stats = Path(tempfile.mkdtemp(prefix="proxima-proof-"))
    for mode in args.modes.split(","):
        t0 = time.time()
        kw = {}
        if args.release and mode != "stock":
            kw["elastic_options"] = {"min_bytes": GiB, "release_delay_s": float(args.delay)}
        llm = build(mode, stats, max_model_len=8192, gpu_memory_utilization=0.85, **kw)
        entry = result.setdefault(mode, {"start_s": round(time.time() - t0, 1), "passes": []})
        rel = (Release(stats / f"{mode}-elastic.json", Path(args.progress), Path(args.go), t0)
               if args.release and mode != "stock" else None)
        for _ in range(2):
            outs, elapsed = generate(llm, requests)
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            entry["passes"].append({"elapsed_s": round(elapsed, 3),
                                    "output_tokens_per_s": round(out_tokens / elapsed, 1),
                                    "ended_s": round(time.time() - t0, 2)})
            llm.reset_prefix_cache()
            save(args, result)               # what is done survives a timeout
        if rel is not None:
            entry["timeline"] = rel.samples[::max(1, len(rel.samples) // 300)]
            save(args, result)
            e = read(stats / f"{mode}-elastic.json") or {}
            result["min_bytes"] = e.get("min_bytes") or GiB
            rel.run(result, float(args.delay), result["min_bytes"], time.monotonic(),
                    lambda: generate(llm, requests, held=False))
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
    ap.add_argument("--modes", default="stock,elastic-auto")
    ap.add_argument("--release", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
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
    save(args, result)
    return code


if __name__ == "__main__":
    sys.exit(main())
