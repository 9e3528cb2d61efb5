"""The gate in front of vLLM's app, with no engine (this machine has no GPU)."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from proxima.allocator import RunAllocator
from proxima.vllm.status import write_status
from proxima.serve.app import create_app
from proxima.serve.engine_checks import CANARY_HEADER
from proxima.serve.preflight import installed_version
from proxima.serve.supervisor import CHECKING, READY

from .conftest import card_stack


@pytest.fixture(scope="module")
def args(serve_args):
    return serve_args("--host", "127.0.0.1", "--port", "8123")


@pytest.fixture(scope="module")
def vllm_app(args):
    """vLLM's real OpenAI app, built without an engine (routes that need none still work)."""
    from proxima.vllm.vllm_v1_compat import api_server_app

    build_app = api_server_app()[0]
    if card_stack():
        return build_app(args)  # vLLM 0.6: routes do not depend on the model's tasks
    return build_app(args, ("generate",))


def test_engine_not_started(args):
    client = TestClient(create_app(args))  # no lifespan: nothing starts
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "not-started"
    assert health.headers["retry-after"]
    report = client.get("/proxima/selfcheck")
    assert report.status_code == 200
    assert report.json() == {"phase": "not-started", "passed": None, "checks": [],
                             "started": report.json()["started"], "finished": None}
    models = client.get("/v1/models")
    assert models.status_code == 503
    assert models.json()["error"]["type"] == "ServiceUnavailableError"
    completion = client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
    assert completion.status_code == 503


def test_metrics_are_served_before_the_engine_exists(args, tmp_path, monkeypatch):
    path = tmp_path / "engine-status.json"
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(path))
    client = TestClient(create_app(args))
    assert "proxima_active 0.0" in client.get("/metrics").text
    write_status({"active": True, "allocator": RunAllocator(4096).stats()}, path)
    text = client.get("/metrics").text
    assert "proxima_active 1.0" in text and "proxima_free_blocks 4096.0" in text


def test_start_on_a_machine_without_gpu_fails_the_self_check(args):
    """The real start-up path: the worker's pre-flight probes the GPU, finds none, and the
    server stays unavailable with the reason in the report (a gunicorn worker would now exit
    with WORKER_BOOT_ERROR; see test_serve_gunicorn)."""
    app = create_app(args)
    with TestClient(app) as client:
        seen = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            report = client.get("/proxima/selfcheck").json()
            seen.add(client.get("/health").status_code)
            if report["phase"] != "starting":
                break
            time.sleep(0.2)
        assert report["phase"] == "failed" and report["passed"] is False
        checks = {c["name"]: c for c in report["checks"]}
        assert checks["gpu"]["status"] == "failed"
        assert "no NVIDIA GPU" in checks["gpu"]["detail"]
        assert [c["name"] for c in report["checks"]] == [
            "gpu", "cuda", "versions", "engine", "proxima-active", "allocator-invariants", "elastic-kv", "canary"]
        assert checks["canary"] == {"name": "canary", "status": "skipped",
                                    "detail": "not run: gpu failed", "fix": ""}
        assert seen == {503}
        assert client.get("/health").json()["status"] == "failed"
        assert client.get("/v1/models").status_code == 503


def test_while_checking_only_the_canary_gets_through(args, vllm_app):
    app = create_app(args)
    supervisor = app.supervisor
    supervisor.inner, supervisor.phase = vllm_app, CHECKING
    client = TestClient(app)
    assert client.get("/version").status_code == 503
    assert client.get("/version", headers={CANARY_HEADER: "guess"}).status_code == 503
    passed = client.get("/version", headers={CANARY_HEADER: supervisor.canary_token})
    assert passed.status_code == 200 and passed.json() == {"version": installed_version("vllm")}
    assert client.get("/health").status_code == 503  # not before the self-check passed

    supervisor.phase = READY
    assert client.get("/version").status_code == 200
    # ready, but no live engine behind it: never report healthy
    assert client.get("/health").json()["status"] == "engine-dead"
    assert "proxima_active" in client.get("/metrics").text  # vLLM's /metrics, our collector
