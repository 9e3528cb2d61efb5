"""proxima-active, allocator-invariants and canary lines, from real status files and real
HTTP servers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proxima.allocator import RunAllocator
from proxima.vllm.status import read_status, write_status
from proxima.serve.engine_checks import (CANARY_HEADER, check_active, check_invariants,
                                         pick_invariants_status, run_canary)

from .conftest import free_port


def status_file(tmp_path, **fields) -> dict:
    path = tmp_path / "engine-status.json"
    write_status({"active": True, "engine": "vllm-v1", "vllm_version": "0.26.0",
                  "num_blocks": 1000, "block_size": 16,
                  "allocator": RunAllocator(1000).stats(), "steps": 0, **fields}, path)
    return read_status(path)  # written by this process: its pid is ours


def test_active_in_the_engine_process(tmp_path):
    status = status_file(tmp_path, invariants_ok=True)
    engine_pid = status["pid"]
    check = check_active(status, server_pid=engine_pid + 1, engine_pids=[engine_pid],
                         since=status["time"] - 1, path=tmp_path)
    assert check.status == "ok" and f"engine pid {engine_pid}" in check.detail


def test_active_in_the_server_process_is_not_enough(tmp_path):
    status = status_file(tmp_path)
    check = check_active(status, server_pid=status["pid"], engine_pids=[],
                         since=status["time"] - 1, path=tmp_path)
    assert check.failed and "in the API server" in check.detail


@pytest.mark.parametrize("case, fragment", [
    ("missing", "wrote no status file"),
    ("stale", "older than this engine"),
    ("inactive", "reports active=false"),
    ("other-engine", "not from this engine"),
])
def test_active_failures(tmp_path, case, fragment):
    status = status_file(tmp_path, active=case != "inactive")
    since = status["time"] + (60 if case == "stale" else -1)
    check = check_active(None if case == "missing" else status, server_pid=-1,
                         engine_pids=[-2] if case == "other-engine" else [],
                         since=since, path=tmp_path / "engine-status.json")
    assert check.failed and fragment in check.detail, check.line()
    assert check.fix


def test_invariants(tmp_path):
    at_activation = status_file(tmp_path, invariants_ok=True)
    later = status_file(tmp_path, steps=42)  # periodic snapshots carry no verdict
    chosen = pick_invariants_status(later, at_activation)
    assert chosen is at_activation
    assert "checked when the engine created the pool" in check_invariants(chosen).detail
    checked_later = status_file(tmp_path, steps=42, invariants_ok=True)
    assert "after 42 scheduler steps" in check_invariants(
        pick_invariants_status(checked_later, at_activation)).detail
    broken = status_file(tmp_path, steps=7, invariants_ok=False, invariants_error="run overlap")
    line = check_invariants(broken)
    assert line.failed and "run overlap" in line.detail and "do not serve" in line.fix
    assert check_invariants(status_file(tmp_path)).failed  # no verdict at all
    # A verdict carries its own time: a snapshot at step 900 may hold one from step 0.
    dated = status_file(tmp_path, steps=900, invariants_ok=True,
                        invariants_checked_at=1764480612.0)       # 2025-11-30 05:30:12 UTC
    detail = check_invariants(dated).detail
    assert "checked at 05:30:12 UTC" in detail and "900" not in detail


class _Completions(BaseHTTPRequestHandler):
    reply: tuple[int, dict] = (200, {})
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.path, dict(self.headers), body))
        code, payload = self.reply
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def canary_against(reply, **kwargs):
    handler = type("H", (_Completions,), {"reply": reply, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check = asyncio.run(run_canary(f"http://127.0.0.1:{server.server_port}", "m",
                                       token="t0k", timeout=10, **kwargs))
    finally:
        server.shutdown()
    return check, handler.seen


def test_canary_ok_sends_the_token_and_the_key():
    check, seen = canary_against((200, {"usage": {"completion_tokens": 4}}), api_key="sk-1")
    assert check.status == "ok" and "4 tokens" in check.detail
    path, headers, body = seen[0]
    assert path == "/v1/completions" and body["model"] == "m" and body["max_tokens"] == 4
    assert headers[CANARY_HEADER] == "t0k" and headers["Authorization"] == "Bearer sk-1"


def test_canary_error_answer():
    check, _ = canary_against((503, {"error": {"message": "engine starting"}}))
    assert check.failed and "answered 503" in check.detail and "engine starting" in check.detail


def test_canary_nobody_listening():
    started = time.monotonic()
    check = asyncio.run(run_canary(f"http://127.0.0.1:{free_port()}", "m", token="t"))
    assert check.failed and "cannot reach the server" in check.detail
    assert time.monotonic() - started < 10
