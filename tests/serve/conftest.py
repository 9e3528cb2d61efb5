"""Shared helpers for the CPU tests of ``proxima serve`` / ``proxima selfcheck``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def proxima_env(**overrides) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("PROXIMA_ALLOCATOR", "PROXIMA_STATS_FILE", "VLLM_PLUGINS"):
        env.pop(key, None)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_proxima(*argv: str, env: dict | None = None, timeout: float = 120):
    """``proxima ARGV`` in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "proxima.cli", *argv], cwd=REPO,
                          env=env or proxima_env(), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def serve_args():
    """``serve_args(*argv)`` -> the namespace vLLM's own ``vllm serve`` parser returns.

    vLLM builds its parser only once it detected a device platform; on this GPU-less machine
    we select vLLM's CPU platform for the build and put the lazy detection back afterwards,
    so nothing else in the session sees it.
    """
    pytest.importorskip("vllm")
    from proxima.serve import vllm_args

    if vllm_args.card_stack():  # vLLM 0.6 builds its parser on any machine
        parser = vllm_args.build_parser()
        return lambda *argv: vllm_args.parse(list(argv), parser)
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    from proxima.serve import vllm_args

    previous = platforms._current_platform
    platforms._current_platform = CpuPlatform()
    try:
        parser = vllm_args.build_parser()
    finally:
        platforms._current_platform = previous

    def make(*argv: str):
        return vllm_args.parse(list(argv), parser)

    return make


def card_stack() -> bool:
    from proxima.serve.preflight import installed_version, is_card_stack

    return is_card_stack(installed_version("vllm"))


# For test modules that exercise vLLM 0.26's own API (V1 engine, its parser's options).
v1_only = pytest.mark.skipif(card_stack(), reason="vLLM 0.26 (V1) API; the card stack has vLLM 0.6")
card_only = pytest.mark.skipif(not card_stack(), reason="needs the card stack (vLLM 0.6.3.post1): "
                                                        "PROXIMA_STACK=card ./dev test")


def assert_one_line_error(done, *fragments: str, code: int = 2) -> str:
    """``proxima serve`` failed with exit ``code`` and exactly one error line (no traceback)
    that holds every fragment; returns that line."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("proxima serve: error:")]
    assert len(errors) == 1, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def boot_supervisor_without_gpu(serve_args, tmp_path, monkeypatch):
    """A worker's supervisor for the embedded demo, its pre-flight assumed passed, run to
    its end on this GPU-less machine (the engine cannot start): ``(supervisor, exit codes
    it asked for)``."""
    import asyncio
    import time

    from proxima.serve import vllm_args
    from proxima.serve.report import ok
    from proxima.serve.supervisor import Supervisor

    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(tmp_path / "engine-status.json"))
    args = serve_args("--port", str(free_port()))
    vllm_args.apply_demo_defaults(args, [])
    passed = [ok("gpu", "assumed"), ok("cuda", "assumed"), ok("versions", "assumed")]
    supervisor = Supervisor(args, preflight=passed, preflight_time=time.time())
    codes: list[int] = []
    supervisor.request_exit = codes.append

    async def boot():
        await supervisor._run()
        await supervisor.stop()

    asyncio.run(boot())
    return supervisor, codes
