"""Router comparison for issue 36: vLLM's ``vllm-router`` against Proxima's own router
(proxima/serve/router.py), over stand-in OpenAI engines on 127.0.0.1, with bounded request
counts. Results: docs/results/router/.

    python -m tests.bench.router_compare --vllm-router-path /tmp/vr/site \\
        [--requests 300] [--streams 60] [--concurrency 16] [--rounds 2] [--json OUT.json]
    python -m tests.bench.router_compare --vllm-router-path /tmp/vr/site --regular-mode-only

``--vllm-router-path``: a directory holding the ``vllm_router`` package (``pip install
--no-deps --target DIR vllm-router==0.1.17 orjson``); without it only ours and the direct
baseline run.

Engines: two pairs of FakeOpenAIServer (tests/bench/conftest.py), models ``alpha``/``beta``
with no delay (latency) and ``alpha-s``/``beta-s`` with 10 ms between tokens (streaming).
Each engine answers 404 for a model that is not its own, so a request routed to the wrong
engine is counted. Targets: ``direct`` (each request sent to its model's engine itself),
``proxima`` (python -m proxima.serve.router), ``vllm-router`` (``--enable-igw``, the engines
registered with their model_id through ``POST /workers``: its regular mode ignores
``model``). Measured:

1. latency: sequential ``/v1/completions`` with max_tokens=1, alternating the two models:
   p50/p90/p99 of the whole answer, and the overhead over direct;
2. streaming: sequential streams of 32 tokens, 10 ms apart: time to the first token
   (TTFT), to the end, and the chunks the client read as separate arrivals (unbuffered:
   about 32; buffered: 1-2);
3. concurrent: ``--concurrency`` streams at once, ``--streams`` x 4 a round, ``--rounds``
   rounds per target: requests/s of each round, TTFT p50/p99;

The sequential parts interleave the targets request by request, so that the machine's
background load falls on each alike.
4. behaviour: an unknown model, ``/v1/models``, ``/health`` with one engine down, ``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.bench.conftest import FakeOpenAIServer, ServerConfig

REPO = Path(__file__).resolve().parents[2]
HEALTH = {"/health": (200, b"", "text/plain")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(url: str, timeout: float = 60, proc: subprocess.Popen | None = None) -> None:
    """Until ``url``/health answers; stops at once if ``proc`` (the server's process) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: its process exited ({proc.returncode}) before it listened")
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not start listening in {timeout} s")


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary(values):
    return {"n": len(values), "p50_ms": round(pct(values, 50) * 1e3, 3),
            "p90_ms": round(pct(values, 90) * 1e3, 3), "p99_ms": round(pct(values, 99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(values) * 1e3, 3)}


def one_stream(client: httpx.Client, url: str, model: str, max_tokens: int):
    """(status, ttft, total, arrivals, tokens): arrivals = reads that brought data."""
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    ttft, arrivals, tokens = None, 0, 0
    with client.stream("POST", url + "/v1/completions", json=body) as answer:
        status = answer.status_code
        for chunk in answer.iter_raw():
            if not chunk:
                continue
            arrivals += 1
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens += chunk.count(b'"text"')
    total = time.perf_counter() - start
    return status, ttft if ttft is not None else total, total, arrivals, tokens


def run_all(targets, args, out):
    """targets: name -> {model: base URL}. The sequential parts interleave the targets
    request by request (the machine's background load falls on each alike); the
    concurrent part runs each target in turn, ``--rounds`` times, alternating the order."""
    names = list(targets)
    clients = {name: httpx.Client(timeout=60) for name in names}
    lat = {n: [] for n in names}
    stream = {n: {"ttft": [], "total": [], "arrivals": [], "tokens": []} for n in names}
    bad = {n: {"latency": 0, "stream": 0, "concurrent": 0} for n in names}
    try:
        for name in names:                                  # warm-up, not counted
            for _ in range(10):
                one_stream(clients[name], targets[name]["alpha"], "alpha", 1)
        for i in range(args.requests):
            model = ["alpha", "beta"][i % 2]
            for name in names[i % len(names):] + names[:i % len(names)]:
                status, _, total, _, _ = one_stream(clients[name], targets[name][model], model, 1)
                bad[name]["latency"] += status != 200
                lat[name].append(total)
        for i in range(args.streams):
            model = ["alpha-s", "beta-s"][i % 2]
            for name in names[i % len(names):] + names[:i % len(names)]:
                status, t1, t, n, k = one_stream(clients[name], targets[name][model], model, 32)
                bad[name]["stream"] += status != 200
                for key, value in (("ttft", t1), ("total", t), ("arrivals", n), ("tokens", k)):
                    stream[name][key].append(value)
    finally:
        for client in clients.values():
            client.close()
    conc = {n: {"rps": [], "ttft": []} for n in names}
    n_conc = args.streams * 4
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            urls = targets[name]

            def worker(i, urls=urls):
                with httpx.Client(timeout=60) as c:
                    model = ["alpha-s", "beta-s"][i % 2]
                    return one_stream(c, urls[model], model, 32)

            start = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                done = list(pool.map(worker, range(n_conc)))
            wall = time.perf_counter() - start
            conc[name]["rps"].append(round(n_conc / wall, 2))
            conc[name]["ttft"] += [d[1] for d in done]
            bad[name]["concurrent"] += sum(d[0] != 200 for d in done)
    for name in names:
        st = stream[name]
        out[name] = {
            "latency": {**summary(lat[name]), "errors_or_misrouted": bad[name]["latency"]},
            "stream": {"ttft": summary(st["ttft"]), "total": summary(st["total"]),
                       "arrivals_per_stream_median": statistics.median(st["arrivals"]),
                       "tokens_per_stream_median": statistics.median(st["tokens"]),
                       "errors_or_misrouted": bad[name]["stream"]},
            "concurrent": {"requests_per_round": n_conc, "concurrency": args.concurrency,
                           "rounds": args.rounds, "requests_per_s": conc[name]["rps"],
                           "ttft": summary(conc[name]["ttft"]),
                           "errors_or_misrouted": bad[name]["concurrent"]}}


def behaviour(url: str) -> dict:
    def show(answer):
        text = answer.text
        return {"status": answer.status_code, "body": text[:300]}

    with httpx.Client(timeout=10) as c:
        return {
            "unknown_model": show(c.post(url + "/v1/completions",
                                         json={"model": "gamma", "prompt": "x", "max_tokens": 1})),
            "v1_models": show(c.get(url + "/v1/models")),
            "metrics": show(c.get(url + "/metrics")),
        }


def regular_mode(path: str) -> str:
    """vllm-router's regular mode (``--worker-urls``) over two engines of different models:
    where do 8 requests for ``alpha`` go? (round robin: half to beta's engine, which
    answers 404 for a model not its own)."""
    alpha = FakeOpenAIServer(ServerConfig(models=("alpha",), routes=HEALTH)).start()
    beta = FakeOpenAIServer(ServerConfig(models=("beta",), routes=HEALTH)).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port",
         str(port), "--worker-urls", alpha.url, beta.url, "--policy", "round_robin",
         "--log-level", "warning"], env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vllm-router (regular mode) did not become healthy")
            time.sleep(0.2)
        statuses = [complete_status(url, "alpha") for _ in range(8)]
        models = httpx.get(url + "/v1/models", timeout=10).text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        alpha.stop()
        beta.stop()
    return (f"vllm-router regular mode (--worker-urls alpha's and beta's engines, round_robin): "
            f"8 requests for model alpha -> statuses {statuses}; alpha's engine served "
            f"{len(alpha.state.bodies)}, the others went to beta's engine, which answers 404 "
            f"for a model not its own; GET /v1/models -> {' '.join(models.split())[:200]}")


def complete_status(url: str, model: str) -> int:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": model, "prompt": "x", "max_tokens": 1}).status_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-router-path")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--regular-mode-only", action="store_true",
                        help="only show where vllm-router's regular mode sends requests")
    args = parser.parse_args()
    if args.regular_mode_only:
        if not args.vllm_router_path:
            raise SystemExit("--regular-mode-only needs --vllm-router-path")
        print(regular_mode(args.vllm_router_path))
        return 0
    for value, bound in ((args.requests, 5000), (args.streams, 1000), (args.concurrency, 64),
                         (args.rounds, 10)):
        if not 1 <= value <= bound:
            raise SystemExit(f"counts are bounded: 1..{bound}, got {value}")
    engines = {
        "alpha": FakeOpenAIServer(ServerConfig(models=("alpha",), delay=0.0, routes=HEALTH)),
        "beta": FakeOpenAIServer(ServerConfig(models=("beta",), delay=0.0, routes=HEALTH)),
        "alpha-s": FakeOpenAIServer(ServerConfig(models=("alpha-s",), delay=0.01, routes=HEALTH)),
        "beta-s": FakeOpenAIServer(ServerConfig(models=("beta-s",), delay=0.01, routes=HEALTH)),
    }
    for server in engines.values():
        server.start()
    procs = []
    out = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "platform": platform.platform()},
           "args": vars(args)}
    try:
        ours_port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "proxima.serve.router", "--port", str(ours_port),
             *[a for m, s in engines.items() for a in ("--backend", f"{m}={s.url}")]], env=env))
        ours = f"http://127.0.0.1:{ours_port}"
        wait_listening(ours)
        targets = {"direct": {m: s.url for m, s in engines.items()},
                   "proxima": {m: ours for m in engines}}
        if args.vllm_router_path:
            vr_port = free_port()
            vr_env = {**os.environ, "PYTHONPATH": args.vllm_router_path}
            log = open(Path(args.json).with_suffix(".vllm-router.log") if args.json
                       else os.devnull, "w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
                 "--port", str(vr_port), "--enable-igw", "--policy", "round_robin",
                 "--log-level", "warning"], env=vr_env, stdout=log, stderr=subprocess.STDOUT))
            vr = f"http://127.0.0.1:{vr_port}"
            wait_listening(vr)
            for model, server in engines.items():
                answer = httpx.post(vr + "/workers", json={"url": server.url, "model_id": model},
                                    timeout=10)
                answer.raise_for_status()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                listed = httpx.get(vr + "/workers", timeout=5).json().get("workers", [])
                if len(listed) == 4 and all(w.get("is_healthy") for w in listed):
                    break
                time.sleep(0.2)
            targets["vllm-router"] = {m: vr for m in engines}
        deadline = time.monotonic() + 30                       # ours: every engine ready
        while httpx.get(ours + "/health", timeout=5).status_code != 200:
            if time.monotonic() > deadline:
                raise SystemExit("our router did not see every engine healthy")
            time.sleep(0.1)
        out["results"] = {}
        out["load_before"] = os.getloadavg()
        run_all(targets, args, out["results"])
        out["load_after"] = os.getloadavg()
        out["behaviour"] = {name: behaviour(urls["alpha"]) for name, urls in targets.items()
                            if name != "direct"}
        # /health with one engine down: stop beta's engine
        engines["beta"].stop()
        time.sleep(3)
        out["health_with_beta_down"] = {
            name: {"status": (a := httpx.get(urls["alpha"] + "/health", timeout=10)).status_code,
                   "body": a.text[:300]}
            for name, urls in targets.items() if name != "direct"}
        out["request_to_beta_while_down"] = {
            name: {"status": (a := httpx.post(urls["beta"] + "/v1/completions", timeout=30,
                                              json={"model": "beta", "prompt": "x",
                                                    "max_tokens": 1})).status_code,
                   "body": a.text[:300]}
            for name, urls in targets.items() if name != "direct"}
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for name, server in engines.items():
            if name != "beta":
                server.stop()
    text = json.dumps(out, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(table(out))
    return 0


def table(out) -> str:
    lines = [f"machine: {out['machine']}; load average before {out['load_before'][0]:.1f}, "
             f"after {out['load_after'][0]:.1f}", "",
             "| target | latency p50 / p90 / p99 ms | stream TTFT p50 / p99 ms | stream total p50 ms "
             "| reads per 32-token stream | concurrent req/s (rounds) | concurrent TTFT p50 / p99 ms "
             "| errors or misrouted |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in out["results"].items():
        lat, st, co = r["latency"], r["stream"], r["concurrent"]
        errors = lat["errors_or_misrouted"] + st["errors_or_misrouted"] + co["errors_or_misrouted"]
        lines.append(
            f"| {name} | {lat['p50_ms']:.2f} / {lat['p90_ms']:.2f} / {lat['p99_ms']:.2f} "
            f"| {st['ttft']['p50_ms']:.2f} / {st['ttft']['p99_ms']:.2f} | {st['total']['p50_ms']:.1f} "
            f"| {st['arrivals_per_stream_median']:g} | {', '.join(map(str, co['requests_per_s']))} "
            f"| {co['ttft']['p50_ms']:.1f} / {co['ttft']['p99_ms']:.1f} | {errors} |")
    lines.append("")
    for key in ("behaviour", "health_with_beta_down", "request_to_beta_while_down"):
        for name, value in out.get(key, {}).items():
            items = value.items() if key == "behaviour" else [("", value)]
            for what, answer in items:
                body = " ".join(answer["body"].split())[:160]
                lines.append(f"{name} {key}{' ' + what if what else ''}: {answer['status']} {body}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
