"""How many streamed chunks a second Proxima's router (proxima/serve/router.py) passes on, and
the CPU it spends on each: many concurrent streams from a stand-in engine that emits one SSE
chunk per request per "step" (as vLLM's API server does), sent direct and through the router
in ABBA order. Results: docs/results/router/ (stream-rate.*).

    python -m tests.bench.router_stream_rate [--streams 400] [--tokens 256] [--step-ms 40]
        [--rounds 2] [--json OUT.json]

The stand-in engine (``--engine PORT``, aiohttp) keeps a fixed clock: chunk i of a stream is
sent at i x step after the request (lateness is not made up), so the engine alone would end
every stream after tokens x step. Measured per run: the wall from the first request to the
last stream's end, chunks a second, the streams' TTFT p50/max, and for the router's runs the
router process's CPU seconds (user + system, /proc) per 1,000 chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.router_compare import free_port, wait_listening

REPO = Path(__file__).resolve().parents[2]
CHUNK = ("data: " + json.dumps({
    "id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
    "created": 1, "model": "A", "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                             "finish_reason": None, "stop_reason": None}],
    "usage": None}) + "\n\n").encode()


def engine(port: int, step_s: float, tokens: int) -> None:
    from aiohttp import web

    async def completions(request):
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        t0 = time.monotonic()
        for i in range(tokens):
            await asyncio.sleep(max(0.0, t0 + (i + 1) * step_s - time.monotonic()))
            await resp.write(CHUNK)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request):
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/health", health)])
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def load(url: str, streams: int) -> dict:
    import aiohttp

    done: list[tuple[float, float, int]] = []

    async def one(session) -> None:
        t0, first, n = time.monotonic(), None, 0
        async with session.post(url + "/v1/completions", json={
                "model": "A", "prompt": "x", "max_tokens": 1, "stream": True}) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    n += 1
                    first = first if first is not None else time.monotonic() - t0
        done.append((first, time.monotonic() - t0, n))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(one(session) for _ in range(streams)))
        wall = time.monotonic() - t0
    ttft = sorted(d[0] for d in done)
    chunks = sum(d[2] for d in done)
    return {"wall_s": round(wall, 3), "chunks": chunks, "chunks_per_s": round(chunks / wall),
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_max_s": round(ttft[-1], 4)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=400, help="concurrent streams (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=256, help="chunks a stream (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=40.0,
                    help="the engine's step: one chunk per stream each (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="ABBA rounds: direct, router, router, direct, ... (default: %(default)s)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--engine", type=int, help=argparse.SUPPRESS)   # the stand-in engine
    args = ap.parse_args(argv)
    if args.engine:
        engine(args.engine, args.step_ms / 1000, args.tokens)
        return 0
    if min(args.streams, args.tokens, args.rounds) < 1 or args.step_ms <= 0:
        ap.error(f"--streams, --tokens and --rounds want 1 or more and --step-ms more than 0; "
                 f"got {args.streams}, {args.tokens}, {args.rounds}, {args.step_ms}")
    e_port, r_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = []
    try:
        eng = subprocess.Popen([sys.executable, "-m", "tests.bench.router_stream_rate",
                                "--engine", str(e_port), "--tokens", str(args.tokens),
                                "--step-ms", str(args.step_ms)], cwd=REPO, env=env)
        procs.append(eng)
        wait_listening(f"http://127.0.0.1:{e_port}", 30, eng)
        router = subprocess.Popen([sys.executable, "-m", "proxima.serve.router", "--backend",
                                   f"A=http://127.0.0.1:{e_port}", "--port", str(r_port)],
                                  cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        procs.append(router)
        wait_listening(f"http://127.0.0.1:{r_port}", 30, router)
        order = [t for r in range(args.rounds)
                 for t in (("direct", "router") if r % 2 == 0 else ("router", "direct"))]
        runs = []
        for i, target in enumerate(order):
            port = r_port if target == "router" else e_port
            before = cpu_seconds(router.pid)
            result = {"target": target, **asyncio.run(load(f"http://127.0.0.1:{port}",
                                                           args.streams))}
            if target == "router":
                result["router_cpu_ms_per_1k_chunks"] = round(
                    1e6 * (cpu_seconds(router.pid) - before) / result["chunks"], 1)
            runs.append(result)
            print(f"[{i + 1}/{len(order)}] {json.dumps(result)}", flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
    ideal = args.tokens * args.step_ms / 1000
    summary = {}
    for target in ("direct", "router"):
        mine = [r for r in runs if r["target"] == target]
        summary[target] = {"wall_s": [r["wall_s"] for r in mine],
                           "chunks_per_s": [r["chunks_per_s"] for r in mine],
                           "ttft_p50_s": [r["ttft_p50_s"] for r in mine]}
    summary["router_over_direct_wall"] = round(
        sum(summary["router"]["wall_s"]) / sum(summary["direct"]["wall_s"]), 3)
    summary["router_cpu_ms_per_1k_chunks"] = [r["router_cpu_ms_per_1k_chunks"] for r in runs
                                              if "router_cpu_ms_per_1k_chunks" in r]
    print(f"engine alone: {ideal:.2f} s a stream, {args.streams * args.tokens / ideal:.0f} "
          f"chunks/s offered; {json.dumps(summary)}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "settings": vars(args), "machine": {"cpus": os.cpu_count(),
                                                "load_avg": os.getloadavg(),
                                                "python": platform.python_version()},
            "offered_chunks_per_s": round(args.streams * args.tokens / ideal),
            "runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
