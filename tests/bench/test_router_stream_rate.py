"""The router's streaming-rate bench (tests/bench/router_stream_rate.py) at a tiny scale:
every chunk reaches the client direct and through the real router, in ABBA order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.bench.router_stream_rate", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_chunk_passes_direct_and_through_the_router(tmp_path):
    out = tmp_path / "rate.json"
    done = _bench("--streams", "6", "--tokens", "5", "--step-ms", "5", "--rounds", "2",
                  "--json", str(out))
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert [r["target"] for r in data["runs"]] == ["direct", "router", "router", "direct"]
    assert all(r["chunks"] == 6 * 5 for r in data["runs"])
    assert all(r["router_cpu_ms_per_1k_chunks"] >= 0 for r in data["runs"]
               if r["target"] == "router")
    assert data["offered_chunks_per_s"] == 6 * 5 / (5 * 5 / 1000)


def test_bad_sizes_get_one_line():
    done = _bench("--streams", "0")
    assert done.returncode == 2 and "--streams, --tokens and --rounds want 1 or more" in done.stderr
    assert "Traceback" not in done.stderr
