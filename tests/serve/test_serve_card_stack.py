"""``proxima serve`` / ``proxima selfcheck`` on the card stack (vLLM 0.6.3.post1, V0 engine).

Runs in the card venv (``PROXIMA_STACK=card ./dev test tests/serve``) against the real vLLM 0.6.3,
which imports on CPU; skipped in the tested-stack venv. No GPU here: the engine itself does not
start, so these cover the versions, vLLM 0.6's parser and app behind Proxima's gate, metrics,
and the bad-input and no-GPU paths.
"""

from __future__ import annotations

import json
import os

import pytest

from proxima.errors import UserError
from proxima.models import DEMO_SERVED_MODEL_NAME, TINY_LLAMA_DIR
from proxima.serve import engine_checks, preflight, validate, vllm_args

from .conftest import (assert_one_line_error, boot_supervisor_without_gpu, card_only, free_port,
                       proxima_env, run_proxima)

pytestmark = card_only


def test_installed_card_stack_is_accepted():
    assert validate.check_vllm_installed({}) == "0.6.3.post1"
    versions = preflight.check_versions(environ={})
    assert versions.status == "ok", versions.line()
    assert versions.detail.startswith("vllm 0.6.3.post1, torch 2.4.0")
    assert versions.detail.endswith(
        "(the card stack, V0 engine); supports: allocator CPU-only; elastic KV scheduler side "
        "refused; elastic KV worker side refused; compaction refused")
    assert vllm_args.card_stack()


def test_vllm06_parser_takes_vllm_serve_options(serve_args):
    args = serve_args("/models/llama", "--max-model-len", "4000", "--enforce-eager",
                      "--gpu_memory_utilization=0.5", "-tp", "2", "--block-size", "32")
    assert args.model == "/models/llama"  # positional MODEL, as `vllm serve MODEL` in 0.6
    assert (args.max_model_len, args.enforce_eager, args.gpu_memory_utilization) == (4000, True, 0.5)
    assert (args.tensor_parallel_size, args.block_size) == (2, 32)
    assert serve_args("--model", "org/name").model == "org/name"
    assert vllm_args.apply_demo_defaults(args, []) is False


def test_vllm06_parser_errors_are_one_line(serve_args):
    with pytest.raises(UserError) as info:
        serve_args("--max-modle-len", "10")
    assert "unrecognized arguments: --max-modle-len" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="requires --tool-call-parser"):
        serve_args("--enable-auto-tool-choice")  # vLLM 0.6's own validate_parsed_serve_args


def test_demo_defaults_without_kv_cache_memory_bytes(serve_args):
    args = serve_args()
    assert vllm_args.apply_demo_defaults(args, []) is True
    assert args.model == str(TINY_LLAMA_DIR) and args.load_format == "dummy"
    assert args.served_model_name == [DEMO_SERVED_MODEL_NAME]
    assert args.max_model_len == vllm_args.DEMO_MAX_MODEL_LEN
    assert args.gpu_memory_utilization == vllm_args.DEMO_GPU_MEMORY_UTILIZATION
    assert args.num_gpu_blocks_override == vllm_args.DEMO_V0_NUM_GPU_BLOCKS
    assert not hasattr(args, "kv_cache_memory_bytes")
    argv = ["--gpu-memory-utilization", "0.5"]
    mine = serve_args(*argv)
    vllm_args.apply_demo_defaults(mine, argv)
    assert mine.gpu_memory_utilization == 0.5 and mine.num_gpu_blocks_override is None


def test_gate_in_front_of_vllm06_app(serve_args, tmp_path, monkeypatch):
    """vLLM 0.6's real OpenAI app, built without an engine, behind Proxima's gate; its /metrics
    (a multiprocess registry, as with its default MQLLMEngine front end) carries proxima_*."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.openai.api_server import build_app

    from proxima.allocator import RunAllocator
    from proxima.vllm.status import write_status
    from proxima.serve import metrics
    from proxima.serve.app import create_app
    from proxima.serve.supervisor import READY

    args = serve_args("--host", "127.0.0.1", "--port", str(free_port()))
    gate = create_app(args)
    client = TestClient(gate)  # no lifespan: nothing starts
    assert client.get("/health").json()["status"] == "not-started"
    assert client.get("/v1/models").status_code == 503

    stats = tmp_path / "engine-status.json"
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(stats))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    inner = build_app(args)
    metrics.add_to_vllm0_app(inner)
    write_status({"active": True, "engine": "vllm-v0", "allocator": RunAllocator(256).stats(),
                  "invariants_ok": True}, stats)
    gate.supervisor.inner, gate.supervisor.phase = inner, READY
    text = client.get("/metrics").text
    assert "proxima_active 1.0" in text and "proxima_free_blocks 256.0" in text
    assert client.get("/version").json() == {"version": "0.6.3.post1"}  # vLLM's own route


def test_in_process_engine_status_from_the_same_pid():
    """vLLM 0.6 may run the engine in the server's process: the same pid is then accepted,
    only when the caller says the engine is in-process."""
    status = {"active": True, "pid": os.getpid(), "time": 2.0, "engine": "vllm-v0",
              "vllm_version": "0.6.3.post1", "num_blocks": 64, "block_size": 16,
              "allocator": {"num_free": 64}}
    kwargs = dict(server_pid=os.getpid(), engine_pids=[os.getpid()], since=1.0, path="s.json")
    line = engine_checks.check_active(status, in_process=True, **kwargs)
    assert line.status == "ok" and "V0 in-process engine" in line.detail, line.line()
    refused = engine_checks.check_active(status, **kwargs)
    assert refused.failed and "not in the engine process" in refused.detail


def test_serve_without_gpu_stops_with_one_line():
    done = run_proxima("serve", "--host", "127.0.0.1", "--port", str(free_port()))
    assert_one_line_error(done, "self-check failed, not serving", "no NVIDIA GPU")
    assert "self-check versions: ok: vllm 0.6.3.post1" in done.stderr


def test_serve_bad_allocator_value_and_missing_model(tmp_path):
    done = run_proxima("serve", env=proxima_env(PROXIMA_ALLOCATOR="yes"))
    assert_one_line_error(done, "PROXIMA_ALLOCATOR must be 1 (Proxima on)", "'yes'")
    done = run_proxima("serve", str(tmp_path / "no-such-model"))
    assert_one_line_error(done, "does not exist")


def test_selfcheck_says_no_gpu_and_accepts_the_card_stack():
    done = run_proxima("selfcheck", "--json")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["gpu"]["status"] == "failed"
    assert checks["gpu"]["detail"].startswith("no NVIDIA GPU visible")
    assert checks["versions"]["status"] == "ok"
    assert "(the card stack, V0 engine); supports: allocator CPU-only;" in \
        checks["versions"]["detail"]
    assert checks["engine"]["detail"] == "not run: gpu failed"


def test_supervisor_starts_vllm06_engine_client_and_reports_its_failure(serve_args, tmp_path,
                                                                       monkeypatch):
    """The worker's V0 path goes through vLLM 0.6's own build_async_engine_client; on this
    GPU-less machine vLLM refuses to start the engine, and that becomes one engine line, the
    later checks skipped, and gunicorn's boot-error exit code (3)."""
    from proxima.serve.launch import V0Launcher

    supervisor, codes = boot_supervisor_without_gpu(serve_args, tmp_path, monkeypatch)
    assert type(supervisor.launcher) is V0Launcher
    assert codes == [3]
    lines = supervisor.report.lines()
    engine = next(line for line in lines if line.startswith("engine:"))
    assert engine.startswith("engine: failed: the engine failed to start: RuntimeError: "
                             "Failed to infer device type"), engine
    assert "proxima-active: skipped: not run: engine failed" in lines
    assert supervisor.inner is None
