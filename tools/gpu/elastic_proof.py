"""Issue 13's GPU proof, driver A: elastic KV memory in one vLLM 0.26 engine on one H200.

    OUT=$OUT PYTHONPATH=$PWD:/tmp/site python3 tools/gpu/elastic_proof.py \\
        [--budget 620] [--only a,b,d] [--a-modes elastic[,proxima]] [--d-load steady|passes]
        [--d-turns ROUNDS [--d-interleave SLICE[,WARMUP]] | --d-together GIB] [--d-also M,...]
        [--d-phases] [--executor uni|mp] [--tp N]

Sub-proofs, each in its own try/except with its own time budget, results written to
$OUT/elastic_proof.json after every step, a PASS/FAIL summary line per sub-proof at the end
(and in $OUT/elastic_proof.log); the engines' logs go into $OUT/elastic_proof-logs.tgz.
Three files in $OUT. The driver never touches CUDA; every engine runs in a child process
that is killed when its time is up or when the driver exits. Engine start-ups (55-130 s
each for the dummy 8B) are what a device session runs out of, so the driver starts as few
as it can: (a)'s engines start side by side, and (b) runs on (d)'s elastic engine.

(a) identity: greedy token ids of a light phase (16 requests, shared prefixes: forced
    cycles unmap and remap granules mid-run) and a pressure phase (200 requests, shared
    prefixes, 30,720-token KV: preemptions, prefix hits), identical for stock vLLM and
    PROXIMA_ELASTIC=1 with forced safe cycles and strict LRU (the schedule is stock's by
    construction, so any difference would be corrupted KV); ``--a-modes elastic,proxima``
    adds PROXIMA_ALLOCATOR=1 alone. The engines run side by side, each with a fixed KV.
(a2) (``--only ...,a2``) the default elastic policy (informational: its eviction and its
    memory differ from stock's, the schedule may differ, and with dummy weights a different
    batch shape can flip a near-tied greedy token).
(d) steady-load throughput: stock then the default elastic policy (1 GiB minimum, 12 s
    release delay), each engine under the same closed loop on its offline engine
    (``elastic_child.py closed_loop``): 256 requests in flight, the next of 3,000
    ShareGPT-like requests (seed 3, in order) added as soon as one finishes; a 10 s warm-up
    window (window 0, the elastic engine's first grow: reported apart, not hidden), then two
    measurement windows of 20 s, output tok/s each; then a drain of at most 5 s (the rest
    aborted). Stock's spread is between its two windows; the ratio is elastic over stock,
    mean of the measurement windows, and passes at >= 0.99; the warm-up window's ratio is
    shown beside it, with requests completed and preemptions. ``--d-load passes`` runs the
    older two held passes of 300 requests instead (bursts: each pass's tail lets the policy
    release its memory, the next pass grows it again).
(b) release and regrow, on (d)'s elastic engine after its load (alone, without d: a
    16 GiB pool and one burst): the workers' mapped KV must fall to the minimum within the
    release delay plus 10 s, a separate process must see that memory come back free and
    allocate it, and more load must map memory again.

``--tp N`` (issue 38): every engine with tensor_parallel_size=N on the N GPUs visible
(CUDA_VISIBLE_DEVICES), through vLLM's mp executor (uni runs one worker: refused). (a)'s
engines keep 30,720 tokens of KV (each GPU holds 1/N of every token's KV heads) and still
run side by side, 0.3 of each GPU each; in (b) the taker measures and allocates on each of
the N GPUs, and each GPU must give back and have taken what its worker released.

Needs: vLLM 0.26.0 importable (PYTHONPATH=$PWD:/tmp/site as staged by run.sh c1/c2), the
Llama-3.1-8B-shaped config tools/gpu/dummy-llama (PROXIMA_PROOF_MODEL overrides).
About 8-9 minutes (four engine start-ups); ``--only d,b --budget 440`` about 6.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from signal import SIGCONT, SIGSTOP

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proofkit as kit  # noqa: E402

HERE = Path(__file__).resolve().parent
CHILD = str(HERE / "elastic_child.py")
GiB = 1 << 30
_STOCK: dict = {}          # stock's identity run, for the informational (a2) comparison
A_MODES = ["elastic"]      # (a)'s engines beside stock (--a-modes)
EXECUTOR = ""              # --executor: every engine's vLLM executor ("": vLLM's choice)
TP = 1                     # --tp: every engine's tensor_parallel_size (GPUs per engine)
DRY = False
WANTED: set = set()

# The taker (with_taker: a process of its own, never the driver) on each of the first GPUS
# visible GPUs (argv[3], default 1): free memory at the engine's peak, then after its
# release, then allocates what came back on every GPU at once. Its top-level fields are
# GPU 0's (as a one-GPU run's always were), ``devices`` holds each GPU's.
TAKER = r"""
import json, sys, time
import torch
progress, out = sys.argv[1], sys.argv[2]
gpus = int(sys.argv[3]) if len(sys.argv) > 3 else 1
if torch.cuda.device_count() < gpus:
    json.dump({"error": f"{gpus} GPUs wanted, {torch.cuda.device_count()} visible",
               "devices": []}, open(out, "w"))
    sys.exit(1)
for d in range(gpus):
    torch.empty(1, device=f"cuda:{d}")    # each GPU's context before the first measure
def phase():
    try:
        return json.load(open(progress))
    except Exception:
        return {}
devices = []
for d in range(gpus):
    free_peak, total = torch.cuda.mem_get_info(d)
    devices.append({"device": d, "free_at_peak": free_peak, "total": total})
end = time.monotonic() + 60
while phase().get("phase") != "released" and time.monotonic() < end:
    time.sleep(0.2)
p = phase()
time.sleep(0.5)
for dev in devices:
    dev["free_after_release"] = torch.cuda.mem_get_info(dev["device"])[0]
held = []
for dev in devices:
    want = int(0.95 * min(max(0, dev["free_after_release"] - dev["free_at_peak"]),
                          p.get("released") or 0))
    dev["tried"] = want
    try:
        buf = torch.empty(want, dtype=torch.uint8, device=f"cuda:{dev['device']}")
        buf.fill_(7)
        torch.cuda.synchronize(dev["device"])
        dev["allocated"] = want
        held.append(buf)
    except Exception as exc:
        dev["allocated"] = 0
        dev["error"] = f"{type(exc).__name__}: {exc}"
del held
result = {k: v for k, v in devices[0].items() if k != "device"}
result.update(released=p.get("released"), seen_release=p.get("phase") == "released",
              devices=devices)
json.dump(result, open(out, "w"))
"""


def _collect(out: kit.Out, name: str, path: Path, rc: int, started: float) -> dict:
    result = kit.read_json(path) or {}
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)  # a child killed as it saved
    result["rc"] = rc
    result["wall_s"] = round(time.monotonic() - started, 1)
    out.results.setdefault("executors", {})[name] = result.get("executor")   # as the child ran
    if rc != 0:
        result.setdefault("error", f"exit {rc}" + (" (timed out)" if rc == 124 else ""))
        result["log_tail"] = kit.tail(out.child_log(name))
    out.log(f"  {name}: rc={rc} wall={result['wall_s']}s"
            + (f" error: {result.get('error')}" if rc else ""))
    return result


def engine_cmd(args: list[str], path: Path, log: Path) -> list[str]:
    """The command of an engine child running ``args``, its result to ``path``; every engine
    the driver starts gets ``--executor``'s backend and ``--tp``'s GPUs. The command is
    written at the top of the child's ``log``: what each engine was asked to be (its GPUs,
    its executor) is in its log, the dry run's too."""
    executor = ["--executor", EXECUTOR] if EXECUTOR else []
    cmd = [sys.executable, CHILD, *args, *executor, "--tp", str(TP), "--out", str(path)]
    with log.open("a") as f:
        f.write(f"[elastic_proof] {shlex.join(cmd)}\n")
    return cmd


def child(out: kit.Out, name: str, args: list[str], env: dict, timeout: float) -> dict:
    path = out.dir / f".{name}.json"
    path.unlink(missing_ok=True)
    started = time.monotonic()
    log = out.child_log(name)
    rc = kit.run(engine_cmd(args, path, log), env, log, timeout)
    return _collect(out, name, path, rc, started)


def children(out: kit.Out, jobs: dict[str, list[str]], env: dict, timeout: float,
             go: Path | None = None, after_go=None, before_go=None) -> dict:
    """Several children side by side (their engines share the GPU), each killed when
    ``timeout`` s have passed; name -> result as :func:`child`'s. With ``go`` (children
    started with ``--start-after go``): once every child is built (its ``go.ready-*`` file)
    or one has exited, ``before_go(signal)`` runs, if given, then ``go`` is made, so that
    their loads start at one moment; then ``after_go(alive, deadline, signal)`` runs, if
    given (``alive(name)``: that child runs; ``signal(name, sig)`` sends ``sig`` to the
    child's process group, its engine core included). The go and ready files are removed
    once the children are done. With VLLM_PORT set (run.sh: one base per GPU set), each
    child searches for its ports from a base of its own, 100 apart: vLLM takes the first
    free port from VLLM_PORT up, so engines started together can find the same one free
    and race for it (EADDRINUSE: why run.sh gives each lane a base of its own; --tp's mp
    engines each open a torch.distributed port)."""
    started = time.monotonic()
    if go is not None:                      # a go or ready file of an earlier run
        for stale in [go, *go.parent.glob(f"{go.name}.ready-*")]:
            stale.unlink(missing_ok=True)
    procs = {}
    for k, (name, args) in enumerate(jobs.items()):
        path = out.dir / f".{name}.json"
        path.unlink(missing_ok=True)
        own = dict(env, VLLM_PORT=str(int(env["VLLM_PORT"]) + 100 * k)) if env.get(
            "VLLM_PORT", "").isdigit() else env
        log = out.child_log(name)
        procs[name] = (kit.start(engine_cmd(args, path, log), own, log), path)
    def signal(name: str, sig: int) -> None:
        proc = procs[name][0]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    if go is not None:
        ready = 0
        while time.monotonic() < started + timeout:
            ready = len(list(go.parent.glob(f"{go.name}.ready-*")))
            if ready >= len(procs) or any(p.poll() is not None for p, _ in procs.values()):
                break
            time.sleep(0.2)
        if before_go is not None:
            before_go(signal)
        go.write_text("go")
        out.log(f"  {ready} of {len(procs)} engines ready after "
                f"{time.monotonic() - started:.0f}s: loads start")
        if after_go is not None:
            after_go(lambda name: procs[name][0].poll() is None, started + timeout, signal)
    results = {}
    for name, (proc, path) in procs.items():
        try:
            rc = proc.wait(timeout=max(0.1, started + timeout - time.monotonic()))
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: out of time
            kit.stop(proc)
            rc = 124
        results[name] = _collect(out, name, path, rc, started)
    if go is not None:                      # the protocol's files do not stay in $OUT
        for used in [go, *go.parent.glob(f"{go.name}.ready-*")]:
            used.unlink(missing_ok=True)
    return results


def compare(ref: dict, other: dict) -> dict:
    """Per phase: requests whose tokens differ, and whether the schedule visibly matched
    (same cached tokens per request, same preemption count)."""
    report = {}
    for phase in ("light", "pressure"):
        a, b = ref.get(phase) or {}, other.get(phase) or {}
        ta, tb = a.get("tokens"), b.get("tokens")
        if not ta or not tb or len(ta) != len(tb):
            report[phase] = {"ok": False, "why": "missing or different request counts"}
            continue
        differing = [i for i, (x, y) in enumerate(zip(ta, tb)) if x != y]
        report[phase] = {"ok": not differing, "differing": differing[:10],
                         "n_differing": len(differing), "requests": len(ta),
                         "same_cached_tokens": a.get("cached_tokens") == b.get("cached_tokens"),
                         "cached_tokens": [sum(a.get("cached_tokens") or []),
                                           sum(b.get("cached_tokens") or [])],
                         "preemptions": [a.get("preemptions"), b.get("preemptions")]}
    return report


# ----------------------------------------------------------------------------- sub-proofs

def proof_a(out: kit.Out, budget: kit.Budget, env: dict, share: float) -> None:
    modes = ["stock"] + [m for m in A_MODES if m != "stock"]
    out.log(f"(a) identity: {', '.join(modes)} side by side (elastic: forced safe cycles); "
            f"budget {share:.0f}s")
    # Side by side on one GPU: each engine's KV is fixed (30,720 tokens), arrivals are held
    # and the policy is step-driven, so the schedule does not depend on timing; each engine
    # checks only its own 0.3 share of the GPU at start-up. With --tp N, side by side on the
    # same N GPUs, 0.3 of each (the 30,720 tokens' KV is split over them by the child).
    found = children(out, {f"a-{m}": ["identity", "--mode", m, "--gpu-memory-utilization", "0.3"]
                           for m in modes}, env, min(share, budget.left() - 10, 200))
    runs = {m: found[f"a-{m}"] for m in modes}
    for mode, run in runs.items():
        out.record("a", **{f"{mode}_rc": run["rc"], f"{mode}_start_s": run.get("start_s"),
                           f"{mode}_error": run.get("error")})
    stock = runs.get("stock", {})
    _STOCK.update(stock)
    checks = {m: compare(stock, runs[m]) for m in modes if m != "stock"}
    e = (runs.get("elastic") or {}).get("elastic") or {}
    pressure = (stock.get("pressure") or {})
    evidence = {"forced_cycles": e.get("forced_cycles"),
                "granules_unmapped": e.get("granules_unmapped"),
                "granules_mapped": e.get("granules_mapped"),
                "map_failures": e.get("map_failures"),
                "worker_map_seconds": e.get("worker_map_seconds"),
                "stock_pressure_preemptions": pressure.get("preemptions"),
                "stock_pressure_cached_tokens": sum(pressure.get("cached_tokens") or [])}
    ok = (all(r.get("rc") == 0 for r in runs.values()) and "elastic" in runs
          and all(c.get(p, {}).get("ok") for c in checks.values() for p in ("light", "pressure"))
          and (e.get("forced_cycles") or 0) >= 1 and (e.get("granules_unmapped") or 0) >= 1
          and e.get("map_failures") == 0 and (pressure.get("preemptions") or 0) > 0
          and evidence["stock_pressure_cached_tokens"] > 0)
    out.record("a", passed=ok, compare=checks, evidence=evidence)


def proof_a2(out: kit.Out, budget: kit.Budget, env: dict) -> None:
    left = budget.left() - 15
    if left < 60:
        out.record("a2", skipped=f"only {left:.0f}s left")
        return
    out.log("(a2) the default elastic policy against stock (informational)")
    stock = _STOCK
    run = child(out, "a2-elastic-auto", ["identity", "--mode", "elastic-auto"], env,
                min(left, 110))
    out.record("a2", rc=run["rc"], compare=compare(stock, run) if stock else None,
               elastic={k: (run.get("elastic") or {}).get(k) for k in (
                   "grows", "shrinks", "failed_grows", "bytes_returned", "mapped_bytes",
                   "pool_bytes", "worker_map_seconds")},
               note="informational: eviction and memory differ from stock's by design, so "
                    "the schedule may differ; with dummy weights greedy near-ties may flip")


def with_taker(out: kit.Out, name: str, args: list[str], env: dict, share: float,
               delay: float):
    """Run an engine child that follows :class:`elastic_child.Release` (it says "peak",
    then "released"); when it says so, a taker process measures the GPU's free memory and
    allocates what came back; then "go" lets the child regrow. (result, taker's result)."""
    progress = out.dir / f".{name}-progress.json"
    go = out.dir / f".{name}-go"
    taken = out.dir / f".{name}-taker.json"
    path = out.dir / f".{name}.json"
    for f in (progress, go, taken, path):
        f.unlink(missing_ok=True)
    started = time.monotonic()
    log = out.child_log(name)
    proc = kit.start(engine_cmd([*args, "--progress", str(progress), "--go", str(go),
                                 "--delay", str(delay)], path, log), env, log)
    deadline = started + share
    taker = None
    rc = 124
    try:
        peak = kit.wait_for(lambda: (kit.read_json(progress) or {}).get("phase") in
                            ("peak", "released") or proc.poll() is not None,
                            max(1, deadline - time.monotonic() - 30))
        if peak and proc.poll() is None:
            cmd = ([sys.executable, CHILD, "taker"] if DRY else [sys.executable, "-c", TAKER])
            taker = kit.start([*cmd, str(progress), str(taken), str(TP)], env,
                              out.child_log(f"{name}-taker"))
            try:
                taker.wait(timeout=max(1, min(90, deadline - time.monotonic() - 15)))
            except Exception:  # noqa: BLE001 - out of time
                kit.stop(taker)
        go.write_text("go")
        try:
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - out of time
            kit.stop(proc)
    finally:
        kit.stop(proc)
        if taker is not None:
            kit.stop(taker)
    take = kit.read_json(taken) or {}
    result = _collect(out, name, path, rc, started)
    for f in (progress, go, taken):
        f.unlink(missing_ok=True)
    return result, take


def judge_b(out: kit.Out, result: dict, take: dict, delay: float, gpus: int = 1) -> None:
    """(b)'s verdict on the engine's ``result`` and the taker's ``take``, the engine on
    ``gpus`` GPUs. The workers' mapped bytes are one worker's (vLLM's scheduler sizes the
    granules by one worker's KV; a tensor-parallel worker holds its share of every
    granule), so each GPU must see what was released come back and the taker take it
    there: one GPU that kept its memory fails (b), whatever the others' sum. The taker's
    per-GPU entries are ``devices``; a result without them (a one-GPU run's of before,
    the dry run's stand-in) is its one GPU. The summary's freed and allocated bytes are
    the least over the GPUs (for one GPU, its own), each GPU's beside them with more."""
    released = result.get("released") or {}
    b1, b2 = result.get("burst1") or {}, result.get("burst2") or {}
    floor = result.get("min_bytes") or GiB
    fell = (released.get("mapped_bytes") or 1 << 62) <= floor and \
        (released.get("seconds_after_burst") or 1e9) <= delay + 10
    devices = take["devices"] if "devices" in take else [take]
    came_back = [d.get("free_after_release", 0) - d.get("free_at_peak", 0) for d in devices]
    took = [d.get("allocated", 0) for d in devices]
    want = max(0, (b1.get("peak_mapped_bytes") or 0) - (released.get("mapped_bytes") or 0))
    ok = (result.get("rc") == 0 and fell and want >= 4 * GiB and len(devices) == gpus
          and min(came_back, default=0) >= 0.9 * want and min(took, default=0) >= 0.85 * want
          and (b2.get("peak_mapped_bytes") or 0) >= floor + 4 * GiB
          and not result.get("error"))
    summary = {"peak_bytes": b1.get("peak_mapped_bytes"),
               "min_bytes": floor, "mapped_after_bytes": released.get("mapped_bytes"),
               "seconds_to_min": released.get("seconds_after_burst"),
               "delay_s": delay, "freed_seen_by_other_process_bytes": min(came_back, default=0),
               "other_process_allocated_bytes": min(took, default=0),
               "regrow_peak_bytes": b2.get("peak_mapped_bytes")}
    if gpus > 1 or len(devices) > 1:
        summary.update(gpus=gpus, gpus_measured=len(devices), freed_seen_per_gpu=came_back,
                       allocated_per_gpu=took)
    out.record("b", passed=ok, engine={k: v for k, v in result.items() if k not in (
                   "stock", "elastic-auto")}, taker=take, summary=summary)


def proof_b(out: kit.Out, budget: kit.Budget, env: dict, share: float) -> None:
    """(b) alone: a 16 GiB elastic pool with a 1 GiB minimum, one burst."""
    out.log(f"(b) release after a burst, another process takes it, regrow; budget {share:.0f}s")
    delay = 12.0
    result, take = with_taker(out, "b-engine", ["burst"], env, share, delay)
    judge_b(out, result, take, delay, TP)


D_TARGET = 0.99            # (d): elastic / stock output tok/s, mean of the measurement windows
# (d)'s steady load (elastic_child.py closed_loop): warm-up window 0, then the measured ones
D_STEADY = {"concurrency": 256, "warmup_s": 10.0, "windows": 2, "window_s": 20.0,
            "drain_s": 5.0}
D_REQUESTS = {"steady": 3000, "passes": 300}   # steady: no prompt comes round twice in ~55 s
D_ALSO: list = []          # --d-also: more engines under (d)'s load, informational
D_PROFILE = ""             # --d-profile / --d-phases: "full" (phases and stack samples), "phases"
D_TOGETHER = 0.0           # --d-together GIB: (d)'s engines side by side, KV fixed at GIB each
D_TURNS = 0                # --d-turns ROUNDS: side by side, taking turns with the GPU
D_TURN = {"warmup_s": 10.0, "windows": 1, "window_s": 20.0, "drain_s": 0.0}   # one turn
D_TURN_GIB = 40.0          # --d-turns: each engine's KV (elastic: its pool, mapped on demand)
D_CPUS = ""                # --d-cpus: the CPUs (d)'s engines run on ("" : the OS decides)
D_INTERLEAVE = 0.0         # --d-interleave SLICE[,WARMUP]: with --d-turns, slices of SLICE s
D_INTERLEAVE_WARMUP = 10.0  # each engine's first slice, not measured (its ramp, its grows)
D_SETTLE_S = 0.5           # the start of each slice not counted (the step frozen mid-way)
START_S = 130.0            # an engine start-up of the dummy 8B, at its slowest seen


def steady_summary(stock: dict, elastic: dict, windows: int) -> tuple[bool, dict]:
    """(d) with the steady load, from the children's entries ``stock`` and ``elastic-auto``:
    output tok/s per window (window 0, the warm-up with the elastic engine's first grow,
    apart), stock's spread between its measurement windows, the ratio (elastic over stock,
    mean of the measurement windows) and the warm-up window's. Passes when every window was
    measured and the ratio is at least D_TARGET."""
    runs = [(e.get("steady") or {}) for e in (stock, elastic)]
    rates = [[w.get("output_tokens_per_s") for w in r.get("windows") or []] for r in runs]
    (s_warm, *s), (e_warm, *e) = [r or [None] for r in rates]
    summary = {"load": "steady", "target": f"ratio >= {D_TARGET}", "ratio": None,
               "stock_spread_pct": None, "warmup_ratio": None,
               "stock_tok_s": s, "elastic_tok_s": e,
               "stock_warmup_tok_s": s_warm, "elastic_warmup_tok_s": e_warm}
    complete = len(s) == len(e) == windows and all(s + e) and s_warm and e_warm
    if complete:
        summary.update(ratio=round(sum(e) / sum(s), 4),
                       stock_spread_pct=spread_pct(s) if len(s) > 1 else None,
                       warmup_ratio=round(e_warm / s_warm, 4),
                       ratio_per_window=[round(b / a, 4) for a, b in zip(s, e)])
    spans = [round(w["end_s"] - w["start_s"], 3) for w in (runs[0].get("windows") or [])[:2]]
    summary.update(warmup_and_window_s=spans, concurrency=runs[0].get("concurrency"),
                   requests_completed=[r.get("completed") for r in runs],
                   preemptions=[r.get("preemptions") for r in runs],
                   aborted_at_drain=[(r.get("drain") or {}).get("aborted") for r in runs])
    return bool(complete and summary["ratio"] >= D_TARGET), summary


def passes_summary(stock: dict, elastic: dict) -> tuple[bool, dict]:
    """(d) with ``--d-load passes``: two held passes per engine (bursts, not a steady load)."""
    s = [p["output_tokens_per_s"] for p in stock.get("passes", [])]
    e = [p["output_tokens_per_s"] for p in elastic.get("passes", [])]
    summary = {"load": "passes", "stock_tok_s": s, "elastic_tok_s": e}
    if len(s) == 2 and len(e) == 2:
        summary.update(stock_spread_pct=round(100 * abs(s[0] - s[1]) / (sum(s) / 2), 2),
                       ratio_pass1=round(e[0] / s[0], 4), ratio_pass2=round(e[1] / s[1], 4),
                       ratio_mean=round(sum(e) / sum(s), 4))
    ok = "ratio_mean" in summary and (summary["ratio_mean"] >= D_TARGET or
                                      summary["ratio_mean"] >= 1 - summary["stock_spread_pct"] / 100)
    return ok, summary


def judge_d(out: kit.Out, stock_run: dict, elastic_run: dict, load: str) -> None:
    stock, elastic = stock_run.get("stock") or {}, elastic_run.get("elastic-auto") or {}
    ok, summary = (steady_summary(stock, elastic, int(D_STEADY["windows"])) if load == "steady"
                   else passes_summary(stock, elastic))
    e = elastic.get("elastic") or {}
    summary.update({k: e.get(k) for k in ("grows", "worker_map_seconds", "pool_bytes")})
    ok = ok and stock_run.get("rc") == 0 and elastic_run.get("rc") == 0
    record_profile(out, "stock", stock)
    record_profile(out, "elastic-auto", elastic)
    out.record("d", passed=ok, summary=summary,
               error=stock_run.get("error") or elastic_run.get("error"),
               log_tail=stock_run.get("log_tail") or elastic_run.get("log_tail"))


def proof_d(out: kit.Out, budget: kit.Budget, env: dict, share: float, load: str) -> None:
    """(d): the default elastic policy's engine, then stock's, each under the same load
    (``load``: steady, a closed loop with windows; passes, two held passes). With (b) asked
    too, (b) runs on the elastic engine right after its load (one engine start fewer): it
    gives its memory back, a taker allocates it, it regrows."""
    with_b = "b" in WANTED
    out.log(f"(d) {load}-load throughput, stock vs elastic default"
            + (" then (b) on the elastic engine" if with_b else "") + f"; budget {share:.0f}s")
    deadline = time.monotonic() + share
    job = ["throughput", "--requests", str(D_REQUESTS[load]), "--load", load]
    if D_PROFILE and load == "steady":
        job.append("--profile" if D_PROFILE == "full" else "--phases")
    if load == "steady":
        job += [a for k, v in D_STEADY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
        run_s = sum(D_STEADY[k] for k in ("warmup_s", "drain_s")) + \
            D_STEADY["windows"] * D_STEADY["window_s"]
    else:
        run_s = 45.0                      # two passes of 300 requests and the pause between
    if D_TURNS and D_INTERLEAVE:
        return proof_d_interleave(out, budget, env, share, load)
    if D_TURNS:
        return proof_d_turns(out, budget, env, share, load)
    if D_TOGETHER:
        return proof_d_together(out, budget, env, share, job, run_s, load)
    # the elastic engine first: it carries (b) and the timeline of its grows; stock's gets
    # what is left (at least a slow start-up, its load and a shutdown)
    stock_need = START_S + run_s + 15
    left = min(deadline - stock_need, budget.end - stock_need - 10) - time.monotonic()
    if left < START_S + run_s:
        out.record("d", passed=False, skipped=f"{share:.0f}s is too little: each engine "
                   f"needs about {START_S + run_s:.0f}s (start-up, load), stock "
                   f"{stock_need:.0f}s; give --budget {2 * stock_need + 40:.0f} or more")
        if with_b:
            out.record("b", passed=False, skipped="runs on (d)'s elastic engine: not started")
        return
    if with_b:
        delay = 12.0
        elastic, take = with_taker(out, "d-elastic", [*job, "--modes", "elastic-auto",
                                                      "--release"], env, left, delay)
        judge_b(out, elastic, take, delay, TP)
    else:
        elastic = child(out, "d-elastic", [*job, "--modes", "elastic-auto"], env, left)
    stock = child(out, "d-stock", [*job, "--modes", "stock"], env,
                  min(deadline, budget.end - 5) - time.monotonic())
    judge_d(out, stock, elastic, load)
    also_d(out, budget, env, job, stock, load, START_S + run_s + 15)


def side_by_side_fits(out: kit.Out, share: float, need: float, what: str, parts: str,
                      flag: str) -> bool:
    """(d)'s engines side by side (``flag``): False, (d) recorded as skipped, when ``share``
    s cannot hold ``need`` s (``what``, made of ``parts``); else True, and (b), asked for, is
    recorded as not run (it needs the GPU to itself)."""
    if share < need:
        out.record("d", passed=False, skipped=f"{share:.0f}s is too little for {what}: about "
                   f"{need:.0f}s ({parts})")
        return False
    if "b" in WANTED:
        out.record("b", passed=False, skipped=f"{flag}: (b) needs the GPU to itself")
    return True


def proof_d_together(out: kit.Out, budget: kit.Budget, env: dict, share: float, job: list,
                     run_s: float, load: str) -> None:
    """``--d-together GIB``: (d)'s engines (elastic, stock, then ``--d-also``'s) side by side
    on the GPU, each with its KV fixed at GIB, their loads started at the same moment once
    every engine is built: stock's spread and the ratio come from the same seconds of the
    same machine (the same host noise and GPU clocks for both). (b) needs the GPU to itself: not run.
    Measured so (session 8): each engine then waits for the GPU for ~half of every step,
    which hides a cost on the scheduler's thread; the run's phases are its finding and
    (d) is recorded as not passed (``informational``), whatever the ratio."""
    modes = ["elastic-auto", "stock"] + [m for m in D_ALSO if m not in ("elastic-auto", "stock")]
    if not side_by_side_fits(out, share, START_S + run_s + 30,
                             f"{len(modes)} engines side by side", "start-up, load, stop",
                             "--d-together"):
        return
    util = round(min(0.3, 0.9 / len(modes)), 3)
    go = out.dir / ".d-go"
    out.log(f"(d) {load}-load throughput, {', '.join(modes)} side by side, KV {D_TOGETHER:g} "
            f"GiB each; budget {share:.0f}s")
    names = child_names(modes)
    found = children(out, {names[m]: [*job, "--modes", m, "--kv-gib", f"{D_TOGETHER:g}",
                                      "--gpu-memory-utilization", str(util),
                                      "--start-after", str(go)] for m in modes},
                     env, share - 5, go=go)
    runs = {m: found[names[m]] for m in modes}
    judge_d(out, runs["stock"], runs["elastic-auto"], load)
    # Not (d)'s verdict: sharing the GPU, each engine waits for it (on the H200, 21-24 ms of
    # a 50 ms step against ~1 of 30 alone), so a cost on the scheduler's thread is hidden.
    rec = out.results["subproofs"]["d"]
    out.record("d", passed=False, ratio_side_by_side_passed=rec.get("passed"),
               informational="side by side the engines share the GPU and wait for it, which "
                             "hides costs on the scheduler's thread: the phases, not the "
                             "ratio, are the finding; (d)'s verdict needs the GPU to itself",
               together={"kv_gib": D_TOGETHER, "gpu_memory_utilization": util,
                         "engines": modes})
    stock = runs["stock"].get("stock") or {}
    also = {m: also_entry(stock, runs[m], m, load) for m in modes[2:]}
    for m in modes[2:]:
        record_profile(out, m, runs[m].get(m) or {})
    if also:
        summary = dict(out.results["subproofs"]["d"].get("summary") or {}, also=also)
        out.record("d", summary=summary)


def child_names(modes) -> dict[str, str]:
    """(d)'s children side by side, by engine: d-elastic for the default policy's, else
    d-MODE (their logs' names in $OUT's tarball)."""
    return {m: "d-elastic" if m == "elastic-auto" else f"d-{m}" for m in modes}


def spread_pct(values: list) -> float:
    """Stock's spread against itself: (max - min) over the mean, in percent."""
    return round(100 * (max(values) - min(values)) / (sum(values) / len(values)), 2)


def turn_order(rounds: int) -> list[list[str]]:
    """``--d-turns``: who runs when, round by round: stock then elastic, then the other way
    round (ABBA...), so that neither always follows the other."""
    pair = ["stock", "elastic-auto"]
    return [pair if r % 2 == 0 else pair[::-1] for r in range(rounds)]


def proof_d_turns(out: kit.Out, budget: kit.Budget, env: dict, share: float,
                  load: str) -> None:
    """``--d-turns ROUNDS``: stock and elastic side by side (KV ``D_TURN_GIB`` each; the
    elastic engine's pool maps on demand), built together, then taking turns with the GPU
    (:func:`turn_order`): in each turn one engine runs the steady load (a warm-up window,
    then a measurement window) while the other has no request. Each round's two turns come
    from the same minutes of the same machine, which engines run one after the other (the
    default) do not give: there, stock's own spread between runs was 2-15% (sessions 7-10).
    The elastic engine, idle through the other's turn, gives its memory back (12 s delay)
    and grows again in its own warm-up window. (b) is not run."""
    if load != "steady":
        out.record("d", passed=False, skipped="--d-turns needs the steady load")
        return
    rounds = D_TURNS
    turn_s = D_TURN["warmup_s"] + D_TURN["windows"] * D_TURN["window_s"] + 5
    if not side_by_side_fits(out, share, START_S + 2 * rounds * turn_s + 30,
                             f"{rounds} rounds of turns", f"start-up, {2 * rounds} turns, stop",
                             "--d-turns"):
        return
    modes = ["elastic-auto", "stock"]
    order = turn_order(rounds)
    go = out.dir / ".d-go"
    turns = out.dir / ".d-turns"
    shutil.rmtree(turns, ignore_errors=True)        # an earlier run's turn files
    turns.mkdir()
    out.log(f"(d) steady load in turns: {rounds} rounds ({', '.join('/'.join(r) for r in order)})"
            f", KV {D_TURN_GIB:g} GiB each, side by side; budget {share:.0f}s")
    job = ["throughput", "--requests", str(D_REQUESTS["steady"] * rounds), "--load", "steady",
           "--turns", str(rounds), "--turn-dir", str(turns), "--start-after", str(go),
           "--kv-gib", f"{D_TURN_GIB:g}", "--gpu-memory-utilization", "0.3"]
    job += [a for k, v in {"concurrency": D_STEADY["concurrency"], **D_TURN}.items()
            for a in (f"--{k.replace('_', '-')}", str(v))]
    if D_PROFILE:
        job.append("--profile" if D_PROFILE == "full" else "--phases")
    if D_CPUS:                  # the same CPUs for both: a turn's engine has them to itself
        job += ["--cpus", D_CPUS]
    names = child_names(modes)
    played: list = []

    def conduct(alive, deadline, signal) -> None:
        for r, pair in enumerate(order):
            for m in pair:
                began = time.monotonic()
                (turns / f"turn-{r}-{m}").write_text("go")
                while not (turns / f"done-{r}-{m}").exists():
                    if not alive(names[m]) or time.monotonic() > deadline:
                        out.log(f"  turn {r} of {m}: stopped (its engine exited or time "
                                "ran out)")
                        return
                    time.sleep(0.1)
                played.append((r, m, round(time.monotonic() - began, 1)))
                out.log(f"  round {r}: {m}'s turn took {played[-1][2]}s")

    found = children(out, {names[m]: [*job, "--modes", m] for m in modes}, env, share - 5,
                     go=go, after_go=conduct)
    shutil.rmtree(turns, ignore_errors=True)
    runs = {m: found[names[m]] for m in modes}
    ok, summary = turns_summary(runs["stock"].get("stock") or {},
                                runs["elastic-auto"].get("elastic-auto") or {}, order)
    e = (runs["elastic-auto"].get("elastic-auto") or {}).get("elastic") or {}
    summary.update({k: e.get(k) for k in ("grows", "worker_map_seconds", "pool_bytes")},
                   turns_played=played, kv_gib=D_TURN_GIB, cpus=D_CPUS or None)
    ok = ok and all(r.get("rc") == 0 for r in runs.values())
    for m in modes:
        record_profile(out, m, {"profile": [t.get("profile") for t in
                                            (runs[m].get(m) or {}).get("turns") or []
                                            if t.get("profile")]})
    out.record("d", passed=ok, summary=summary,
               error=runs["stock"].get("error") or runs["elastic-auto"].get("error"),
               log_tail=runs["stock"].get("log_tail") or runs["elastic-auto"].get("log_tail"))


def proof_d_interleave(out: kit.Out, budget: kit.Budget, env: dict, share: float,
                       load: str) -> None:
    """``--d-turns ROUNDS --d-interleave SLICE[,WARMUP]``: stock and elastic side by side
    (KV ``D_TURN_GIB`` each), both loaded from the start with the same closed loop, and
    only one engine runs at a time: the other's process group (its engine core with it) is
    stopped (SIGSTOP) with its requests in flight and its memory as it was, then continued
    (SIGCONT) for its own slice. After one WARMUP slice each (the ramp to 256 requests in
    flight, the elastic engine's grows), ROUNDS rounds of one SLICE each, in
    :func:`turn_order`. Each slice's rate is its engine's output tokens over the steps that
    ended in it (the child's step log, monotonic clock), less its first ``D_SETTLE_S``.
    With turns of 30 s (``--d-turns`` alone) the host's speed changed from one turn to the
    next by up to 19% (session 16); slices of a few seconds pair the engines closer in
    time, and no measured slice holds a ramp from an empty engine. An engine that produced tokens
    inside the other's slices was not frozen: (d) fails then, whatever the ratio."""
    if load != "steady":
        out.record("d", passed=False, skipped="--d-interleave needs the steady load")
        return
    rounds, S, W = D_TURNS, D_INTERLEAVE, D_INTERLEAVE_WARMUP
    schedule = 2 * W + 2 * rounds * S
    if not side_by_side_fits(out, share, START_S + schedule + W + 30,
                             f"{rounds} rounds of {S:g} s slices",
                             f"start-up, two {W:g} s warm-ups, {2 * rounds} slices, stop",
                             "--d-interleave"):
        return
    modes = ["stock", "elastic-auto"]
    order = turn_order(rounds)
    names = child_names(modes)
    go = out.dir / ".d-go"
    active = W + rounds * S                 # one engine's running seconds
    requests = D_REQUESTS["steady"] * max(1, -(-int(active) // 55))
    out.log(f"(d) steady load interleaved: {rounds} rounds of {S:g} s slices after a {W:g} s "
            f"warm-up each ({', '.join('/'.join(r) for r in order)}), KV {D_TURN_GIB:g} GiB "
            f"each, side by side; budget {share:.0f}s")
    # each child's loop: its warm-up window, then one window to past the schedule's end
    # (the second engine starts its loop a warm-up later, when it is first let run)
    job = ["throughput", "--requests", str(requests), "--load", "steady", "--start-after",
           str(go), "--kv-gib", f"{D_TURN_GIB:g}", "--gpu-memory-utilization", "0.3",
           "--concurrency", str(D_STEADY["concurrency"]), "--warmup-s", f"{W:g}",
           "--windows", "1", "--window-s", f"{schedule - W + 2:g}", "--drain-s", "0",
           "--step-log"]
    if D_CPUS:
        job += ["--cpus", D_CPUS]
    slices: list = []

    def freeze_second(signal) -> None:
        signal(names[modes[1]], SIGSTOP)

    def conduct(alive, deadline, signal) -> None:
        running = modes[0]
        plan = [(None, m, W) for m in modes] + [(r, m, S) for r, pair in enumerate(order)
                                                for m in pair]
        try:
            for r, m, span in plan:
                if not all(alive(names[x]) for x in modes) or time.monotonic() + span > deadline:
                    out.log(f"  slice {r} of {m}: not run (an engine exited or time ran out)")
                    return
                if m != running:
                    signal(names[running], SIGSTOP)
                    signal(names[m], SIGCONT)
                    running = m
                began = time.monotonic()
                time.sleep(span)
                slices.append((r, m, began, time.monotonic()))
        finally:
            for m in modes:                  # both run to their loop's end, then exit
                signal(names[m], SIGCONT)
        out.log(f"  {len(slices)} slices played ({2 * rounds} measured)")

    found = children(out, {names[m]: [*job, "--modes", m] for m in modes}, env, share - 5,
                     go=go, before_go=freeze_second, after_go=conduct)
    runs = {m: found[names[m]] for m in modes}
    steady = {m: (runs[m].get(m) or {}).get("steady") or {} for m in modes}
    ok, summary = interleave_summary({m: steady[m].get("step_log") or [] for m in modes},
                                     slices, order, D_SETTLE_S)
    e = (runs["elastic-auto"].get("elastic-auto") or {}).get("elastic") or {}
    first = slices[0][2] if slices else 0.0
    summary.update({k: e.get(k) for k in ("grows", "worker_map_seconds", "pool_bytes")},
                   slices=[[r, m, round(a - first, 2), round(b - first, 2)]
                           for r, m, a, b in slices],
                   elastic_events=policy_events(e.get("events") or [], slices, D_SETTLE_S,
                                                first),
                   preemptions=[steady[m].get("preemptions") for m in modes],
                   slice_s=S, warmup_s=W, settle_s=D_SETTLE_S, kv_gib=D_TURN_GIB,
                   cpus=D_CPUS or None)
    ok = ok and all(r.get("rc") == 0 for r in runs.values())
    out.record("d", passed=ok, summary=summary,
               error=runs["stock"].get("error") or runs["elastic-auto"].get("error"),
               log_tail=runs["stock"].get("log_tail") or runs["elastic-auto"].get("log_tail"))


def policy_events(events: list, slices: list, settle: float, first: float) -> list:
    """The elastic policy's last events (``[monotonic time, "grow"/"shrink"/"fail",
    granules]``, its stats file's ``events``: the engine core's clock, the driver's) placed
    in the slices: ``[kind, granules, seconds after the first slice, where]``, where is
    ``[round, mode]`` of the slice past its settle that holds it (round None: a warm-up),
    or None (a settle, or outside every slice)."""
    placed = []
    for event in events:
        try:
            t, kind, n = float(event[0]), str(event[1]), int(event[2])
        except (TypeError, ValueError, IndexError):
            continue
        where = next(([r, m] for r, m, a, b in slices if a + settle <= t <= b), None)
        placed.append([kind, n, round(t - first, 2), where])
    return placed


def interleave_summary(logs: dict, slices: list, order: list,
                       settle: float) -> tuple[bool, dict]:
    """(d) interleaved: ``logs`` (mode -> [(monotonic end of a step, its output tokens)]),
    ``slices`` ([(round or None for a warm-up, mode, began, ended)], the driver's monotonic
    clock, the same as the children's). A slice's rate: of its engine's steps that ended in
    [began + settle, ended], all but the first, their tokens over the time from the first's
    end to the last's (each step runs from the previous one's end: no part of a step
    outside the slice is counted, nor any time without a step). The ratio is
    elastic's tokens over its seconds against stock's, over every measured slice; beside
    it each round's ratio, stock's spread over its slices, and ``frozen_leak_tokens``: each
    engine's tokens from steps that ended inside the *other* engine's slices (past their
    settle), which a frozen engine cannot have. Passes when every round has both slices
    with tokens, nothing leaked, and the ratio is at least D_TARGET."""
    from bisect import bisect_left, bisect_right
    from itertools import accumulate

    times = {m: [t for t, _ in log] for m, log in logs.items()}
    sums = {m: [0.0, *accumulate(k for _, k in log)] for m, log in logs.items()}

    def steps(m, lo, hi):                   # indices of the steps that ended in [lo, hi]
        return bisect_left(times[m], lo), bisect_right(times[m], hi)

    rate: dict = {}
    leak = {m: 0.0 for m in logs}
    for r, m, began, ended in slices:
        lo = began + settle
        for other in logs:
            if other != m:
                i, j = steps(other, lo, ended)
                leak[other] += sums[other][j] - sums[other][i]
        i, j = steps(m, lo, ended)
        if r is not None and j - i >= 2:
            rate[(r, m)] = (sums[m][j] - sums[m][i + 1], times[m][j - 1] - times[m][i])
    modes = ("stock", "elastic-auto")
    per = {m: [rate.get((r, m)) for r in range(len(order))] for m in modes}
    summary = {"load": "steady, interleaved", "target": f"ratio >= {D_TARGET}", "ratio": None,
               "rounds": len(order), "order": order,
               "stock_tok_s": [round(x[0] / x[1], 1) if x else None for x in per["stock"]],
               "elastic_tok_s": [round(x[0] / x[1], 1) if x else None
                                 for x in per["elastic-auto"]],
               "ratio_per_round": None, "stock_spread_pct": None,
               "frozen_leak_tokens": {m: round(v) for m, v in leak.items()}}
    s, e = summary["stock_tok_s"], summary["elastic_tok_s"]
    complete = all(x for x in s + e) and len(s) == len(e) == len(order) > 0
    if complete:
        tok = {m: sum(x[0] for x in per[m]) / sum(x[1] for x in per[m]) for m in modes}
        summary.update(ratio=round(tok["elastic-auto"] / tok["stock"], 4),
                       ratio_per_round=[round(b / a, 4) for a, b in zip(s, e)],
                       stock_spread_pct=spread_pct(s))
    frozen = not any(leak.values())
    if not frozen:
        summary["error"] = ("an engine ran while it should have been stopped (tokens inside "
                            "the other engine's slices): the slices are not the engines' "
                            "own; check that SIGSTOP reaches the engine core's process")
    return bool(complete and frozen and summary["ratio"] >= D_TARGET), summary


def turns_summary(stock: dict, elastic: dict, order: list) -> tuple[bool, dict]:
    """(d) in turns: each engine's output tok/s per turn (its measurement windows' tokens
    over their seconds; warm-up windows apart), in rounds; the ratio is elastic's tokens
    over stock's over all rounds, with each round's own ratio, stock's spread between its
    turns and the warm-up windows' ratio. Passes when every turn was measured and the ratio
    is at least D_TARGET."""
    def per_turn(entry):
        rates, warm = [], []
        for t in entry.get("turns") or []:
            w = (t.get("steady") or {}).get("windows") or []
            m = [x for x in w if x.get("kind") == "measure"]
            rates.append(round(sum(x["output_tokens"] for x in m) /
                               sum(x["end_s"] - x["start_s"] for x in m), 1) if m else None)
            warm.append(w[0].get("output_tokens_per_s") if w else None)
        return rates, warm
    (s, s_warm), (e, e_warm) = per_turn(stock), per_turn(elastic)
    rounds = len(order)
    summary = {"load": "steady, in turns", "target": f"ratio >= {D_TARGET}", "ratio": None,
               "rounds": rounds, "order": order, "stock_tok_s": s, "elastic_tok_s": e,
               "stock_warmup_tok_s": s_warm, "elastic_warmup_tok_s": e_warm,
               "stock_spread_pct": None, "ratio_per_round": None, "warmup_ratio": None}
    complete = (len(s) == len(e) == rounds and all(s + e) and all(s_warm + e_warm))
    if complete:
        summary.update(ratio=round(sum(e) / sum(s), 4),
                       ratio_per_round=[round(b / a, 4) for a, b in zip(s, e)],
                       stock_spread_pct=spread_pct(s),
                       warmup_ratio=round(sum(e_warm) / sum(s_warm), 4))
    runs = [[t.get("steady") or {} for t in x.get("turns") or []] for x in (stock, elastic)]
    summary.update(preemptions=[[r.get("preemptions") for r in x] for x in runs],
                   requests_completed=[[r.get("completed") for r in x] for x in runs])
    return bool(complete and summary["ratio"] >= D_TARGET), summary


def record_profile(out: kit.Out, mode: str, entry: dict) -> None:
    """A (d) engine's ``--d-profile`` / ``--d-phases`` result (its child entry's
    ``profile``), added to (d)'s record under ``profile``; none: nothing."""
    if entry.get("profile"):
        rec = out.results["subproofs"].get("d", {})
        out.record("d", profile={**(rec.get("profile") or {}), mode: entry["profile"]})


def also_entry(stock: dict, run: dict, mode: str, load: str) -> dict:
    """One ``--d-also`` engine against stock: its tok/s and ratios."""
    entry = run.get(mode) or {}
    ok, s = (steady_summary(stock, entry, int(D_STEADY["windows"])) if load == "steady"
             else passes_summary(stock, entry))
    return {"tok_s": s.get("elastic_tok_s"), "ratio_to_stock": s.get("ratio", s.get("ratio_mean")),
            "warmup_ratio": s.get("warmup_ratio"), "rc": run.get("rc"),
            "error": run.get("error")}


def also_d(out: kit.Out, budget: kit.Budget, env: dict, job: list, stock_run: dict,
           load: str, need: float) -> None:
    """``--d-also``: more engines under (d)'s load after stock's, informational (where
    elastic mode's cost lies: ``elastic-off`` maps the whole pool and runs no policy,
    ``elastic-fixed`` adds the granule-aware pool, still all mapped; ``elastic-compacted``
    is the default policy with KV compaction on (auto); ``proxima`` is the
    allocator alone). Each one's tok/s and its ratio to stock go into
    (d)'s record as ``also``; one that does not fit in the budget is skipped, said so."""
    if not D_ALSO:
        return
    stock = stock_run.get("stock") or {}
    also = {}
    for mode in D_ALSO:
        left = budget.end - 5 - time.monotonic()
        if left < need:
            also[mode] = {"skipped": f"{left:.0f}s left, needs about {need:.0f}s"}
            continue
        run = child(out, f"d-{mode}", [*job, "--modes", mode], env, left)
        entry = run.get(mode) or {}
        also[mode] = also_entry(stock, run, mode, load)
        out.log(f"  (d) also {mode}: {json.dumps(also[mode])}")
        record_profile(out, mode, entry)
    summary = dict(out.results["subproofs"].get("d", {}).get("summary") or {}, also=also)
    out.record("d", summary=summary)


def main() -> int:
    global CHILD, DRY, WANTED, D_PROFILE, D_TOGETHER, D_TURNS, D_CPUS, D_INTERLEAVE, \
        D_INTERLEAVE_WARMUP, EXECUTOR, TP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./gpu-out"),
                    help="results folder (default: $OUT, else ./gpu-out)")
    ap.add_argument("--budget", type=float, default=620.0,
                    help="seconds for everything (default: %(default)s)")
    ap.add_argument("--only", default="a,b,d",
                    help="sub-proofs to run, in this order: a, a2 (the default policy's "
                         "identity, informational, always last), b, d; with b and d, b runs "
                         "on d's elastic engine (default: %(default)s)")
    ap.add_argument("--a-modes", default="elastic",
                    help="engines compared with stock in (a): elastic, proxima "
                         "(default: %(default)s; PROXIMA_ALLOCATOR=1 alone was proven "
                         "identical in session 5)")
    ap.add_argument("--d-load", choices=("steady", "passes"), default="steady",
                    help="(d)'s load: steady, a closed loop of %d requests in flight, a "
                         "%gs warm-up window then %d windows of %gs (elastic_child.py "
                         "closed_loop); passes, the older two held passes of 300 requests "
                         "(bursts with a tail, in which the elastic policy releases its "
                         "memory) (default: %%(default)s)" % (
                             D_STEADY["concurrency"], D_STEADY["warmup_s"],
                             D_STEADY["windows"], D_STEADY["window_s"]))
    ap.add_argument("--d-also", default="",
                    help="more engines under (d)'s load after stock's, informational: "
                         "elastic-off (connector and VMM-backed KV, whole pool mapped, no "
                         "policy), elastic-fixed (that plus the granule-aware pool's "
                         "placement, all mapped), elastic-compacted (the default policy with "
                         "KV compaction, auto) and proxima (allocator alone) (default: none)")
    ap.add_argument("--d-together", type=float, default=0.0, metavar="GIB",
                    help="(d)'s engines (elastic, stock, --d-also's) side by side on the GPU, "
                         "KV fixed at GIB each, their loads started together, each engine's "
                         "phases beside the others' (with --d-phases); informational: sharing "
                         "the GPU hides the scheduler's costs, so (d) is not passed this way; "
                         "(b) is not run (default: 0, one after the other with the GPU to "
                         "itself)")
    ap.add_argument("--d-turns", type=int, default=0, metavar="ROUNDS",
                    help="(d) with stock and elastic side by side (KV %g GiB each), taking "
                         "turns with the GPU, ROUNDS rounds of one turn each (stock first in "
                         "even rounds, elastic in odd ones; a turn: a %gs warm-up window, "
                         "then %gs measured, while the other engine idles): each round's "
                         "pair comes from the same minutes of the same machine; (b) is not "
                         "run (default: 0, one engine after the other)" % (
                             D_TURN_GIB, D_TURN["warmup_s"], D_TURN["window_s"]))
    ap.add_argument("--d-interleave", default="", metavar="SLICE[,WARMUP]",
                    help="with --d-turns ROUNDS: both engines loaded from the start and "
                         "frozen in turn (SIGSTOP/SIGCONT of the one not running), ROUNDS "
                         "rounds of one SLICE s slice each after one WARMUP s slice each "
                         "(default WARMUP %g); each slice's rate from the engines' step logs, "
                         "its first %g s left out (default: off, turns of a warm-up and a "
                         "measured window)" % (D_INTERLEAVE_WARMUP, D_SETTLE_S))
    ap.add_argument("--d-cpus", default="", metavar="LIST",
                    help="--d-turns: both engines on these CPUs (e.g. 0-7; auto: the lower "
                         "half of the CPUs this driver may use), so that whichever has its "
                         "turn runs on the same cores; engines one after the other were "
                         "found to run 10-15%% apart from one start to the next (session 10) "
                         "(default: none, the OS places them)")
    ap.add_argument("--d-phases", action="store_true",
                    help="steady (d): --d-profile's phase timers alone (mean ms per step of "
                         "schedule, execute, wait, ...), no stack sampler: costs the engines "
                         "~nothing (default: off)")
    ap.add_argument("--d-profile", action="store_true",
                    help="steady (d): time each engine core's phases and sample its stack "
                         "and the loop's, over the warm-up and the measurement windows, "
                         "into (d)'s record as profile (engineprof.py; a diagnostic, it "
                         "costs each engine alike) (default: off)")
    ap.add_argument("--executor", choices=("uni", "mp"), default="",
                    help="every engine's vLLM executor, stock's and Proxima's alike: uni runs "
                         "the worker's input preparation and launches on the engine core's "
                         "thread, after the scheduler (a CPU-bound step pays for both); mp "
                         "runs the worker in a process of its own, beside the scheduler "
                         "(default: vLLM's choice, uni for one GPU; mp with --tp above 1)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="every engine's tensor_parallel_size: N GPUs each, the first N "
                         "visible (CUDA_VISIBLE_DEVICES), through the mp executor; (b)'s "
                         "taker measures and takes memory on each (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run the orchestration with a CPU stand-in child (fake_child.py): "
                         "checks budgets and files, proves nothing (default: off)")
    args = ap.parse_args()
    order = [n for n in args.only.split(",") if n]
    unknown = sorted(set(order) - {"a", "a2", "b", "d"})
    if unknown:
        print(f"elastic_proof: unknown sub-proof(s) {', '.join(unknown)} in --only: give a, "
              f"a2, b and/or d", file=sys.stderr)
        return 2
    A_MODES[:] = [m for m in args.a_modes.split(",") if m]
    EXECUTOR, TP = args.executor, args.tp
    if TP < 1:
        print(f"elastic_proof: --tp wants a number of GPUs per engine, 1 or more, got {TP}",
              file=sys.stderr)
        return 2
    if TP > 1 and EXECUTOR == "uni":
        print(f"elastic_proof: --tp {TP} needs the mp executor (uni runs one worker, on one "
              f"GPU): leave --executor out or give mp", file=sys.stderr)
        return 2
    if TP > 1:
        EXECUTOR = "mp"          # vLLM's own choice for one host too, said to every engine
    D_ALSO[:] = [m for m in args.d_also.split(",") if m]
    D_PROFILE = "full" if args.d_profile else "phases" if args.d_phases else ""
    D_TOGETHER = args.d_together
    if D_TOGETHER < 0:
        print(f"elastic_proof: --d-together wants GiB of KV per engine (0: off), got "
              f"{args.d_together:g}", file=sys.stderr)
        return 2
    D_TURNS = args.d_turns
    if D_TURNS < 0 or (D_TURNS and (D_TOGETHER or D_ALSO)):
        print(f"elastic_proof: --d-turns wants a number of rounds (0: off) and neither "
              f"--d-together nor --d-also, got --d-turns {args.d_turns}", file=sys.stderr)
        return 2
    if args.d_interleave:
        parts = args.d_interleave.split(",")
        try:
            values = [float(x) for x in parts]
        except ValueError:
            values = []
        if len(parts) > 2 or not values or min(values) <= 0 or not D_TURNS:
            print(f"elastic_proof: --d-interleave wants SLICE[,WARMUP] in seconds above 0, "
                  f"with --d-turns ROUNDS, got {args.d_interleave!r}"
                  + ("" if D_TURNS else " without --d-turns"), file=sys.stderr)
            return 2
        D_INTERLEAVE = values[0]
        D_INTERLEAVE_WARMUP = values[1] if len(values) > 1 else D_INTERLEAVE_WARMUP
        if args.d_phases or args.d_profile:
            print("elastic_proof: --d-interleave cannot time phases (--d-phases, "
                  "--d-profile): a stopped engine's frozen seconds would count in whatever "
                  "call it was stopped in", file=sys.stderr)
            return 2
        if D_INTERLEAVE <= 2 * D_SETTLE_S:
            print(f"elastic_proof: --d-interleave: a slice of {D_INTERLEAVE:g} s leaves "
                  f"nothing to count after its first {D_SETTLE_S:g} s; give more than "
                  f"{2 * D_SETTLE_S:g}", file=sys.stderr)
            return 2
    D_CPUS = args.d_cpus
    if D_CPUS == "auto":
        mine = sorted(os.sched_getaffinity(0))
        D_CPUS = ",".join(map(str, mine[:max(1, len(mine) // 2)]))
    if D_CPUS and not D_TURNS:
        print("elastic_proof: --d-cpus needs --d-turns (engines taking turns share the CPUs)",
              file=sys.stderr)
        return 2
    if D_CPUS:
        sys.path.insert(0, str(HERE))
        from elastic_child import cpu_list

        try:
            cpu_list(D_CPUS)
        except ValueError as exc:
            print(f"elastic_proof: --d-cpus {args.d_cpus!r}: {exc}", file=sys.stderr)
            return 2
    bad = sorted(set(D_ALSO) - {"elastic-off", "elastic-fixed", "elastic-compacted", "proxima"})
    if bad:
        print(f"elastic_proof: unknown engine(s) {', '.join(bad)} in --d-also: give "
              f"elastic-off, elastic-fixed, elastic-compacted and/or proxima", file=sys.stderr)
        return 2
    if args.dry_run:
        CHILD, DRY = str(HERE / "fake_child.py"), True
    out = kit.Out(Path(args.out), "elastic_proof")
    budget = kit.Budget(args.budget)
    cache = Path(os.environ.get("VLLM_CACHE_ROOT", "/root/.cache/vllm-proof"))
    env = kit.engine_env(cache)
    wanted = WANTED = set(args.only.split(","))
    out.results["executor"] = EXECUTOR or "default"
    out.results["tp"] = TP
    out.log(f"elastic proof: budget {args.budget:.0f}s, sub-proofs {sorted(wanted)}, "
            f"model {os.environ.get('PROXIMA_PROOF_MODEL', kit.MODEL)}, executor "
            f"{EXECUTOR or 'default'}, tp {TP}")
    plan = {"a": (proof_a, 170), "b": (proof_b, 200),
            "d": (lambda *a: proof_d(*a, load=args.d_load), 440)}
    runs = [n for n in order if n != "a2" and not (n == "b" and "d" in wanted)]
    for name in runs:                # in the order asked: the first get the budget
        fn, share = plan[name]
        if name == runs[-1]:         # the last sub-proof gets what is left, not its nominal share
            share = budget.left()
        share = budget.cap(share, reserve=5)
        if share < 30:
            out.record(name, passed=False, skipped=f"only {budget.left():.0f}s left")
            continue
        try:
            fn(out, budget, env, share)
        except Exception as exc:  # noqa: BLE001 - one sub-proof's failure is its own
            import traceback

            out.record(name, passed=False, error=f"{type(exc).__name__}: {exc}",
                       traceback=traceback.format_exc()[-3000:])
        finally:
            kit.kill_all()
    if "a2" in wanted:
        try:
            proof_a2(out, budget, env)
        except Exception as exc:  # noqa: BLE001
            out.record("a2", error=f"{type(exc).__name__}: {exc}")
        finally:
            kit.kill_all()
    lines = []
    for name, entry in out.results["subproofs"].items():
        if name == "a2":
            c = (entry.get("compare") or {})
            lines.append(f"(a2) INFO: default policy vs stock: "
                         + ", ".join(f"{p} {v.get('n_differing')} of {v.get('requests')} differ"
                                     for p, v in c.items()) if c else
                         f"(a2) INFO: {entry.get('skipped') or entry.get('error') or 'no result'}")
            continue
        verdict = "PASS" if entry.get("passed") else "FAIL"
        detail = entry.get("summary") or entry.get("evidence") or entry.get("skipped") or \
            entry.get("error")
        lines.append(f"({name}) {verdict}: {json.dumps(detail, default=str)[:600]}")
    for line in lines:
        out.log(line)
    out.results["summary_lines"] = lines
    out.results["wall_s"] = round(budget.elapsed(), 1)
    out.finish()
    return 0 if all(e.get("passed") for n, e in out.results["subproofs"].items()
                    if n != "a2") else 1


if __name__ == "__main__":
    sys.exit(main())
