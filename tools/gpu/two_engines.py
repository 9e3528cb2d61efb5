"""Issue 13's GPU proof, driver B: N engines on one GPU (default two), bursts in turn.

    OUT=$OUT PYTHONPATH=$PWD:/tmp/site python3 tools/gpu/two_engines.py \\
        [--engines 2] [--budget 410] [--requests 1000] [--compactor module:factory]

(c) N vLLM OpenAI servers (vLLM 0.26's api_server, dummy Llama-3.1-8B) on one GPU, named A,
B, C, ... on ports ``--port`` .. ``--port``+N-1, started side by side (``--start``). Schedule:
each round a burst on A while the others idle, then on B while the others idle, ... (``--rounds``
times). Run twice, on the same schedule:

* static: N stock engines with a fixed split, ``gpu_memory_utilization`` ``--static-util``
  each (0.45 for two engines; for more, 0.9/N unless given: the log says so), their KV fixed
  with ``--static-kv-gib`` (what that utilization gives when profiled) so that they can start
  side by side; without it (the default for N > 2) vLLM profiles each and they start one
  after the other (a profile run is upset by another engine loading beside it);
* single (``--only ...,single``): the upper bound of any sharing, ONE stock engine holding
  the GPU's whole KV (``--single-util`` 0.9), every engine's bursts sent to it in turn;
* endpoint (``--only ...,endpoint``): ONE ``proxima serve --models FILE`` with the N engines
  as models A, B, ... of the same path (each elastic, self-sized, ``sleep_after``
  ``--sleep-after`` seconds): a model idle that long gives back its KV and then its weights
  (host memory), so the busy one can grow into them; its next request wakes it (held, not
  refused). Requests go to the one endpoint with "model": A, B, ...; each engine's counters
  are read from its local port (``--port`` + 10 + i). With ``--endpoints separate``: N
  ``proxima serve --models FILE`` of ONE model each, on ports ``--port`` .. ``--port``+N-1,
  started as ``--start`` says, side by side unless given (two users' separate servers, as
  the user path's elastic servers: they meet only in the GPU's ledger, through which each
  sleeps for the other's demand). ``--endpoint-direct`` sends each burst to the engine's
  own port instead, after one 1-token request through the router that wakes it: the same
  engines without the router's hop;
* elastic: N Proxima engines with elastic KV memory (PROXIMA_ALLOCATOR=1
  PROXIMA_ELASTIC=1), each allowed a maximum of ``--max-gib`` (72 GiB for two, more than half
  of the GPU; for more, what the GPU holds with every other engine at its minimum: the log
  shows the arithmetic) and a minimum of 2 GiB, release delay 2 s: the busy engine takes what
  the idle ones gave back (a grow the GPU cannot back yet is retried: it never fails a
  request).

Per setup: aggregate output tokens/s over the schedule, per-burst time and tokens/s,
preemptions (vLLM's counter, from /metrics), TTFT p50/p99, errors, the work each burst made
its engine do (``work``, vLLM's own counters on both sides: steps that reported, their mean
length in ms of the burst's wall time and in tokens, prompt tokens computed, a preempted
request's again, and tokens generated); for elastic also each
engine's mapped bytes at the end of every burst (``mapped_<X>_bytes``), sampled every 0.5 s
during it (``mapped_during``: the idle engines' memory), and the grow/shrink counters (the
connector's stats file). PASS: elastic >= 1.3x static's aggregate throughput, zero errors;
the ratio is reported for any N. ``--tail N:TOKENS`` sends N long requests with each burst that
the schedule does not wait for: they outlive it, and their blocks pin granules of the engine
that went idle (issue 14's case for moving them: the ``compacted`` setup against ``elastic``).
``--contexts COUNT:TOKENS:VISITS`` sends reuse bursts instead (contexts asked again and
again); several comma-separated workloads take turns, one a round, so a control (contexts
that fit in a static share) runs on the same engines in the same minutes as the workload it
controls, and the summary's ``per_workload`` gives each its own ratio. ``--shapes
PROMPT:OUTPUT:REQUESTS,...`` does the same for plain bursts of several shapes (issue 33's
prefill-heavy, decode-heavy and short), each with its own ratio and TTFT.
With ``--compactor module:factory`` (issue 14's compaction) the elastic servers get it in
their elastic options (``compactor``); ``PROXIMA_PROOF_ELASTIC_OPTIONS`` (JSON) adds any
other option.

Before anything starts, the driver checks its plan: the memory (an estimate from
``--engine-gib`` per engine besides KV on a ``--gpu-gib`` GPU: static shares that cannot fit
are refused) and the time (every setup's start-ups, N x ``--rounds`` bursts, the stops): a
budget too small for it is said in one line (exit 2), not run.

Rounds over device calls (ABBA: ``--only static,elastic``, then ``--only elastic,static``;
``--only single`` for the upper bound): ``--pool FILE`` for each run's two_engines.json
pools them (nothing starts) into two_engines-pooled.json: per workload the ratio over every
(round, engine) burst both setups ran in full, each pair of runs, each setup's spread.

Files in $OUT: two_engines.json (rewritten after every burst), two_engines.log, and
two_engines-logs.tgz (the servers' logs). The driver never touches CUDA; servers run in their
own process groups and are killed when their time is up or the driver exits.
About 4-5 minutes for two setups of two engines (two side-by-side start-ups of 75-130 s, four
bursts of ~20-60 s); four engines: see docs/benchmarks.md section 7.3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proofkit as kit  # noqa: E402

GiB = 1 << 30
MAX_ENGINES = 8
MIN_GIB = 2                     # each elastic engine's minimum
# vLLM's counters read around each burst: preemptions, prefix-cache tokens looked up, found
BURST_METRICS = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total")
# ... and the work it did, the same on both sides (stock's own counters): engine steps,
# tokens over them, prompt tokens computed (a preempted request's again) and tokens generated
WORK_METRICS = {"steps": "vllm:iteration_tokens_total_count",
                "step_tokens": "vllm:iteration_tokens_total_sum",
                "prompt_tokens_computed": "vllm:prompt_tokens_total",
                "generated_tokens": "vllm:generation_tokens_total"}
#: what one /metrics scrape on each side of a burst reads: BURST_METRICS, then WORK_METRICS
SCRAPED = BURST_METRICS + tuple(WORK_METRICS.values())


def _mean_step(work: dict, wall_s: float) -> dict:
    """``work`` (:data:`WORK_METRICS`' counters) with its mean step: ms of ``wall_s`` a step,
    tokens a step (where it has steps)."""
    if work["steps"] > 0:
        work["ms_per_step"] = round(1000 * wall_s / work["steps"], 2)
        work["tokens_per_step"] = round(work["step_tokens"] / work["steps"], 1)
    return work


def burst_work(before: list, after: list, wall_s: float) -> dict:
    """What a burst made its engine do, from :data:`WORK_METRICS` read before and after
    it: each counter's growth, and the mean step. Empty where the server did not give them."""
    if None in before or None in after:
        return {}
    return _mean_step({k: int(a - b) for k, a, b in zip(WORK_METRICS, after, before)}, wall_s)


def work_total(bursts) -> dict:
    """The work of ``bursts`` together: their counters summed, the mean step over their wall
    time; empty unless every one of them has it."""
    bursts = list(bursts)
    if not bursts or not all((b.get("work") or {}).get("steps") for b in bursts):
        return {}
    return _mean_step({k: sum(b["work"][k] for b in bursts) for k in WORK_METRICS},
                      sum(b["wall_s"] for b in bursts))


# The time plan's floors (seconds): a warm start-up of one engine (session 7: 75-81 s, two
# side by side), what each more engine side by side adds, what an elastic start-up adds (its
# spawned `mp` worker, ~19 s, and the GPU pre-flight probe, ~5 s: session 29), what a start-up
# adds where this host has no torch.compile cache yet (session 30 on a fresh H100: elastic
# healthy after 155 s against 100-122 s warm, a stock start cut off after 75 s), the shortest
# burst, a setup's stop, what an endpoint that may sleep adds (the copy of its weights to
# pinned host memory, ~10 s for 8B's, and its engines' start beside each other: two one-model
# endpoints healthy after 142 s in s37 and 171 s in s40, where call 2's endpoints, planned at
# 130 s, ran out of budget while they started)
GPU_PLAN = {"start": 80.0, "start_each_more": 10.0, "elastic_more": 25.0, "cold_more": 50.0,
            "burst": 15.0, "stop": 15.0, "endpoint_more": 65.0}
DRY_PLAN = {"start": 2.0, "start_each_more": 0.5, "elastic_more": 0.0, "cold_more": 0.0,
            "burst": 1.0, "stop": 1.0, "endpoint_more": 0.5}
#: the setups --only takes
SETUPS = ("static", "elastic", "compacted", "single", "endpoint")


def compile_cache_root() -> Path:
    """Where the engines keep vLLM's cache (torch.compile's under it): VLLM_CACHE_ROOT."""
    return Path(os.environ.get("VLLM_CACHE_ROOT", "/root/.cache/vllm-proof"))


def compile_cache_cold(root: Path) -> bool:
    """True where no engine has compiled on this host yet: no file under the torch.compile
    cache, so every start-up compiles from scratch."""
    cache = root / "torch_compile_cache"
    return not (cache.is_dir() and any(f.is_file() for f in cache.rglob("*")))


def starts_cold(args) -> bool:
    """Whether the time plan counts start-ups as cold now (never in a --dry-run)."""
    return not args.dry_run and compile_cache_cold(compile_cache_root())


def names(n: int) -> list[str]:
    """The engines' names: A, B, C, ..."""
    return [chr(ord("A") + i) for i in range(n)]


def elastic_util(n: int) -> float:
    """The elastic engines' gpu_memory_utilization: with their KV fixed it only sets vLLM's
    start-up check (free memory >= it x total), which the engines started before must leave
    free: 0.3 for two (as before), 0.9/N beyond."""
    return round(min(0.3, 0.9 / n), 4)


def vllm_options(args) -> list[str]:
    """The vLLM options every engine of every setup gets (dummy weights, the kit's tokenizer,
    the batch and length bounds)."""
    return ["--load-format", "dummy", "--tokenizer", kit.TOKENIZER, "--max-num-seqs",
            str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)] + (
                ["--enforce-eager"] if args.enforce_eager else [])


def server_cmd(port: int, static: bool, args, stats_file: Path, single: bool = False) -> list[str]:
    if args.dry_run:
        return [sys.executable, str(Path(__file__).resolve().parent / "fake_server.py"),
                "--port", str(port)] + ([] if static else [
                    "--stats-file", str(stats_file), "--min-bytes", str(MIN_GIB * GiB),
                    "--max-bytes", str(int(args.max_gib * GiB)), "--delay", str(args.delay)])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--port", str(port), "--host", "127.0.0.1"] + vllm_options(args)
    if single:           # the upper bound: one stock engine with the GPU's whole KV
        cmd += ["--gpu-memory-utilization", str(args.single_util)]
        if args.single_kv_gib:
            cmd += ["--kv-cache-memory-bytes", str(int(args.single_kv_gib * GiB))]
        return cmd
    if static:
        cmd += ["--gpu-memory-utilization", str(args.static_util)]
        if args.static_kv_gib:          # what --static-util gives, fixed (see --static-kv-gib)
            cmd += ["--kv-cache-memory-bytes", str(int(args.static_kv_gib * GiB))]
        return cmd
    if args.user_path:    # as the docs tell a user: `proxima serve MODEL --elastic`, no sizing
        cap = getattr(args, "user_kv_max_gib", None)   # --max-gib given: a capped engine
        extra = f",{args.elastic_options}" if getattr(args, "elastic_options", None) else ""
        return [sys.executable, "-m", "proxima.cli", "serve", args.model] + cmd[5:] + [
            "--elastic", "--elastic-options", f"stats_file={stats_file}{extra}"] + (
                ["--kv-max", f"{int(cap * GiB)}"] if cap else [])
    options = {"policy": "auto", "min_bytes": MIN_GIB * GiB, "max_bytes": int(args.max_gib * GiB),
               "release_delay_s": args.delay, "granule_bytes": args.granule_mib << 20,
               "stats_file": str(stats_file)}
    if args.compactor:
        options["compactor"] = args.compactor
    options.update(json.loads(os.environ.get("PROXIMA_PROOF_ELASTIC_OPTIONS") or "{}"))
    ktc = {"kv_connector": "ProximaElasticConnector",
           "kv_connector_module_path": "proxima.vllm.elastic_connector",
           "kv_role": "kv_producer", "kv_connector_extra_config": options}
    return cmd + ["--gpu-memory-utilization", str(elastic_util(args.engines)),
                  "--kv-cache-memory-bytes", str(int(args.max_gib * GiB)),
                  "--kv-transfer-config", json.dumps(ktc)]


def endpoint_ports(args) -> dict[str, int]:
    """The endpoint setup's engines' local ports (their counters are read there)."""
    return {k: args.port + 10 + i for i, k in enumerate(names(args.engines))}


def endpoint_cmd(out: kit.Out, args, stats: dict, only: str | None = None,
                 port: int | None = None) -> list[str]:
    """The endpoint setup's one command: ``proxima serve --models FILE`` with the N engines
    as models A, B, ... of ``--model``, each self-sized and elastic, ``sleep_after``
    ``--sleep-after`` (the file is written into ``out``; the stand-in reads only the names).
    ``only``: the endpoint of that one model (``--endpoints separate``) on ``port``."""
    extra = f",{args.elastic_options}" if args.elastic_options else ""
    models = [{"name": k, "path": args.model, "port": port, "sleep_after": args.sleep_after,
               "args": ["--elastic-options", f"stats_file={stats[k]}{extra}"]}
              for k, port in endpoint_ports(args).items() if only in (None, k)]
    port = args.port if port is None else port
    spec = out.dir / (f".endpoint-{only}-models.json" if only else ".endpoint-models.json")
    spec.write_text(json.dumps({"args": vllm_options(args), "models": models}, indent=2) + "\n")
    if args.dry_run:
        return [sys.executable, str(Path(__file__).resolve().parent / "fake_multi.py"),
                "--port", str(port), "--models", str(spec)]
    return [sys.executable, "-m", "proxima.cli", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--models", str(spec)]


#: the endpoint's log lines of its models' sleeps and wakes (proxima.serve.sleepwake)
SLEEP_LINE = re.compile(r"model (\S+): (asleep|awake) in ([\d.]+) s")


def sleep_events(text: str) -> list[list]:
    """[model, "asleep"/"awake", seconds] for each sleep and wake the endpoint logged."""
    return [[m.group(1), m.group(2), float(m.group(3))] for m in SLEEP_LINE.finditer(text)]


def elastic_active(log: str, models=()) -> bool:
    """Whether a server's log says it runs with elastic KV ("Proxima elastic KV"): the
    endpoint's, for each of its ``models`` (its engines' lines come prefixed "[NAME] ")."""
    lines = [line for line in log.splitlines() if "Proxima elastic KV" in line]
    return all(any(f"[{m}] " in line for line in lines) for m in models) if models \
        else bool(lines)


def gpu_apps() -> int | None:
    """How many compute processes nvidia-smi lists (None: no answer)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return len(done.stdout.split()) if done.returncode == 0 else None


def triples(text: str, option: str, form: str, least: tuple[int, int, int],
            example: str) -> tuple[tuple[int, int, int], ...]:
    """One or more A:B:C of whole numbers, comma-separated, each at least ``least``."""
    out = []
    for part in text.split(","):
        try:
            values = tuple(int(x) for x in part.split(":"))
        except ValueError:
            values = ()
        if len(values) != 3 or any(v < m for v, m in zip(values, least)):
            raise argparse.ArgumentTypeError(
                f"{option} wants {form}, or several comma-separated, e.g. {example}, "
                f"got {text!r}")
        out.append(values)
    return tuple(out)


def contexts_spec(text: str) -> tuple[tuple[int, int, int], ...]:
    """``--contexts``: one or more COUNT:TOKENS:VISITS, comma-separated (round r's bursts
    send the (r mod how many)-th)."""
    return triples(text, "--contexts", "COUNT:TOKENS:VISITS (whole numbers, COUNT and VISITS "
                   "at least 1, TOKENS at least 16)", (1, 16, 1),
                   "100:4096:4 or 50:4096:4,100:4096:4")


def shapes_spec(text: str) -> tuple[tuple[int, int, int], ...]:
    """``--shapes``: one or more PROMPT:OUTPUT:REQUESTS, comma-separated (round r's bursts
    send the (r mod how many)-th)."""
    return triples(text, "--shapes", "PROMPT:OUTPUT:REQUESTS (whole numbers: mean prompt "
                   "tokens at least 2, output tokens and requests at least 1)", (2, 1, 1),
                   "4000:1024:96,512:256:1000")


def spec_name(spec: tuple[int, int, int]) -> str:
    return ":".join(map(str, spec))


def tail_spec(text: str) -> tuple[int, int]:
    try:
        n, tokens = (int(x) for x in text.split(":"))
        if n < 0 or tokens < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tail wants N:TOKENS (e.g. 16:1536), got {text!r}")
    return n, tokens


def healthy(port: int) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3).status == 200
    except OSError:
        return False


def metrics(port: int, names) -> list[float | None]:
    """Each of ``names`` from one scrape of the server's /metrics (summed over its labels;
    None where absent or the server did not answer)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return [None] * len(names)
    out = []
    for name in names:
        values = [float(m.group(1)) for m in re.finditer(
            rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        out.append(sum(values) if values else None)
    return out


def burst_requests(n: int, seed: int, prompt: int, output: int,
                   contexts: tuple[int, int, int] | None = None) -> list[tuple[list[int], int]]:
    """A burst's requests: ``n`` random prompts of [0.5, 1.5] x ``prompt`` tokens; with
    ``contexts`` (count, tokens, visits), ``count`` x ``visits`` requests instead, each one of
    ``count`` contexts of ``tokens`` random tokens (drawn for this burst: no burst shares
    them) followed by a question of its own (``prompt`` tokens as above), in ``visits``
    rounds, each round every context once in an order of its own."""
    rng = random.Random(seed)

    def question() -> list[int]:
        return [rng.randrange(3, 32000) for _ in range(rng.randrange(prompt // 2, prompt * 3 // 2))]

    if contexts is None:
        return [(question(), output) for _ in range(n)]
    count, tokens, visits = contexts
    docs = [[rng.randrange(3, 32000) for _ in range(tokens)] for _ in range(count)]
    out = []
    for _ in range(visits):
        order = list(range(count))
        rng.shuffle(order)
        out += [(docs[d] + question(), output) for d in order]
    return out


async def one(client, port: int, model: str, prompt: list[int], max_tokens: int,
              timeout: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}"}
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:        # the engine failed mid-answer (vLLM sends
                    err = chunk["error"]    # an error chunk, then [DONE])
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    return {"error": f"error in stream: {str(msg)[:160]}"}
                usage = chunk.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens", tokens)
                # the first token: counted by the server's usage, since random token ids of a
                # dummy model often decode to no text (session 5's TTFT equalled the latency)
                if first is None and (tokens or (chunk.get("choices")
                                                 and chunk["choices"][0].get("text"))):
                    first = time.perf_counter() - start
            if not done:
                return {"error": "stream cut before [DONE]"}
            if tokens < max_tokens:         # ignore_eos: anything shorter was cut
                return {"error": f"{tokens} of {max_tokens} tokens"}
    except Exception as exc:  # noqa: BLE001 - counted as an error of this request
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return {"ttft": first if first is not None else time.perf_counter() - start,
            "tokens": tokens, "latency": time.perf_counter() - start}


TIMED_OUT = "burst timed out"     # a request still running when the burst's time ran out


async def run_burst(port: int, model: str, requests, timeout: float) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 8,
                          max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, port, model, p, m, timeout))
                 for p, m in requests]
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout)
        except asyncio.TimeoutError:
            for t in tasks:
                t.cancel()
            results = [t.result() if t.done() and not t.cancelled() else
                       {"error": TIMED_OUT} for t in tasks]
        wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = sorted(r["ttft"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(requests), "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall, 1) if wall else None,
            "errors": len(errors), "first_errors": errors[:5],
            "timed_out": errors.count(TIMED_OUT), **percentiles(ttft),
            "ttfts": ttft}


class Tail:
    """Long requests sent with a burst that the schedule does not wait for (``--tail``): they
    outlive the burst, pinning the granules their blocks lie in while the other engine is
    busy -- what KV compaction can move out of the way. Own thread, own event loop."""

    def __init__(self, port: int, model: str, requests, timeout: float) -> None:
        self.result: dict = {}
        self.thread = threading.Thread(target=self._run, args=(port, model, requests, timeout),
                                       daemon=True)
        self.thread.start()

    def _run(self, port, model, requests, timeout) -> None:
        try:
            self.result = asyncio.run(run_burst(port, model, requests, timeout))
        except Exception as exc:  # noqa: BLE001 - counted as this tail's errors
            self.result = {"requests": len(requests), "errors": len(requests),
                           "first_errors": [f"{type(exc).__name__}: {exc}"[:200]]}

    def join(self, timeout: float) -> dict:
        self.thread.join(timeout)
        if self.thread.is_alive():
            return {"errors": 0, "first_errors": ["still running at the end"], "requests": 0}
        self.result.pop("ttfts", None)
        return self.result


class Sampler:
    """Each engine's mapped bytes (its stats file) every 0.5 s while a burst runs:
    ``stop()`` gives per engine the minimum, mean and maximum seen."""

    def __init__(self, stats: dict) -> None:
        self.stats, self.seen = stats, {k: [] for k in stats}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for k, path in self.stats.items():
                e = kit.read_json(path)
                if e and e.get("mapped_bytes") is not None:
                    self.seen[k].append(e["mapped_bytes"])
            self.done.wait(0.5)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join(2)
        return {k: {"min": min(v), "mean": int(sum(v) / len(v)), "max": max(v), "n": len(v)}
                for k, v in self.seen.items() if v}


def endpoint_events(ep: dict) -> list[list]:
    """The endpoint setup's sleeps and wakes, every endpoint's log's (--endpoints separate:
    one log per engine) in one list; runs before 2026-12-07 kept that list as sleep_events."""
    return [ev for seen in (ep.get("sleep_events_by") or {}).values() for ev in seen] \
        or ep.get("sleep_events") or []


def starts_together(static: bool, args) -> bool:
    """Side by side when each engine's KV is fixed (elastic: its maximum; static: the bytes
    --static-util gives, --static-kv-gib): no start-up profiling for another to upset.
    Profiled static engines (--static-kv-gib 0) start one after the other."""
    return args.start == "parallel" and (not static or bool(args.static_kv_gib))


def run_setup(out: kit.Out, budget: kit.Budget, name: str, static: bool, args, env) -> dict:
    """Start the N engines, run the schedule, stop them. Returns the setup's figures."""
    single, endpoint = name == "single", name == "endpoint"
    ports = {k: args.port + i for i, k in enumerate(names(args.engines))}
    stats = {k: out.dir / f".{name}-{k}-elastic.json" for k in ports}
    # the single setup starts A's server only and sends every engine's bursts to it; the
    # endpoint setup starts one process (the endpoint) that starts every engine, or with
    # --endpoints separate one endpoint per engine
    separate = endpoint and args.endpoints == "separate"
    layout = "single" if single else "separate" if separate else "one" if endpoint \
        else "servers"
    one_port = {k: args.port for k in ports}
    started, target = {          # the processes started; where each engine's bursts go
        "single": ({"A": args.port}, one_port), "one": ({"all": args.port}, one_port),
        "separate": (ports, ports), "servers": (ports, ports)}[layout]
    counters = endpoint_ports(args) if endpoint else target    # where /metrics is read
    procs = {}
    result: dict = {"setup": name, "bursts": []}
    try:
        together = starts_together(static, args)
        result["start"] = "parallel" if together else "sequential"
        t0 = {}

        def launch(key: str, port: int) -> None:
            engine_env = dict(env)
            if endpoint:        # it sets the switches for its engines, vLLM their ports
                cmd = endpoint_cmd(out, args, stats, key if separate else None, port)
                if separate:    # each endpoint's engine its own torch.distributed base:
                    # side by side, two from one VLLM_PORT collide (EADDRINUSE on the H100)
                    engine_env["VLLM_PORT"] = str(25000 + 100 * (port - args.port))
                    result[f"vllm_port_{key}"] = int(engine_env["VLLM_PORT"])
                result.update({f"command_{key}" if separate else "command": " ".join(cmd)},
                              sleep_after=args.sleep_after, endpoints=args.endpoints,
                              direct=args.endpoint_direct)
            elif not static:
                engine_env.update(PROXIMA_ALLOCATOR="1", PROXIMA_ELASTIC="1",
                                  VLLM_PORT=str(21000 + 100 * (port - args.port)))
                if name == "compacted":         # issue 14: KV compaction on as well
                    engine_env["PROXIMA_COMPACTION"] = "1"
                else:
                    engine_env.pop("PROXIMA_COMPACTION", None)
            else:
                engine_env.update(VLLM_PORT=str(23000 + 100 * (port - args.port)))
            t0[key] = time.monotonic()
            out.log(f"  {name}: starting server {key} on port {port}")
            if not endpoint:
                cmd = server_cmd(port, static, args, stats[key], single)
            procs[key] = kit.start(cmd, engine_env, out.child_log(f"{name}-{key}"))

        def await_healthy(key: str, port: int) -> None:
            up = kit.wait_for(lambda: healthy(port) or procs[key].poll() is not None,
                              budget.cap(420 if endpoint else 240, reserve=60), every=1.0)
            if not up or not healthy(port):
                raise RuntimeError(f"server {key} ({name}) did not become healthy: "
                                   f"{kit.tail(out.child_log(f'{name}-{key}'), 8)}")
            result[f"start_{key}_s"] = round(time.monotonic() - t0[key], 1)
            out.log(f"  {name}: server {key} healthy after {result[f'start_{key}_s']}s")
            if not static and not args.dry_run:
                log = out.child_log(f"{name}-{key}").read_text(errors="replace")
                result[f"elastic_{key}_active"] = elastic_active(
                    log, (key,) if separate else ports if endpoint else ())
                if not result[f"elastic_{key}_active"]:
                    raise RuntimeError(f"server {key} runs without elastic KV memory (no "
                                       f"'Proxima elastic KV' line in its log: is Proxima's "
                                       f"entry point installed in /tmp/site?)")

        if together:
            for key, port in started.items():
                launch(key, port)
            for key, port in started.items():
                await_healthy(key, port)
        else:
            for key, port in started.items():
                launch(key, port)
                await_healthy(key, port)
        out.record("c", **{name: result})
        # each round: a burst on every engine in turn (A busy while the rest idle, then B, ...)
        schedule = [(key, r, j) for r in range(args.rounds) for j, key in enumerate(ports)]
        tail_n, tail_tokens = args.tail
        tails: list[Tail] = []
        t_all = time.perf_counter()
        floor = (DRY_PLAN if args.dry_run else GPU_PLAN)["burst"]
        for i, (key, r, j) in enumerate(schedule):
            # what is left, less the shortest burst for each one still to come
            left = budget.cap(args.burst_timeout, reserve=15 + floor * (len(schedule) - i - 1))
            if left < 20:
                result["cut_short"] = f"only {budget.left():.0f}s left before burst {i + 1}"
                break
            port = target[key]
            if endpoint and args.endpoint_direct:
                # the router holds this request while it wakes a sleeping model; the burst
                # then goes to the engine's own port (the router's cost left out)
                woken = asyncio.run(run_burst(port, key, burst_requests(
                    1, seed=9000 + i, prompt=16, output=1), left))
                if woken["errors"]:
                    raise RuntimeError(f"the request to wake {key} through the router "
                                       f"failed: {woken.get('first_errors')}")
                port = counters[key]
            before = metrics(counters[key], SCRAPED)
            spec = args.contexts[r % len(args.contexts)] if args.contexts else None
            shape = args.shapes[r % len(args.shapes)] if args.shapes else None
            prompt, output, n = shape or (args.prompt, args.output, args.requests or 0)
            requests = burst_requests(n, seed=100 * r + j, prompt=prompt, output=output,
                                      contexts=spec)
            out.log(f"  {name}: burst {i + 1}/{len(schedule)} on {key}: {len(requests)} requests")
            if tail_n:          # long requests this burst leaves behind (not waited for)
                tails.append(Tail(port, args.model, burst_requests(
                    tail_n, seed=7000 + 100 * r + j, prompt=args.prompt,
                    output=tail_tokens), left + args.burst_timeout))
            sampler = Sampler(stats)
            t_burst = time.monotonic()   # the engines' policy clock is the same monotonic one
            burst = asyncio.run(run_burst(port, key if endpoint else args.model, requests,
                                          left))
            burst["mapped_during"] = sampler.stop()
            if budget_cut(burst, left, args.burst_timeout):
                burst["cut_by_budget"] = True
                result["cut_short"] = (f"the budget ended burst {i + 1} with "
                                       f"{burst['timed_out']} of its requests still running")
            after = metrics(counters[key], SCRAPED)
            if endpoint:        # the models' sleeps and wakes the endpoints logged meanwhile
                burst["sleep_events"] = []
                for k in started:
                    seen = sleep_events(out.child_log(f"{name}-{k}").read_text(errors="replace"))
                    had = result.setdefault("sleep_events_by", {}).get(k, [])
                    burst["sleep_events"] += seen[len(had):]
                    result["sleep_events_by"][k] = seen
            n_burst = len(BURST_METRICS)
            burst["work"] = burst_work(before[n_burst:], after[n_burst:], burst["wall_s"])
            before, after = before[:n_burst], after[:n_burst]
            burst.update(engine=key, round=r, preemptions=None if None in (before[0], after[0])
                         else after[0] - before[0])
            if spec:
                burst["contexts"] = spec_name(spec)
            if shape:
                burst["shape"] = spec_name(shape)
            if None not in before[1:] + after[1:]:
                burst["prefix_cache_queries"], burst["prefix_cache_hits"] = (
                    int(a - b) for a, b in zip(after[1:], before[1:]))
            for k, path in stats.items():
                e = kit.read_json(path)
                if e:
                    burst[f"mapped_{k}_bytes"] = e.get("mapped_bytes")
                    burst[f"reported_mapped_{k}_bytes"] = (e.get("reported_mapped") or 0) * (
                        e.get("bytes_per_granule") or 0)
                    # its grows, shrinks and failed grows around the burst (the engine keeps
                    # its last 20), in seconds from the burst's start: who waited for whom
                    burst[f"events_{k}"] = [
                        [round(t - t_burst, 2), kind, n] for t, kind, n in e.get("events") or ()
                        if t >= t_burst - 5]
            ttfts = burst["ttfts"] = [round(t, 3) for t in burst["ttfts"]]   # kept: --pool
            result.setdefault("all_ttfts", []).extend(ttfts)
            label = burst.get("shape") or burst.get("contexts")
            if label:       # each workload's own TTFT percentiles (per_workload)
                result.setdefault("ttfts_by", {}).setdefault(label, []).extend(ttfts)
            result["bursts"].append(burst)
            out.log(f"  {name}: burst {i + 1} done: {burst['wall_s']}s, "
                    f"{burst['output_tokens_per_s']} tok/s, errors {served_errors(burst)}"
                    + (f" (and {burst['timed_out']} requests still running when the budget "
                       f"ended it)" if burst.get("cut_by_budget") else "") + ", "
                    f"preemptions {burst['preemptions']}" + (
                        f", {burst['work']['steps']} steps of {burst['work']['ms_per_step']} "
                        f"ms and {burst['work']['tokens_per_step']} tokens, prompt tokens "
                        f"computed {burst['work']['prompt_tokens_computed']}"
                        if burst["work"].get("steps") else ""))
            out.record("c", **{name: {k: v for k, v in result.items() if k != "all_ttfts"}})
        wall = time.perf_counter() - t_all
        if tails:       # they count for errors, not for the schedule's throughput
            done = [t.join(max(1.0, budget.left() - 10)) for t in tails]
            result["tails"] = {"requests": sum(t.get("requests", 0) for t in done),
                               "output_tokens": sum(t.get("output_tokens", 0) for t in done),
                               "errors": sum(t.get("errors", 0) for t in done),
                               "first_errors": [e for t in done for e in t.get("first_errors", [])][:5]}
        tokens = sum(b["output_tokens"] for b in result["bursts"])
        ttft = result.pop("all_ttfts", [])
        result["ttft_by_workload"] = {k: percentiles(v) for k, v in
                                      result.pop("ttfts_by", {}).items()}
        result.update(
            schedule_wall_s=round(wall, 2), output_tokens=tokens,
            aggregate_output_tokens_per_s=round(tokens / wall, 1) if wall else None,
            errors=sum(served_errors(b) for b in result["bursts"]),
            preemptions=sum(b["preemptions"] or 0 for b in result["bursts"]),
            prefix_hit_rate=hit_rate(result["bursts"]), **percentiles(ttft))
        work = work_total(result["bursts"])
        if work:
            result["work"] = work
        for k, path in stats.items():
            e = kit.read_json(path)
            if e:
                result[f"elastic_{k}"] = {x: e.get(x) for x in (
                    "grows", "shrinks", "failed_grows", "bytes_returned", "evicted_cached",
                    "mapped_bytes", "pool_bytes", "worker_map_seconds", "worker_unmap_seconds",
                    "compactor_calls", "compaction")}
        return result
    finally:
        for proc in procs.values():      # all asked to stop at once, then waited for
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        for key in list(procs):     # the endpoint stops its engines one after the other
            kit.stop(procs[key], timeout=60 if endpoint else 20)
        time.sleep(0.2 if args.dry_run else 3)   # the engine cores' GPU memory comes back
        if endpoint and not args.dry_run:       # its engines are in groups of their own
            kit.wait_for(lambda: gpu_apps() in (0, None), 60, every=2.0)


def percentiles(values: list[float]) -> dict:
    """TTFT p50 and p99 (the nearest rank at or below) of ``values``; None where empty."""
    v = sorted(values)
    return {"ttft_p50_s": round(statistics.median(v), 3) if v else None,
            "ttft_p99_s": round(v[min(len(v) - 1, int(0.99 * len(v)))], 3) if v else None}


def ttft_figures(rows: list[dict]) -> dict:
    """TTFT p50/p99 over every request of ``rows`` (bursts, or one model's part of each)
    where every row kept its TTFTs; else each row's own percentiles, as lists (rows written
    before the TTFTs were kept)."""
    if rows and all("ttfts" in r for r in rows):
        return percentiles([t for r in rows for t in r["ttfts"]])
    return {"ttft_p50_s": [r["ttft_p50_s"] for r in rows],
            "ttft_p99_s": [r["ttft_p99_s"] for r in rows]}


def burst_rate(bursts) -> float | None:
    """Output tokens/s of ``bursts`` together: their tokens over their summed wall time."""
    bursts = list(bursts)
    wall = sum(b["wall_s"] for b in bursts)
    return sum(b["output_tokens"] for b in bursts) / wall if wall else None


def rounded_rate(bursts) -> float | None:
    rate = burst_rate(bursts)
    return round(rate, 1) if rate is not None else None


def per_workload(static: dict, elastic: dict, specs, key: str = "contexts") -> list[dict]:
    """Each ``--contexts`` or ``--shapes`` workload's figures (``key``), static against
    elastic: output tokens over the summed wall time of its bursts, TTFT p50/p99,
    preemptions and prefix hits."""
    rows = []
    for spec in map(spec_name, specs):
        row = {key: spec}
        for name, r in (("static", static), ("elastic", elastic)):
            row[f"{name}_ttft"] = (r.get("ttft_by_workload") or {}).get(spec)
            bursts = [b for b in r["bursts"] if b.get(key) == spec]
            row[f"{name}_tok_s"] = rounded_rate(bursts)
            row[f"{name}_bursts"] = len(bursts)
            row.setdefault("preemptions", []).append(sum(b["preemptions"] or 0 for b in bursts))
            row.setdefault("prefix_hit_rate", []).append(hit_rate(bursts))
            row.setdefault("errors", []).append(sum(served_errors(b) for b in bursts))
        row["ratio"] = (round(row["elastic_tok_s"] / row["static_tok_s"], 3)
                        if row["static_tok_s"] and row["elastic_tok_s"] else None)
        rows.append(row)
    return rows


# what makes two runs' bursts the same requests, and their setups the same servers (a capped
# elastic engine, a single engine of another size: not runs to pool); the rest (budget, order,
# ports) may differ
LOAD_SETTINGS = ("engines", "requests", "prompt", "output", "shapes", "contexts", "tail",
                 "enforce_eager", "model", "user_kv_max_gib", "single_util", "single_kv_gib",
                 "elastic_options")


def budget_cut(burst: dict, left: float, burst_timeout: float) -> bool:
    """A burst with requests still running when its time ran out, where that time was what
    the budget had left and not ``--burst-timeout``: the driver cut it short, the server did
    not fail them."""
    return bool(burst.get("timed_out")) and left < burst_timeout


def served_errors(burst: dict) -> int:
    """A burst's failed requests, less those the budget's end cut short."""
    return burst["errors"] - (burst.get("timed_out", 0) if burst.get("cut_by_budget") else 0)


def paired(a: dict | None, b: dict | None) -> tuple[float | None, int | None]:
    """Setup ``a``'s output tokens/s over ``b``'s, and on how many bursts: over the whole
    schedules (None) where both ran every burst in full, else over the bursts both served
    before either was cut short (the same requests in the same order: a whole run against a
    cut one would compare other work), burst time only. (None, 0): no burst to compare."""
    if not (a and b and a.get("aggregate_output_tokens_per_s")
            and b.get("aggregate_output_tokens_per_s")):
        return None, 0
    ab, bb = a.get("bursts", []), b.get("bursts", [])
    if len(ab) == len(bb) and not (a.get("cut_short") or b.get("cut_short")) \
            and not any(x.get("cut_by_budget") for x in ab + bb):
        return round(a["aggregate_output_tokens_per_s"] / b["aggregate_output_tokens_per_s"],
                     3), None
    n = 0
    for x, y in zip(ab, bb):
        if x.get("cut_by_budget") or y.get("cut_by_budget"):
            break
        n += 1
    return (round(burst_rate(ab[:n]) / burst_rate(bb[:n]), 3), n) if n else (None, 0)


def full_burst(burst: dict, output: int | None = None) -> bool:
    """A burst every request of which ended within it (none still running at its timeout)
    with all its ``output`` tokens (ignore_eos: fewer is an answer cut short, which a driver
    before 2026-12-05 counted as no error when an engine died mid-burst)."""
    if burst.get("shape"):
        output = int(str(burst["shape"]).split(":")[1])
    short = output is not None and burst.get("requests") and (
        burst["output_tokens"] < burst["requests"] * output)
    return (not short and not burst.get("timed_out")
            and TIMED_OUT not in burst.get("first_errors", []))


def pool(runs: list[tuple[str, dict]], output: int | None = None) -> dict:
    """Runs of the same load over several device calls (ABBA: ``--only static,elastic``,
    then ``--only elastic,static``), each ``(label, its subproof c)``. A burst is keyed by
    (round, engine): the same requests in every run (its seed is its round and engine). Per
    workload (shape, contexts, or the one load), over the keys that static and elastic both
    ran in full at least once: each setup's output tokens over the wall time of all its full
    bursts there (pooled tok/s), elastic / static, elastic / single where single ran, TTFT
    p50/p99 over every request of those bursts; each elastic run against each static run; each
    setup's runs against each other (its spread); per run, its bursts not run in full (one
    still running at its timeout, or with fewer than ``output`` tokens an answer)."""
    setups = ("static", "elastic", "single", "compacted", "endpoint")
    per = {n: [(label, {(b["round"], b["engine"]): b for b in c[n]["bursts"]
                        if full_burst(b, output)},
                c[n]) for label, c in runs if isinstance(c.get(n), dict) and c[n].get("bursts")]
           for n in setups}

    def keys_of(name):
        return set().union(*(set(f) for _, f, _ in per[name])) if per[name] else set()

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    def label(b):
        return b.get("shape") or b.get("contexts") or "all"

    both = keys_of("static") & (keys_of("elastic") | keys_of("endpoint"))
    out = {"runs": {n: [{"run": lab, "full_bursts": len(f),
                         "not_full": [i + 1 for i, b in enumerate(r["bursts"])
                                      if not full_burst(b, output)],
                         **({"cut_short": r["cut_short"]} if r.get("cut_short") else {})}
                        for lab, f, r in per[n]] for n in setups if per[n]},
           "workloads": []}
    if not both:
        out["why"] = "no burst that static and elastic (or endpoint) both ran in full"
        return out
    workloads = sorted({label(b) for _, f, _ in per["static"] for k, b in f.items() if k in both},
                       key=str)
    for w in workloads:
        row: dict = {"workload": w}
        for n in setups:
            keys = {k for k in both if any(k in f and label(f[k]) == w for _, f, _ in per[n])}
            chosen = [f[k] for _, f, _ in per[n] for k in sorted(keys) if k in f]
            if not chosen:
                continue
            row[n] = {"bursts": len(chosen), "tok_s": rounded_rate(chosen),
                      "errors": sum(b["errors"] for b in chosen),
                      "preemptions": sum(b.get("preemptions") or 0 for b in chosen),
                      **ttft_figures(chosen)}
            work = work_total(chosen)
            if work:            # the engines' own counters (runs since they were read)
                row[n]["work"] = work
        row["ratio"] = ratio(row.get("elastic", {}).get("tok_s"), row["static"]["tok_s"])
        if "single" in row:
            row["elastic_to_single"] = ratio(row.get("elastic", {}).get("tok_s"),
                                             row["single"]["tok_s"])
        runs_of = {n: [(lab, f) for lab, f, _ in per[n]] for n in ("static", "elastic",
                                                                    "endpoint")}
        row["pairs"] = kit.run_pairs(("elastic", runs_of["elastic"]),
                                     ("static", runs_of["static"]), rounded_rate,
                                     lambda k, b: label(b) == w)
        row["spread"] = {n: kit.run_spread(runs_of[n], rounded_rate,
                                           lambda k, b: k in both and label(b) == w)
                         for n in ("static", "elastic", "endpoint") if runs_of[n]}
        if "endpoint" in row:       # the one endpoint whose idle models sleep
            row["endpoint_ratio"] = ratio(row["endpoint"]["tok_s"], row["static"]["tok_s"])
            row["endpoint_to_elastic"] = ratio(row["endpoint"]["tok_s"],
                                               row.get("elastic", {}).get("tok_s"))
            if "single" in row:
                row["endpoint_to_single"] = ratio(row["endpoint"]["tok_s"],
                                                  row["single"]["tok_s"])
            row["endpoint_pairs"] = kit.run_pairs(("endpoint", runs_of["endpoint"]),
                                                  ("static", runs_of["static"]), rounded_rate,
                                                  lambda k, b: label(b) == w)
        out["workloads"].append(row)
    return out


def pool_main(args) -> int:
    """``--pool FILE ...``: summarize earlier runs (nothing starts)."""
    runs, mine = [], None
    for path in args.pool:
        data = kit.read_json(Path(path))
        c = (data or {}).get("subproofs", {}).get("c")
        if not c:
            print(f"two_engines: --pool {path}: not a two_engines.json with setups (no file, "
                  f"or no 'subproofs.c' in it)", file=sys.stderr)
            return 2
        theirs, diff = kit.settings_diff(data, LOAD_SETTINGS, mine, here="before")
        mine = mine or theirs
        if diff:
            print(f"two_engines: --pool {path}: another load ({diff}): its bursts are not "
                  f"the others'; pool runs of one load", file=sys.stderr)
            return 2
        runs.append((path, c))
    # endpoint runs pool only with their like: one --sleep-after, one layout, one path
    endpoints = [c["endpoint"] for _, c in runs if isinstance(c.get("endpoint"), dict)]
    sleeps = {ep.get("sleep_after") for ep in endpoints}
    if len(sleeps) > 1:
        print(f"two_engines: --pool: the endpoint runs' --sleep-after differ "
              f"({', '.join(sorted(f'{x:g}' for x in sleeps if x is not None))}): pool runs "
              f"of one", file=sys.stderr)
        return 2
    layouts = {ep.get("endpoints", "one") for ep in endpoints}
    if len(layouts) > 1:
        print(f"two_engines: --pool: the endpoint runs' --endpoints differ "
              f"({', '.join(sorted(layouts))}): pool runs of one", file=sys.stderr)
        return 2
    direct = {bool(ep.get("direct")) for ep in endpoints}
    if len(direct) > 1:
        print("two_engines: --pool: some endpoint runs sent their bursts through the router "
              "and some to the engines directly (--endpoint-direct): pool runs of one",
              file=sys.stderr)
        return 2
    out = kit.Out(Path(args.out), "two_engines-pooled")
    out.results["settings"] = {"pool": args.pool, **mine}
    summary = pool(runs, mine.get("output"))
    out.record("pooled", **summary)
    for row in summary["workloads"]:
        out.log(f"{row['workload']}: elastic / static {row['ratio']} "
                f"({row.get('elastic', {}).get('tok_s')} against {row['static']['tok_s']} "
                f"tok/s, {row['static']['bursts']} static and "
                f"{row.get('elastic', {}).get('bursts')} elastic bursts, errors "
                f"{row['static']['errors']} / {row.get('elastic', {}).get('errors')}); pairs "
                f"{[p['ratio'] for p in row['pairs']]}; static's spread "
                f"{[x['ratio'] for x in row['spread']['static']]}"
                + (f"; elastic / single {row['elastic_to_single']}" if "single" in row else "")
                + (f"; endpoint / static {row['endpoint_ratio']} ({row['endpoint']['tok_s']} "
                   f"tok/s, pairs {[p['ratio'] for p in row['endpoint_pairs']]}), / elastic "
                   f"{row['endpoint_to_elastic']}, / single {row.get('endpoint_to_single')}"
                   if "endpoint" in row else "")
                + "".join(f"; {n} {row[n]['work']['ms_per_step']} ms and "
                          f"{row[n]['work']['tokens_per_step']} tokens a step"
                          for n in ("static", "elastic", "single", "endpoint")
                          if "work" in row.get(n, {})))
    if not summary["workloads"]:
        out.log(f"nothing pooled: {summary.get('why')}")
    out.results["summary_lines"] = [json.dumps(summary)]
    out.finish()
    return 0 if summary["workloads"] else 1


def hit_rate(bursts: list[dict]) -> float | None:
    """vLLM's prefix-cache hit rate over ``bursts`` (tokens hit / tokens looked up; None
    where the servers did not report it)."""
    asked = sum(b.get("prefix_cache_queries", 0) for b in bursts)
    return round(sum(b.get("prefix_cache_hits", 0) for b in bursts) / asked, 4) if asked else None


class Parser(argparse.ArgumentParser):
    """Bad input: one line (what was wrong, the value), exit 2, no usage dump."""

    def error(self, message: str):
        self.exit(2, f"two_engines: {message} (see --help)\n")


def engines_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 2 <= n <= MAX_ENGINES:
        raise argparse.ArgumentTypeError(
            f"--engines wants a whole number of engines from 2 to {MAX_ENGINES}, got {text!r}")
    return n


def parse(argv=None):
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./gpu-out"),
                    help="results folder (default: $OUT, else ./gpu-out)")
    ap.add_argument("--engines", type=engines_arg, default=2, metavar="N",
                    help=f"engines on the GPU, 2 to {MAX_ENGINES}, named A, B, C, ... on ports "
                         f"--port .. --port+N-1; each round a burst on each in turn "
                         f"(default: %(default)s)")
    ap.add_argument("--budget", type=float, default=410.0,
                    help="seconds for everything; checked against the plan before anything "
                         "starts (default: %(default)s)")
    ap.add_argument("--model", default=os.environ.get("PROXIMA_PROOF_MODEL", kit.MODEL),
                    help="model config directory, dummy weights (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per burst (default: 1000; with --contexts, COUNT x VISITS)")
    ap.add_argument("--prompt", type=int, default=256,
                    help="mean prompt tokens, uniform in [0.5, 1.5] of it; with --contexts, "
                         "the question after the context (default: %(default)s)")
    ap.add_argument("--contexts", type=contexts_spec, default=None, metavar="COUNT:TOKENS:VISITS",
                    help="a reuse workload: each burst COUNT contexts of TOKENS tokens (new ones "
                         "each burst), each asked VISITS times, a round of every context at a "
                         "time in its own order; whether a visit finds its context still "
                         "cached is what an engine's KV memory decides; several, comma-"
                         "separated (e.g. 50:4096:4,100:4096:4), are sent one a round in "
                         "turn (round r the (r mod how many)-th; --rounds at least how "
                         "many), and the summary gives each its own ratio (default: none, "
                         "every prompt its own)")
    ap.add_argument("--shapes", type=shapes_spec, default=None,
                    metavar="PROMPT:OUTPUT:REQUESTS",
                    help="burst shapes instead of --prompt/--output/--requests: each "
                         "PROMPT:OUTPUT:REQUESTS (mean prompt tokens, uniform in [0.5, 1.5] of "
                         "it; output tokens; requests per burst); several, comma-separated, "
                         "are sent one a round in turn (--rounds at least how many), on the "
                         "same servers, and the summary gives each its own ratio and TTFT "
                         "(e.g. issue 33's 4000:512:160,4000:1024:96,512:256:1000) "
                         "(default: none)")
    ap.add_argument("--output", type=int, default=512,
                    help="output tokens per request (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="each server's --max-model-len (default: the longest request a "
                         "burst or tail can send, 1.5 x --prompt + its output tokens, at "
                         "least 2048)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of one burst per engine, A first (default: %(default)s)")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="(default: %(default)s)")
    ap.add_argument("--max-gib", type=float, default=None,
                    help="each elastic engine's KV maximum, GiB (default: 72 for two engines, "
                         "more than half of an H200's 139.8 GiB; for more engines what the GPU "
                         "holds for the busy one with every other at its 2 GiB minimum: "
                         "--gpu-gib - N x --engine-gib - (N-1) x 2 - 4 GiB of slack, e.g. 57 "
                         "for four; with --user-path: not given, each engine sizes itself; "
                         "given, serve's --kv-max caps each, e.g. at a static share to tell "
                         "elastic mode's own cost from what more memory does to a load)")
    ap.add_argument("--delay", type=float, default=2.0,
                    help="elastic release delay, s (default: %(default)s)")
    ap.add_argument("--granule-mib", type=int, default=32,
                    help="elastic mapping grain per layer, MiB (default: %(default)s; fewer, "
                         "larger maps when a burst grows the pool)")
    ap.add_argument("--burst-timeout", type=float, default=120.0,
                    help="seconds a burst may take (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8300,
                    help="A's port; B's is +1, C's +2, ... (default: %(default)s)")
    ap.add_argument("--compactor", default=None, metavar="MODULE:FACTORY",
                    help="issue 14's compaction hook for the elastic servers (default: none)")
    ap.add_argument("--only", default="static,elastic",
                    help="setups to run, in this order: static, elastic, compacted (elastic "
                         "with KV compaction, issue 14), single (the upper bound of any "
                         "sharing: ONE stock engine with the GPU's whole KV, --single-util, "
                         "every engine's bursts sent to it in turn), endpoint (one "
                         "`proxima serve --models` with the engines as models that sleep "
                         "when idle, --sleep-after) (default: %(default)s)")
    ap.add_argument("--single-util", type=float, default=0.9,
                    help="the single setup's gpu_memory_utilization (default: %(default)s)")
    ap.add_argument("--single-kv-gib", type=float, default=0.0,
                    help="the single setup's KV, GiB; 0: vLLM profiles it (alone on the GPU, "
                         "safe) (default: %(default)s)")
    ap.add_argument("--static-util", type=float, default=None,
                    help="each static engine's gpu_memory_utilization (default: 0.45 for two "
                         "engines; for N > 2, 0.9/N, said in the log); N x it at most 0.95")
    ap.add_argument("--static-kv-gib", type=float, default=None,
                    help="the static engines' KV, GiB, fixed so that they can start side by "
                         "side: what --static-util gives each when profiled (0.45 gave two "
                         "stock engines started one after the other 46.62 and 46.85 GiB, "
                         "session 6 call 2); 0: vLLM profiles each, and they start one after "
                         "the other (N start-ups in a row: safe on any GPU, slow) (default: "
                         "46.6 for two engines; 0 for more, since what 0.9/N gives was not "
                         "measured: give it, e.g. 15 for four on an H200: 0.225 x 139.8 less "
                         "weights 14.96, activations 1.1, non-torch 0.22, to start them side "
                         "by side)")
    ap.add_argument("--engine-gib", type=float, default=18.0,
                    help="the memory plan's estimate of each engine's GPU memory besides KV, "
                         "GiB (dummy Llama-3.1-8B on vLLM 0.26: weights 14.96, activations up "
                         "to 1.8, CUDA graphs 0.98, non-torch 0.22) (default: %(default)s)")
    ap.add_argument("--gpu-gib", type=float, default=None,
                    help="the GPU's memory for the memory plan, GiB (default: the GPU's, as "
                         "vLLM sees it: 139.8 on an H200, 79.2 on an H100 80GB, by the name "
                         "nvidia-smi gives; 139.8 with --dry-run)")
    ap.add_argument("--start", choices=("parallel", "sequential"), default="parallel",
                    help="start the engines side by side where their KV is fixed, or one "
                         "after the other (default: %(default)s)")
    ap.add_argument("--tail", type=tail_spec, default=(0, 0), metavar="N:TOKENS",
                    help="with each burst, N more requests of TOKENS output tokens that the "
                         "schedule does not wait for: they outlive the burst (compaction's "
                         "case; default: none)")
    ap.add_argument("--user-path", action="store_true",
                    help="the elastic servers as the docs tell a user to start them: `proxima "
                         "serve MODEL --elastic` (gunicorn, self-check, mp executor), with no "
                         "sizing flag (it sizes itself from the GPU and the per-GPU ledger) and "
                         "the product's release delay; --delay and --granule-mib then do not "
                         "apply, --max-gib only where given (default: off: vLLM's api_server "
                         "with Proxima's connector and those options)")
    ap.add_argument("--elastic-options", default=None, metavar="K=V,...",
                    help="with --user-path: more of serve's --elastic-options for every "
                         "elastic server, e.g. gpu_free_low=0.02 (the share of the GPU a grow "
                         "leaves free; 0.05 by default) to measure what the reserve costs "
                         "(default: none, the product's defaults)")
    ap.add_argument("--sleep-after", type=float, default=5.0,
                    help="the endpoint setup: each model's sleep_after, seconds idle before it "
                         "gives back its KV and its weights (at least 1) (default: "
                         "%(default)s)")
    ap.add_argument("--endpoints", choices=("one", "separate"), default="one",
                    help="the endpoint setup: one `proxima serve --models` of every engine, or "
                         "a separate one-model `proxima serve` per engine (on --port + i, "
                         "meeting only in the GPU's ledger) (default: %(default)s)")
    ap.add_argument("--endpoint-direct", action="store_true",
                    help="the endpoint setup: send each burst to the model's engine itself (its "
                         "own port), not through the endpoint's router; one 1-token request "
                         "through the router first wakes a sleeping model, outside the burst's "
                         "clock. Tells the router's cost from the engine's (default: off)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="every server without torch.compile and CUDA graphs (both setups "
                         "alike): each start takes seconds instead of a minute (default: off)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU stand-in servers (fake_server.py): checks the orchestration, "
                         "proves nothing (default: off)")
    ap.add_argument("--pool", action="append", default=[], metavar="FILE",
                    help="an earlier two_engines.json of the same load; repeatable: nothing "
                         "runs, the runs are pooled (ABBA over device calls) into "
                         "two_engines-pooled.json: per workload the ratio over every burst "
                         "both setups ran in full, each pair of runs, each setup's spread "
                         "(default: none)")
    return ap.parse_args(argv)


def resolve(args, order: list[str]) -> tuple[str | None, list[str]]:
    """Fill the N-dependent defaults and check the memory plan. Returns (the error line or
    None, the lines for the log)."""
    n, notes = args.engines, []
    static = "static" in order
    output = max(args.output, args.tail[1])
    context = max(t for _, t, _ in args.contexts) if args.contexts else 0
    longest = context + args.prompt * 3 // 2 + output
    if args.shapes:
        given = ",".join(map(spec_name, args.shapes))
        if args.contexts or args.requests is not None:
            return (f"--shapes {given} sets each burst's prompt, output and requests: leave "
                    f"out {'--contexts' if args.contexts else '--requests'}"), notes
        if args.rounds < len(args.shapes):
            return (f"--shapes {given} gives {len(args.shapes)} shapes, one a round, but "
                    f"--rounds is {args.rounds}: give --rounds {len(args.shapes)} (or a "
                    f"multiple of it)"), notes
        longest = max(p * 3 // 2 + max(o, args.tail[1]) for p, o, _ in args.shapes)
    if args.contexts:
        sizes = [c * v for c, _, v in args.contexts]
        given = ",".join(map(spec_name, args.contexts))
        if len(sizes) > 1 and args.rounds < len(sizes):
            return (f"--contexts {given} gives {len(sizes)} workloads, one a round, but "
                    f"--rounds is {args.rounds}: give --rounds {len(sizes)} (or a multiple of "
                    f"it, to run each as often)"), notes
        if args.requests is not None and (len(sizes) > 1 or args.requests != sizes[0]):
            return (f"--requests {args.requests} and --contexts {given} disagree: with "
                    f"--contexts a burst is COUNT x VISITS = "
                    f"{' or '.join(map(str, sizes))} requests; leave --requests out"), notes
        args.requests = sizes[0] if len(sizes) == 1 else None
    elif args.requests is None and not args.shapes:
        args.requests = 1000
    if args.max_model_len is None:
        args.max_model_len = max(2048, longest)
    elif args.max_model_len < longest:
        return (f"--max-model-len {args.max_model_len} is shorter than the longest request "
                f"({f'a {context}-token context + ' if context else ''}1.5 x --prompt "
                f"{args.prompt} + {output} output tokens = {longest}): give at least "
                f"{longest}, or shorter --prompt/--output"), notes
    if args.static_util is None:
        args.static_util = 0.45 if n == 2 else math.floor(900 / n) / 1000
        if n != 2:
            notes.append(f"static: gpu_memory_utilization {args.static_util} each (0.9/{n}, "
                         f"no --static-util given)")
    if not 0 < args.static_util <= 1 or (static and n * args.static_util > 0.95 + 1e-9):
        return (f"--static-util {args.static_util} for {n} engines asks for "
                f"{n * args.static_util:.2f} of the GPU: give at most {0.95 / n:.3f} (N x it "
                f"at most 0.95)"), notes
    known = None if args.dry_run else gpu_known()
    if args.gpu_gib is None:
        if not args.dry_run and known is None:
            return ("the GPU is neither an H200 nor an H100 80GB (nvidia-smi: "
                    f"{gpu_name() or 'no answer'}): give --gpu-gib and --static-kv-gib"), notes
        args.gpu_gib = known[0] if known else 139.8
    if args.static_kv_gib is None:
        args.static_kv_gib = ((known[1] if known else 46.6) if n == 2 else 0.0)
    if args.static_kv_gib < 0:
        return f"--static-kv-gib wants 0 (profile) or more GiB, got {args.static_kv_gib}", notes
    base = args.engine_gib
    args.user_kv_max_gib = args.max_gib if args.user_path else None
    if "endpoint" in order and not 1 <= args.sleep_after <= 86400:
        return (f"--sleep-after wants seconds from 1 to 86400 (the endpoint's sleep_after), "
                f"got {args.sleep_after:g}"), notes
    if args.elastic_options:
        if not args.user_path and "endpoint" not in order:
            return ("--elastic-options is for --user-path's servers and the endpoint's "
                    "models (without them, give PROXIMA_PROOF_ELASTIC_OPTIONS as JSON)"), notes
        # serve's own check, here: a bad value is refused before any GPU time is spent
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from proxima.config import ConfigError, elastic_options_text

        try:
            given = elastic_options_text(args.elastic_options, "--elastic-options")
        except ConfigError as exc:
            return str(exc), notes
        if "stats_file" in given:
            return "--elastic-options: stats_file is the driver's: leave it out", notes
    if args.max_gib is None:
        args.max_gib = 72.0 if n == 2 else float(math.floor(
            args.gpu_gib - n * base - (n - 1) * MIN_GIB - 4))
        if n != 2:
            notes.append(f"elastic: max {args.max_gib:.0f} GiB each (the busy one with the "
                         f"other {n - 1} at {MIN_GIB} GiB: {args.gpu_gib} - {n} x {base} - "
                         f"{n - 1} x {MIN_GIB} - 4 GiB of slack)")
    if args.max_gib <= MIN_GIB:
        return (f"elastic max {args.max_gib} GiB for {n} engines is not above the {MIN_GIB} "
                f"GiB minimum: {n} engines of ~{base} GiB besides KV leave no room on a "
                f"{args.gpu_gib} GiB GPU; give fewer --engines or --max-gib"), notes
    if static:
        kv = args.static_kv_gib or args.static_util * args.gpu_gib - (base - 1.0)
        how = "fixed" if args.static_kv_gib else "profiled, about"
        if kv <= 0:
            return (f"--static-util {args.static_util} leaves no KV for an engine of ~{base} "
                    f"GiB besides KV on a {args.gpu_gib} GiB GPU: give fewer --engines"), notes
        need = n * (base + kv)
        notes.append(f"memory plan (estimate, --engine-gib {base} each besides KV, "
                     f"--gpu-gib {args.gpu_gib}): static {n} x ({base} + {kv:.1f} KV, {how}) "
                     f"= {need:.1f} GiB")
        if args.static_kv_gib and need > args.gpu_gib:
            return (f"--static-kv-gib {args.static_kv_gib} for {n} engines needs about "
                    f"{need:.0f} GiB ({n} x ({base} + {args.static_kv_gib})), more than the "
                    f"GPU's {args.gpu_gib}: give at most "
                    f"{math.floor(10 * (args.gpu_gib / n - base)) / 10}"), notes
    if "single" in order:
        if not 0 < args.single_util <= 0.95 or args.single_kv_gib < 0:
            return (f"--single-util wants more than 0 and at most 0.95, --single-kv-gib 0 "
                    f"(profile) or more GiB; got {args.single_util} and "
                    f"{args.single_kv_gib}"), notes
        notes.append(f"single: one stock engine at gpu_memory_utilization {args.single_util}"
                     + (f" with {args.single_kv_gib} GiB of KV" if args.single_kv_gib
                        else ", KV profiled") + f", all {n} engines' bursts sent to it")
    if args.user_path and any(x in order for x in ("elastic", "compacted")):
        notes.append("elastic: `proxima serve MODEL --elastic`, no sizing flag: each engine "
                     "sizes itself (its 'elastic sizing:' log line); --delay and "
                     "--granule-mib do not apply" + (
                         f"; --max-gib {args.user_kv_max_gib:g} caps each (serve's --kv-max)"
                         if args.user_kv_max_gib else ", nor --max-gib (not given)")
                     + (f"; --elastic-options {args.elastic_options}"
                        if args.elastic_options else ""))
    if "endpoint" in order and args.endpoints == "separate":
        notes.append(f"endpoint: {n} separate `proxima serve --models FILE` of one model each "
                     f"({', '.join(names(n))} of {Path(args.model).name}) on ports "
                     f"{args.port}-{args.port + n - 1}, "
                     f"{'side by side' if args.start == 'parallel' else 'one after the other'}"
                     f", no sizing flag, "
                     f"sleep_after {args.sleep_after:g} s each"
                     + (f"; --elastic-options {args.elastic_options}"
                        if args.elastic_options else ""))
    elif "endpoint" in order:
        notes.append(f"endpoint: one `proxima serve --models FILE`, models "
                     f"{', '.join(names(n))} of {Path(args.model).name}, no sizing flag, "
                     f"sleep_after {args.sleep_after:g} s each (engines' counters on ports "
                     f"{args.port + 10}-{args.port + 9 + n})"
                     + (f"; --elastic-options {args.elastic_options}"
                        if args.elastic_options else ""))
    if "endpoint" in order and args.endpoint_direct:
        notes.append("endpoint: --endpoint-direct: each burst sent to the model's engine on "
                     "its own port, after one 1-token request through the router (which wakes "
                     "a sleeping model) outside the burst's clock")
    if not args.user_path and any(x in order for x in ("elastic", "compacted")):
        peak = n * base + (n - 1) * MIN_GIB + args.max_gib
        notes.append(f"memory plan: elastic, one engine busy at its {args.max_gib:.0f} GiB max, "
                     f"the other {n - 1} at {MIN_GIB} GiB: {n} x {base} + {n - 1} x {MIN_GIB} "
                     f"+ {args.max_gib:.0f} = {peak:.1f} GiB"
                     + ("" if peak <= args.gpu_gib else
                        f", more than {args.gpu_gib}: the busy engine's grows beyond "
                        f"~{args.max_gib - peak + args.gpu_gib:.0f} GiB wait and retry"))
    return None, notes


def setup_seconds(name: str, args, cold: bool = False) -> tuple[float, str]:
    """The least time a setup can take: its start-ups (side by side or in a row; longer for
    an elastic setup, and where ``cold``: no torch.compile cache on this host), N x rounds
    bursts at their shortest, its stop."""
    c = DRY_PLAN if args.dry_run else GPU_PLAN
    n = args.engines
    together = starts_together(name == "static", args)
    one = c["start"] + (c["elastic_more"] if name not in ("static", "single") else 0.0) \
        + (c["cold_more"] if cold else 0.0)
    if name == "single":
        start, n, together = one, 1, True
    elif name == "endpoint" and args.endpoints == "separate":   # each its own
        start = one + c["endpoint_more"] + c["start_each_more"] * (n - 2) if together \
            else (one + c["endpoint_more"]) * n
    elif name == "endpoint":    # its own checks, then its engines side by side
        start, together = one + c["start_each_more"] * (n - 2) + c["endpoint_more"], True
    else:
        start = one + c["start_each_more"] * (n - 2) if together else one * n
    bursts = args.engines * args.rounds
    total = start + bursts * c["burst"] + c["stop"]
    how = ("one engine" if name == "single" else
           f"{n} {'side by side' if together else 'one after the other'}")
    return total, (f"{name} {total:.0f}s ({start:.0f}s of start-up, {how}"
                   f"{', no compile cache yet' if cold else ''}, {bursts} "
                   f"bursts x {c['burst']:.0f}s, {c['stop']:.0f}s stop)")


#: GPUs measured: name in nvidia-smi -> (GiB as vLLM sees it, what --static-util 0.45 gives
#: two stock engines of dummy Llama-3.1-8B when profiled, GiB of KV: the H200's from session
#: 6 call 2, the H100's 17 with ~0.6 GiB to spare, sessions 23 and 24)
GPUS = {"H200": (139.8, 46.6), "H100 80GB": (79.2, 17.0)}


def gpu_name() -> str | None:
    """The first visible GPU's name, as nvidia-smi says it (None: no answer)."""
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        done = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=name",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def gpu_known() -> tuple[float, float] | None:
    """(--gpu-gib, --static-kv-gib) for this GPU when it is one measured (:data:`GPUS`)."""
    name = gpu_name() or ""
    return next((v for k, v in GPUS.items() if k in name), None)


def main() -> int:
    args = parse()
    if args.pool:
        return pool_main(args)
    order = [n for n in args.only.split(",") if n]
    unknown = sorted(set(order) - set(SETUPS))
    if unknown:
        print(f"two_engines: unknown setup(s) {', '.join(unknown)} in --only: give "
              f"{', '.join(SETUPS[:-1])} and/or {SETUPS[-1]}", file=sys.stderr)
        return 2
    error, notes = resolve(args, order)
    if error:
        print(f"two_engines: {error}", file=sys.stderr)
        return 2
    cold = starts_cold(args)
    plan = [setup_seconds(name, args, cold) for name in order]
    need = sum(p[0] for p in plan)
    refused = kit.budget_refusal("two_engines", args.budget,
                                 f"{len(order)} setup(s) of {args.engines} engines", plan,
                                 "or fewer --engines/--rounds, or one setup in --only")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    out = kit.Out(Path(args.out), "two_engines")
    budget = kit.Budget(args.budget)
    env = kit.engine_env(compile_cache_root())
    keys = names(args.engines)
    reuse = "".join(f"{', then' if i else ', after'} {c} contexts of {t} tokens, each asked "
                    f"{v} times" for i, (c, t, v) in enumerate(args.contexts or ()))
    if args.contexts and len(args.contexts) > 1:
        reuse += " (one workload a round, in turn)"
    per_burst = ("/".join(str(c * v) for c, _, v in args.contexts) if args.contexts
                 else args.requests)
    load = (f"bursts of shapes {', '.join(f'{p}/{o} x {n}' for p, o, n in args.shapes)} "
            f"(prompt / output tokens x requests, one shape a round in turn)"
            if args.shapes else f"{per_burst} requests per burst ({args.prompt} prompt / "
            f"{args.output} output tokens{reuse})")
    out.log(f"{args.engines} engines ({', '.join(keys)} on ports {args.port}-"
            f"{args.port + args.engines - 1}): budget {args.budget:.0f}s, {load}, "
            f"{args.rounds} round(s) of {args.engines} bursts, static "
            f"gpu_memory_utilization {args.static_util} with "
            f"{f'{args.static_kv_gib} GiB of KV' if args.static_kv_gib else 'profiled KV'}, "
            + ("elastic via `proxima serve --elastic` (self-sized)" if args.user_path else
               f"elastic max {args.max_gib} GiB") + f", compactor {args.compactor}")
    for line in notes:
        out.log(f"  {line}")
    out.log(f"  time plan, at least: {'; '.join(p[1] for p in plan)}")
    out.results["settings"] = vars(args)
    results = {}
    for name in order:   # what a setup needs now: a setup before it may have filled the cache
        setup_need = setup_seconds(name, args, starts_cold(args))[0]
        if budget.left() < setup_need:
            out.record("c", **{f"{name}_skipped": f"only {budget.left():.0f}s left, the setup "
                               f"needs at least {setup_need:.0f}s: give --budget "
                               f"{math.ceil(need) + 30} or more"})
            out.log(f"  {name}: skipped, only {budget.left():.0f}s left")
            continue
        try:
            results[name] = run_setup(out, budget, name, name in ("static", "single"), args, env)
            out.record("c", **{name: results[name]})
        except Exception as exc:  # noqa: BLE001 - the other setup still runs
            import traceback

            out.record("c", **{f"{name}_error": f"{type(exc).__name__}: {exc}",
                               f"{name}_traceback": traceback.format_exc()[-2000:]})
            out.log(f"  {name}: FAILED: {exc}")
        finally:
            kit.kill_all()

    def idle_mapped(r) -> list[dict]:
        # per burst, each idle engine's mapped bytes over the busy one's burst (mean of the
        # samples), else at its end
        rows = []
        for b in r["bursts"]:
            row = {}
            for k in keys:
                if k != b["engine"]:
                    seen = (b.get("mapped_during") or {}).get(k)
                    row[k] = seen["mean"] if seen else b.get(f"mapped_{k}_bytes")
            rows.append(row)
        return rows

    def idle_total(r) -> list:
        # the idle engines' mapped bytes together, per burst (two engines: the idle one's)
        return [sum(v for v in row.values() if v is not None)
                if any(v is not None for v in row.values()) else None
                for row in idle_mapped(r)]

    s, e = results.get("static"), results.get("elastic")
    unfinished = [n for n in order
                  if not (results.get(n) or {}).get("aggregate_output_tokens_per_s")]
    errored = [n for n in order if (results.get(n) or {}).get("errors")]
    cut = [f"{n} ({results[n]['cut_short']})" for n in order
           if (results.get(n) or {}).get("cut_short")]
    # the verdict is elastic against static (>= 1.3x): a run of other setups has none, and
    # fails only where a setup did not finish or had errors
    judged = bool(unfinished or errored or cut) or {"static", "elastic"} <= set(order)
    passed = False
    ratio, on = paired(e, s)
    if ratio is not None:
        passed = ratio >= 1.3 and e["errors"] == 0 and s["errors"] == 0 and not cut
        summary = {"ratio": ratio, **({"ratio_on_bursts": on} if on else {}),
                   "static_tok_s": s["aggregate_output_tokens_per_s"],
                   "elastic_tok_s": e["aggregate_output_tokens_per_s"],
                   "errors": [s["errors"], e["errors"]],
                   "preemptions": [s["preemptions"], e["preemptions"]],
                   "prefix_hit_rate": [s.get("prefix_hit_rate"), e.get("prefix_hit_rate")],
                   "ttft_p50_s": [s["ttft_p50_s"], e["ttft_p50_s"]],
                   "ttft_p99_s": [s["ttft_p99_s"], e["ttft_p99_s"]],
                   **({"cut_short": cut} if cut else {})}
    else:
        summary = {"why": f"a setup did not finish: {', '.join(unfinished)} (see "
                          f"two_engines.json)" if unfinished else
                   f"errors in {', '.join(errored)}" if errored else
                   f"cut short: {'; '.join(cut)}: its figure is partial (--pool leaves that "
                   f"burst out); give --budget more" if cut else
                   f"no elastic-against-static verdict: --only {','.join(order)}"}
    summary["engines"] = args.engines
    one = results.get("single")
    if one and one.get("aggregate_output_tokens_per_s"):
        # issue 33: the upper bound of any sharing on the same bursts, one engine for all
        summary["single"] = {
            "tok_s": one["aggregate_output_tokens_per_s"], "errors": one["errors"],
            "ttft_p50_s": one["ttft_p50_s"], "ttft_p99_s": one["ttft_p99_s"],
            "elastic_to_single": paired(e, one)[0], "static_to_single": paired(s, one)[0]}
    ep = results.get("endpoint")
    if ep and ep.get("aggregate_output_tokens_per_s"):
        # one endpoint whose idle models sleep: what their weights' memory adds
        def to(other):
            return paired(ep, results.get(other))[0]
        on_static = paired(ep, s)[1]
        events = endpoint_events(ep)
        summary["endpoint"] = {
            "tok_s": ep["aggregate_output_tokens_per_s"], "errors": ep["errors"],
            "preemptions": ep["preemptions"], "ttft_p50_s": ep["ttft_p50_s"],
            "ttft_p99_s": ep["ttft_p99_s"], "sleep_after_s": ep.get("sleep_after"),
            "endpoints": ep.get("endpoints", "one"), "direct": ep.get("direct", False),
            "to_static": to("static"), "to_elastic": to("elastic"), "to_single": to("single"),
            **({"to_static_on_bursts": on_static} if on_static else {}),
            "sleeps": sum(1 for ev in events if ev[1] == "asleep"),
            "wake_s": [ev[2] for ev in events if ev[1] == "awake"]}
    if s and e and args.contexts and len(args.contexts) > 1:
        summary["per_workload"] = per_workload(s, e, args.contexts)
    if s and e and args.shapes:
        summary["per_workload"] = per_workload(s, e, args.shapes, key="shape")
    burst_rates = {n: [b["output_tokens_per_s"] for b in r["bursts"]] for n, r in results.items()}
    if burst_rates:
        summary["per_burst_tok_s"] = burst_rates
    if e:
        summary["idle_mapped_bytes_per_burst"] = idle_mapped(e)
    c = results.get("compacted")
    if c and c.get("aggregate_output_tokens_per_s"):
        # issue 14: what the idle engines had given back during the busy one's burst
        summary["compacted"] = {
            "tok_s": c["aggregate_output_tokens_per_s"], "errors": c["errors"],
            "preemptions": c["preemptions"],
            "ratio_to_static": paired(c, s)[0],
            "idle_engine_mapped_bytes_per_burst": idle_total(c),
            "idle_engine_mapped_bytes_per_burst_without": idle_total(e) if e else None,
            "bytes_returned": [c.get(f"elastic_{k}", {}).get("bytes_returned") for k in keys],
            "bytes_returned_without": [e.get(f"elastic_{k}", {}).get("bytes_returned")
                                       for k in keys] if e else None}
    out.record("c", passed=passed, summary=summary)
    verdict = "PASS" if passed else "FAIL" if judged else "DONE"
    line = f"(c) {verdict}: {json.dumps(summary)}"
    out.log(line)
    out.results["summary_lines"] = [line]
    out.results["wall_s"] = round(budget.elapsed(), 1)
    for path in out.dir.glob(".*-elastic.json*"):  # the engines' live files, and the
        path.unlink()                                 # temporary ones a killed writer left
    out.finish()
    return 0 if verdict != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
