"""A stand-in for one model's ``proxima serve`` engine, in its own process, for the
several-models endpoint's tests: ``python -m tests.serve.standin_engine --port P --model NAME``.

It answers what the endpoint asks of an engine: ``/health`` (200, or ``--health CODE``),
``/v1/models``, ``/metrics`` (a few ``proxima_*`` and ``vllm:*`` families, a counter with
``_created`` and a histogram among them), ``POST /v1/completions`` and
``/v1/chat/completions`` (SSE when ``"stream": true``, one chunk per token, else one JSON),
``POST /v1/embeddings``, ``GET /proxima/kv``. Every answer names the engine (``"engine":
NAME``), so a test sees which engine served a request. With ``--gate FILE`` a stream sends
its first chunk and then waits until FILE exists: a test proves that the endpoint passed
that chunk on before the engine finished; and if the rest cannot be written (the endpoint
closed the connection) it creates FILE.cut.

Sleep and wake, as ``proxima serve --sleep-mode`` answers them (proxima.serve.engine_sleep):
``POST /proxima/sleep`` puts it to sleep (200; again while asleep: 200, no second sleep),
``POST /proxima/wake_up`` wakes it (after ``--wake-delay S``; 500 with ``--wake-fail``),
and while it sleeps its inference routes answer 503. ``GET /proxima/kv`` says
``sleeping`` and counts the sleeps and wakes done, and the sleeps asked with
``{"release": true}`` (``released``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def metrics_text(name: str, served: int) -> str:
    return (
        "# HELP proxima_kv_mapped_bytes KV memory backed by GPU memory now (elastic KV)\n"
        "# TYPE proxima_kv_mapped_bytes gauge\n"
        f"proxima_kv_mapped_bytes {1048576 * (1 + len(name))}.0\n"
        "# HELP proxima_kv_grows_total grow decisions (maps sent)\n"
        "# TYPE proxima_kv_grows_total counter\n"
        "proxima_kv_grows_total 3.0\n"
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{name}"}} 0.0\n'
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        f'vllm:prompt_tokens_total{{engine="0",model_name="{name}"}} {float(served)}\n'
        "# HELP vllm:prompt_tokens_created Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_created gauge\n"
        f'vllm:prompt_tokens_created{{engine="0",model_name="{name}"}} 1.7e+09\n'
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        f'vllm:e2e_request_latency_seconds_bucket{{le="1.0",model_name="{name}"}} {float(served)}\n'
        f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{name}"}} {float(served)}\n'
        f'vllm:e2e_request_latency_seconds_count{{model_name="{name}"}} {float(served)}\n'
        f'vllm:e2e_request_latency_seconds_sum{{model_name="{name}"}} {0.5 * served}\n')


class SleepState:
    def __init__(self, wake_delay: float = 0.0, wake_fail: bool = False):
        self.asleep = False
        self.sleeps = self.wakes = 0
        self.released = 0                   # sleeps asked with {"release": true}
        self.wake_delay, self.wake_fail = wake_delay, wake_fail
        self.lock = threading.Lock()        # one sleep or wake at a time, as the engine's


def make_handler(name: str, health: int, gate: str | None, served: list,
                 sleep: SleepState | None = None):
    sleep = sleep or SleepState()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def _json(self, status: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                if health == 200:
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self._json(health, {"status": "starting", "engine": name})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": name, "object": "model", "created": 1, "owned_by": "vllm",
                     "root": f"/models/{name}", "max_model_len": 2048, "engine": name}]})
            elif self.path == "/metrics":
                body = metrics_text(name, len(served)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/proxima/kv":
                self._json(200, {"engine": name, "mapped_bytes": 1, "sleeping": sleep.asleep,
                                 "sleeps": sleep.sleeps, "wakes": sleep.wakes,
                                 "released": sleep.released})
            else:
                self._json(404, {"error": "not found", "engine": name})

        def _sleep_route(self, action: str, body: dict):
            with sleep.lock:
                if action == "sleep":
                    if not sleep.asleep:
                        sleep.asleep = True
                        sleep.sleeps += 1
                        sleep.released += body.get("release") is True
                    return self._json(200, {"sleeping": True, "seconds": 0.01,
                                            "weights_bytes": 2**30, "engine": name})
                if not sleep.asleep:
                    return self._json(200, {"sleeping": False, "seconds": 0.0, "engine": name})
                time.sleep(sleep.wake_delay)
                if sleep.wake_fail:
                    return self._json(500, {"error": "vLLM's wake failed (RuntimeError: "
                                                     "CUDA out of memory)", "engine": name})
                sleep.asleep = False
                sleep.wakes += 1
                return self._json(200, {"sleeping": False, "seconds": sleep.wake_delay,
                                        "engine": name})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path in ("/proxima/sleep", "/proxima/wake_up"):
                return self._sleep_route(self.path[len("/proxima/"):], body or {})
            if sleep.asleep:
                return self._json(503, {"error": {"message": "the model is asleep",
                                                  "type": "ServiceUnavailableError",
                                                  "code": 503}, "engine": name})
            served.append(body)
            if body.get("model") != name:
                return self._json(404, {"error": f"model {body.get('model')!r} is not {name!r}",
                                        "engine": name})
            if self.path == "/v1/embeddings":
                return self._json(200, {"object": "list", "model": name, "engine": name,
                                        "data": [{"object": "embedding", "index": 0,
                                                  "embedding": [0.5, 0.25]}]})
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                return self._json(404, {"error": "not found", "engine": name})
            tokens = int(body.get("max_tokens") or 3)
            if not body.get("stream"):
                return self._json(200, {"object": "text_completion", "model": name,
                                        "engine": name,
                                        "choices": [{"index": 0, "text": " tok" * tokens}]})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for i in range(tokens):
                    chunk = {"object": "chunk", "model": name, "engine": name,
                             "choices": [{"index": 0, "text": f" t{i}"}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                    if i == 0 and gate:
                        while not os.path.exists(gate):
                            time.sleep(0.02)
                    elif gate:
                        time.sleep(0.05)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except OSError:                 # the client went away: as vLLM aborts the request
                if gate:
                    open(gate + ".cut", "w").close()

    return Handler


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--health", type=int, default=200)
    parser.add_argument("--gate")
    parser.add_argument("--wake-delay", type=float, default=0.0)
    parser.add_argument("--wake-fail", action="store_true")
    parser.add_argument("--arbiter", action="store_true",
                        help="serve from a forked worker and wait on it, as gunicorn's arbiter "
                             "does: the worker shares stdout and outlives a kill -9 of this pid")
    args = parser.parse_args(argv)
    if args.arbiter:
        worker = os.fork()
        if worker:
            # one write: with PYTHONUNBUFFERED print writes the text and its newline apart,
            # and the worker's first line could land between them
            sys.stdout.flush()
            os.write(1, f"stand-in arbiter (pid {os.getpid()}), worker pid {worker}\n".encode())
            os.waitpid(worker, 0)
            return 0
    served: list = []
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port),
                                make_handler(args.model, args.health, args.gate, served,
                                             SleepState(args.wake_delay, args.wake_fail)))
    httpd.daemon_threads = True
    print(f"stand-in engine {args.model} on 127.0.0.1:{args.port} (pid {os.getpid()})", flush=True)
    httpd.serve_forever(poll_interval=0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
