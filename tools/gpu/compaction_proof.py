"""Issue 14's GPU proof, one process, one engine: KV compaction inside vLLM 0.26 on an H200.

    PYTHONPATH=$PWD:/tmp/site python3 tools/gpu/compaction_proof.py --out "$OUT" \\
        --budget 235 --rounds 5

One engine (dummy Llama-3.1-8B, ``load_format=dummy``, token-id prompts, CUDA graphs on,
prefix caching on, async scheduling as vLLM's default) with Proxima's allocator, elastic
KV memory and KV compaction; its scheduler runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the compactor's mode is switched between runs
(:func:`tests.support.forced.set_mode`; ``off`` is elastic mode without compaction,
``every:K`` the tests' forced compaction). Sub-proofs, each with its own time budget, each one PASS/FAIL line,
the JSON rewritten after each (``$OUT/compaction_proof.json``):

1. ``identity``: the same greedy requests (64, a third sharing one of four 512-token
   prefixes, a KV cache small enough to preempt) under ``off``, ``every:2``, ``every:5``
   and ``auto``: token-identical outputs, with blocks really moved (live, shared, cached)
   and preemptions seen; the worker code's host-device synchronisations counted (torch's
   sync debug mode around it: expected 0).
2. ``throughput``: a larger request set, rounds of (off, auto) interleaved in the one
   engine (``--rounds``, fewer when the budget runs out: a round starts only if both its
   runs fit): every round's output tokens/s, scheduler CPU ms per step and GC pause time;
   the ratio of the means (target >= 0.98), off's spread against itself, each auto round
   against its neighbouring off rounds; the stall compaction adds per step (GPU ms of its
   copies and table writes, CUDA events; scheduler ms of its planning), p50/p99 over all
   auto rounds without the mover's first call, which is reported on its own
   (:func:`summarize_throughput`).

Needs: a CUDA GPU, vLLM 0.26 importable, the Llama config (``--model``, default
``tools/gpu/dummy-llama``). About 60-100 s of engine start, ~25 s of identity runs,
then ~8 s per throughput run (5 rounds: ~80 s); ~200 s in all.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BYTES_PER_TOKEN = 131072            # Llama-3.1-8B's KV: 32 layers x 8 heads x 128 x 2 x bf16


class Budget(Exception):
    """A sub-proof ran out of its time."""


def _alarm(signum, frame):
    raise Budget("time budget exhausted")


class Proof:
    def __init__(self, out: Path, total: float) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.total = total
        self.result = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "proofs": {}}
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "compaction_proof.log", "a", buffering=1)

    def left(self) -> float:
        return self.total - (time.monotonic() - self.t0)

    def say(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        tmp = self.out / ".compaction_proof.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2, default=str))
        os.replace(tmp, self.out / "compaction_proof.json")

    def run(self, name: str, budget: float, fn) -> None:
        """``fn()`` -> (ok, details) within ``budget`` seconds (and the total)."""
        limit = int(min(budget, self.left() - 5))
        entry = self.result["proofs"].setdefault(name, {})
        if limit < 10:
            entry.update(status="SKIPPED", reason=f"only {self.left():.0f}s left")
            self.say(f"SKIPPED {name}: only {self.left():.0f}s left")
            self.save()
            return
        t = time.monotonic()
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(limit)
        try:
            ok, details = fn(entry)
            entry.update(details)
            entry["status"] = "PASS" if ok else "FAIL"
        except Budget:
            entry["status"] = "FAIL"
            entry["error"] = f"over its budget of {limit}s"
        except Exception as exc:              # noqa: BLE001 - every failure is a FAIL line
            entry["status"] = "FAIL"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-4000:]
        finally:
            signal.alarm(0)
        entry["wall_s"] = round(time.monotonic() - t, 1)
        self.save()
        summary = {k: v for k, v in entry.items() if k in ("error", "summary")}
        self.say(f"{entry['status']} {name} ({entry['wall_s']}s) {json.dumps(summary)}")


# ----------------------------------------------------------------------------- workloads

def prefixed_prompts(n, seed, prefixes, prefix_len, body, every):
    """``n`` token-id prompts of ``body`` = (min, max) tokens; every ``every``-th starts
    with one of ``prefixes`` shared prefixes of ``prefix_len`` tokens (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 30000) for _ in range(prefix_len)] for _ in range(prefixes)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 30000) for _ in range(rng.randrange(*body))]
        out.append(shared[i % prefixes] + tail if i % every == 0 else tail)
    return out


def identity_prompts():
    return prefixed_prompts(64, 7, prefixes=4, prefix_len=512, body=(200, 1200), every=3)


def throughput_prompts():
    return prefixed_prompts(192, 11, prefixes=8, prefix_len=256, body=(100, 900), every=4)


# ----------------------------------------------------------------------------- the engine

def build_engine(args, proof: Proof):
    os.environ.update(PROXIMA_ALLOCATOR="1", PROXIMA_ELASTIC="1",
                      VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0",
                      VLLM_NO_USAGE_STATS="1")
    os.environ.pop("PROXIMA_COMPACTION", None)
    sys.path.insert(0, str(ROOT))
    import vllm
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from proxima.vllm import elastic_v1, plugin

    plugin.register()               # as vLLM's entry point would (Proxima may not be installed)
    extra = {"compaction": {"mode": "1"}}               # hook, scratch and compactor on
    proof.result["vllm"] = vllm.__version__
    import torch

    proof.result["gpu"] = torch.cuda.get_device_name(0)
    t = time.monotonic()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_model_len=4096, kv_cache_memory_bytes=args.kv_tokens * BYTES_PER_TOKEN,
              enable_prefix_caching=True, max_num_seqs=64,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]},
              kv_transfer_config=KVTransferConfig(**elastic_v1.connector_config(extra)))
    proof.result["engine_start_s"] = round(time.monotonic() - t, 1)
    from proxima.vllm import compaction_v1

    found = compaction_v1.compactors()
    if len(found) != 1:
        raise RuntimeError(f"expected one compactor in this process, found {len(found)} "
                           "(is the engine core in-process?)")
    return llm, found[0]


_preemptions = [0]


def count_preemptions():
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._preempt_request

    def _preempt_request(self, request, timestamp):
        _preemptions[0] += 1
        return original(self, request, timestamp)

    Scheduler._preempt_request = _preempt_request


def generate(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _preemptions[0]
    t = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    wall = time.monotonic() - t
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return tokens, wall, _preemptions[0] - before, cached


def set_mode(compactor, mode):
    """``off``, ``auto`` (the policy) or ``every:K`` (forced: the tests' own policy)."""
    from tests.support import forced

    forced.set_mode(compactor, mode)


# ----------------------------------------------------------------------------- sub-proofs

def identity(llm, compactor, proof, probe):
    def body(entry):
        prompts = identity_prompts()
        runs = {}
        probe.check_syncs = True
        for mode in ("off", "every:2", "every:5", "auto"):
            set_mode(compactor, mode)
            compactor.reset_metrics()
            probe.reset()
            tokens, wall, preempted, cached = generate(llm, prompts, 96)
            stats = compactor.stats()
            runs[mode] = tokens
            entry.setdefault("runs", {})[mode] = {
                "wall_s": round(wall, 2), "preemptions": preempted, "cached_tokens": cached,
                "worker_syncs": probe.syncs, "syncs_during_worker": probe.syncs_any,
                "compaction": {k: stats[k] for k in (
                    "relocations", "live_moved", "cached_moved", "shared_moved",
                    "scratch_used", "steered", "live_displaced", "steps_with_moves",
                    "gpu_ms", "plan_ms")}}
            proof.save()
            proof.say(f"  identity {mode}: {wall:.1f}s, {preempted} preemptions, "
                      f"{cached} cached tokens, {stats['relocations']} block copies")
        ref = runs["off"]
        differing = {m: [i for i, (a, b) in enumerate(zip(ref, t)) if a != b]
                     for m, t in runs.items() if m != "off"}
        moved = {m: entry["runs"][m]["compaction"]["relocations"] for m in differing}
        probe.check_syncs = False
        syncs = {m: (entry["runs"][m]["worker_syncs"], entry["runs"][m]["syncs_during_worker"])
                 for m in runs}
        ok = (all(not d for d in differing.values()) and all(v > 0 for v in moved.values())
              and all(len(t) == len(ref) for t in runs.values())
              and entry["runs"]["off"]["preemptions"] > 0
              and entry["runs"]["off"]["cached_tokens"] > 0)
        return ok, {"summary": {"differing_requests": {m: len(d) for m, d in differing.items()},
                                "block_copies": moved,
                                "preemptions": entry["runs"]["off"]["preemptions"],
                                "worker_syncs_ours_any": syncs},
                    "differing": {m: d[:10] for m, d in differing.items()}}
    return body


def _percentiles(values):
    from proxima.vllm.status import percentiles

    return percentiles(values, 4)


def summarize_throughput(rounds, target=0.98):
    """The throughput verdict from every round (pure; unit-tested on CPU).

    ``rounds``: ``[{"mode": "off"|"auto", "rate": tok/s, "gpu_ms": [...], "plan_ms": [...],
    "sched_ms_per_step": float|None, "gc_ms": float|None, "worker_syncs": int|None}, ...]``
    in the order run. The ratio is auto's mean over off's mean; off's spread against
    itself is ``(max - min) / mean`` of its rounds (and its relative standard deviation);
    the stall percentiles pool every auto round's samples except the very first one of
    the run (the mover's first call, which may include Triton's compile or its cache
    load): that one is reported on its own. PASS: ratio >= target with two or more rounds
    of each mode."""
    rates = {m: [r["rate"] for r in rounds if r["mode"] == m] for m in ("off", "auto")}
    out = {"rounds": len(rounds), "off_tok_s": [round(x) for x in rates["off"]],
           "auto_tok_s": [round(x) for x in rates["auto"]]}
    if not rates["off"] or not rates["auto"]:
        out.update(ratio=None, verdict="no complete pair of rounds")
        return False, out

    def spread(xs):
        mean = statistics.fmean(xs)
        if len(xs) < 2:
            return None, None
        return round((max(xs) - min(xs)) / mean, 4), round(statistics.stdev(xs) / mean, 4)

    off, auto = statistics.fmean(rates["off"]), statistics.fmean(rates["auto"])
    ratio = auto / off
    out["off_mean_tok_s"], out["auto_mean_tok_s"] = round(off), round(auto)
    out["ratio"] = round(ratio, 4)
    out["off_spread"], out["off_rel_stdev"] = spread(rates["off"])
    out["auto_spread"], out["auto_rel_stdev"] = spread(rates["auto"])
    # each auto round against the off rounds around it (drift over the run cancels)
    pairs = []
    for i, r in enumerate(rounds):
        if r["mode"] != "auto":
            continue
        near = [rounds[j]["rate"] for j in (i - 1, i + 1)
                if 0 <= j < len(rounds) and rounds[j]["mode"] == "off"]
        if near:
            pairs.append(round(r["rate"] / statistics.fmean(near), 4))
    out["auto_over_neighbouring_off"] = pairs
    gpu, first = [], None
    for r in rounds:
        if r["mode"] != "auto":
            continue
        samples = list(r.get("gpu_ms") or ())
        if first is None and samples:
            first, samples = samples[0], samples[1:]
        gpu += samples
    out["stall_gpu_ms_first_call"] = None if first is None else round(first, 4)
    out["stall_gpu_ms"] = _percentiles(gpu)
    out["plan_ms"] = _percentiles([x for r in rounds if r["mode"] == "auto"
                                   for x in r.get("plan_ms") or ()])
    # a different schedule (preemptions, prefix hits: the eviction window may pick
    # another cached block once blocks moved) changes the work itself, not its overhead
    for key in ("sched_ms_per_step", "gc_ms", "worker_syncs", "preemptions", "cached_tokens"):
        per = {m: [r.get(key) for r in rounds if r["mode"] == m and r.get(key) is not None]
               for m in ("off", "auto")}
        out[key] = {m: (round(statistics.fmean(v), 4) if v else None) for m, v in per.items()}
    enough = len(rates["off"]) >= 2 and len(rates["auto"]) >= 2
    out["verdict"] = (f"auto/off {ratio:.3f} (target {target})"
                      + ("" if enough else "; fewer than two rounds of each: not conclusive"))
    return ratio >= target and enough, out


class _Probe:
    """Per-round diagnostics of the in-process engine: the scheduler's CPU time per step
    (``schedule`` + ``update_from_output``), Python's garbage-collection pauses, and the
    host-device synchronisations inside the compaction worker code (torch's sync debug
    mode, warnings raised from Proxima's files only; only while ``check_syncs`` is set:
    the identity runs, so that the timed rounds carry no probe cost of their own)."""

    def __init__(self) -> None:
        import gc

        from vllm.v1.core.sched.scheduler import Scheduler

        from proxima.vllm import compaction_worker

        self.sched_s = 0.0
        self.steps = 0
        self.gc_s = 0.0
        self.syncs = 0
        self.syncs_any = 0
        self.check_syncs = False
        self._gc_t = None
        self._undo = []
        probe = self
        for name in ("schedule", "update_from_output"):
            original = getattr(Scheduler, name)
            self._undo.append((Scheduler, name, original))

            def timed(self, *a, _original=original, _name=name, **k):
                t = time.perf_counter()
                try:
                    return _original(self, *a, **k)
                finally:
                    probe.sched_s += time.perf_counter() - t
                    probe.steps += _name == "schedule"
            setattr(Scheduler, name, timed)

        def on_gc(phase, info):
            if phase == "start":
                probe._gc_t = time.perf_counter()
            elif probe._gc_t is not None:
                probe.gc_s += time.perf_counter() - probe._gc_t
                probe._gc_t = None
        gc.callbacks.append(on_gc)
        self._on_gc = on_gc

        worker = compaction_worker.apply_on_worker
        self._undo.append((compaction_worker, "apply_on_worker", worker))

        def checked(runner, work):
            import warnings

            import torch

            if not probe.check_syncs:
                return worker(runner, work)
            cuda = torch.cuda.is_available()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode(1)
                try:
                    return worker(runner, work)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                    syncs = [w for w in seen if "synchroniz" in str(w.message)]
                    probe.syncs_any += len(syncs)       # any thread, Triton's launcher too
                    probe.syncs += sum(1 for w in syncs
                                       if any(d in str(w.filename).replace(os.sep, "/")
                                              for d in ("proxima/vllm/",
                                                        "proxima/kernels/")))
        compaction_worker.apply_on_worker = checked

    def reset(self) -> None:
        self.sched_s, self.steps, self.gc_s, self.syncs, self.syncs_any = 0.0, 0, 0.0, 0, 0

    def close(self) -> None:
        """Put back what was wrapped."""
        import gc

        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def read(self) -> dict:
        return {"sched_ms_per_step": round(1000 * self.sched_s / self.steps, 4)
                if self.steps else None, "steps": self.steps,
                "gc_ms": round(1000 * self.gc_s, 2), "worker_syncs": self.syncs}


def throughput(llm, compactor, proof, rounds, probe):
    def body(entry):
        prompts = throughput_prompts()
        probe.check_syncs = False
        done = []
        entry["rounds"] = done
        try:
            _rounds(llm, compactor, proof, rounds, probe, prompts, done)
        except Budget:                   # the time ran out mid-round: judge what finished
            entry["cut_short"] = True
        ok, summary = summarize_throughput(done)
        proof.say("  throughput: " + json.dumps({k: summary.get(k) for k in (
            "ratio", "off_spread", "auto_over_neighbouring_off", "stall_gpu_ms",
            "stall_gpu_ms_first_call", "plan_ms", "sched_ms_per_step", "preemptions",
            "cached_tokens")}))
        return ok, {"summary": summary}
    return body


def _rounds(llm, compactor, proof, rounds, probe, prompts, done) -> None:
    """Up to ``rounds`` pairs (off, auto), each run appended to ``done`` as it ends."""
    longest = 0.0
    for r in range(rounds):
        # a round is a pair (off, auto): start one only if both fit
        if done and proof.left() < 2.4 * longest + 10:
            proof.say(f"  throughput: {proof.left():.0f}s left, stopping after "
                      f"{r} rounds")
            break
        for mode in ("off", "auto"):
            set_mode(compactor, mode)
            compactor.reset_metrics()
            probe.reset()
            tokens, wall, preempted, cached = generate(llm, prompts, 128)
            longest = max(longest, wall)
            s = compactor.stats()
            row = {"round": r + 1, "mode": mode, "rate": sum(len(t) for t in tokens) / wall,
                   "wall_s": round(wall, 2), "preemptions": preempted,
                   "cached_tokens": cached, **probe.read(),
                   "steps_with_moves": s["steps_with_moves"],
                   "bytes_moved": s["bytes_moved"], "pack_skipped": s.get("pack_skipped"),
                   "gpu_ms": [round(x, 4) for x in compactor.gpu_ms.steps],
                   "plan_ms": [round(x, 4) for x in compactor.plan_ms.steps]}
            done.append(row)
            proof.save()
            proof.say(f"  throughput round {r + 1} {mode}: {row['rate']:.0f} tok/s, "
                      f"{preempted} preemptions, sched {row['sched_ms_per_step']} ms/step, "
                      f"gc {row['gc_ms']} ms, {row['steps_with_moves']} moving steps, "
                      f"{row['bytes_moved'] / 1e9:.2f} GB, syncs {row['worker_syncs']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"),
                    help="folder for compaction_proof.json and .log (default: $OUT)")
    ap.add_argument("--budget", type=float, default=235,
                    help="seconds for everything (default 235)")
    ap.add_argument("--model", default=str(ROOT / "tools" / "gpu" / "dummy-llama"),
                    help="a Llama-3.1-8B config dir (default tools/gpu/dummy-llama)")
    ap.add_argument("--kv-tokens", type=int, default=24576,
                    help="KV cache size in tokens (default 24576: 3 GiB, preempts)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="throughput rounds, each one off run then one auto run, in one "
                         "engine; fewer if the budget runs out (default 3)")
    args = ap.parse_args()
    proof = Proof(Path(args.out), args.budget)
    proof.result["args"] = vars(args)
    proof.save()
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is usable here")
        if not Path(args.model, "config.json").exists():
            raise RuntimeError(f"no model config at {args.model}")
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(int(max(10, min(150, proof.left() - 20))))
        try:
            llm, compactor = build_engine(args, proof)
            count_preemptions()
        finally:
            signal.alarm(0)
    except Exception as exc:                  # noqa: BLE001
        proof.result["proofs"]["engine"] = {"status": "FAIL", "error": f"{type(exc).__name__}: "
                                            f"{exc}", "traceback": traceback.format_exc()[-4000:]}
        proof.save()
        proof.say(f"FAIL engine: {type(exc).__name__}: {exc}")
        return 1
    proof.say(f"engine up in {proof.result['engine_start_s']}s, {proof.left():.0f}s left")
    probe = _Probe()
    proof.run("identity", 80, identity(llm, compactor, proof, probe))
    proof.run("throughput", max(30, proof.left() - 10), throughput(llm, compactor, proof,
                                                                   args.rounds, probe))
    proof.result["finished_s"] = round(time.monotonic() - proof.t0, 1)
    proof.save()
    statuses = [p.get("status") for p in proof.result["proofs"].values()]
    proof.say("SUMMARY " + " ".join(f"{n}={p.get('status')}" for n, p in proof.result["proofs"].items()))
    return 0 if statuses and all(s == "PASS" for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
