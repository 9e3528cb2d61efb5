"""The appliance's GPU check (nix/gpu-check.py) where there is no GPU: it must fail, loudly,
at its first step, and its later steps must refuse what a machine without a GPU reports.
On a GPU it runs the image's stack (docs/deploy.md has the command); here only the failure
paths can run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "nix" / "gpu-check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run the check itself (docs/deploy.md)")


def test_without_a_gpu_the_check_fails_at_its_first_step(no_gpu, tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 1
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith("gpu-check: FAILED: gpu: no CUDA device visible")
    assert "`cuda` system feature" in line and "nix run .#gpu-check" in line
    assert "Traceback" not in done.stderr
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["steps"] == {}


def test_the_selfcheck_step_refuses_a_selfcheck_that_did_not_pass(no_gpu, monkeypatch):
    """The real `proxima selfcheck` on this machine (GPU failed, engine checks skipped): the
    step names every check that is not ok."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    gpu_check = load()
    with pytest.raises(gpu_check.Failed) as failed:
        gpu_check.check_selfcheck()
    message = str(failed.value)
    assert message.startswith("selfcheck: exit ")
    assert "gpu=failed" in message and "engine=skipped" in message
    assert "proxima-active=skipped" in message


def test_the_check_is_documented_with_its_commands():
    deploy = (REPO / "docs" / "deploy.md").read_text()
    for command in ("nix build .#proxima.gpuCheck", "nix run .#gpu-check",
                    "python3 nix/gpu-check.py"):
        assert command in deploy, command
