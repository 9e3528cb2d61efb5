"""Several models behind one endpoint (issue 36), on CPU: the real endpoint (uvicorn + the
router) and the real supervisor, over stand-in engines in their own processes
(tests/serve/standin_engine.py) in place of ``proxima serve PATH`` per model."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from proxima.serve import multi  # noqa: E402
from proxima.serve.router import (FAILED, READY, RESTARTING, Backend,  # noqa: E402
                                  merge_expositions)

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def standin(name: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.serve.standin_engine", "--port", str(port),
            "--model", name, *extra]


def wait_for(predicate, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


class Running:
    def __init__(self, endpoint: multi.Endpoint, thread: threading.Thread, output: list):
        self.endpoint, self.thread, self.output = endpoint, thread, output
        self.url = f"http://127.0.0.1:{endpoint.port}"
        self.engines = {e.backend.name: e for e in endpoint.supervisor.engines}

    def get(self, path: str, **kw):
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, body, **kw):
        return httpx.post(self.url + path, json=body, timeout=30, **kw)


class Lines:
    """The supervisor's output sink: the engines' lines, kept."""

    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines.append(text)

    def flush(self):
        pass


@pytest.fixture
def endpoint(tmp_path):
    """Factory: ``endpoint({name: [extra stand-in options]}, sleep_after={name: seconds},
    places={name: (awake_bytes, asleep_bytes)}, **Endpoint options)`` -> a Running endpoint
    whose engines are all ready (stopped after the test)."""
    started = []

    def start(models: dict, wait_ready=True, sleep_after=None, places=None, **options):
        engines = []
        for name, extra in models.items():
            port = free_port()
            awake, asleep = (places or {}).get(name, (0, 0))
            engines.append(multi.Engine(
                backend=Backend(name=name, url=f"http://127.0.0.1:{port}", path=f"/models/{name}",
                                sleep_after=(sleep_after or {}).get(name),
                                awake_bytes=awake, asleep_bytes=asleep),
                command=standin(name, port, *extra),
                env={**os.environ, "PYTHONPATH": str(REPO)}))
        out = Lines()
        ep = multi.Endpoint(engines, "127.0.0.1", free_port(), health_interval=0.1,
                            output=out, **options)
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault(
            "code", __import__("asyncio").run(ep.run())), daemon=True)
        thread.start()
        running = Running(ep, thread, out.lines)
        running.result = result
        started.append(running)
        wait_for(lambda: _answers(running.url), "the endpoint to listen")
        if wait_ready:
            wait_for(lambda: all(e.backend.state == READY for e in ep.supervisor.engines),
                     "every engine ready")
        return running

    yield start
    for running in started:
        running.endpoint.stop()
        running.thread.join(timeout=60)
        assert not running.thread.is_alive(), "the endpoint did not stop"
        for engine in running.endpoint.supervisor.engines:     # every engine ended with it
            if engine.process is not None:
                assert engine.process.returncode is not None


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def test_routes_each_request_to_its_models_engine(endpoint):
    ep = endpoint({"alpha": [], "beta": []})
    for name in ("alpha", "beta", "beta", "alpha"):
        answer = ep.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert answer.json()["engine"] == name
        chat = ep.post("/v1/chat/completions", {"model": name, "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 200 and chat.json()["engine"] == name
    embedding = ep.post("/v1/embeddings", {"model": "beta", "input": "x"})
    assert embedding.status_code == 200 and embedding.json()["engine"] == "beta"
    # /engines/NAME/... reaches one engine's own routes (proxima kv --url .../engines/NAME)
    assert ep.get("/engines/alpha/proxima/kv").json()["engine"] == "alpha"
    assert ep.get("/engines/beta/proxima/kv").json()["engine"] == "beta"


def test_a_model_named_by_its_path_or_a_hub_id_is_routed_by_that_name(endpoint):
    """``proxima serve /models/llama --sleep-after S`` serves the model under its path, as
    vllm serve does; a Hugging Face id has a / too."""
    ep = endpoint({"/models/llama": [], "org/model": []})
    for name in ("/models/llama", "org/model"):
        answer = ep.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["engine"] == name, answer.text
    assert ep.get("/engines//models/llama/proxima/kv").json()["engine"] == "/models/llama"
    assert ep.get("/engines/org/model/proxima/kv").json()["engine"] == "org/model"
    assert [m["id"] for m in ep.get("/v1/models").json()["data"]] == ["/models/llama",
                                                                      "org/model"]
    assert ep.post("/v1/completions", {"model": "/models", "prompt": "x"}).status_code == 404


def test_a_stream_is_passed_on_chunk_by_chunk(endpoint, tmp_path):
    gate = tmp_path / "gate"
    ep = endpoint({"alpha": ["--gate", str(gate)], "beta": []})
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = answer.iter_lines()
        first = next(line for line in lines if line)
        # the engine is still holding the rest (it waits for the gate): the first chunk came
        # through the endpoint on its own, not after the whole answer
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == " t0"
        assert not gate.exists()
        gate.touch()
        rest = [line for line in lines if line]
    assert [json.loads(r.removeprefix("data: "))["choices"][0]["text"] for r in rest[:-1]] == \
        [" t1", " t2", " t3"]
    assert rest[-1] == "data: [DONE]"


def test_a_client_that_goes_away_mid_stream_cuts_the_engines_stream_too(endpoint, tmp_path):
    """vLLM aborts a request when its client disconnects: the endpoint must pass that on."""
    gate = tmp_path / "gate"
    ep = endpoint({"alpha": ["--gate", str(gate)]})
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as answer:
        assert next(line for line in answer.iter_lines() if line).startswith("data: ")
    gate.touch()                      # the engine goes on writing to a closed connection
    wait_for(lambda: Path(f"{gate}.cut").exists(), "the engine's stream to be cut")


def test_models_lists_every_model_and_an_unknown_one_is_a_404_in_openais_shape(endpoint):
    ep = endpoint({"alpha": [], "beta": []})
    listing = ep.get("/v1/models").json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["alpha", "beta"]
    assert listing["data"][0]["max_model_len"] == 2048          # the engine's own entry
    assert all(m["proxima_state"] == "ready" for m in listing["data"])
    assert ep.get("/v1/models/beta").json()["id"] == "beta"
    for answer in (ep.post("/v1/completions", {"model": "gamma", "prompt": "x"}),
                   ep.post("/v1/chat/completions", {"model": "gamma", "messages": []}),
                   ep.get("/v1/models/gamma")):
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "`gamma` does not exist" in error["message"] and "alpha, beta" in error["message"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
    missing = ep.post("/v1/completions", {"prompt": "x"})       # several models: say which
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_with_an_api_key_the_endpoints_own_model_list_asks_for_it(endpoint):
    ep = endpoint({"alpha": []}, api_keys={"sesame"})
    assert ep.get("/v1/models").status_code == 401
    assert ep.get("/v1/models/alpha").status_code == 401
    assert set(ep.get("/v1/models").json()["error"]) == {"message", "type", "param", "code"}
    assert ep.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    listed = ep.get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert listed.status_code == 200 and listed.json()["data"][0]["id"] == "alpha"
    assert ep.get("/health").status_code == 200          # as vLLM's: no key for /health


def test_health_is_200_only_when_every_engine_is_and_names_the_ones_that_are_not(endpoint):
    ep = endpoint({"alpha": [], "beta": []})
    answer = ep.get("/health")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"

    sick = endpoint({"alpha": [], "beta": ["--health", "503"]}, wait_ready=False)
    wait_for(lambda: sick.engines["alpha"].backend.state == READY, "alpha ready")
    wait_for(lambda: "/health answered 503" in sick.engines["beta"].backend.detail,
             "beta's 503 seen")
    answer = sick.get("/health")
    assert answer.status_code == 503
    assert answer.json()["not_ready"] == ["beta"]
    assert "/health answered 503" in answer.json()["engines"]["beta"]["detail"]
    # its model answers 503 meanwhile; the other one serves
    refused = sick.post("/v1/completions", {"model": "beta", "prompt": "x"})
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert sick.post("/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200


def test_engines_start_one_after_another(endpoint):
    """By default (a GPU without ample room, models that may sleep) the next engine starts
    once the one before is ready: it is sized counting those already on the GPU's ledger."""
    ep = endpoint({"alpha": ["--health", "503"], "beta": []}, wait_ready=False)
    wait_for(lambda: "/health answered 503" in ep.engines["alpha"].backend.detail,
             "alpha answering 503")
    assert ep.engines["beta"].process is None
    assert ep.get("/health").json()["engines"]["beta"]["state"] == "starting"


def test_side_by_side_every_engine_starts_at_once(endpoint):
    """Where the GPU has ample room (multi.start_side_by_side), no engine waits for another:
    beta starts and is ready while alpha still answers 503."""
    ep = endpoint({"alpha": ["--health", "503"], "beta": []}, wait_ready=False,
                  side_by_side=True)
    wait_for(lambda: ep.engines["beta"].backend.state == READY, "beta ready")
    assert ep.engines["alpha"].process is not None
    assert ep.get("/health").json()["engines"]["alpha"]["state"] == "starting"


def test_metrics_carry_every_engines_series_labelled_by_model(endpoint):
    ep = endpoint({"alpha": [], "beta": []})
    ep.post("/v1/completions", {"model": "beta", "prompt": "x"})
    text = ep.get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("proxima_kv_mapped_bytes", "vllm:num_requests_running", "vllm:prompt_tokens",
                 "vllm:e2e_request_latency_seconds", "proxima_router_engine_up"):
        assert {s.labels["model"] for s in families[name].samples} == {"alpha", "beta"}, name
        assert text.count(f"# TYPE {name}") == 1 or text.count(f"# TYPE {name}_total") == 1
    mapped = {s.labels["model"]: s.value for s in families["proxima_kv_mapped_bytes"].samples}
    assert mapped == {"alpha": 6 * 1048576.0, "beta": 5 * 1048576.0}
    prompt = {(s.name, s.labels["model"]): s.value for s in families["vllm:prompt_tokens"].samples}
    assert prompt[("vllm:prompt_tokens_total", "beta")] == 1.0
    created = families["vllm:prompt_tokens_created"]    # as prometheus_client writes it
    assert created.type == "gauge" and text.count("# TYPE vllm:prompt_tokens_created") == 1
    assert {s.labels["model"]: s.value for s in created.samples} == {"alpha": 1.7e9, "beta": 1.7e9}
    # the engines' own labels are kept beside the added one
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels["engine"] == "0" and running.labels["model_name"] == running.labels["model"]
    assert text.count("# HELP vllm:e2e_request_latency_seconds ") == 1


def test_merge_keeps_one_help_and_type_per_family_and_drops_a_conflicting_type():
    a = "# TYPE x gauge\nx 1\n# TYPE y_total counter\ny_total 2\n"
    b = "# TYPE x_total counter\nx_total 5\n# HELP y_total why\n# TYPE y_total counter\ny_total 3\n"
    text = merge_expositions([("a", a), ("b", b), ("c", None)])
    assert text.count("# TYPE x gauge") == 1 and "x_total" not in text
    assert 'y_total{model="a"} 2.0' in text and 'y_total{model="b"} 3.0' in text
    assert 'proxima_router_engine_up{model="c"} 0.0' in text


def test_a_killed_engine_is_restarted_and_its_model_answers_503_meanwhile(endpoint):
    ep = endpoint({"alpha": [], "beta": []}, backoff=(1.0,))
    engine = ep.engines["beta"]
    first_pid = engine.pid
    assert ep.get("/health").json()["engines"]["beta"]["pid"] == first_pid
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: engine.backend.state == RESTARTING, "beta restarting")
    refused = ep.post("/v1/completions", {"model": "beta", "prompt": "x"})
    assert refused.status_code == 503
    assert "being restarted" in refused.json()["error"]["message"]
    assert ep.get("/health").json()["not_ready"] == ["beta"]
    assert ep.post("/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200
    wait_for(lambda: engine.backend.state == READY, "beta back")
    assert engine.pid != first_pid and engine.backend.restarts == 1
    assert ep.post("/v1/completions", {"model": "beta", "prompt": "x"}).json()["engine"] == "beta"
    assert 'proxima_router_engine_restarts_total{model="beta"} 1.0' in ep.get("/metrics").text


def test_a_killed_arbiter_is_seen_at_once_and_its_orphan_worker_stopped(endpoint):
    # On the GPU (gunicorn: an arbiter, the worker serving): kill -9 of the arbiter left the
    # worker serving and holding the output pipe, and the supervisor never saw the death.
    ep = endpoint({"alpha": ["--arbiter"], "beta": ["--arbiter"]}, backoff=(1.0,))
    engine = ep.engines["beta"]
    arbiter = engine.pid
    pattern = re.compile(r"\[beta\] stand-in arbiter .*worker pid (\d+)")
    worker = int(wait_for(lambda: next((m.group(1) for m in map(pattern.search, ep.output) if m),
                                       None), "beta's worker pid"))
    os.kill(arbiter, signal.SIGKILL)
    wait_for(lambda: engine.backend.state == RESTARTING, "beta restarting")
    assert ep.post("/v1/completions", {"model": "beta", "prompt": "x"}).status_code == 503
    wait_for(lambda: not os.path.exists(f"/proc/{worker}") or
             open(f"/proc/{worker}/stat").read().split()[2] == "Z", "the orphan worker gone")
    wait_for(lambda: engine.backend.state == READY, "beta back")
    assert engine.pid != arbiter and engine.backend.restarts == 1
    assert ep.post("/v1/completions", {"model": "beta", "prompt": "x"}).json()["engine"] == "beta"


STOPPED_BY_SIGTERM = """
import asyncio, os, sys
from proxima.serve import multi
from proxima.serve.router import Backend
ports = [int(p) for p in sys.argv[1:4]]
engines = [multi.Engine(backend=Backend(name=n, url=f"http://127.0.0.1:{p}", path=f"/models/{n}"),
                        command=[sys.executable, "-m", "tests.serve.standin_engine", "--port",
                                 str(p), "--model", n, "--arbiter"], env=dict(os.environ))
           for n, p in zip(("alpha", "beta"), ports)]
sys.exit(asyncio.run(multi.serve(engines, "127.0.0.1", ports[2])))
"""


def test_sigterm_stops_the_endpoint_and_every_engine_with_exit_0(tmp_path):
    ports = [free_port() for _ in range(3)]
    proc = __import__("subprocess").Popen(
        [sys.executable, "-c", STOPPED_BY_SIGTERM, *map(str, ports)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=(tmp_path / "out").open("w"),
        stderr=__import__("subprocess").STDOUT)
    url = f"http://127.0.0.1:{ports[2]}"
    health = wait_for(lambda: _answers(url) and httpx.get(url + "/health").status_code == 200
                      and httpx.get(url + "/health").json(), "both engines ready")
    pids = [e["pid"] for e in health["engines"].values()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "out").read_text()
    # a clean stop prints no traceback (the engines' pipes were once left to be closed after
    # the loop had ended: "Exception ignored ... Event loop is closed", twice)
    said = (tmp_path / "out").read_text()
    assert "Traceback" not in said and "Exception ignored" not in said, said
    for pid in pids:                                   # the arbiters, and with them the workers
        assert not os.path.exists(f"/proc/{pid}")
    for port in ports[:2]:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_an_engine_that_keeps_dying_is_given_up_and_the_others_keep_serving(endpoint):
    ep = endpoint({"alpha": [], "beta": []}, backoff=(0.05,), max_restarts=2)
    engine = ep.engines["beta"]
    for n in range(3):
        wait_for(lambda: engine.backend.state == READY, f"beta ready ({n})")
        os.kill(engine.pid, signal.SIGKILL)
        wait_for(lambda: engine.backend.state != READY, "beta's death seen")
    wait_for(lambda: engine.backend.state == FAILED, "beta given up")
    assert "given up" in ep.get("/health").json()["engines"]["beta"]["detail"]
    assert ep.post("/v1/completions", {"model": "beta", "prompt": "x"}).status_code == 503
    assert ep.post("/v1/completions", {"model": "alpha", "prompt": "x"}).status_code == 200


def test_an_engine_that_cannot_start_stops_everything_with_its_error_line(endpoint):
    ep = endpoint({"alpha": [], "beta": ["--no-such-option"]}, wait_ready=False)
    ep.thread.join(timeout=WAIT_S)
    assert ep.result["code"] == 1
    assert "beta" in ep.endpoint.line and "before it was ready" in ep.endpoint.line
    assert "unrecognized arguments: --no-such-option" in ep.endpoint.line
    assert any(line.startswith("[beta] ") for line in ep.output)      # its log, prefixed
    assert ep.engines["alpha"].process.returncode is not None          # stopped with it


def test_side_by_side_an_engine_that_cannot_start_stops_the_others_mid_start(endpoint):
    """All at once, the others are still starting (alpha never gets ready) when beta fails:
    every one is stopped, and the line is beta's."""
    ep = endpoint({"alpha": ["--health", "503"], "beta": ["--no-such-option"]},
                  wait_ready=False, side_by_side=True)
    ep.thread.join(timeout=WAIT_S)
    assert ep.result["code"] == 1
    assert "beta" in ep.endpoint.line and "unrecognized arguments" in ep.endpoint.line
    assert ep.engines["alpha"].process.returncode is not None
