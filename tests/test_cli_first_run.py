"""`proxima replay` as a first-time user meets it, in a fresh process each time: stdout holds
the table alone (vLLM's warnings go to stderr), the progress bar appears when the replay
starts (never a 0/N bar waiting on vLLM's imports), Ctrl-C keeps the repeats already
finished, and the PNG reads right for short and long runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("vllm", reason="needs vLLM (./dev test)")


def proxima(*argv: str, **kwargs):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for key in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL", "PROXIMA_ALLOCATOR"):
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "-m", "proxima.cli", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_stdout_is_the_table_and_the_bar_starts_with_the_work(tmp_path):
    done = proxima("replay", "--workload", "chat", "--requests", "12")
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["stock", "proxima", "proxima/stock"], out    # nothing above
    # the header, 8 figures, the busy steps and request latency (V1: 5 rows), the two
    # granule rows (V1) and their ratio line, the checks
    assert lines[-1].startswith("parity checks:") and len(lines) == 18, out
    assert [line.split()[0] for line in lines[9:16]] == [
        "busy_steps", "queue_wait_p50_steps", "queue_wait_p99_steps", "ttft_p50_steps",
        "ttft_p99_steps", "reclaimable_granule_fraction", "packed_ideal_fraction"], out
    assert "WARNING" not in out and "INFO" not in out
    # tqdm writes its bar to stderr with carriage returns; the first frame of each run's
    # bar already counts a finished request: it was created when the replay had started,
    # not while vLLM was importing (whose warnings, if any, come before it).
    frames = [f for f in err.replace("\r", "\n").splitlines() if f.startswith("stock 1/1:")]
    assert frames, err
    assert "0/12" not in frames[0] and " 0%" not in frames[0], frames[0]
    warning_at = max((err.find(w) for w in ("WARNING", "No CUDA runtime")), default=-1)
    if warning_at >= 0:
        assert warning_at < err.find("stock 1/1:")


def test_ctrl_c_during_repeats_keeps_those_finished(tmp_path):
    """SIGINT to a real `proxima replay --repeat 200`, once two repeats are written:
    exit 130, the table of the finished repeats on stdout, and the JSON says which."""
    out = tmp_path / "r.json"
    run = proxima("replay", "--workload", "chat", "--requests", "10", "--repeat", "200",
                  "--no-progress", "--json", str(out))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None:
            if out.exists() and json.loads(out.read_text()).get("repeats_done", 0) >= 2:
                break
            time.sleep(0.2)
        assert run.poll() is None, run.communicate()
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130, stderr
    assert "Traceback" not in stderr
    report = json.loads(out.read_text())
    done = report["repeats_done"]
    assert report["partial"] is True and 2 <= done < 200
    for label in ("stock", "proxima"):
        assert len(report["results"][label]["scheduler_ms_per_step_runs"]) == done
        assert report["results"][label]["completed"] == 10
    assert f"interrupted during repeat {done + 1} of 200: keeping the {done} finished" in stderr
    assert stderr.rstrip().endswith("proxima replay: interrupted")
    assert stdout.splitlines()[-1].startswith("parity checks:")
    assert not list(tmp_path.glob(".r.json.*"))             # no temporary file left


def _result(label: str, hist: dict, timeline: list, steps: int, v0: bool = False) -> dict:
    result = {"allocator": label, "completed": sum(hist.values()), "steps": steps,
              "single_run_fraction": hist.get(1, 0) / max(1, sum(hist.values())),
              "blocks_per_run": 2.0}
    if v0:   # the V0 driver's layout
        result.update(runs_per_request={str(k): v for k, v in hist.items()},
                      free_runs_over_time=[list(t[:3]) for t in timeline])
    else:
        result.update(runs_per_request_histogram=hist, largest_free_run_timeline=timeline)
    return result


@pytest.mark.parametrize("v0", [False, True], ids=["v1-layout", "v0-layout"])
def test_plot_panels_are_readable_for_every_shape_of_run(tmp_path, v0):
    """~90 distinct run counts become a few power-of-two bins; a run without free-space
    samples says so instead of an empty panel; no matplotlib warning either way."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401 - its own import-time deprecations are not ours
    from PIL import Image

    from proxima.replay.plot import binned, bins, write_plot

    comb = {k: 3 for k in range(1, 91)}                   # the pressure comb
    edges = bins(max(comb))
    assert len(edges) == 8 and edges[:4] == [(1, 1), (2, 2), (3, 4), (5, 8)]
    assert sum(binned(comb, edges)) == pytest.approx(1.0)
    long_line = [(s, 1000 - s, 900 - s if s < 500 else 50, 3) for s in range(0, 1000, 10)]
    report = {"workload": "pressure", "requests": 270, "vllm_version": "x", "repeat": 1,
              "settings": {"num_blocks": 1920, "block_size": 16},
              "results": {"stock": {"single_run_fraction": 0.0, "blocks_per_run": 1.1},
                          "proxima": {"single_run_fraction": 0.2, "blocks_per_run": 1.3}}}
    cases = {"long": ({"stock": [_result("stock", comb, long_line, 1000, v0)],
                       "proxima": [_result("proxima", {1: 270}, long_line, 1000, v0)]}, 91),
             "no-samples": ({"stock": [_result("stock", {1: 2}, [], 6, v0)],
                             "proxima": [_result("proxima", {1: 2}, [], 6, v0)]}, None)}
    for name, (runs, largest) in cases.items():
        path = tmp_path / f"{name}.png"
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)    # any matplotlib warning fails
            write_plot(report, runs, str(path), largest_request_blocks=largest)
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 1000
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_replay_plot_of_a_short_run_has_free_space_samples(tmp_path):
    """A run of a few steps (shorter than the old fixed sampling interval of 25) still gets
    its free-space timeline: the sampling interval follows the workload's length."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 3}\n{"prompt_len": 40, "output_len": 5}\n')
    png, js = tmp_path / "short.png", tmp_path / "short.json"
    run = proxima("replay", "--trace", str(trace), "--no-progress", "--plot", str(png),
                  "--json", str(js))
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Warning" not in err

    from proxima.replay.cli import timeline_every
    from proxima.workloads import load_trace, make_workload

    assert timeline_every(load_trace(trace), 1024) == 1
    assert timeline_every(make_workload("pressure", 500), 1024) > 1
    assert timeline_every(make_workload("sharegpt", 1000), 1024) <= 25
