"""Issue 36 on a real GPU: `proxima serve` with two models behind one endpoint, as a user
runs it (one command, a subprocess, so CUDA never touches pytest's process).

Two copies of the embedded demo model (random weights) under the names ``a`` and ``b``,
each with a small KV pool, elastic, on the one GPU. Tests, in file order: every engine
ready and /health 200; routing and streaming through the endpoint; /v1/models; the 404;
/metrics labelled by model, with both engines' proxima_* and vllm:* series; the mp executor
chosen by default (the log); kill -9 of one model's engine (its `proxima serve`): 503 for
that model while the other serves, then back; SIGTERM stops everything. Last, with its own
`proxima serve`, one sleep/wake cycle of a model given `--sleep-after` (issue 36, item 3):
greedy outputs identical across it, the sleep and wake seconds, the first token after the
wake and the GPU's used memory written to sleep_wake.json under $PROXIMA_GPU_OUT or $OUT
(PROXIMA_SLEEP_MODEL picks the model: the tiny demo by default, whose weights are too small
to show in the memory figures; tools/gpu/dummy-llama has Llama-3.1-8B's).

On one H100 (docs/results/h100-2026-12-05-s22): 4 of 6 passed; the kill -9 and SIGTERM
tests failed on two supervisor bugs, fixed since with CPU tests that reproduce them
(tests/serve/test_serve_multi.py), not yet re-run on a GPU. Run:
    python -m pytest -m gpu tests/gpu/test_serve_multi_gpu.py -v
(or `bash tools/gpu/run.sh run 560 "0:serve-multi-tests"` on the staged host).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
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
TINY = str(ROOT / "proxima" / "models" / "tiny-llama")
START_TIMEOUT_S = 900
MODEL_OPTIONS = ("--load-format dummy --max-model-len 2048 --kv-cache-memory-bytes 536870912 "
                 "--gpu-memory-utilization 0.1 --enforce-eager --kv-max 512MiB")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_serve(models: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`proxima serve --model M ...` as a user runs it, waited for until /health is 200
    (fails the test, with the log's tail, if it exits or is not ready in time)."""
    port = free_port()
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("PROXIMA_ALLOCATOR", None)
    env.pop("PROXIMA_STATS_FILE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         *[arg for model in models for arg in ("--model", model)]],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"proxima serve exited with {proc.returncode}:\n{tail(log)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"/health not 200 within {START_TIMEOUT_S} s\n{tail(log)}")
        time.sleep(1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("multi") / "serve.log"
    proc, url = start_serve([f"a={TINY} {MODEL_OPTIONS}", f"b={TINY} {MODEL_OPTIONS}"], log)
    yield {"url": url, "proc": proc, "log": log}
    if proc.poll() is None:
        proc.kill()


def tail(log: Path, n: int = 80) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": "hello", "max_tokens": 8, **extra})


def test_every_model_is_served_through_the_one_endpoint(served):
    url = served["url"]
    health = httpx.get(url + "/health", timeout=10).json()
    assert set(health["engines"]) == {"a", "b"}
    for model in ("a", "b", "a"):
        answer = complete(url, model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model
    listing = httpx.get(url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in listing["data"]] == ["a", "b"]
    unknown = complete(url, "c")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_stream_comes_through_chunk_by_chunk(served):
    body = {"model": "b", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", json=body,
                      timeout=120) as answer:
        assert answer.status_code == 200
        data = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) >= 3


def test_metrics_carry_both_engines_labelled(served):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served["url"] + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("proxima_active", "proxima_kv_mapped_bytes", "vllm:num_requests_running"):
        assert {s.labels.get("model") for s in families[name].samples} == {"a", "b"}, name


def test_the_mp_executor_is_the_default_with_elastic(served):
    assert "--elastic on one GPU: vLLM's mp executor" in served["log"].read_text(errors="replace")


def test_a_killed_engine_comes_back_and_its_model_is_503_meanwhile(served):
    url = served["url"]
    pid = httpx.get(url + "/health", timeout=10).json()["engines"]["b"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while complete(url, "b").status_code != 503:
        assert time.monotonic() < deadline, "b never answered 503 after its engine died"
        time.sleep(0.2)
    assert complete(url, "a").status_code == 200
    deadline = time.monotonic() + START_TIMEOUT_S
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, tail(served["log"])
        time.sleep(1)
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["engines"]["b"]["restarts"] == 1 and health["engines"]["b"]["pid"] != pid
    assert complete(url, "b").status_code == 200


def test_sigterm_stops_the_endpoint_and_every_engine(served):
    proc = served["proc"]
    pids = [e["pid"] for e in httpx.get(served["url"] + "/health", timeout=10).json()["engines"].values()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=180) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# -- issue 36 item 3: one sleep/wake cycle on a real engine ------------------------------------
SLEEP_AFTER_S = 5
# tools/gpu/dummy-llama: 8B's shape, config only (the tiny model's tokenizer is given with it)
SLEEP_MODEL = os.environ.get("PROXIMA_SLEEP_MODEL", TINY)


def _gpu_used_bytes() -> int | None:
    """NVML's used memory of the (first visible) GPU, without a CUDA context here."""
    try:
        try:
            import pynvml
        except ImportError:
            from vllm.third_party import pynvml  # type: ignore[no-redef]
        pynvml.nvmlInit()
        try:
            first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(first))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - a figure for the record only
        return None


def _sleep_state(url: str) -> str | None:
    """The router's sleep state of model s: awake, falling-asleep, asleep or waking."""
    return httpx.get(url + "/v1/models/s", timeout=10).json().get("proxima_sleep_state")


def _stream_timed(url: str, body: dict) -> tuple[float | None, float, list[int]]:
    """(seconds to the first token, seconds to the end, the generated token ids) of a streamed
    completion. Token ids, not text: the 8B-shaped model's random weights pick ids beyond the
    tiny tokenizer's vocabulary, which decode to no text at all (session 27's run on an H100
    compared two empty strings, and never saw a first token)."""
    import json

    began = time.perf_counter()
    first, ids = None, []
    with httpx.stream("POST", url + "/v1/completions",
                      json={**body, "stream": True, "return_token_ids": True},
                      timeout=300) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            piece = choice.get("token_ids") or []
            if first is None and (piece or choice.get("text")):
                first = time.perf_counter() - began
            ids += piece
    assert ids, "the stream carried no token ids (return_token_ids)"
    return first, time.perf_counter() - began, ids


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def test_an_idle_model_sleeps_and_its_next_request_wakes_it(tmp_path):
    """`--sleep-after` on a real engine (vLLM's sleep mode beside elastic KV): the model
    falls asleep once idle (KV given back, weights to host), a request wakes it and is
    answered, greedy outputs before and after are identical, twice. Records the sleep and
    wake seconds of both cycles, the first token after the wake (and a warm one) and the
    GPU's used memory awake / asleep / awake in sleep_wake.json under $PROXIMA_GPU_OUT or
    $OUT."""
    import json
    import re

    log = tmp_path / "serve.log"
    options = MODEL_OPTIONS if SLEEP_MODEL == TINY else \
        f"--load-format dummy --tokenizer {TINY} --max-model-len 2048 --enforce-eager --kv-max 4GiB"
    proc, url = start_serve([f"s={SLEEP_MODEL} {options} --sleep-after {SLEEP_AFTER_S}"], log)
    try:
        body = {"model": "s", "prompt": "The capital of France is", "max_tokens": 16,
                "temperature": 0}
        warm_first, _, before = _stream_timed(url, body)
        used_awake = _gpu_used_bytes()

        def wait_asleep():
            # asleep, not falling asleep: vLLM's sleep takes seconds (10 s for 8B's weights
            # on an H100), and memory read before it ends is still the weights'
            deadline = time.monotonic() + SLEEP_AFTER_S + 180
            while _sleep_state(url) != "asleep":
                assert proc.poll() is None, tail(log)
                assert time.monotonic() < deadline, f"never fell asleep\n{tail(log)}"
                time.sleep(0.5)

        wait_asleep()
        used_asleep = _gpu_used_bytes()
        kv = httpx.get(url + "/engines/s/proxima/kv", timeout=10).json()
        assert kv["sleeping"] is True and kv["mapped_bytes"] <= kv["bytes_per_granule"]
        wake_first, wake_total, after = _stream_timed(url, body)     # wakes it
        assert after == before, "greedy output changed across the sleep/wake cycle"
        assert _sleep_state(url) == "awake"
        again_first, _, again = _stream_timed(url, body)
        assert again == before
        used_woken = _gpu_used_bytes()
        # a second cycle: the weights were copied to host memory while the engine started
        # (proxima/vllm/sleep_memory.py), and each sleep releases them without a copy (vLLM's
        # own: 7.64 s of 8B's for the first, pinning it, s28; 0.33 s copying, s37)
        wait_asleep()
        second_first, _, second = _stream_timed(url, body)
        assert second == before, "greedy output changed across the second sleep/wake cycle"
        text = log.read_text(errors="replace")
        slept = re.findall(r"model s: asleep in ([0-9.]+) s", text)
        woke = re.findall(r"model s: awake in ([0-9.]+) s \(room ([0-9.]+) s, wake ([0-9.]+) s\)",
                          text)
        engine_slept = re.findall(r"asleep in ([0-9.]+) s \(weights", text)
        weights_gib = re.findall(r"asleep in [0-9.]+ s \(weights, ~([0-9.]+) GiB", text)
        kept = re.findall(r"copied ([0-9.]+) GiB of weights to pinned host memory in "
                          r"([0-9.]+) s", text)
        assert len(slept) >= 2 and len(woke) >= 2, tail(log)
        figures = {
            "model": SLEEP_MODEL, "sleep_after_s": SLEEP_AFTER_S,
            "sleep_s": float(slept[0]), "engine_sleep_s": float(engine_slept[0])
            if engine_slept else None,
            "second_sleep_s": float(slept[1]) if len(slept) > 1 else None,
            "second_wake_s": float(woke[1][0]) if len(woke) > 1 else None,
            "first_token_after_second_wake_s": _rounded(second_first),
            "wake_s": float(woke[0][0]), "wake_room_s": float(woke[0][1]),
            "wake_vllm_s": float(woke[0][2]),
            "first_token_after_wake_s": _rounded(wake_first),
            "request_after_wake_s": round(wake_total, 3),
            "first_token_warm_s": _rounded(warm_first),
            "first_token_awake_again_s": _rounded(again_first),
            "gpu_used_bytes": {"awake": used_awake, "asleep": used_asleep, "woken": used_woken},
            "tokens": len(before), "outputs_identical": after == before,
            "weights_gib": float(weights_gib[0]) if weights_gib else None,
            "kept_on_host_gib": float(kept[0][0]) if kept else None,
            "kept_at_start_s": float(kept[0][1]) if kept else None,
        }
        print("\nsleep/wake:", json.dumps(figures))
        out = os.environ.get("PROXIMA_GPU_OUT") or os.environ.get("OUT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "sleep_wake.json").write_text(json.dumps(figures, indent=1) + "\n")
            (Path(out) / "sleep_wake.log").write_text(tail(log, 400) + "\n")
        # the weights went to pinned host memory at start-up, and the sleeps release them
        # without a copy, leaving torch's GPU cache to the wake (proxima/vllm/sleep_memory.py)
        assert kept, f"no start-up copy of the weights in the engine's log\n{tail(log)}"
        assert "release them without a copy, and keep torch's GPU cache" in text, tail(log)
        assert figures["engine_sleep_s"] is not None and figures["engine_sleep_s"] < 1.0, \
            figures
        if used_awake is not None and used_asleep is not None:
            # the weights left the GPU: at least half their bytes show as free
            assert weights_gib, tail(log)
            assert used_awake - used_asleep > float(weights_gib[0]) * 2**30 / 2, figures
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
