"""Elastic KV memory's control and visibility: GET/POST /proxima/kv, ``proxima kv``, the
``proxima_kv_*`` metrics, ``proxima serve --elastic``'s options, the elastic-kv self-check.

The route is the real app (TestClient, and a real uvicorn server for the CLI); the engine
side is the function vLLM's engine core runs for the utility call
(``elastic_v1.engine_core_proxima_kv``) on a real vLLM 0.26 scheduler with Proxima's
connector and pool. Only the ZMQ hop between the API process and the engine core (vLLM's
``call_utility_async``) is replaced by a direct call: it needs a running engine.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from proxima.errors import UserError
from proxima.serve.app import create_app
from proxima.serve.supervisor import READY

from .conftest import card_stack, free_port


@pytest.fixture(scope="module")
def args(serve_args):
    return serve_args("--host", "127.0.0.1", "--port", "8124")


def engine_with(scheduler):
    """An engine client whose utility calls run in ``scheduler``'s 'engine core'."""
    from proxima.vllm import elastic_v1

    core = SimpleNamespace(scheduler=scheduler)

    async def call_utility_async(method, *call_args):
        assert method == elastic_v1.UTILITY
        return elastic_v1.engine_core_proxima_kv(core, *call_args)

    return SimpleNamespace(engine_core=SimpleNamespace(call_utility_async=call_utility_async),
                           errored=False)


@pytest.fixture
def elastic_scheduler():
    if card_stack():
        pytest.skip("elastic KV memory needs vLLM's V1 engine")
    from proxima.vllm import elastic_v1, vllm_v1
    from proxima.replay.driver_v1 import build_scheduler

    if elastic_v1.unsupported_reason("scheduler"):
        pytest.skip(elastic_v1.unsupported_reason("scheduler"))
    from vllm.config import KVTransferConfig

    # started at one granule (not the default's warm-up, grown to twice it at the first step):
    # the route's tests read and move the bounds from the minimum
    ktc = KVTransferConfig(**elastic_v1.connector_config({"policy": "auto",
                                                          "granule_bytes": 2 << 20,
                                                          "initial_granules": 1}))
    scheduler = build_scheduler(proxima=True, num_blocks=16 * 256, kv_transfer_config=ktc)
    yield scheduler
    vllm_v1.deactivate()


def serving(args, engine):
    app = create_app(args)
    app.supervisor.engine = engine
    app.supervisor.phase = READY
    return app


def test_kv_route_reads_and_sets_the_bounds(args, elastic_scheduler):
    client = TestClient(serving(args, engine_with(elastic_scheduler)))
    status = client.get("/proxima/kv")
    assert status.status_code == 200, status.text
    data = status.json()
    per = data["bytes_per_granule"]
    assert data["policy"] == "auto" and data["pool_bytes"] == 16 * per
    assert data["mapped_bytes"] == per and data["used_bytes"] == 0
    assert (data["sleeping"], data["sleep_state"]) == (False, "awake")
    changed = client.post("/proxima/kv", json={"min_bytes": 3 * per, "max_bytes": "1GiB"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["min_bytes"] == 3 * per and changed.json()["mapping_granules"] == 2
    cleared = client.post("/proxima/kv", json={"max_bytes": None}).json()
    assert cleared["max_bytes"] == cleared["pool_bytes"]


@pytest.mark.parametrize("body, status, message", [
    ("not json", 400, "not JSON"), ([], 400, "a JSON object"), ({}, 400, "a JSON object"),
    ({"size": 1}, 400, "unknown field"), ({"max_bytes": "big"}, 400, "not a size"),
    ({"min_bytes": "2GiB", "max_bytes": "1GiB"}, 400, "below min_bytes"),
])
def test_kv_route_refuses_bad_requests_with_one_line(args, elastic_scheduler, body, status,
                                                     message):
    client = TestClient(serving(args, engine_with(elastic_scheduler)))
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    answer = client.post("/proxima/kv", **kwargs)
    assert answer.status_code == status and message in answer.json()["error"]


def test_kv_route_without_engine_or_without_elastic(args):
    client = TestClient(create_app(args))
    answer = client.get("/proxima/kv")
    assert answer.status_code == 503 and "not running" in answer.json()["error"]
    plain = SimpleNamespace(scheduler=SimpleNamespace(connector=None))
    from proxima.vllm import elastic_v1

    async def call(method, *a):
        return elastic_v1.engine_core_proxima_kv(plain, *a)

    engine = SimpleNamespace(engine_core=SimpleNamespace(call_utility_async=call))
    answer = TestClient(serving(args, engine)).get("/proxima/kv")
    assert answer.status_code == 404 and "not active" in answer.json()["error"]
    assert TestClient(serving(args, engine)).delete("/proxima/kv").status_code == 405


@pytest.fixture
def live_server(args, elastic_scheduler):
    import uvicorn

    port = free_port()
    config = uvicorn.Config(serving(args, engine_with(elastic_scheduler)), host="127.0.0.1",
                            port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_proxima_kv_cli_reads_and_sets(live_server, capsys):
    from proxima.cli import main

    assert main(["kv", "--url", live_server]) == 0
    out = capsys.readouterr().out
    assert "elastic KV memory (policy auto" in out and "mapped" in out and "pool" in out
    assert main(["kv", "--url", live_server, "--max", "1GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_bytes"] <= 1 << 30
    assert main(["kv", "--url", live_server, "--max", "none"]) == 0
    capsys.readouterr()
    assert main(["kv", "--url", live_server, "--min", "100TiB"]) == 1
    assert "above the pool" in capsys.readouterr().err


def test_proxima_kv_says_when_the_model_sleeps():
    from proxima.serve.kv import check_answer, format_status

    base = {"policy": "auto", "granule_blocks": 256, "bytes_per_granule": 2 << 20,
            "mapped_bytes": 2 << 20, "pool_bytes": 64 << 30}
    assert "asleep" not in format_status(check_answer({**base, "sleeping": False}))
    text = format_status(check_answer({**base, "sleeping": True, "sleep_state": "asleep"}))
    assert "the model is asleep (vLLM's sleep mode: its weights in host memory" in text
    with pytest.raises(Exception, match="sleeping is an integer"):
        check_answer({**base, "sleeping": 1})


@pytest.mark.parametrize("argv, message", [
    (["kv", "--url", "foo"], "--url must look like http://HOST:PORT"),
    (["kv", "--url", "http://127.0.0.1:9", "--max", "3XB"], "--max: '3XB' is not a size"),
    (["kv", "--url", "http://127.0.0.1:9", "--min", "2GiB", "--max", "1GiB"], "is below --min"),
    (["kv", "--url", "http://127.0.0.1:9"], "cannot reach"),
])
def test_proxima_kv_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    from proxima.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_metrics_carry_the_elastic_section(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from proxima.vllm.status import write_status
    from proxima.serve.metrics import ProximaCollector

    path = tmp_path / "status.json"
    write_status({"active": True, "elastic": {
        "mapped_bytes": 4 << 30, "used_bytes": 1 << 30, "reclaimable_bytes": 2 << 30,
        "pool_bytes": 64 << 30, "min_bytes": 0, "max_bytes": 64 << 30, "short": False,
        "grows": 7, "shrinks": 3, "failed_grows": 2, "bytes_returned": 12 << 30,
        "evicted_cached": 40, "policy": "auto"}}, path)
    registry = CollectorRegistry()
    registry.register(ProximaCollector(path=lambda: path))
    text = generate_latest(registry).decode()
    for line in ("proxima_kv_mapped_bytes 4.294967296e+09", "proxima_kv_grows_total 7.0",
                 "proxima_kv_failed_grows_total 2.0", "proxima_kv_returned_bytes_total 1.2884901888e+10",
                 "proxima_kv_reclaimable_bytes 2.147483648e+09", "proxima_kv_short 0.0",
                 "proxima_kv_evicted_cached_blocks_total 40.0"):
        assert line in text, line


def test_serve_takes_its_elastic_options_out_of_the_command_line():
    from proxima.serve.serve_flags import take_elastic_options

    rest, options = take_elastic_options(["m", "--port", "8000", "--elastic", "--kv-max=80GiB",
                                          "--kv-min", "2GiB", "--elastic-options",
                                          "release_delay_s=5,eviction=lru"])
    assert rest == ["m", "--port", "8000"]
    assert options == {"release_delay_s": 5, "eviction": "lru", "min_bytes": "2GiB",
                       "max_bytes": "80GiB"}
    assert take_elastic_options(["m"]) == (["m"], None)
    assert take_elastic_options(["m", "--elastic"]) == (["m"], {})


@pytest.mark.parametrize("argv, message", [
    (["--kv-max", "8GiB"], "--kv-max needs --elastic"),
    (["--elastic", "--kv-max"], "--kv-max needs a value"),
    (["--elastic", "--kv-max", "lots"], "--kv-max: 'lots' is not a size"),
    (["--elastic", "--kv-min", "8GiB", "--kv-max", "4GiB"], "--kv-max 4GiB is below --kv-min 8GiB"),
    (["--elastic", "--elastic-options", "bogus=1"], "unknown option"),
    (["--elastic", "--elastic-options", "nokey"], "is not key=value"),
    (["--elastic=1"], "--elastic takes no value"),
])
def test_serve_elastic_bad_options_are_one_clear_error(argv, message):
    from proxima.serve.serve_flags import take_elastic_options

    with pytest.raises(UserError, match=message):
        take_elastic_options(["m", *argv])


def test_elastic_selfcheck_line():
    from proxima.serve.engine_checks import check_elastic

    assert check_elastic(None, wanted=False).status == "skipped"
    assert check_elastic({"active": True}, wanted=True).status == "failed"
    line = check_elastic({"elastic": {"num_granules": 8, "policy": "auto",
                                      "mapped_bytes": 1 << 30, "pool_bytes": 8 << 30,
                                      "min_bytes": 0, "max_bytes": 8 << 30,
                                      "granule_blocks": 32, "bytes_per_granule": 64 << 20}},
                         wanted=True)
    assert line.status == "ok" and "1.00 GiB of 8.00 GiB mapped" in line.line()
