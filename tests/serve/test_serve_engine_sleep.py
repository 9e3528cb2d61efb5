"""One engine's ``POST /proxima/sleep`` and ``/proxima/wake_up`` (proxima.serve.engine_sleep)
through the real gate and vLLM's real app, with an engine client standing in for vLLM's
AsyncLLM (no GPU here): it keeps the state a real engine would (mapped KV given back by
the idle release over a few reads, asleep or awake, what its ledger was told) and refuses
what vLLM would (a wake that finds no memory)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from starlette.testclient import TestClient

from proxima.serve.app import create_app
from proxima.serve.supervisor import READY

from .test_serve_app import args, vllm_app  # noqa: F401  (fixtures)

GRAIN = 2 << 20


class StandInEngineClient:
    """AsyncLLM's part the routes use: ``sleep``, ``wake_up``, ``engine_core.
    call_utility_async("proxima_kv", ...)``, ``errored``, ``vllm_config``."""

    def __init__(self, sleep_mode=True, mapped_granules=3, wake_error=None):
        self.errored = False
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=sleep_mode))
        self.mapped = mapped_granules           # given back one granule per read (idle)
        self.releasing = True
        self.asleep = False
        self.asleep_bytes = 0
        self.quiet = False                      # the connector asks for no idle steps
        self.calls = []
        self.wake_error = wake_error
        self.engine_core = SimpleNamespace(call_utility_async=self._utility)

    async def _utility(self, name, request):
        assert name == "proxima_kv"
        request = dict(request)
        if "sleeping" in request:
            self.quiet = request.pop("sleeping")
        if "asleep_bytes" in request:
            self.asleep_bytes = request.pop("asleep_bytes")
        if request.pop("release_now", None) is True:   # the policy's release_idle_now
            self.calls.append(("release_now",))
            self.mapped = 1
        answer = {"mapped_bytes": self.mapped * GRAIN, "bytes_per_granule": GRAIN,
                  "used_bytes": 0}
        if self.releasing and self.mapped > 1 and not self.asleep:
            self.mapped -= 1
        return answer

    async def sleep(self, level=1, mode="abort"):
        assert not self.asleep and self.mapped == 1, "slept before the KV was given back"
        # vLLM's pause would never complete while the connector keeps the engine stepping
        assert self.quiet, "slept while the connector still asks for idle steps"
        self.calls.append(("sleep", level, mode))
        await asyncio.sleep(0)
        self.asleep = True

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        if self.wake_error:
            raise RuntimeError(self.wake_error)
        self.asleep = False


def client_for(args, vllm_app, engine):  # noqa: F811
    app = create_app(args)
    app.supervisor.inner, app.supervisor.phase, app.supervisor.engine = vllm_app, READY, engine
    app.sleep.poll_s = 0.01
    return app, TestClient(app)


def test_sleep_waits_for_the_kv_then_sleeps_and_a_wake_brings_it_back(args, vllm_app,  # noqa: F811
                                                                      monkeypatch):
    from proxima.serve import engine_sleep

    monkeypatch.setattr(engine_sleep, "weights_bytes", lambda a: 7 << 30)
    engine = StandInEngineClient(mapped_granules=3)
    app, client = client_for(args, vllm_app, engine)
    assert client.get("/version").status_code == 200
    slept = client.post("/proxima/sleep")
    assert slept.status_code == 200, slept.text
    assert slept.json()["sleeping"] is True and slept.json()["weights_bytes"] == 7 << 30
    assert engine.calls == [("sleep", 1, "wait")] and engine.asleep
    assert engine.asleep_bytes == 7 << 30                   # the ledger was told
    assert client.get("/proxima/kv").json()["sleeping"] is True
    # asleep: inference is refused with how to wake it; health and metrics still answer
    refused = client.get("/version")
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert "asleep" in refused.json()["error"]["message"]
    assert "/proxima/wake_up" in refused.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert client.post("/proxima/sleep").json()["sleeping"] is True   # no second sleep
    assert engine.calls == [("sleep", 1, "wait")]
    woke = client.post("/proxima/wake_up")
    assert woke.status_code == 200 and woke.json()["sleeping"] is False
    assert engine.asleep_bytes == 0 and not engine.asleep and not engine.quiet
    assert client.get("/version").status_code == 200
    assert client.post("/proxima/wake_up").json() == {"sleeping": False, "seconds": 0.0}
    assert engine.calls == [("sleep", 1, "wait"), ("wake_up", None)]


def test_a_sleep_while_the_kv_is_held_is_refused_and_changes_nothing(args, vllm_app):  # noqa: F811
    engine = StandInEngineClient(mapped_granules=4)
    engine.releasing = False                                # a request holds its KV
    app, client = client_for(args, vllm_app, engine)
    answer = client.post("/proxima/sleep", json={"timeout_s": 0.05})
    assert answer.status_code == 409 and answer.headers["retry-after"]
    assert "not given back yet" in answer.json()["error"]
    assert engine.calls == [] and client.get("/version").status_code == 200
    for bad in ({"timeout_s": -1}, {"timeout_s": "soon"}, [1]):
        assert client.post("/proxima/sleep", json=bad).status_code == 400
    assert client.get("/proxima/sleep").status_code == 405


def test_a_sleep_with_release_gives_the_kv_back_at_once_rather_than_waiting(args,  # noqa: F811
                                                                            vllm_app):
    engine = StandInEngineClient(mapped_granules=4)
    engine.releasing = False                    # its idle release is not due for minutes
    app, client = client_for(args, vllm_app, engine)
    answer = client.post("/proxima/sleep", json={"timeout_s": 0.05, "release": True})
    assert answer.status_code == 200 and answer.json()["sleeping"] is True
    assert engine.calls == [("release_now",), ("sleep", 1, "wait")]
    for bad in ({"release": "yes"}, {"timeout_s": 1, "releas": True}):
        refused = client.post("/proxima/sleep", json=bad)
        assert refused.status_code == 400 and "release" in refused.json()["error"]


def test_a_failed_wake_leaves_the_engine_asleep_and_says_why(args, vllm_app):  # noqa: F811
    engine = StandInEngineClient(mapped_granules=1, wake_error="CUDA out of memory")
    app, client = client_for(args, vllm_app, engine)
    assert client.post("/proxima/sleep").status_code == 200
    answer = client.post("/proxima/wake_up")
    assert answer.status_code == 500 and "CUDA out of memory" in answer.json()["error"]
    assert app.sleep.state == "asleep" and client.get("/version").status_code == 503
    assert engine.quiet                 # still asleep: the connector asks for no step


def test_an_engine_without_sleep_mode_refuses_both_routes(args, vllm_app):  # noqa: F811
    app, client = client_for(args, vllm_app, StandInEngineClient(sleep_mode=False))
    for route in ("/proxima/sleep", "/proxima/wake_up"):
        answer = client.post(route)
        assert answer.status_code == 409 and "--sleep-mode" in answer.json()["error"]
    app.supervisor.phase = "starting"
    assert client.post("/proxima/sleep").status_code == 503
