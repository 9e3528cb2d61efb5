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


def test_a_child_that_outlives_its_time_is_killed_with_its_group(tmp_path):
    sys.path.insert(0, str(PROOF))
    import proofkit

    started = time.monotonic()
    code = proofkit.run([sys.executable, "-c",
                         "import subprocess, sys, time; "
                         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                         "time.sleep(60)"], {"PATH": "/usr/bin:/bin"}, tmp_path / "c.log", 2)
    assert code == 124 and time.monotonic() - started < 20
