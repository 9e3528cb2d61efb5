"""Idle models sleep and wake on their next request (issue 36, item 3), on CPU: the real
endpoint (uvicorn, router, supervisor, :mod:`proxima.serve.sleepwake`) over stand-in
engines (tests/serve/standin_engine.py) that serve ``/proxima/sleep`` and
``/proxima/wake_up`` as ``proxima serve --sleep-mode`` does: an asleep stand-in answers
inference with 503, so a request that got through was answered by an awake engine."""

from __future__ import annotations

import json
import logging
import threading

import pytest

httpx = pytest.importorskip("httpx")

from tests.serve.test_serve_multi import endpoint, wait_for  # noqa: E402,F401

SLEEP_AFTER = 0.4


class Logged(logging.Handler):
    """The endpoint's log lines, caught on the "proxima.serve" logger itself (the "proxima"
    logger stops propagating once any serve test ran logs.setup())."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def logged():
    logger = logging.getLogger("proxima.serve")
    handler, level = Logged(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def kv(ep, name):
    return ep.get(f"/engines/{name}/proxima/kv").json()


def asleep(ep, name):
    return ep.engines[name].backend.sleep_state == "asleep"


def complete(ep, name, **extra):
    return ep.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2, **extra})


def test_an_idle_model_is_put_to_sleep_and_still_listed(endpoint, logged):
    ep = endpoint({"alpha": [], "beta": []}, sleep_after={"alpha": SLEEP_AFTER})
    assert complete(ep, "alpha").status_code == 200
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")
    state = kv(ep, "alpha")
    # the engine itself sleeps (it may have slept and woken already while beta started)
    assert state["sleeping"] is True and state["sleeps"] == state["wakes"] + 1
    assert kv(ep, "beta")["sleeping"] is False                    # no sleep_after: never
    listing = {m["id"]: m for m in ep.get("/v1/models").json()["data"]}
    assert set(listing) == {"alpha", "beta"}
    assert listing["alpha"]["proxima_sleeping"] is True
    assert listing["alpha"]["proxima_sleep_state"] == "asleep"
    assert "proxima_sleeping" not in listing["beta"] and "proxima_sleep_state" not in listing["beta"]
    health = ep.get("/health")
    assert health.status_code == 200                              # asleep is not unhealthy
    assert health.json()["engines"]["alpha"]["sleep"] == "asleep"
    metrics = ep.get("/metrics").text
    assert 'proxima_sleeping{model="alpha"} 1.0' in metrics
    assert 'proxima_sleeping{model="beta"}' not in metrics
    assert any("model alpha: asleep in" in r for r in logged)


def test_a_model_with_a_request_in_flight_does_not_sleep(endpoint, tmp_path):
    gate = tmp_path / "gate"
    ep = endpoint({"alpha": ["--gate", str(gate)]}, sleep_after={"alpha": SLEEP_AFTER})
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")       # idle since it started
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        # the stream is held open for well past sleep_after: the model stays awake
        threading.Event().wait(SLEEP_AFTER * 4)
        assert ep.engines["alpha"].backend.sleep_state == "awake"
        assert ep.engines["alpha"].backend.in_flight == 1
        gate.touch()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep once the stream ended")
    assert ep.engines["alpha"].backend.in_flight == 0


def test_a_request_for_a_sleeping_model_wakes_it_once_and_is_answered(endpoint, logged):
    ep = endpoint({"alpha": []}, sleep_after={"alpha": SLEEP_AFTER})
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")
    answer = complete(ep, "alpha")
    assert answer.status_code == 200, answer.text
    assert answer.json()["engine"] == "alpha"
    state = kv(ep, "alpha")
    assert state["wakes"] == 1 and state["sleeping"] is False
    assert ep.engines["alpha"].backend.wakes == 1
    assert any("model alpha: awake in" in r for r in logged)
    entry = ep.get("/v1/models/alpha").json()
    assert entry["proxima_sleeping"] is False and entry["proxima_sleep_state"] == "awake"
    # it falls asleep again, and a streamed request wakes it just the same
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep again")
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line]
    assert [json.loads(x.removeprefix("data: "))["choices"][0]["text"] for x in lines[:-1]] == \
        [" t0", " t1", " t2"]
    assert kv(ep, "alpha")["wakes"] == 2
    metrics = ep.get("/metrics").text
    assert 'proxima_router_wakes_total{model="alpha"} 2.0' in metrics


def test_concurrent_requests_for_a_sleeping_model_make_one_wake(endpoint):
    ep = endpoint({"alpha": ["--wake-delay", "0.5"]}, sleep_after={"alpha": SLEEP_AFTER})
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")
    answers = [None] * 4

    def ask(i):
        answers[i] = complete(ep, "alpha")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert [a.status_code for a in answers] == [200] * 4
    assert kv(ep, "alpha")["wakes"] == 1
    assert ep.engines["alpha"].backend.wakes == 1


def test_a_failed_wake_answers_503_in_openais_shape_and_the_model_stays_listed(endpoint, logged):
    ep = endpoint({"alpha": ["--wake-fail"], "beta": []}, sleep_after={"alpha": SLEEP_AFTER})
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")
    answer = complete(ep, "alpha")
    assert answer.status_code == 503
    assert answer.headers["retry-after"].isdigit()
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "asleep and could not be woken" in error["message"]
    assert "CUDA out of memory" in error["message"]               # the engine's reason
    assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
    assert [m["id"] for m in ep.get("/v1/models").json()["data"]] == ["alpha", "beta"]
    assert asleep(ep, "alpha") and kv(ep, "alpha")["sleeping"] is True
    assert complete(ep, "beta").status_code == 200                # the others serve on
    assert any("model alpha: wake failed" in r for r in logged)


def test_a_wake_that_finds_no_room_answers_503_without_waking_the_engine(endpoint):
    async def no_room(name, need, timeout):
        from proxima.serve.sleepwake import WakeFailed

        assert (name, need) == ("alpha", 2**30)         # the weights the sleep freed
        raise WakeFailed("the GPU's other engines did not give back 1.00 GiB within 1 s")

    ep = endpoint({"alpha": []}, sleep_after={"alpha": SLEEP_AFTER},
                  sleep_options={"make_room": no_room})
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep")
    answer = complete(ep, "alpha")
    assert answer.status_code == 503 and "did not give back" in answer.json()["error"]["message"]
    state = kv(ep, "alpha")
    assert state["sleeping"] is True and state["wakes"] == 0      # never asked to wake


def test_sleep_and_wake_asked_through_the_endpoint_keep_its_state_right(endpoint, tmp_path):
    gate = tmp_path / "gate"
    ep = endpoint({"alpha": ["--gate", str(gate)]}, sleep_after={"alpha": 3600})
    slept = ep.post("/engines/alpha/proxima/sleep", None)
    assert slept.status_code == 200 and slept.json()["sleeping"] is True
    assert asleep(ep, "alpha") and kv(ep, "alpha")["sleeping"] is True
    assert ep.post("/engines/alpha/proxima/sleep", None).json()["sleeping"] is True
    assert kv(ep, "alpha")["sleeps"] == 1                         # once
    woke = ep.post("/engines/alpha/proxima/wake_up", None)
    assert woke.status_code == 200 and woke.json()["sleeping"] is False
    assert kv(ep, "alpha")["wakes"] == 1
    # a model serving a request is not put to sleep under it
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        refused = ep.post("/engines/alpha/proxima/sleep", None)
        assert refused.status_code == 409 and "serving requests" in refused.json()["error"]
        gate.touch()
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert kv(ep, "alpha")["sleeping"] is False


def test_idle_time_counts_from_the_last_request_or_from_when_the_engine_became_ready():
    from types import SimpleNamespace

    from proxima.serve.router import READY, STARTING, Backend
    from proxima.serve.sleepwake import SleepWake

    a = Backend(name="a", url="http://127.0.0.1:1", sleep_after=60, state=STARTING)
    b = Backend(name="b", url="http://127.0.0.1:2", sleep_after=None, state=READY)
    sw = SleepWake(SimpleNamespace(backends={"a": a, "b": b}))
    start = a.last_request
    assert sw.tick(start + 600) == []                 # starting for 10 minutes: not idle
    a.state = READY
    assert sw.tick(start + 659) == []                 # ready for 59 s
    assert sw.tick(start + 660) == [a]                # b has no sleep_after: never
    end = sw.begin(a)
    assert sw.tick(start + 9999) == []                # a request in flight
    end()
    end()                                             # ended once, whatever is called twice
    assert a.in_flight == 0 and sw.tick(a.last_request + 59.9) == []
    assert sw.tick(a.last_request + 60) == [a]
    a.sleep_retry_at = a.last_request + 70            # its engine refused: not before then
    assert sw.tick(a.last_request + 65) == [] and sw.tick(a.last_request + 70) == [a]


def test_a_wakes_room_is_asked_of_the_other_engines_through_the_gpus_ledger(tmp_path):
    """What the weights need and the GPU does not have free is posted as unmet demand in
    the GPU's real ledger file (the other engines give back at their next step), until
    the GPU has it; never given: the wake fails, and the demand is taken away either way."""
    import asyncio

    from proxima.memory.ledger import ledger_path, live_records
    from proxima.serve.sleepwake import WakeFailed, gpu_room

    GiB = 2**30
    path = ledger_path("GPU-sleep", tmp_path)
    seen = []
    frees = iter([9 * GiB])
    room = gpu_room("GPU-sleep", str(tmp_path), free=lambda: next(frees))
    asyncio.run(room("alpha", 8 * GiB, 5.0))                      # free enough: nothing asked
    assert live_records(path) == ()

    def freeing():
        values = iter([5 * GiB, 5 * GiB, 6 * GiB, 8 * GiB])
        def free():
            seen.append([(r.name, r.unmet) for r in live_records(path)])
            return next(values)
        return free

    asyncio.run(gpu_room("GPU-sleep", str(tmp_path), free=freeing())("alpha", 8 * GiB, 30.0))
    assert ("starting", 3 * GiB) in seen[2]                       # the demand the others read
    assert live_records(path) == ()                               # gone once met
    stuck = gpu_room("GPU-sleep", str(tmp_path), free=lambda: 5 * GiB)
    with pytest.raises(WakeFailed, match="did not give back the 3.00 GiB its weights need"):
        asyncio.run(stuck("alpha", 8 * GiB, 0.5))
    assert live_records(path) == ()


def test_a_wake_leaves_the_gpus_free_margin_free(tmp_path):
    """The weights' bytes plus keep_free (an engine's KV map leaves that much free for the
    forward's activations): a wake that would take the GPU below it asks the others for the
    difference first."""
    import asyncio

    from proxima.memory.ledger import ledger_path, live_records
    from proxima.serve.sleepwake import WakeFailed, gpu_room

    GiB = 2**30
    path = ledger_path("GPU-margin", tmp_path)
    asyncio.run(gpu_room("GPU-margin", str(tmp_path), free=lambda: 9 * GiB,
                         keep_free=1 * GiB)("alpha", 8 * GiB, 5.0))   # 8 + 1: nothing asked
    assert live_records(path) == ()
    seen = []

    def free():
        seen.append([(r.name, r.unmet) for r in live_records(path)])
        return 8 * GiB                  # the weights' bytes free, the margin not
    with pytest.raises(WakeFailed, match=r"1.00 GiB its weights need \(with 1.00 GiB left free\)"):
        asyncio.run(gpu_room("GPU-margin", str(tmp_path), free=free,
                             keep_free=1 * GiB)("alpha", 8 * GiB, 0.5))
    assert ("starting", 1 * GiB) in [entry for read in seen for entry in read]
    assert live_records(path) == ()


def test_an_idle_sleeper_sleeps_for_another_engines_unmet_demand_not_its_own():
    """Before its sleep_after: a model that may sleep, idle DEMAND_IDLE_S (HELD_IDLE_S if
    its last sleep was undone by a request less than HELD_IDLE_S after its last one), is
    chosen when another engine on the GPU wants memory it cannot get; never for its own
    demand, never with a request in flight, one at a time, the least recently used first."""
    import asyncio
    import time
    from types import SimpleNamespace

    from proxima.serve.router import READY, Backend
    from proxima.serve.sleepwake import ASLEEP, AWAKE, DEMAND_IDLE_S, HELD_IDLE_S, SleepWake

    GiB = 2**30
    a = Backend(name="a", url="http://127.0.0.1:8101", sleep_after=600, state=READY, pid=11)
    b = Backend(name="b", url="http://127.0.0.1:8102", sleep_after=None, state=READY, pid=12)
    c = Backend(name="c", url="http://127.0.0.1:8103", sleep_after=600, state=READY, pid=13)
    sw = SleepWake(SimpleNamespace(backends={"a": a, "b": b, "c": c}), demand=lambda: [])
    start = max(a.last_request, c.last_request)
    c.last_request = start + 5                        # used more recently than a
    busy = [(8102, 5 * GiB)]
    assert sw.for_demand(start + DEMAND_IDLE_S - 0.1, busy) is None      # not idle enough
    assert sw.for_demand(start + DEMAND_IDLE_S, busy) is a               # b may never sleep
    assert sw.for_demand(start + DEMAND_IDLE_S, []) is None              # nobody wants
    assert sw.for_demand(start + DEMAND_IDLE_S, [(8101, 5 * GiB)]) is None   # a's own
    assert sw.for_demand(start + 99, [(8101, 5 * GiB)]) is c             # a's, for c
    assert sw.tick(start + 99) == []                                     # sleep_after 600
    end = sw.begin(a)
    assert sw.for_demand(start + 99, busy) is c                          # a is serving
    end()
    c.sleep_state = ASLEEP

    def woken_after(backend, gap: float) -> None:
        """``backend`` asleep, a request ``gap`` s after its last one (its wake: a real
        awake() with the engine's answer stood in for)."""
        async def woke(_backend) -> None:
            _backend.sleep_state = AWAKE
        backend.sleep_state = ASLEEP
        backend.last_request = time.monotonic() - gap
        sw._wake = woke
        assert asyncio.run(sw.awake(backend)) is None
        assert backend.sleep_state == AWAKE

    assert DEMAND_IDLE_S < HELD_IDLE_S
    # alternating bursts: woken for its burst long after its last request, idle through
    # the other's burst: sleeps for it after DEMAND_IDLE_S (s41: held 10 s, the other's
    # 15 s burst of short requests ran 10 s without its memory)
    woken_after(a, HELD_IDLE_S + 5)
    t = a.last_request
    assert sw.for_demand(t + DEMAND_IDLE_S - 0.1, busy) is None
    assert sw.for_demand(t + DEMAND_IDLE_S, busy) is a
    # requests now and then: woken 3 s after its last one, that sleep was a mistake: it
    # sleeps for demand only once idle HELD_IDLE_S ...
    woken_after(a, 3.0)
    t = a.last_request
    assert sw.for_demand(t + DEMAND_IDLE_S, busy) is None
    assert sw.for_demand(t + HELD_IDLE_S - 0.1, busy) is None
    assert sw.for_demand(t + HELD_IDLE_S, busy) is a
    # ... and stays so while it is awake and after later requests, until a wake after a
    # gap of HELD_IDLE_S or more
    a.last_request = t2 = t + 20
    assert sw.for_demand(t2 + HELD_IDLE_S - 0.1, busy) is None
    woken_after(a, HELD_IDLE_S)
    assert sw.for_demand(a.last_request + DEMAND_IDLE_S, busy) is a
    # a request to an awake model does not change it (only a wake tells a gap)
    a.held = True
    a.last_request = time.monotonic() - 1.0
    assert asyncio.run(sw.awake(a)) is None and a.held is True
    sw._sleeps["a"] = None                                               # a falling asleep
    assert sw.for_demand(a.last_request + 99, busy) is None
    # a short sleep_after is its own bound on the idle time
    d = Backend(name="d", url="http://127.0.0.1:8104", sleep_after=2, state=READY, pid=14)
    sw = SleepWake(SimpleNamespace(backends={"d": d}), demand=lambda: [])
    assert sw.for_demand(d.last_request + 2, [(0, GiB)]) is d      # a wake's room (port 0)


def test_a_model_sleeps_for_the_demand_another_engine_posts_in_the_gpus_ledger(
        endpoint, logged, tmp_path):
    """The real endpoint and the GPU's real ledger file: an engine posts unmet demand (as a
    busy elastic engine whose grow the GPU cannot back does); the idle model that may sleep
    is put to sleep long before its sleep_after, its KV given back at once; its next request
    wakes it and is answered, and, woken so soon after its last request, it is not slept again
    for the same demand after the short idle."""
    from proxima.memory.ledger import Ledger, ledger_path
    from proxima.serve.sleepwake import gpu_demand

    GiB = 2**30
    ep = endpoint({"alpha": [], "beta": []}, sleep_after={"alpha": 600},
                  sleep_options={"demand": gpu_demand("GPU-demand", str(tmp_path)),
                                 "demand_idle_s": 0.3})
    assert complete(ep, "alpha").status_code == 200
    beta_port = int(ep.engines["beta"].backend.url.rsplit(":", 1)[1])
    busy = Ledger(ledger_path("GPU-demand", tmp_path), model="beta", port=beta_port)
    busy.post(mapped=40 * GiB, minimum=GiB, unmet=6 * GiB)
    wait_for(lambda: asleep(ep, "alpha"), "alpha asleep for beta's demand")
    assert any("model alpha sleeps for the GPU's other engines: 6.00 GiB wanted" in r
               for r in logged)
    assert kv(ep, "alpha")["sleeping"] is True
    assert complete(ep, "alpha").status_code == 200              # woken, answered
    assert ep.engines["alpha"].backend.sleep_state == "awake"
    import time

    time.sleep(1.0)                                              # the demand is still there
    # held: woken soon after its last request
    assert ep.engines["alpha"].backend.sleep_state == "awake"
    assert sum("sleeps for the GPU's other engines" in r for r in logged) == 1
    busy.close()


def test_two_endpoints_on_one_gpu_sleep_for_each_others_demand(endpoint, logged, tmp_path):
    """Two engines as two separate ``proxima serve --model 'NAME=PATH --sleep-after S'``
    (one model each, as two users start them): they meet only in the GPU's ledger file. The
    busy one's unmet demand puts the other's idle model to sleep; the busy one never sleeps
    for its own demand; the sleeper's next request, sent to its own endpoint, wakes it."""
    from proxima.memory.ledger import Ledger, ledger_path
    from proxima.serve.sleepwake import gpu_demand

    GiB = 2**30
    options = {"demand_idle_s": 0.3}
    one = endpoint({"alpha": []}, sleep_after={"alpha": 600}, sleep_options={
        "demand": gpu_demand("GPU-two", str(tmp_path)), **options})
    two = endpoint({"beta": []}, sleep_after={"beta": 600}, sleep_options={
        "demand": gpu_demand("GPU-two", str(tmp_path)), **options})
    assert complete(one, "alpha").status_code == 200
    assert complete(two, "beta").status_code == 200
    beta_port = int(two.engines["beta"].backend.url.rsplit(":", 1)[1])
    busy = Ledger(ledger_path("GPU-two", tmp_path), model="beta", port=beta_port)
    busy.post(mapped=40 * GiB, minimum=GiB, unmet=6 * GiB)
    wait_for(lambda: asleep(one, "alpha"), "alpha asleep for the other endpoint's demand")
    import time

    time.sleep(1.0)             # beta's demand is its own: beta stays awake
    assert two.engines["beta"].backend.sleep_state != "asleep"
    assert complete(two, "beta").status_code == 200
    assert complete(one, "alpha").status_code == 200                 # woken, answered
    assert one.engines["alpha"].backend.sleep_state == "awake"
    slept = [r for r in logged if "sleeps for the GPU's other engines" in r]
    assert len(slept) == 1 and slept[0].startswith(
        "model alpha sleeps for the GPU's other engines: 6.00 GiB wanted (idle ")
    busy.close()
