"""Issue 36's GPU proof: one GPU, three models, one endpoint, against three stock servers.

    OUT=$OUT PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python3 tools/gpu/three_models.py --out $OUT [--budget 540] [--only proxima,stock]

Models (dummy weights, ``--load-format dummy``, the tiny-llama tokenizer, token-id prompts):
big = tools/gpu/dummy-llama (Llama-3.1-8B's shape), mid = dummy-llama-3b (Llama-3.2-3B),
small = dummy-llama-1b (Llama-3.2-1B). Two setups, the same seeded trace:

* proxima: ONE command, no sizing flag: ``proxima serve --port P --models FILE`` (the file,
  JSON, lists the three with ``--load-format dummy --tokenizer TINY --max-model-len 8192``;
  compaction off). The endpoint starts the engines (side by side where they need at most
  half the GPU's free memory, as these do) and each sizes itself (the "elastic sizing:"
  lines of its log are recorded); requests carry "model": NAME.
* stock: three stock vLLM OpenAI servers (PROXIMA_ALLOCATOR=0), one per model on its own
  port, each with a static share ``--gpu-memory-utilization --stock-util`` (0.28), started
  one after another (a profile run is upset by another engine loading beside it).

The trace: ``--rounds`` rounds; each round a burst on each model in turn (big, mid, small):
``--requests`` requests to the busy model and ``--background`` to each of the other two, all
at once; prompts of ``--prompt`` MIN:MAX random token ids, ``--output`` MIN:MAX tokens
(ignore_eos), streamed. Measured per model and together: output tokens/s over the trace's
wall time, TTFT p50/p99, errors; memory per model: proxima's ``/engines/NAME/proxima/kv``
(mapped, min, max bytes) at idle, sampled during every burst and after it; for both setups
``nvidia-smi``'s memory per process, summed per model (a process counts for the model whose
``--served-model-name`` its ancestors carry), at idle and after every burst; stock's KV from
its log ("Available KV cache memory"). The summary: aggregate tok/s per setup, the ratio
proxima/stock, per model tok/s and TTFT.

The plan is checked first: a budget too small for the setups' start-ups, bursts and stops is
said in one line (exit 2). ``--with FILE`` takes the setups not run now from an earlier
three_models.json (a run split over two device calls: ``--only proxima``, then ``--only
stock --with .../three_models.json``), so the ratio is still computed.
Time, measured on one H100 with ``--enforce-eager``: ``proxima serve`` started its three
engines one after another in 258 s (s27); side by side, 94 s on a warm host, and not within
120 s on a fresh one (s28); stock's three servers 130-158 s; a round of bursts 49-57 s on
proxima, 98-100 s on stock. ``--rounds 1`` fits both setups in one 600 s device call (plan
513 s); with two rounds the plan refuses both before anything starts: run ``--only
proxima`` and ``--only stock --with FILE`` in two calls.
Rounds over calls (ABBA): give every earlier run with ``--with`` (repeatable; runs of
different ``--rounds`` pool on the bursts they share, each burst being seeded by its round
and model); the summary's ``pooled`` gives the ratio over every burst run in full at a
(round, model) both setups ran in full, each pair of runs' ratio, and each setup's runs
against each other (its spread).
Files in $OUT: three_models.json (rewritten as results come), three_models.log,
three_models-logs.tgz (the servers' logs). ``--dry-run``: CPU stand-ins (fake_multi.py, the
real multi-model endpoint over fake_server.py engines, and fake_server.py for stock).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import proofkit as kit  # noqa: E402
from two_engines import TIMED_OUT, healthy, percentiles, run_burst, ttft_figures  # noqa: E402

GPU = Path(__file__).resolve().parent
MODELS = {"big": GPU / "dummy-llama", "mid": GPU / "dummy-llama-3b",
          "small": GPU / "dummy-llama-1b"}
SETUPS = ("proxima", "stock")
# the plan's floors, seconds: one model's start-up per setup (compiled; eager), whether a
# setup's models start side by side, what proxima serve does before its engines start, a
# burst, a setup's stop. Measured on one H100: eager, proxima serve's engines one after
# another 76-84 s each (s23, s27) after 23 s of its own checks; side by side (since
# 2026-12-06, where the models need at most half the GPU's free memory: these need 32 of
# 78 GiB) all three ready 94 s after the endpoint started on a warm host, and NOT ready after
# 120 s on the first start of a fresh one (three vLLM imports at once, cold page cache; s28);
# stock servers 39-64 s each (s27, s28); compiled, two `proxima serve --elastic` side by side
# 111-120 s, two stock 73-114 s. The driver starts stock's one after another (vLLM's memory
# profiling of one must not see another loading). A round of three bursts took proxima
# 49-57 s and stock 98-100 s (s27, s28).
GPU_PLAN = {"start": {"proxima": 150.0, "stock": 75.0},
            "start_eager": {"proxima": 130.0, "stock": 53.0},
            "side_by_side": {"proxima": True, "stock": False}, "before": {"proxima": 25.0},
            "burst": {"proxima": 20.0, "stock": 33.0}, "stop": 20.0}
DRY_PLAN = {"start": {"proxima": 2.0, "stock": 2.0}, "start_eager": {"proxima": 2.0, "stock": 2.0},
            "side_by_side": {"proxima": True, "stock": False}, "before": {},
            "burst": {"proxima": 1.0, "stock": 1.0}, "stop": 1.0}


def span(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
        if not 1 <= lo <= hi:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants MIN:MAX (whole numbers, 1 <= MIN <= MAX), "
                                         f"e.g. 2000:6000, got {text!r}")
    return lo, hi


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"),
                    help="where the files go (default: $OUT or gpu-out)")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="wall-clock seconds for everything (default: %(default)s)")
    ap.add_argument("--only", default="proxima,stock",
                    help="the setups, in this order (default: %(default)s)")
    ap.add_argument("--with", dest="with_files", action="append", default=[],
                    metavar="FILE",
                    help="an earlier three_models.json: its setups not run now join the "
                         "summary; repeatable, with --only none to summarize earlier runs "
                         "only (default: none)")
    ap.add_argument("--port", type=int, default=8500,
                    help="proxima's endpoint; stock's servers on PORT+1..PORT+3 "
                         "(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of three bursts (big, mid, small) (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=64,
                    help="requests of a burst to its model (default: %(default)s)")
    ap.add_argument("--background", type=int, default=4,
                    help="requests to each of the other two models during a burst "
                         "(default: %(default)s)")
    ap.add_argument("--prompt", type=span, default=(2000, 6000), metavar="MIN:MAX",
                    help="prompt tokens, uniform (default: 2000:6000)")
    ap.add_argument("--output", type=span, default=(256, 512), metavar="MIN:MAX",
                    help="output tokens, uniform, ignore_eos (default: 256:512)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="every model's --max-model-len (default: %(default)s)")
    ap.add_argument("--stock-util", type=float, default=0.28,
                    help="each stock server's --gpu-memory-utilization (default: %(default)s)")
    ap.add_argument("--burst-timeout", type=float, default=180.0,
                    help="the most seconds one burst may take (default: %(default)s)")
    ap.add_argument("--start-timeout", type=float, default=420.0,
                    help="the most seconds a setup's start-up may take (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=36, help="the trace's seed (default: 36)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="every engine of both setups without torch.compile and CUDA graphs: "
                         "start-ups of ~30 s instead of ~75 s, slower decoding alike "
                         "(default: off)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU stand-ins: checks the orchestration, proves nothing "
                         "(default: off)")
    return ap.parse_args(argv)


# -- the trace ---------------------------------------------------------------------------------
# what makes the trace: two runs are compared burst by burst only where these are equal
TRACE_SETTINGS = ("rounds", "requests", "background", "prompt", "output", "seed")


def _plain(value):
    """A setting as JSON gives it back (a MIN:MAX pair is a list there)."""
    return list(value) if isinstance(value, tuple) else value


def trace(args) -> list[dict]:
    """The bursts, the same for every setup: per burst the busy model and, per model, its
    requests [(prompt token ids, max_tokens)]."""
    out = []
    names = list(MODELS)
    for r in range(args.rounds):
        for j, busy in enumerate(names):
            rng = random.Random(args.seed * 1000 + 10 * r + j)
            reqs = {}
            for name in names:
                n = args.requests if name == busy else args.background
                reqs[name] = [([rng.randrange(3, 32000) for _ in range(rng.randint(*args.prompt))],
                               rng.randint(*args.output)) for _ in range(n)]
            out.append({"round": r, "busy": busy, "requests": reqs})
    return out


async def run_mixed(ports: dict, burst: dict, timeout: float) -> dict:
    """A burst: every model's requests at once, each model's to its port."""
    names = list(burst["requests"])
    results = await asyncio.gather(*(run_burst(ports[n], n, burst["requests"][n], timeout)
                                     for n in names))
    return dict(zip(names, results))


# -- memory ------------------------------------------------------------------------------------
def get_json(url: str, timeout: float = 5.0) -> dict | None:
    import urllib.request

    try:
        return json.loads(urllib.request.urlopen(url, timeout=timeout).read())
    except (OSError, ValueError):
        return None


KV_KEYS = ("mapped_bytes", "used_bytes", "min_bytes", "max_bytes", "pool_bytes", "grows",
           "shrinks", "failed_grows", "bytes_returned")


def proxima_kv(port: int) -> dict:
    out = {}
    for name in MODELS:
        kv = get_json(f"http://127.0.0.1:{port}/engines/{name}/proxima/kv")
        out[name] = {k: kv.get(k) for k in KV_KEYS if k in kv} if isinstance(kv, dict) else None
    return out


# session id -> model: each server (stock) and each engine of proxima serve (its supervisor
# starts them in sessions of their own) is a session leader; vLLM and gunicorn retitle their
# processes (setproctitle), so the leaders' command lines are read as soon as they appear
LEADERS: dict[int, str] = {}


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        table[int(entry.name)] = (ppid, cmd)
    return table


def _session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def note_leaders(parent: int) -> None:
    """The children of ``parent`` that carry ``--served-model-name NAME``: sessions of NAME."""
    for pid, (ppid, cmd) in _procs().items():
        m = re.search(r"--served-model-name[= ](\S+)", cmd)
        if ppid == parent and m and pid not in LEADERS:
            LEADERS[pid] = m.group(1)


def model_of(pid: int, table) -> str | None:
    """The model of the session the process is in, else the one whose
    ``--served-model-name`` the process or an ancestor carries."""
    if _session(pid) in LEADERS:
        return LEADERS[_session(pid)]
    seen = 0
    while pid in table and seen < 64:
        m = re.search(r"--served-model-name[= ](\S+)", table[pid][1])
        if m:
            return m.group(1)
        pid, seen = table[pid][0], seen + 1
    return None


def gpu_memory() -> dict:
    """nvidia-smi's memory per process, summed per model (MiB); {"error": ...} without it."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:120]}
    table = _procs()
    per: dict = {}
    for line in text.strip().splitlines():
        try:
            pid, mib = (int(x.strip()) for x in line.split(","))
        except ValueError:
            continue
        name = model_of(pid, table) or f"pid {pid}"
        per[name] = per.get(name, 0) + mib
    return {"mib_per_model": per}


def ledger(dry_run: bool) -> list | dict:
    """``proxima kv --json`` without --url: every Proxima engine in the GPU ledgers (pid,
    model, KV mapped, non-KV bytes, bounds)."""
    if dry_run:
        return []
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROXIMA_")}
        env["PYTHONPATH"] = os.pathsep.join([str(kit.ROOT), env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-m", "proxima.cli", "kv", "--json"],
                              capture_output=True, text=True, timeout=60, cwd=kit.ROOT, env=env)
        return json.loads(done.stdout) if done.returncode == 0 else {
            "error": f"exit {done.returncode}: {done.stderr.strip()[-200:]}"}
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


class Sampler:
    """proxima's mapped bytes per model every 0.5 s during a burst: min, mean, max, and the
    series itself (seconds since the burst began, GiB), memory per model over time."""

    def __init__(self, port: int | None) -> None:
        self.port, self.seen = port, {n: [] for n in MODELS}
        self.series: dict = {n: [] for n in MODELS}
        self.began = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        if port is not None:
            self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            for name, kv in proxima_kv(self.port).items():
                if kv and kv.get("mapped_bytes") is not None:
                    self.seen[name].append(kv["mapped_bytes"])
                    self.series[name].append([round(time.perf_counter() - self.began, 2),
                                              round(kv["mapped_bytes"] / 2**30, 3)])
            self.done.wait(0.5)

    def stop(self) -> dict:
        self.done.set()
        if self.port is not None:
            self.thread.join(5)
        return {n: {"min": min(v), "mean": int(sum(v) / len(v)), "max": max(v), "n": len(v),
                    "series_s_gib": self.series[n]}
                for n, v in self.seen.items() if v}


# -- the setups --------------------------------------------------------------------------------
def common_args(args) -> list[str]:
    return ["--load-format", "dummy", "--tokenizer", kit.TOKENIZER, "--max-model-len",
            str(args.max_model_len)] + (["--enforce-eager"] if args.enforce_eager else [])


def models_file(out: kit.Out, args) -> Path:
    path = out.dir / ".three_models-models.json"
    path.write_text(json.dumps({"models": [
        {"name": n, "path": str(p), "args": common_args(args)} for n, p in MODELS.items()]},
        indent=2) + "\n")
    return path


def not_ready(log_text: str, code: int | None, waited: float, tail: str = "") -> str:
    """Why ``proxima serve --models`` is not serving: its exit, or the start-up budget run
    out; and which engines were ready by then (the endpoint's "model NAME: ready" lines),
    not the tail of the health polls."""
    done = [n for n in MODELS if f"model {n}: ready" in log_text]
    how = ("side by side" if "engines start side by side" in log_text else
           "one after another" if "engines start one after another" in log_text else
           "before any engine started")
    why = (f"exited with {code}: {tail}" if code is not None else
           f"not ready after {waited:.0f}s (the setup's start-up budget; its engines started "
           f"{how})")
    return (f"proxima serve --models {why}; ready: {', '.join(done) or 'none'}; not ready: "
            f"{', '.join(n for n in MODELS if n not in done) or 'none'}")


def start_proxima(out: kit.Out, budget: kit.Budget, args, env, result: dict,
                  reserve: float) -> dict:
    spec = models_file(out, args)
    result["models_file"] = json.loads(spec.read_text())
    if args.dry_run:
        cmd = [sys.executable, str(GPU / "fake_multi.py"), "--port", str(args.port),
               "--models", str(spec)]
    else:
        cmd = [sys.executable, "-m", "proxima.cli", "serve", "--host", "127.0.0.1", "--port",
               str(args.port), "--models", str(spec)]
    result["command"] = " ".join(cmd)
    out.log(f"  proxima: {result['command']}")
    t0 = time.monotonic()
    proc = kit.start(cmd, env, out.child_log("proxima"))
    def ready() -> bool:
        note_leaders(proc.pid)          # each engine as it starts, before it is retitled
        return healthy(args.port) or proc.poll() is not None

    waited = budget.cap(args.start_timeout, reserve=reserve)
    up = kit.wait_for(ready, waited, every=1.0)
    log = out.child_log("proxima")
    if not up or not healthy(args.port):
        code = proc.poll()
        raise RuntimeError(not_ready(log.read_text(errors="replace"), code, waited,
                                     kit.tail(log, 8) if code is not None else ""))
    result["start_s"] = round(time.monotonic() - t0, 1)
    result["elastic_sizing"] = [line.strip() for line in
                                log.read_text(errors="replace").splitlines()
                                if "elastic sizing:" in line]
    out.log(f"  proxima: healthy after {result['start_s']}s; "
            f"{len(result['elastic_sizing'])} 'elastic sizing:' line(s)")
    for line in result["elastic_sizing"]:
        out.log(f"    {line[-220:]}")
    return {n: args.port for n in MODELS}


def start_stock(out: kit.Out, budget: kit.Budget, args, env, result: dict,
                reserve: float) -> dict:
    ports = {n: args.port + 1 + i for i, n in enumerate(MODELS)}
    for i, (name, port) in enumerate(ports.items()):
        if args.dry_run:
            cmd = [sys.executable, str(GPU / "fake_server.py"), "--port", str(port),
                   "--served-model-name", name]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(MODELS[name]), "--served-model-name", name, "--host", "127.0.0.1",
                   "--port", str(port), "--gpu-memory-utilization", str(args.stock_util),
                   *common_args(args)]
        t0 = time.monotonic()
        out.log(f"  stock: starting {name} on port {port}")
        proc = kit.start(cmd, dict(env, PROXIMA_ALLOCATOR="0", VLLM_PORT=str(23000 + 100 * i)),
                         out.child_log(f"stock-{name}"))
        LEADERS[proc.pid] = name
        up = kit.wait_for(lambda: healthy(port) or proc.poll() is not None,
                          budget.cap(args.start_timeout, reserve=reserve), every=1.0)
        if not up or not healthy(port):
            raise RuntimeError(f"stock server {name} did not become healthy (exit "
                               f"{proc.poll()}): {kit.tail(out.child_log(f'stock-{name}'), 8)}")
        result[f"start_{name}_s"] = round(time.monotonic() - t0, 1)
        kv = re.findall(r"Available KV cache memory: ([\d.]+) GiB",
                        out.child_log(f"stock-{name}").read_text(errors="replace"))
        result[f"kv_{name}_gib"] = float(kv[-1]) if kv else None
        out.log(f"  stock: {name} healthy after {result[f'start_{name}_s']}s, KV "
                f"{result[f'kv_{name}_gib']} GiB")
    result["start_s"] = round(sum(result[f"start_{n}_s"] for n in MODELS), 1)
    return ports


def run_setup(out: kit.Out, budget: kit.Budget, name: str, args, env, bursts,
              later: float) -> dict:
    """Start a setup, run the trace on it. ``later``: the seconds the setups after it need
    at least (a start-up may not eat them)."""
    result: dict = {"setup": name, "bursts": []}
    out.record("setups", **{name: result})
    c = DRY_PLAN if args.dry_run else GPU_PLAN
    reserve = later + c["stop"] + c["burst"][name] * len(bursts) + 15
    ports = (start_proxima if name == "proxima" else start_stock)(out, budget, args, env, result,
                                                                  reserve)
    kv_port = args.port if name == "proxima" else None
    result["idle"] = {"gpu": gpu_memory(), **({"kv": proxima_kv(kv_port),
                                                "ledger": ledger(args.dry_run)} if kv_port else {})}
    out.log(f"  {name}: idle memory {json.dumps(result['idle'])}")
    out.record("setups", **{name: result})
    floor = c["burst"][name]
    per_model = {n: {"tokens": 0, "ttfts": [], "errors": 0, "requests": 0, "first_errors": []}
                 for n in MODELS}
    t_all = time.perf_counter()
    for i, burst in enumerate(bursts):
        left = budget.cap(args.burst_timeout,
                          reserve=15 + c["stop"] + floor * (len(bursts) - i - 1))
        if left < min(20, floor * 2):
            result["cut_short"] = f"only {budget.left():.0f}s left before burst {i + 1}"
            out.log(f"  {name}: cut short: {result['cut_short']}")
            break
        counts = {n: len(r) for n, r in burst["requests"].items()}
        out.log(f"  {name}: burst {i + 1}/{len(bursts)} on {burst['busy']}: {counts}")
        sampler = Sampler(kv_port)
        t0 = time.perf_counter()
        got = asyncio.run(run_mixed(ports, burst, left))
        row = {"busy": burst["busy"], "round": burst["round"],
               "wall_s": round(time.perf_counter() - t0, 3), "models": {}}
        capped = left < args.burst_timeout
        if capped and any(r.get("timed_out") for r in got.values()):
            # the budget, not the burst timeout, ended it: its unfinished requests are the
            # driver's, not the setup's errors, and the burst is compared with no other
            row["cut_by_budget"] = True
            for r in got.values():
                r["unfinished"] = r.get("timed_out", 0)
                r["errors"] -= r["unfinished"]
        if kv_port:
            row["mapped_during"] = sampler.stop()
            row["kv_after"] = proxima_kv(kv_port)
            row["ledger_after"] = ledger(args.dry_run)
        row["gpu_after"] = gpu_memory()
        for n, r in got.items():
            ttfts = r.pop("ttfts")
            acc = per_model[n]
            acc["tokens"] += r["output_tokens"]
            acc["ttfts"] += ttfts
            acc["errors"] += r["errors"]
            acc["requests"] += r["requests"]
            acc["first_errors"] = (acc["first_errors"] + r["first_errors"])[:5]
            row["models"][n] = {**r, "ttfts": [round(t, 4) for t in ttfts]}
        result["bursts"].append(row)
        out.log(f"  {name}: burst {i + 1} {row['wall_s']}s, tok/s "
                + ", ".join(f"{n} {r['output_tokens_per_s']}" for n, r in got.items())
                + f", errors {sum(r['errors'] for r in got.values())}"
                + (f", {sum(r['unfinished'] for r in got.values())} unfinished when the budget "
                   f"ran out" if row.get("cut_by_budget") else ""))
        out.record("setups", **{name: result})
        if row.get("cut_by_budget"):
            result["cut_short"] = f"the budget ended burst {i + 1} before all its requests did"
            break
    wall = time.perf_counter() - t_all
    total = sum(a["tokens"] for a in per_model.values())
    result["trace_wall_s"] = round(wall, 2)
    result["aggregate_output_tokens_per_s"] = round(total / wall, 1) if wall and total else None
    result["errors"] = sum(a["errors"] for a in per_model.values())
    result["per_model"] = {}
    for n, a in per_model.items():
        result["per_model"][n] = {
            "requests": a["requests"], "output_tokens": a["tokens"],
            "output_tokens_per_s": round(a["tokens"] / wall, 1) if wall else None,
            **percentiles(a["ttfts"]),
            "errors": a["errors"], "first_errors": a["first_errors"]}
    out.record("setups", **{name: result})
    return result


def descendants(roots) -> set[int]:
    """Every process below ``roots`` (pids), by /proc's parent links."""
    table = _procs()
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        for child, (ppid, _) in table.items():
            if ppid == pid and child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop_setup(out: kit.Out, dry_run: bool) -> None:
    """End a setup: its servers (SIGTERM to their groups, 45 s of grace: proxima serve stops
    its engines one by one), then any process they started that outlived them (SIGKILL: the
    engines live in groups of their own), then wait until nvidia-smi lists no compute
    process (at most 90 s), so that the next setup finds the GPU empty."""
    import signal

    procs = list(kit._children)
    below = descendants(p.pid for p in procs)
    for proc in procs:
        kit.stop(proc, timeout=45)
    kit.kill_all()
    table = _procs()
    strays = sorted(pid for pid in below if pid in table)
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if strays:
        out.log(f"  killed {len(strays)} process(es) left by the setup's servers: {strays[:8]}")
    if dry_run:
        return

    def apps():
        got = gpu_memory()
        return None if "error" in got else got["mib_per_model"]

    if kit.wait_for(lambda: apps() == {} or apps() is None, 90, every=2.0) is None:
        out.log(f"  the GPU still lists compute processes 90 s after the stop: {apps()}")


def setup_seconds(name: str, args) -> tuple[float, str]:
    c = DRY_PLAN if args.dry_run else GPU_PLAN
    one = c["start_eager" if args.enforce_eager else "start"][name]
    start = c["before"].get(name, 0.0) + one * (1 if c["side_by_side"][name] else len(MODELS))
    bursts = len(MODELS) * args.rounds
    total = start + bursts * c["burst"][name] + c["stop"]
    return total, (f"{name} {total:.0f}s ({start:.0f}s of start-up, {bursts} bursts x "
                   f"{c['burst'][name]:.0f}s, {c['stop']:.0f}s stop)")


def gpu_max(r: dict) -> dict | None:
    """Per model, the most nvidia-smi memory (MiB) seen after a burst."""
    top: dict = {}
    for b in r.get("bursts", []):
        for n, mib in ((b.get("gpu_after") or {}).get("mib_per_model") or {}).items():
            top[n] = max(top.get(n, 0), mib)
    return top or None


def comparable(burst: dict) -> bool:
    """A burst every request of which ended (done or failed) within it: one the budget cut,
    or one with requests still running at the burst timeout, measured only a part."""
    return not burst.get("cut_by_budget") and not any(
        m.get("timed_out", m.get("first_errors", []).count(TIMED_OUT))
        for m in burst["models"].values())


def matched(p: dict, k: dict) -> dict:
    """Proxima against stock on the bursts both ran in full (the trace is the same: burst i
    is the same requests on both): aggregate output tok/s, its ratio, per busy model the
    ratio of its bursts' tok/s and its TTFT p50/p99, errors on those bursts."""
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(p.get("bursts", []), k.get("bursts", [])))
             if comparable(a) and comparable(b)]
    left = [i + 1 for i in range(max(len(p.get("bursts", [])), len(k.get("bursts", []))))
            if i not in {j for j, _, _ in pairs}]
    if not pairs:
        return {"bursts": 0, "ratio": None, "left_out": left}

    def tokens(b):
        return sum(m["output_tokens"] for m in b["models"].values())

    def rate(bursts):
        return sum(tokens(b) for b in bursts) / sum(b["wall_s"] for b in bursts)

    out = {"bursts": len(pairs), "left_out": left,
           "tok_s": {"proxima": round(rate([a for _, a, _ in pairs]), 1),
                     "stock": round(rate([b for _, _, b in pairs]), 1)},
           "errors": {"proxima": sum(m["errors"] for _, a, _ in pairs for m in a["models"].values()),
                      "stock": sum(m["errors"] for _, _, b in pairs for m in b["models"].values())},
           "busy": {}}
    out["ratio"] = round(out["tok_s"]["proxima"] / out["tok_s"]["stock"], 3)
    for n in MODELS:
        mine = [(a, b) for _, a, b in pairs if a["busy"] == n]
        if not mine:
            continue
        row = {"bursts": len(mine),
               "ratio": round(rate([a for a, _ in mine]) / rate([b for _, b in mine]), 3)}
        for side, j in (("proxima", 0), ("stock", 1)):
            row.update({f"{side}_{k}": v for k, v in
                        ttft_figures([pair[j]["models"][n] for pair in mine]).items()})
        out["busy"][n] = row
    return out


def pooled(runs: dict) -> dict:
    """Several runs of a setup (rounds in ABBA order, over device calls): ``runs`` maps a setup
    to [(label, its result)]. A burst is keyed by (round, busy model), the same requests in
    every run (each burst's seed is its own). Per setup, every burst it ran in full at a key
    that both setups ran in full at least once: pooled output tok/s (tokens over wall time),
    the pooled ratio, each busy model's ratio and pooled TTFTs; every proxima run against
    every stock run on their common keys, and each setup's runs against each other (its
    spread); per run, the bursts it did not run in full."""
    def full(result):
        return {(b["round"], b["busy"]): b for b in result.get("bursts", []) if comparable(b)}

    def rate(bursts):
        bursts = list(bursts)
        return (sum(m["output_tokens"] for b in bursts for m in b["models"].values())
                / sum(b["wall_s"] for b in bursts))

    per = {s: [(label, full(r), r) for label, r in runs.get(s, [])] for s in SETUPS}
    have = {s: set().union(*(set(f) for _, f, _ in per[s])) for s in SETUPS}
    keys = sorted(have["proxima"] & have["stock"])
    out = {"runs": {s: [{"run": label, "full_bursts": len(f),
                         "not_full": [i + 1 for i, b in enumerate(r.get("bursts", []))
                                      if not comparable(b)]} for label, f, r in per[s]]
                    for s in SETUPS},
           "keys": [f"round {r + 1} {busy}" for r, busy in keys]}
    if not keys:
        out["ratio"] = None
        return out
    chosen = {s: [b for _, f, _ in per[s] for k, b in f.items() if k in keys] for s in SETUPS}
    out["bursts"] = {s: len(chosen[s]) for s in SETUPS}
    out["tok_s"] = {s: round(rate(chosen[s]), 1) for s in SETUPS}
    out["ratio"] = round(out["tok_s"]["proxima"] / out["tok_s"]["stock"], 3)
    out["errors"] = {s: sum(m["errors"] for b in chosen[s] for m in b["models"].values())
                     for s in SETUPS}
    runs_of = {s: [(label, f) for label, f, _ in per[s]] for s in SETUPS}
    out["pairs"] = kit.run_pairs(("proxima", runs_of["proxima"]), ("stock", runs_of["stock"]),
                                 rate)
    out["spread"] = {s: kit.run_spread(runs_of[s], rate, lambda k, b: k in keys)
                     for s in SETUPS}
    out["busy"] = {}
    for n in MODELS:
        mine = {s: [b for b in chosen[s] if b["busy"] == n] for s in SETUPS}
        if not (mine["proxima"] and mine["stock"]):
            continue
        row = {"bursts": {s: len(mine[s]) for s in SETUPS},
               "ratio": round(rate(mine["proxima"]) / rate(mine["stock"]), 3)}
        for s in SETUPS:
            row.update({f"{s}_{k}": v for k, v in
                        ttft_figures([b["models"][n] for b in mine[s]]).items()})
        out["busy"][n] = row
    return out


def summarize(results: dict, planned: int | None = None) -> dict:
    s = {}
    for name, r in results.items():
        s[name] = {"tok_s": r.get("aggregate_output_tokens_per_s"), "errors": r.get("errors"),
                   "start_s": r.get("start_s"), "bursts": len(r.get("bursts", [])),
                   "per_model_tok_s": {n: m["output_tokens_per_s"]
                                       for n, m in (r.get("per_model") or {}).items()},
                   "ttft_p50_s": {n: m["ttft_p50_s"] for n, m in (r.get("per_model") or {}).items()},
                   "ttft_p99_s": {n: m["ttft_p99_s"] for n, m in (r.get("per_model") or {}).items()},
                   "idle_gpu_mib": (r.get("idle") or {}).get("gpu", {}).get("mib_per_model"),
                   "gpu_mib_after_bursts_max": gpu_max(r)}
        if r.get("cut_short"):
            s[name]["cut_short"] = r["cut_short"]
        if name == "proxima":
            s[name]["kv_bounds"] = {n: [(kv or {}).get("min_bytes"), (kv or {}).get("max_bytes")]
                                    for n, kv in ((r.get("idle") or {}).get("kv") or {}).items()}
            s[name]["idle_kv_mapped"] = {n: (kv or {}).get("mapped_bytes") for n, kv in
                                         ((r.get("idle") or {}).get("kv") or {}).items()}
            s[name]["kv_max_mapped_during_bursts"] = {
                n: max([b["mapped_during"][n]["max"] for b in r.get("bursts", [])
                        if n in (b.get("mapped_during") or {})], default=None) for n in MODELS}
        else:
            s[name]["kv_gib"] = {n: r.get(f"kv_{n}_gib") for n in MODELS}
    p, k = results.get("proxima"), results.get("stock")
    if p and k and p.get("bursts") and k.get("bursts"):
        # the ratio: the bursts both setups ran in full, pair by pair (a setup cut short by
        # the budget is compared on the bursts it finished, not on tok/s over its own part)
        s["matched"] = matched(p, k)
        s["ratio"] = s["matched"]["ratio"]
        s["complete"] = s["matched"]["bursts"] == (planned or max(len(p["bursts"]),
                                                                  len(k["bursts"])))
    else:
        s["ratio"] = None
    if s["ratio"] is None:
        s["why"] = "no burst that both setups ran in full: see three_models.json"
    return s


def main() -> int:
    args = parse()
    order = [n for n in args.only.split(",") if n and args.only != "none"]
    unknown = sorted(set(order) - set(SETUPS))
    if unknown or not (order or args.only == "none"):
        print(f"three_models: unknown setup(s) {', '.join(unknown) or '(none given)'} in "
              f"--only: give proxima and/or stock (or none, with --with)", file=sys.stderr)
        return 2
    if not order and not args.with_files:
        print("three_models: --only none runs nothing: give the earlier runs to summarize "
              "with --with FILE", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.requests < 1 or args.background < 0:
        print(f"three_models: --rounds {args.rounds}, --requests {args.requests}, --background "
              f"{args.background}: give at least 1, 1 and 0", file=sys.stderr)
        return 2
    if args.prompt[1] + args.output[1] > args.max_model_len:
        print(f"three_models: --max-model-len {args.max_model_len} is shorter than the longest "
              f"request ({args.prompt[1]} + {args.output[1]} tokens): give at least "
              f"{args.prompt[1] + args.output[1]}, or a shorter --prompt/--output", file=sys.stderr)
        return 2
    if not 0 < args.stock_util <= 0.95 / len(MODELS) + 1e-9 and "stock" in order:
        print(f"three_models: --stock-util {args.stock_util} x {len(MODELS)} servers asks for "
              f"{len(MODELS) * args.stock_util:.2f} of the GPU: give at most "
              f"{0.95 / len(MODELS):.3f}", file=sys.stderr)
        return 2
    earlier, runs = {}, {s: [] for s in SETUPS}
    # a trace of fewer rounds is the start of one of more (each burst is seeded by its round
    # and its model): runs of different --rounds pool on the bursts they share
    same = [k for k in TRACE_SETTINGS if k != "rounds"]
    mine = None if not order else {k: _plain(getattr(args, k)) for k in same}
    most_rounds = args.rounds if order else 0
    for path in args.with_files:
        data = kit.read_json(Path(path))
        if not data or "setups" not in data.get("subproofs", {}):
            print(f"three_models: --with {path}: not a three_models.json with "
                  f"setups (no file, or no 'subproofs.setups' in it)", file=sys.stderr)
            return 2
        theirs, diff = kit.settings_diff(data, same, mine, _plain)
        mine = mine or theirs
        if diff:
            print(f"three_models: --with {path}: another trace ({diff}): its bursts are not "
                  f"these; give the same trace options, or run both setups anew", file=sys.stderr)
            return 2
        most_rounds = max(most_rounds, int((data.get("settings") or {}).get("rounds") or 1))
        earlier.update({k: v for k, v in data["subproofs"]["setups"].items()
                        if k in SETUPS and k not in order and k not in earlier})
        ran = str((data.get("settings") or {}).get("only") or "").split(",")
        for k, v in data["subproofs"]["setups"].items():
            if k in SETUPS and k in ran:        # not the setups it took from its own --with
                runs[k].append((path, v))
    plan = [setup_seconds(n, args) for n in order]
    refused = kit.budget_refusal(
        "three_models", args.budget, ", ".join(order), plan,
        f"{'' if args.enforce_eager else '--enforce-eager, '}fewer --rounds, or one setup in "
        f"--only (then the other with --with)")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    out = kit.Out(Path(args.out), "three_models")
    budget = kit.Budget(args.budget)
    env = kit.engine_env(Path(os.environ.get("VLLM_CACHE_ROOT", "/root/.cache/vllm-proof")))
    if not order:           # --only none: the trace is the earlier runs'
        for k, v in mine.items():
            setattr(args, k, tuple(v) if isinstance(v, list) else v)
        args.rounds = most_rounds
    bursts = trace(args)
    out.log(f"three models ({', '.join(f'{n}={p.name}' for n, p in MODELS.items())}), setups "
            f"{', '.join(order) or 'none run (a summary of --with)'}: budget {args.budget:.0f}s, "
            f"{args.rounds} round(s) of 3 bursts, "
            f"{args.requests} requests to the busy model + {args.background} to each other, "
            f"prompts {args.prompt[0]}-{args.prompt[1]}, outputs {args.output[0]}-"
            f"{args.output[1]} tokens, stock util {args.stock_util}"
            f"{', eager' if args.enforce_eager else ''}")
    if plan:
        out.log(f"  time plan, at least: {'; '.join(p[1] for p in plan)}")
    settings = dict(vars(args))
    out.results["settings"] = settings
    results = dict(earlier)
    if earlier:
        out.record("setups", **earlier)
        out.log(f"  from {', '.join(args.with_files)}: {', '.join(earlier)}")
    for i, (name, (setup_need, _)) in enumerate(zip(order, plan)):
        if budget.left() < setup_need:
            out.record("skipped", **{name: f"only {budget.left():.0f}s left, the setup needs "
                                     f"at least {setup_need:.0f}s"})
            out.log(f"  {name}: skipped, only {budget.left():.0f}s left")
            continue
        try:
            results[name] = run_setup(out, budget, name, args, env, bursts,
                                      sum(p[0] for p in plan[i + 1:]))
        except Exception as exc:  # noqa: BLE001 - the other setup still runs
            import traceback

            out.record("errors", **{name: f"{type(exc).__name__}: {exc}",
                                    f"{name}_traceback": traceback.format_exc()[-2000:]})
            out.log(f"  {name}: FAILED: {exc}")
        finally:
            stop_setup(out, args.dry_run)
    summary = summarize(results, len(bursts))
    for name in order:
        if name in results:
            runs[name].append(("this run", results[name]))
    if any(len(v) > 1 for v in runs.values()):
        summary["pooled"] = pooled(runs)
        out.log(f"  pooled over {', '.join(f'{len(v)} {s} run(s)' for s, v in runs.items())}: "
                f"ratio {summary['pooled']['ratio']}")
    out.record("summary", **summary)
    line = f"three models: {json.dumps(summary)}"
    out.log(line)
    out.results["summary_lines"] = [line]
    out.results["wall_s"] = round(budget.elapsed(), 1)
    for path in out.dir.glob(".three_models-*"):
        path.unlink()
    out.finish()
    ok = summary.get("ratio") is not None and all(
        r.get("errors") == 0 and not r.get("cut_short") for r in results.values())
    if "pooled" in summary:     # runs over calls: the pooled figure is the one
        pool = summary["pooled"]
        ok = pool["ratio"] is not None and not any(pool["errors"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
