"""A CPU stand-in for vLLM's OpenAI server (``two_engines.py --dry-run``): /health, /metrics
(a preemption counter; vLLM's prefix-cache counters over an unbounded cache of 16-token blocks),
streamed /v1/completions with usage. With ``--stats-file`` it plays
an elastic engine's stats file: mapped bytes start at ``--min-bytes``, grow by 64 MiB per
request in flight (up to ``--max-bytes``), and fall back to the minimum ``--delay`` s after
the last request ended (a shrink, its bytes counted as returned). One process per port, so
the driver runs as many as it has engines. With ``--served-model-name NAME`` it also answers
``/v1/models`` and, as ``proxima serve --elastic`` does, ``GET /proxima/kv`` (its mapped,
minimum and maximum bytes; ``--elastic`` grows and releases them without a stats file): what
``three_models.py --dry-run`` reads, through the real multi-model endpoint. It checks the driver's orchestration, nothing about
vLLM or Proxima."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from proxima.ioutil import publish_text  # noqa: E402

PER_REQUEST = 64 << 20
BLOCK = 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stats-file", default=None)
    ap.add_argument("--min-bytes", type=int, default=2 << 30)
    ap.add_argument("--max-bytes", type=int, default=72 << 30)
    ap.add_argument("--delay", type=float, default=2.0)
    ap.add_argument("--served-model-name", default="fake")
    ap.add_argument("--elastic", action="store_true")
    args = ap.parse_args()
    served = [0]
    lock = threading.Lock()
    state = {"mapped_bytes": args.min_bytes, "grows": 0, "shrinks": 0, "failed_grows": 0,
             "bytes_returned": 0, "pool_bytes": args.max_bytes,
             "events": []}        # (monotonic time, grow/shrink, granules), as the engine's
    active = [0]
    last_end = [time.monotonic()]
    cached: set = set()                 # prefixes seen, whole blocks (a cache that never evicts)
    cache = {"queries": 0, "hits": 0}
    work = {"iteration_tokens_total_count": 0, "iteration_tokens_total_sum": 0,
            "prompt_tokens_total": 0, "generation_tokens_total": 0}

    def write_stats() -> None:          # under the lock; atomic, the driver samples it
        if not args.stats_file:
            return
        publish_text(args.stats_file, json.dumps(dict(
            state, reported_mapped=state["mapped_bytes"] >> 20, bytes_per_granule=1 << 20)))

    def event(kind: str, nbytes: int) -> None:     # under the lock: the last 20 kept
        state["events"] = state["events"][-19:] + [(time.monotonic(), kind, nbytes >> 20)]

    def release() -> None:              # the release delay, as the elastic policy's
        while True:
            time.sleep(0.05)
            with lock:
                if (active[0] == 0 and state["mapped_bytes"] > args.min_bytes
                        and time.monotonic() - last_end[0] >= args.delay):
                    event("shrink", state["mapped_bytes"] - args.min_bytes)
                    state["bytes_returned"] += state["mapped_bytes"] - args.min_bytes
                    state["mapped_bytes"] = args.min_bytes
                    state["shrinks"] += 1
                    write_stats()

    with lock:
        write_stats()
    if args.stats_file or args.elastic:
        threading.Thread(target=release, daemon=True).start()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"     # a streamed body ends with the connection

        def log_message(self, *a):
            pass

        def _send(self, code, body, kind="application/json"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, (f"vllm:num_preemptions_total{{engine=\"0\"}} {served[0]}.0\n"
                                 f"vllm:prefix_cache_queries_total {cache['queries']}.0\n"
                                 f"vllm:prefix_cache_hits_total {cache['hits']}.0\n"
                                 + "".join(f"vllm:{k}{{engine=\"0\"}} {v}.0\n"
                                           for k, v in work.items()))
                           .encode(), "text/plain")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": args.served_model_name, "object": "model"}]}).encode())
            elif self.path == "/proxima/kv":
                with lock:
                    kv = dict(state, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                              used_bytes=active[0] * PER_REQUEST)
                self._send(200, json.dumps(kv).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = int(body.get("max_tokens", 4))
            prompt = body.get("prompt") or []
            with lock:
                active[0] += 1
                # a block's key chains its parent's with its own tokens (as vLLM's block
                # hashes do): O(prompt) per request, not a tuple of the whole prefix per block
                keys, parent = [], None
                for i in range(BLOCK, len(prompt) + 1, BLOCK):
                    parent = hash((parent, tuple(prompt[i - BLOCK:i])))
                    keys.append(parent)
                hit = 0
                while hit < len(keys) and keys[hit] in cached:
                    hit += 1
                cached.update(keys)
                cache["queries"] += len(prompt)
                cache["hits"] += hit * BLOCK
                # the work counters as vLLM's: here one step a request, prompt and output
                work["iteration_tokens_total_count"] += 1
                work["iteration_tokens_total_sum"] += len(prompt) + n
                work["prompt_tokens_total"] += len(prompt)
                work["generation_tokens_total"] += n
                want = min(args.max_bytes, args.min_bytes + active[0] * PER_REQUEST)
                if want > state["mapped_bytes"]:
                    event("grow", want - state["mapped_bytes"])
                    state["mapped_bytes"] = want
                    state["grows"] += 1
                    write_stats()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for _ in range(3):
                    self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                    time.sleep(0.01)
                usage = {"choices": [], "usage": {"completion_tokens": n}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
            finally:
                with lock:
                    active[0] -= 1
                    last_end[0] = time.monotonic()
                    served[0] += 1

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 2048     # a burst connects all at once
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
