"""docker/healthcheck.py, the health check of every image, against a real HTTP server: 0 only
for 200 on /health, else 1 with one line."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


@pytest.fixture
def server():
    state = {"status": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = state["status"] if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/health", state
    httpd.shutdown()


def check(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=dict(os.environ, PROXIMA_HEALTH_URL=url), timeout=30)


def test_healthy_only_when_health_answers_200(server):
    url, state = server
    starting = check(url)
    assert starting.returncode == 1
    assert starting.stderr.strip() == (f"proxima-healthcheck: {url} answered 503 (503: self-check "
                                       "not passed yet, or the engine is down)")
    state["status"] = 200
    healthy = check(url)
    assert healthy.returncode == 0 and healthy.stderr == ""


def test_no_server_is_unhealthy_in_one_line(server):
    url, _ = server
    port = url.split(":")[2].split("/")[0]
    done = check(url.replace(port, "9"))          # the discard port: nothing listens
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "no answer" in line
