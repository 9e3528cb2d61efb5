"""One launcher per engine generation (proxima/serve/launch.py), picked by the version
policy, and the V1 one's engine life on this GPU-less machine: vLLM's real engine-core
process starts, fails, and the failure becomes one self-check line."""

from __future__ import annotations

import multiprocessing

import pytest

from proxima.serve import launch

from .conftest import boot_supervisor_without_gpu, v1_only


@pytest.mark.parametrize("version, launcher, generation", [
    ("0.26.0", launch.V1Launcher, "v1"), ("0.27.1", launch.V1Launcher, "v1"),
    ("0.6.3.post1", launch.V0Launcher, "v0"), ("0.6.2", launch.V0Launcher, "v0"),
])
def test_the_launcher_follows_the_engine_generation(version, launcher, generation):
    chosen = launch.launcher_for(version)
    assert type(chosen) is launcher and chosen.generation == generation


def test_both_launchers_have_one_interface():
    names = ("engine_client", "build_app", "engine_pids", "in_process", "summary", "sizing")
    for cls in launch.LAUNCHERS.values():
        assert all(callable(getattr(cls, name, None)) for name in names), cls


@v1_only
def test_v1_engine_start_failure_is_one_line_and_leaves_no_engine(serve_args, tmp_path,
                                                                  monkeypatch):
    """The V1 launcher builds AsyncLLM, whose engine-core process starts and fails here (no
    GPU): one failed engine line, the later checks skipped, gunicorn's boot-error exit code
    (3), and no engine process left behind."""
    supervisor, codes = boot_supervisor_without_gpu(serve_args, tmp_path, monkeypatch)
    assert type(supervisor.launcher) is launch.V1Launcher
    assert codes == [3]
    lines = supervisor.report.lines()
    engine = next(line for line in lines if line.startswith("engine:"))
    assert engine.startswith("engine: failed: the engine failed to start: "), engine
    assert "proxima-active: skipped: not run: engine failed" in lines
    assert supervisor.inner is None and supervisor.engine is None
    assert multiprocessing.active_children() == []
