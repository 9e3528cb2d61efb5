"""A CPU stand-in for vLLM's OpenAI server (``two_engines.py --dry-run``): /health, /metrics
(a preemption counter), streamed /v1/completions with usage. It checks the driver's
orchestration, nothing about vLLM or Proxima."""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stats-file", default=None)
    args = ap.parse_args()
    served = [0]

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
                self._send(200, f"vllm:num_preemptions_total{{engine=\"0\"}} {served[0]}.0\n"
                           .encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = int(body.get("max_tokens", 4))
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
            served[0] += 1
            if args.stats_file:
                with open(args.stats_file, "w") as f:
                    json.dump({"mapped_bytes": served[0], "reported_mapped": 1,
                               "bytes_per_granule": 1, "grows": 1}, f)

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 2048     # a burst connects all at once
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
