"""Issue 5 on a real GPU: `proxima serve` end to end, through HTTP, as a user runs it.

One server (the embedded random-weights demo model) is started for the module as a
subprocess (`python -m proxima.cli serve`), so CUDA never touches pytest's process. Tests
then read its self-check, talk to it with the OpenAI Python client, scrape Prometheus, start a
second server that must fail for lack of GPU memory, serve a Llama-3.1-8B-shaped dummy model,
and finally kill the engine process and watch gunicorn's supervised restart. The tests run in
file order: the engine-death test is last but one, SIGTERM last.

Needs on the GPU host, besides vLLM 0.26.0 + torch 2.11.0: proxima installed (its
`vllm.general_plugins` entry point), gunicorn, uvicorn-worker, fastapi, uvicorn,
prometheus_client, httpx, openai.

Run on the H200:  python -m pytest -m gpu tests/gpu/test_serve_gpu.py -v
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
    pytest.mark.skipif(importlib.util.find_spec("gunicorn") is None, reason="needs gunicorn"),
]

ROOT = Path(__file__).resolve().parents[2]
DEMO = "proxima-demo-random-weights"
START_TIMEOUT_S = 600
CHECK_NAMES = ["gpu", "cuda", "versions", "engine", "proxima-active", "allocator-invariants",
               "canary"]
# Llama-3.1-8B's shape (as tools/gpu/dummy-llama), weights random (load_format=dummy).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`proxima serve ARGV` in a subprocess, its output in a log file."""

    def __init__(self, tmp: Path, *argv: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.status_file = tmp / "engine-status.json"
        self.log = tmp / "serve.log"
        env = dict(os.environ, VLLM_NO_USAGE_STATS="1", PROXIMA_STATS_FILE=str(self.status_file),
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                              if p))
        env.pop("PROXIMA_ALLOCATOR", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxima.cli", "serve", *argv, "--host", "127.0.0.1",
             "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT, text=True)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def health(self) -> tuple[int | None, dict]:
        try:
            response = httpx.get(f"{self.url}/health", timeout=5)
        except httpx.HTTPError:
            return None, {}
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {}

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> list:
        """Poll /health until 200; returns the (code, status) pairs seen before."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"proxima serve exited with {self.proc.returncode}:\n{self.tail()}")
            code, body = self.health()
            if code == 200:
                return seen
            seen.append((code, body.get("status")))
            time.sleep(0.5)
        pytest.fail(f"/health not 200 within {timeout} s; last {seen[-3:]}\n{self.tail()}")

    def engine_pid(self) -> int:
        return json.loads(self.status_file.read_text())["pid"]

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def metrics(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"))
    srv.seen_before_ready = srv.wait_healthy()
    yield srv
    srv.stop()


def test_health_was_503_until_the_self_check_passed(server):
    assert server.seen_before_ready, "the first /health answer was already 200"
    assert all(code in (None, 503) for code, _ in server.seen_before_ready)
    assert {"starting", "checking"} & {status for _, status in server.seen_before_ready}


def test_self_check_passes(server):
    report = httpx.get(f"{server.url}/proxima/selfcheck", timeout=10).json()
    assert report["phase"] == "ready" and report["passed"] is True, report
    assert [c["name"] for c in report["checks"]] == CHECK_NAMES
    assert all(c["status"] == "ok" for c in report["checks"]), report
    engine_pid = server.engine_pid()
    assert engine_pid != server.proc.pid  # Proxima runs in the engine, not in the server
    active = next(c for c in report["checks"] if c["name"] == "proxima-active")
    assert f"engine pid {engine_pid}" in active["detail"]
    log = server.log.read_text()
    assert "RANDOM weights" in log and "self-check passed" in log
    done = subprocess.run([sys.executable, "-m", "proxima.cli", "selfcheck", "--url", server.url],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith("canary: ok: POST /v1/completions")


def test_models_names_the_random_weights_demo(server):
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [DEMO]


def test_openai_client_completion_and_streamed_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    completion = client.completions.create(model=DEMO, prompt="Hello, Proxima", max_tokens=16,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16
    assert isinstance(completion.choices[0].text, str)

    stream = client.chat.completions.create(
        model=DEMO, messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
        stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) >= 2
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_prometheus_shows_proxima_gauges(server):
    def one(i: int):
        httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": DEMO, "prompt": "x " * (20 + 37 * i), "max_tokens": 64 + 16 * i,
            "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.5)  # the engine writes its status at most once a second
    got = metrics(server.url)
    g = lambda name, **labels: got[(name, tuple(sorted(labels.items())))]
    assert g("proxima_active") == 1
    status = json.loads(server.status_file.read_text())
    assert g("proxima_blocks") == status["allocator"]["num_blocks"] > 0
    assert 0 < g("proxima_free_blocks") <= g("proxima_blocks")
    assert 0 < g("proxima_largest_free_run_blocks") <= g("proxima_free_blocks")
    assert 0 <= g("proxima_fragmentation_index") <= 1
    assert g("proxima_free_runs") >= 1
    assert g("proxima_scheduler_steps_total") > 0
    assert g("proxima_allocator_seconds_total") > 0
    assert g("proxima_allocator_seconds_per_step") > 0
    assert ("proxima_blocks_per_run_bucket", (("le", "+Inf"),)) in got
    assert any(name.startswith("vllm:") for name, _ in got)  # vLLM's own metrics still there


def test_too_little_gpu_memory_stops_a_second_server_with_the_figure_to_lower(server, tmp_path):
    """The first server holds GPU memory; a second one asking for 99% of it cannot start."""
    second = Server(tmp_path, "--gpu-memory-utilization", "0.99")
    try:
        code = second.proc.wait(START_TIMEOUT_S)
    finally:
        second.stop()
    assert code == 1, second.tail()
    errors = [line for line in second.log.read_text().splitlines()
              if line.startswith("proxima serve: error:")]
    assert len(errors) == 1, second.tail()
    assert errors[0].startswith("proxima serve: error: engine: failed: out of GPU memory at "
                                "start"), errors[0]
    assert "lower --gpu-memory-utilization (now 0.99)" in errors[0]
    assert server.health()[0] == 200  # the first server is unaffected


def test_llama_8b_shaped_dummy_model(tmp_path, server):
    model = tmp_path / "llama-3.1-8b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    tokenizer = ROOT / "proxima" / "models" / "tiny-llama"  # ids < 512 < 128256: any fits
    srv = Server(tmp_path, str(model), "--load-format", "dummy", "--tokenizer", str(tokenizer),
                 "--max-model-len", "4096", "--gpu-memory-utilization", "0.6",
                 "--served-model-name", "llama-8b-shape")
    try:
        srv.wait_healthy()
        report = httpx.get(f"{srv.url}/proxima/selfcheck", timeout=10).json()
        assert report["passed"] is True, report
        out = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "model": "llama-8b-shape", "prompt": "Hello", "max_tokens": 32,
            "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == 32
        assert metrics(srv.url)[("proxima_active", ())] == 1
    finally:
        assert srv.stop() == 0, srv.tail()


def test_engine_death_restarts_the_worker(server):
    """Kill -9 the engine core: the in-flight request ends with an error (no hang), /health
    goes 503, gunicorn starts a fresh worker with a new engine, the self-check passes again
    and /health is back to 200; the server process (gunicorn's arbiter) never went away."""
    old_pid = server.engine_pid()
    outcome = {}

    def long_request():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                    "model": DEMO, "prompt": "long", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}) as response:
                outcome["status"] = response.status_code
                outcome["body"] = "".join(response.iter_text())
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "the in-flight request hung after the engine died"
    assert outcome["ended"] - killed < 60
    finished_normally = outcome.get("status") == 200 and '"finish_reason":"length"' in \
        outcome.get("body", "").replace(" ", "")
    assert not finished_normally, outcome  # it cannot have completed 1500 tokens normally

    seen_503 = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not seen_503:
        code, _ = server.health()
        seen_503 = code in (503, None)
        time.sleep(0.2)
    assert seen_503, "/health never left 200 after the engine died"

    server.wait_healthy()
    assert server.proc.poll() is None  # the arbiter supervised; it did not exit
    new_pid = server.engine_pid()
    assert new_pid != old_pid and not alive(old_pid)
    report = httpx.get(f"{server.url}/proxima/selfcheck", timeout=10).json()
    assert report["passed"] is True, report
    out = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": DEMO, "prompt": "again", "max_tokens": 4, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 4
    assert "gunicorn starts a new one" in server.log.read_text()


def test_sigterm_stops_server_and_engine(server):
    engine_pid = server.engine_pid()
    assert server.stop(timeout=120) == 0, server.tail()
    deadline = time.monotonic() + 30
    while alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(engine_pid), "the engine process outlived the server"
