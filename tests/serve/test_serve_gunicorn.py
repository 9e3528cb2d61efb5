"""gunicorn's configuration for proxima serve, and the real arbiter + worker on CPU."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from uvicorn_worker import UvicornWorker

from proxima.serve.app import ProximaApp
from proxima.serve.gunicorn_conf import ProximaApplication
from proxima.serve.worker import ProximaWorker

from .conftest import REPO, free_port, proxima_env, v1_only


def test_config_one_uvicorn_worker_long_timeouts(serve_args):
    args = serve_args("--host", "127.0.0.1", "--port", "9001")
    application = ProximaApplication(args)
    cfg = application.cfg
    assert cfg.worker_class is ProximaWorker and issubclass(cfg.worker_class, UvicornWorker)
    assert cfg.workers == 1
    assert cfg.timeout == 300 and cfg.graceful_timeout == 60
    assert cfg.bind == ["127.0.0.1:9001"]
    assert cfg.preload_app is False and cfg.max_requests == 0
    assert cfg.control_socket_disable is True
    assert ProximaWorker.CONFIG_KWARGS["lifespan"] == "on"
    app = application.load()  # the app factory: builds the gate, starts nothing
    assert isinstance(app, ProximaApp)
    assert app.supervisor.args is args and app.supervisor.phase == "not-started"


@pytest.mark.parametrize("argv, bind", [
    ([], ["0.0.0.0:8000"]),
    (["--host", "::1", "--port", "9002"], ["[::1]:9002"]),
    pytest.param(["--uds", "/tmp/proxima.sock"], ["unix:/tmp/proxima.sock"], marks=v1_only),
])
def test_bind_follows_vllm_options(serve_args, argv, bind):
    assert ProximaApplication(serve_args(*argv)).cfg.bind == bind


@v1_only  # vLLM 0.6 has no --disable-uvicorn-access-log
def test_access_log_and_tls_options_map_to_gunicorn(serve_args, tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k"), cert.write_text("c")
    cfg = ProximaApplication(serve_args("--disable-uvicorn-access-log", "--ssl-keyfile", str(key),
                                        "--ssl-certfile", str(cert))).cfg
    assert cfg.accesslog is None
    assert (cfg.keyfile, cfg.certfile) == (str(key), str(cert))
    assert ProximaApplication(serve_args()).cfg.accesslog == "-"


def test_failed_self_check_halts_gunicorn_with_one_line(tmp_path):
    """Real arbiter, real worker: /health answers 503 while the worker checks, the self-check
    fails (no GPU), the worker exits with WORKER_BOOT_ERROR, the arbiter halts, and proxima
    serve ends non-zero with the failing check as its last line."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/serve/boot_gunicorn.py"), str(port),
                             str(tmp_path / "failure.txt")], cwd=REPO, env=proxima_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            seen.append((response.status_code, response.json().get("status")))
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert seen and all(code == 503 for code, _ in seen), seen
    assert ("starting" in {status for _, status in seen}), seen
    assert "Booting worker" in err and "Worker failed to boot" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("proxima serve: error: gpu: failed: no NVIDIA GPU visible"), last
    assert "Traceback" not in err
