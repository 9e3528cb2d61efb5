"""More models than fit at once, as long as the active ones fit (issue 36, item 3), on CPU:
the real endpoint (uvicorn, router, supervisor, :mod:`proxima.serve.sleepwake`) over
stand-in engines (tests/serve/standin_engine.py) that sleep and wake as ``proxima serve
--sleep-mode`` does (asleep, their inference routes answer 503: a request that got
through was answered by an awake engine). Each model's place on the GPU is what
:func:`proxima.serve.multi.plan_residency` sets from the models' config.json; here given.
The start-up refusal and plan run the real fit on the repository's dummy model configs."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from proxima.errors import UserError  # noqa: E402
from proxima.serve import multi, residency, validate  # noqa: E402
from proxima.serve.multi_config import parse_command_line  # noqa: E402

from tests.serve.test_serve_multi import endpoint, wait_for  # noqa: E402,F401
from tests.serve.test_serve_sleepwake import complete, kv, logged  # noqa: E402,F401

GiB = 2**30
REPO = Path(__file__).resolve().parents[2]
BIG, MID = str(REPO / "tools/gpu/dummy-llama"), str(REPO / "tools/gpu/dummy-llama-3b")
# three models of 4 GiB awake, 1 GiB asleep, on 9 GiB: two awake at a time
THREE = {"a": [], "b": [], "c": []}
PLACES = {name: (4 * GiB, 1 * GiB) for name in THREE}
HOUR = {name: 3600 for name in THREE}           # no idle sleep during a test: only evictions


def state(ep, name):
    return ep.engines[name].backend.sleep_state


def three(endpoint, models=THREE, **options):  # noqa: F811
    ep = endpoint(models, sleep_after=HOUR, places=PLACES,
                  sleep_options={"capacity": 9 * GiB}, **options)
    wait_for(lambda: state(ep, "a") == "asleep", "a put to sleep for c")
    return ep


def test_three_models_where_two_fit_start_one_asleep_and_all_are_served(endpoint, logged):  # noqa: F811
    ep = three(endpoint)
    assert (state(ep, "b"), state(ep, "c")) == ("awake", "awake")
    assert "model a sleeps to make room for c" in logged
    assert kv(ep, "a")["released"] == 1                 # its KV given back at once
    listing = {m["id"]: m for m in ep.get("/v1/models").json()["data"]}
    assert set(listing) == {"a", "b", "c"} and listing["a"]["proxima_sleeping"] is True
    assert ep.get("/health").status_code == 200
    for name in ("b", "c"):                             # awake: served with no wake
        assert complete(ep, name).json()["engine"] == name
    assert ep.engines["b"].backend.wakes == ep.engines["c"].backend.wakes == 0
    # the sleeping one wakes on its request; b, the least recently used, sleeps for it
    answer = complete(ep, "a")
    assert answer.status_code == 200 and answer.json()["engine"] == "a"
    assert (state(ep, "a"), state(ep, "b"), state(ep, "c")) == ("awake", "asleep", "awake")
    assert "model b sleeps to make room for a" in logged
    assert kv(ep, "b")["sleeping"] is True and kv(ep, "b")["released"] == 1
    assert complete(ep, "b").json()["engine"] == "b"    # and back: c is now the LRU
    assert state(ep, "c") == "asleep" and state(ep, "a") == "awake"
    assert "model c sleeps to make room for b" in logged


def test_a_model_with_a_request_in_flight_is_never_put_to_sleep(endpoint, tmp_path, logged):  # noqa: F811
    gate = tmp_path / "gate"
    ep = three(endpoint, {"a": [], "b": ["--gate", str(gate)], "c": []})
    complete(ep, "c")                                   # b is the least recently used...
    body = {"model": "b", "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", ep.url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        # ...but serves a request: c sleeps for a instead
        assert complete(ep, "a").json()["engine"] == "a"
        assert (state(ep, "b"), state(ep, "c")) == ("awake", "asleep")
        assert "model c sleeps to make room for a" in logged
        assert not any(line.startswith("model b sleeps") for line in logged)
        gate.touch()
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert kv(ep, "b")["sleeps"] == 0


def test_with_no_model_to_put_to_sleep_the_wake_is_a_503_in_openais_shape(endpoint, tmp_path,  # noqa: F811
                                                                         logged):
    gates = {n: tmp_path / f"gate-{n}" for n in ("b", "c")}
    ep = three(endpoint, {"a": [], **{n: ["--gate", str(g)] for n, g in gates.items()}})
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    streams = [httpx.stream("POST", ep.url + "/v1/completions", json={**body, "model": n},
                            timeout=30) for n in gates]
    held = []                   # the line iterators kept: a closed one ends the stream
    try:
        for s in streams:
            held.append(s.__enter__().iter_lines())
            assert next(line for line in held[-1] if line).startswith("data: ")
        refused = complete(ep, "a")
        assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
        assert "asleep and could not be woken" in error["message"]
        assert "lacks 3.00 GiB" in error["message"] and "request in flight" in error["message"]
        assert (state(ep, "a"), state(ep, "b"), state(ep, "c")) == ("asleep", "awake", "awake")
        assert kv(ep, "a")["wakes"] == 0                # never asked to wake
    finally:
        for g in gates.values():
            g.touch()
        for s in streams:
            s.__exit__(None, None, None)
    assert complete(ep, "a").status_code == 200         # once one is idle, it sleeps for a


def test_a_restarting_engine_puts_an_idle_sleeper_to_sleep_before_it_starts(endpoint, logged):  # noqa: F811
    ep = three(endpoint, backoff=(5.0,))
    c = ep.engines["c"]
    first = c.pid
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: c.backend.state == "restarting", "c restarting")
    # c's memory is free while it is down: a wakes with no model put to sleep
    assert complete(ep, "a").json()["engine"] == "a"
    assert c.backend.state == "restarting" and state(ep, "b") == "awake"
    wait_for(lambda: c.backend.state == "ready" and c.pid != first, "c back")
    # c starts awake: b (idle longest) slept first, so the GPU's count never went over
    assert (state(ep, "a"), state(ep, "b"), state(ep, "c")) == ("awake", "asleep", "awake")
    assert "model b sleeps to make room for c" in logged
    assert complete(ep, "c").json()["engine"] == "c"


def test_a_start_waits_for_a_model_with_a_request_in_flight_to_finish(tmp_path):
    """:meth:`SleepWake.admit` never puts a busy model to sleep: it waits."""
    import asyncio
    from types import SimpleNamespace

    from proxima.serve.router import READY, Backend
    from proxima.serve.sleepwake import SleepWake

    a = Backend(name="a", url="u", sleep_after=60, state=READY, pid=1,
                awake_bytes=4 * GiB, asleep_bytes=GiB)
    b = Backend(name="b", url="u", sleep_after=None, awake_bytes=4 * GiB)
    sw = SleepWake(SimpleNamespace(backends={"a": a, "b": b}), capacity=6 * GiB,
                   wake_timeout=0.3, tick_s=0.05)
    a.in_flight = 1
    asyncio.run(sw.admit(b))            # after the bound: started anyway, a untouched
    assert b.admitted and a.sleep_state == "awake"
    assert sw.short(b) == 2 * GiB


# -- before anything starts ------------------------------------------------------------------
def models(*specs):
    argv = []
    for spec in specs:
        argv += ["--model", spec]
    return argv


def test_the_start_up_fit_counts_only_the_never_sleeping_and_the_largest_sleeper(monkeypatch):
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    argv = models(f"chat={BIG}", f"rare={BIG} --sleep-after 60", f"mid={MID} --sleep-after 60")
    all_awake = parse_command_line([*argv, "--gpu-memory-bytes", "80GiB"])
    chat, rare, mid = multi.fit_models(all_awake)[2]
    assert chat.sleeps is False and rare.sleeps and mid.sleeps
    assert rare.freed > mid.freed > 5 * GiB                     # the weights a sleep frees
    total = chat.awake + rare.awake + mid.awake
    least = chat.awake + rare.awake + mid.asleep                # never + largest + mid asleep
    assert least < 40 * GiB < total
    # 40 GiB: not all at once, accepted; the start-up plan says who sleeps for whom
    plan, _, _, engines = multi.prepare([*argv, "--gpu-memory-bytes", "40GiB",
                                         "--port", str(_port())])
    need, capacity, places, source = multi.fit_models(plan)
    # what the endpoint is given: each backend's place, what the GPU has for them
    assert multi.plan_residency(plan, {}, engines) == 40 * GiB
    assert [(e.backend.awake_bytes, e.backend.asleep_bytes) for e in engines] == \
        [(chat.awake, chat.awake), (rare.awake, rare.asleep), (mid.awake, mid.asleep)]
    assert need == least and capacity == 40 * GiB
    lines = residency.plan_lines(places, capacity, source)
    assert "take turns" in lines[0]
    assert lines[1] == "at start-up, model rare sleeps to make room for mid (it wakes on its " \
                       "first request)"
    # without --sleep-after the same three are refused as before
    with pytest.raises(UserError, match="the models do not fit on one GPU even at their min"):
        multi.prepare([*models(f"chat={BIG}", f"rare={BIG}", f"mid={MID}"),
                       "--gpu-memory-bytes", "40GiB", "--port", str(_port())])


def test_the_start_up_refusal_when_the_never_sleeping_and_the_largest_sleeper_do_not_fit(
        monkeypatch):
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    argv = models(f"chat={BIG}", f"rare={BIG} --sleep-after 60", f"mid={MID} --sleep-after 60")
    with pytest.raises(UserError) as err:
        multi.prepare([*argv, "--gpu-memory-bytes", "36GiB", "--port", str(_port())])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("the models that never sleep and the largest that may sleep do "
                           "not fit on one GPU even at their minimums: chat ")
    assert "GiB + rare " in line and "(the largest that may sleep) + mid asleep " in line
    assert "> --gpu-memory-bytes's 36.00 GiB" in line
    assert "give more models --sleep-after" in line


def test_the_plan_puts_the_least_recently_started_sleeper_to_sleep_first():
    P = residency.Place
    places = [P("a", 4, 1), P("never", 4), P("b", 4, 1), P("c", 4, 1)]
    assert residency.start_plan(places, 10) == [("a", "b"), ("b", "c")]
    assert residency.start_plan(places, 16) == []
    with pytest.raises(UserError, match=r"never 0.00 GiB \+ a 0.00 GiB \(the largest"):
        residency.check(places, 7)                  # 4 + 3 asleep + 3 freed = 10 > 7
    assert residency.check(places, 10) == 10


def _port():
    from tests.serve.test_serve_multi import free_port

    return free_port()


def test_a_wake_the_kv_releases_cannot_make_room_for_puts_an_idle_sleeper_to_sleep(endpoint,  # noqa: F811
                                                                                 logged):
    """Not counted (no capacity: e.g. a model given as a Hugging Face id), the GPU still
    lacks the weights' bytes after the others gave back their KV: the least recently used
    idle sleeper sleeps, and the ask is made again."""
    from proxima.serve.sleepwake import WakeFailed

    asks = []

    async def room(name, need, timeout):
        other = state(ep, "b" if name == "a" else "a")
        asks.append((name, other))
        if other != "asleep":                       # the other's weights are what is missing
            raise WakeFailed("the GPU's other engines did not give back 1.00 GiB")

    ep = endpoint({"a": [], "b": []}, sleep_after={"a": 3600, "b": 3600},
                  sleep_options={"make_room": room})
    assert ep.post("/engines/a/proxima/sleep", None).json()["sleeping"] is True
    answer = complete(ep, "a")
    assert answer.status_code == 200 and answer.json()["engine"] == "a"
    assert asks == [("a", "awake"), ("a", "asleep")]
    assert (state(ep, "a"), state(ep, "b")) == ("awake", "asleep")
    assert any(line.startswith("model b sleeps to make room for a") for line in logged)
    # and back: a, idle, sleeps for b
    assert complete(ep, "b").json()["engine"] == "b" and state(ep, "a") == "asleep"
    assert asks[2:] == [("b", "awake"), ("b", "asleep")]


def test_the_count_is_what_the_next_engines_own_sizing_reads_from_the_gpus_ledger(tmp_path):
    """The start-up plan says rare sleeps to make room for mid: through the GPU's real
    ledger file, mid's own sizing (:func:`sizing.plan` over the records, as the engine
    runs it) refuses while rare is awake and fits once rare's record counts it asleep
    (its non-KV memory less the weights, as the connector's ``asleep_bytes`` writes it)."""
    from proxima.memory.ledger import Ledger, ledger_path
    from proxima.serve import autosize, sizing

    argv = models(f"chat={BIG}", f"rare={BIG} --sleep-after 60", f"mid={MID} --sleep-after 60",
                  ) + ["--gpu-memory-bytes", "40GiB"]
    need, capacity, places, _ = multi.fit_models(parse_command_line(argv))
    chat, rare, mid = places
    assert residency.start_plan(places, capacity) == [("rare", "mid")]
    least = sizing.DEFAULT_KV_MIN
    path = ledger_path("GPU-residency", tmp_path)
    records = []
    try:
        for place, name in ((chat, "chat"), (rare, "rare")):
            records.append(Ledger(path, name=name, model=name, nonkv=place.awake - least))
            records[-1].post(least, least)
        others = autosize.ledger_others("GPU-residency", str(tmp_path))
        mid_nonkv = mid.awake - least
        with pytest.raises(UserError, match="does not fit on the GPU even at its minimum"):
            sizing.plan(capacity, mid_nonkv, others)
        rare_ledger = records[1]
        rare_ledger.nonkv = rare.asleep - least                 # what its sleep freed: gone
        rare_ledger.repost()
        others = autosize.ledger_others("GPU-residency", str(tmp_path))
        assert sum(o.claim for o in others) == chat.awake + rare.asleep
        assert sizing.plan(capacity, mid_nonkv, others).kv_min == least
    finally:
        for ledger in records:
            ledger.close()


# -- side by side or one after another ---------------------------------------------------------
def test_engines_start_side_by_side_only_where_the_gpu_has_ample_room(monkeypatch):
    """The three models of the H100 run (8B, 3B and 1B shapes: 31.91 GiB at their minimums)
    start at once on a GPU with 78 GiB free; not on one with 60 GiB free (over half of it),
    not with a model that may sleep, not where the free memory was not probed."""
    small = str(REPO / "tools/gpu/dummy-llama-1b")
    three = models(f"big={BIG}", f"mid={MID}", f"small={small}")
    plan = parse_command_line(three)
    facts = {"devices": [{"total_memory": 85 * 10**9, "free_memory": 78 * GiB, "uuid": "G"}]}
    together, why = multi.start_side_by_side(plan, facts)
    assert together, why
    assert why.startswith("the models need 31.") and why.endswith("the GPU has 78.00 GiB free")
    facts["devices"][0]["free_memory"] = 60 * GiB
    together, why = multi.start_side_by_side(plan, facts)
    assert not together and why.endswith("GiB free: over 50% of it")
    facts["devices"][0]["free_memory"] = 78 * GiB
    sleeper = parse_command_line(models(f"big={BIG}", f"mid={MID} --sleep-after 60"))
    assert multi.start_side_by_side(sleeper, facts) == (
        False, "models that may sleep take turns on the GPU")
    assert multi.start_side_by_side(plan, {}) == (False, "the GPU's free memory is not known")
    given = parse_command_line([*three, "--gpu-memory-bytes", "80GiB"])
    assert multi.start_side_by_side(given, facts)[0] is False
    nowhere = parse_command_line(models(f"big={BIG}", "hub=org/not-a-local-dir"))
    assert multi.start_side_by_side(nowhere, facts) == (
        False, "the size of hub is not known (no local config.json)")
    assert multi.start_side_by_side(parse_command_line(models(f"big={BIG}")), facts) == (
        False, "one model")
