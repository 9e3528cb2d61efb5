"""The GPU proof drivers' orchestration, on CPU (--dry-run: stand-in children and servers).

What is checked is what the lead cannot afford to find out on the GPU: a driver finishes
within its budget, writes at most three files to $OUT (results JSON, log, children's logs
packed), prints one PASS/FAIL line per sub-proof, and kills a child that outlives its time.
Nothing here proves anything about elastic KV memory (tests/gpu/proof/*.py on the H200 do).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROOF = REPO / "tests" / "gpu" / "proof"


def run(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROOF / script), "--out", str(out), "--dry-run",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=180)


def test_driver_a_dry_run_writes_three_files_and_a_line_per_subproof(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "120", "--only", "a,b,d,a2",
               "--a-modes", "elastic,proxima")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-logs.tgz", "elastic_proof.json", "elastic_proof.log"]
    data = json.loads((tmp_path / "elastic_proof.json").read_text())
    assert [line.split(" ")[0] + line.split(" ")[1] for line in data["summary_lines"]] == [
        "(a)PASS:", "(b)PASS:", "(d)PASS:", "(a2)INFO:"]
    assert set(data["subproofs"]) == {"a", "b", "d", "a2"}
    assert set(data["subproofs"]["a"]["compare"]) == {"elastic", "proxima"}
    # (b) ran on (d)'s elastic engine: one child log for both, no separate burst engine
    logs = subprocess.run(["tar", "tzf", str(tmp_path / "elastic_proof-logs.tgz")],
                          capture_output=True, text=True).stdout
    assert "d-elastic.log" in logs and "b-engine" not in logs, logs


def test_driver_a_runs_b_alone_on_its_own_engine(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "60", "--only", "b")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "elastic_proof.json").read_text())
    assert set(data["subproofs"]) == {"b"} and data["subproofs"]["b"]["passed"]


def test_driver_b_dry_run(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "120", "--requests", "30",
               "--port", "8390")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    assert len(list(tmp_path.iterdir())) == 3
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    for setup in ("static", "elastic"):
        assert len(c[setup]["bursts"]) == 2 and c[setup]["errors"] == 0
        assert c[setup]["aggregate_output_tokens_per_s"] > 0


def test_driver_b_tail_requests_outlive_their_burst_and_are_counted(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "120", "--requests", "20",
               "--port", "8392", "--only", "elastic,compacted", "--tail", "3:16")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    for setup in ("elastic", "compacted"):
        assert c[setup]["tails"]["requests"] == 6 and c[setup]["tails"]["errors"] == 0
        assert c[setup]["tails"]["output_tokens"] == 6 * 16
    assert len(c["summary"]["compacted"]["idle_engine_mapped_bytes_per_burst"]) == 2
    bad = run("two_engines.py", tmp_path / "bad", "--tail", "three")
    assert bad.returncode == 2 and "--tail wants N:TOKENS" in bad.stderr


def test_a_child_that_outlives_its_time_is_killed_with_its_group(tmp_path):
    sys.path.insert(0, str(PROOF))
    import proofkit

    started = time.monotonic()
    code = proofkit.run([sys.executable, "-c",
                         "import subprocess, sys, time; "
                         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                         "time.sleep(60)"], {"PATH": "/usr/bin:/bin"}, tmp_path / "c.log", 2)
    assert code == 124 and time.monotonic() - started < 20


def _compaction_proof():
    sys.path.insert(0, str(PROOF))
    import compaction_proof

    return compaction_proof


def test_compaction_throughput_summary_uses_means_spread_and_drops_the_first_call():
    proof = _compaction_proof()
    rounds = [
        {"mode": "off", "rate": 3400.0, "sched_ms_per_step": 4.0, "gc_ms": 10.0},
        {"mode": "auto", "rate": 3350.0, "gpu_ms": [50.0, 0.1, 0.2], "plan_ms": [0.3, 0.2],
         "sched_ms_per_step": 4.5, "gc_ms": 12.0},
        {"mode": "off", "rate": 3500.0, "sched_ms_per_step": 4.2, "gc_ms": 9.0},
        {"mode": "auto", "rate": 3450.0, "gpu_ms": [0.3, 0.4], "plan_ms": [0.1],
         "sched_ms_per_step": 4.7, "gc_ms": 11.0},
    ]
    ok, s = proof.summarize_throughput(rounds)
    assert ok and s["ratio"] == round(3400 / 3450, 4)
    assert s["off_spread"] == round(100 / 3450, 4) and s["off_rel_stdev"] > 0
    assert s["stall_gpu_ms_first_call"] == 50.0
    assert s["stall_gpu_ms"]["n"] == 4 and s["stall_gpu_ms"]["max"] == 0.4   # JIT left out
    assert s["plan_ms"]["n"] == 3
    assert s["auto_over_neighbouring_off"] == [round(3350 / 3450, 4), round(3450 / 3500, 4)]
    assert s["sched_ms_per_step"] == {"off": 4.1, "auto": 4.6}
    # below target, and a single round of each is never conclusive
    ok, s = proof.summarize_throughput([dict(rounds[0]), dict(rounds[1], rate=3000.0)])
    assert not ok and s["ratio"] == round(3000 / 3400, 4) and s["off_spread"] is None
    ok, s = proof.summarize_throughput(rounds[:1] + rounds[2:3])
    assert not ok and s["ratio"] is None
    ok, _ = proof.summarize_throughput(rounds[:2])
    assert not ok and "not conclusive" in _["verdict"]


def test_compaction_throughput_rounds_interleave_and_stop_on_the_budget(tmp_path, monkeypatch):
    """The throughput sub-proof's orchestration with a stand-in engine (vLLM's own
    SamplingParams and Scheduler are imported, nothing runs on a GPU): rounds alternate
    off/auto, every round is reported, a round starts only if both its runs fit."""
    import pytest

    pytest.importorskip("vllm")
    from collections import deque
    from types import SimpleNamespace

    proof = _compaction_proof()
    p = proof.Proof(tmp_path, total=100.0)
    clock = [0.0]
    monkeypatch.setattr(proof.time, "monotonic", lambda: clock[0])
    p.t0 = 0.0

    class LLM:
        def generate(self, prompts, params, use_tqdm=False):
            clock[0] += 20.0                      # each run: 20 s of the 100
            out = SimpleNamespace(token_ids=[1] * params.max_tokens)
            return [SimpleNamespace(outputs=[out], num_cached_tokens=3) for _ in prompts]

    class Compactor:
        modes: list = []

        def set_mode(self, mode):
            self.modes.append(mode)

        def reset_metrics(self):
            self.gpu_ms = SimpleNamespace(steps=deque([0.5, 0.1]))
            self.plan_ms = SimpleNamespace(steps=deque([0.2]))

        def stats(self):
            return {"steps_with_moves": 1, "bytes_moved": 2 << 20, "pack_skipped": 0}

    probe = proof._Probe()
    try:
        entry = {}
        ok, details = proof.throughput(LLM(), Compactor(), p, 5, probe)(entry)
    finally:
        probe.close()
    modes = [r["mode"] for r in entry["rounds"]]
    assert modes == ["off", "auto", "off", "auto"]     # a third pair would not fit
    assert Compactor.modes[0] is None and Compactor.modes[1].kind == "auto"
    s = details["summary"]
    assert s["ratio"] == 1.0 and s["stall_gpu_ms_first_call"] == 0.5 and ok
    from proxima.engines import compaction_v1
    from vllm.v1.core.sched.scheduler import Scheduler

    assert Scheduler.schedule.__name__ == "schedule"          # the probe put them back
    assert compaction_v1.apply_on_worker.__name__ == "apply_on_worker"
