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
