"""A small real OpenAI-compatible HTTP server for testing `proxima bench` online mode.

It listens on 127.0.0.1 (ephemeral port) in a thread, serves ``/v1/models``, streams
SSE chunks for ``/v1/completions`` and ``/v1/chat/completions`` (one chunk per
``tokens_per_chunk`` tokens, ``delay`` seconds apart), and ``/metrics`` with a
preemption counter. It records every request body it received and every token it
streamed, so tests compare the client's figures with what was really sent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class ServerConfig:
    models: tuple = ("tiny",)
    delay: float = 0.001                # seconds between chunks
    tokens_per_chunk: int = 1
    usage: bool = True                  # honour stream_options (continuous usage + final)
    fail_every: int = 0                 # every k-th received generation request -> HTTP 500
    stream_error_every: int = 0         # every k-th -> an {"error": ...} chunk mid-stream
    preemptions_per_request: int = 0    # added to the counter per finished request
    metrics: str = "total"              # "total" | "bare" | "none"
    models_answer: bytes | None = None  # the body of GET /v1/models instead of the list
    die_after: int = 0                  # SIGKILL this process midway through the k-th stream
                                        # (a server dying mid-run: run it as a subprocess,
                                        # tests/bench/standin_server.py)
    routes: dict = field(default_factory=dict)  # path -> (status, body, content type[,
                                        # {header: value}]): answered as is to GET and POST


@dataclass
class ServerState:
    bodies: list = field(default_factory=list)       # generation request bodies, in arrival order
    tokens_streamed: int = 0                         # tokens of successfully finished streams
    chunks_streamed: int = 0
    preemptions: int = 0
    active: int = 0                                  # streams open now
    peak_active: int = 0                             # most streams open at once
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeOpenAIServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.state = ServerState()
        handler = self._handler()
        ThreadingHTTPServer.request_queue_size = 256    # all of a burst connects at once
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def start(self) -> "FakeOpenAIServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"    # the stream ends when the connection closes

            def log_message(self, *args):    # keep pytest output clean
                pass

            def _send(self, status: int, body: bytes, ctype: str, headers=None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                cfg = server.config
                if self.path in cfg.routes:
                    self._send(*cfg.routes[self.path])
                elif self.path == "/v1/models" and cfg.models_answer is not None:
                    self._send(200, cfg.models_answer, "application/json")
                elif self.path == "/v1/models":
                    data = {"object": "list",
                            "data": [{"id": m, "object": "model"} for m in cfg.models]}
                    self._send(200, json.dumps(data).encode(), "application/json")
                elif self.path == "/metrics" and cfg.metrics != "none":
                    name = ("vllm:num_preemptions_total" if cfg.metrics == "total"
                            else "vllm:num_preemptions")
                    with server.state.lock:
                        value = server.state.preemptions
                    text = (f"# HELP {name} preemptions\n# TYPE {name} counter\n"
                            f'{name}{{engine="0",model_name="tiny"}} {float(value)}\n'
                            f'vllm:num_preemptions_created{{engine="0"}} 1.7e9\n'
                            f"vllm:num_requests_running 0.0\n")
                    self._send(200, text.encode(), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"error": "not found"}', "application/json")

            def do_POST(self):
                cfg, state = server.config, server.state
                if self.path in cfg.routes:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    return self._send(*cfg.routes[self.path])
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                chat = self.path == "/v1/chat/completions"
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    return self._send(404, b"{}", "application/json")
                if body.get("model") not in cfg.models:
                    return self._send(404, b'{"error": "model not found"}', "application/json")
                with state.lock:
                    state.bodies.append(body)
                    nth = len(state.bodies)
                if cfg.fail_every and nth % cfg.fail_every == 0:
                    return self._send(500, b'{"error": "injected failure"}', "application/json")
                with state.lock:
                    state.active += 1
                    state.peak_active = max(state.peak_active, state.active)
                self._open = True
                try:
                    self._stream(body, chat, nth)
                finally:
                    self._closing()

            def _closing(self) -> None:
                # A stream stops counting as open just before its last token chunk is written:
                # the client cannot finish (and start the next request in its slot) before that
                # chunk reaches it, so the server's count never runs ahead of the client's.
                if getattr(self, "_open", False):
                    self._open = False
                    with server.state.lock:
                        server.state.active -= 1

            def _stream(self, body, chat, nth):
                cfg, state = server.config, server.state
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                prompt_tokens = (len(body["prompt"]) if not chat
                                 else len(body["messages"][0]["content"].split()))
                opts = body.get("stream_options") or {}
                usage_each = cfg.usage and opts.get("continuous_usage_stats")
                usage_final = cfg.usage and opts.get("include_usage")

                def emit(obj) -> None:
                    self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                    self.wfile.flush()

                if chat:
                    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                    if usage_each:
                        first["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
                    emit(first)
                total, sent, chunks = body["max_tokens"], 0, 0
                while sent < total:
                    time.sleep(cfg.delay)
                    n = min(cfg.tokens_per_chunk, total - sent)
                    sent += n
                    chunks += 1
                    text = " tok" * n
                    finish = "length" if sent == total else None
                    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish}
                              if chat else {"index": 0, "text": text, "finish_reason": finish})
                    chunk = {"object": "chunk", "choices": [choice]}
                    if usage_each:
                        chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
                    if cfg.die_after and nth >= cfg.die_after and sent > total // 2:
                        os.kill(os.getpid(), signal.SIGKILL)
                    if cfg.stream_error_every and nth % cfg.stream_error_every == 0 and sent > total // 2:
                        self._closing()
                        emit({"error": {"message": "injected stream error", "code": 500}})
                        self.wfile.write(b"data: [DONE]\n\n")
                        return
                    if finish:
                        self._closing()
                    emit(chunk)
                if usage_final:
                    emit({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                   "completion_tokens": sent}})
                # counted before [DONE]: a client that has read it (and then reads /metrics)
                # must find this request's preemptions there, as a server's counter has them
                with state.lock:
                    state.tokens_streamed += sent
                    state.chunks_streamed += chunks
                    state.preemptions += cfg.preemptions_per_request
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler


@pytest.fixture
def fake_server():
    """Factory: ``fake_server(**ServerConfig fields)`` -> a started server, stopped after."""
    servers = []

    def start(**kwargs) -> FakeOpenAIServer:
        server = FakeOpenAIServer(ServerConfig(**kwargs)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def closed_port_url():
    """A loopback URL on which nothing listens (port bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def trace_file(tmp_path):
    """Factory: write a JSONL trace of (prompt_len, output_len) pairs, return its path."""
    def write(pairs, name="trace.jsonl"):
        path = tmp_path / name
        path.write_text("".join(json.dumps({"prompt_len": p, "output_len": o}) + "\n"
                                for p, o in pairs))
        return str(path)
    return write
