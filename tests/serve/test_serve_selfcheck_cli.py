"""``proxima selfcheck``: one line per check, non-zero exit on failure."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import free_port, run_proxima


def test_no_gpu_is_reported_clearly():
    done = run_proxima("selfcheck")
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu: failed: no NVIDIA GPU visible (torch.cuda.is_available() is "
                               "False")
    assert lines[0].endswith("— run on a machine with a GPU, or with docker run --gpus all")
    assert [line.split(":")[0] for line in lines] == [
        "gpu", "cuda", "versions", "engine", "proxima-active", "allocator-invariants", "elastic-kv", "canary"]
    assert "engine: skipped: not run: gpu failed" in lines
    assert "Traceback" not in done.stderr


def test_no_engine_json():
    done = run_proxima("selfcheck", "--no-engine", "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["passed"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["versions"]["status"] == "ok"
    assert checks["engine"] == {"name": "engine", "status": "skipped", "detail": "--no-engine",
                                "fix": ""}


class _Report(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        code = 200 if self.path == "/proxima/selfcheck" else 404
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body if code == 200 else b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("passed, code", [(True, 0), (False, 1)])
def test_url_prints_a_running_servers_report(passed, code):
    checks = [{"name": "gpu", "status": "ok", "detail": "1 x NVIDIA H200", "fix": ""},
              {"name": "canary", "status": "ok" if passed else "failed",
               "detail": "POST /v1/completions", "fix": "" if passed else "see the log"}]
    handler = type("H", (_Report,), {"body": json.dumps(
        {"phase": "ready" if passed else "failed", "passed": passed, "checks": checks}).encode()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = run_proxima("selfcheck", "--url", f"http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines()[0] == "gpu: ok: 1 x NVIDIA H200"
    assert done.stdout.splitlines()[1].startswith(f"canary: {'ok' if passed else 'failed'}")


@pytest.mark.parametrize("body", [b"[]", b'"ok"', b'{"checks": 5}', b'{"checks": [7]}',
                                  b'{"checks": [{"name": "gpu"}]}',
                                  b'{"checks": [{"name": "gpu", "status": "ok", "detail": "x", '
                                  b'"extra": 1}]}'])
def test_url_answering_no_report_is_one_line_and_exit_1(body):
    """A server (or anything on that port) whose JSON is no self-check report: one line,
    exit 1 (the server's failure, as `proxima kv` says it), not an AttributeError / TypeError
    traceback."""
    handler = type("H", (_Report,), {"body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = run_proxima("selfcheck", "--url", f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a self-check report" in lines[0]


def test_url_nobody_listening():
    port = free_port()
    done = run_proxima("selfcheck", "--url", f"http://127.0.0.1:{port}")
    assert done.returncode == 2
    assert done.stderr.startswith(f"proxima selfcheck: error: cannot reach http://127.0.0.1:{port}/proxima/selfcheck")


def test_version_still_works():
    done = run_proxima("--version")
    assert done.returncode == 0 and done.stdout.startswith("proxima ")
