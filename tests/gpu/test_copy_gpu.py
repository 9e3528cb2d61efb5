"""Issue 12 item 1 on a GPU: `python3 -m proxima.bench.copy` with vLLM 0.26's
ops.swap_blocks_batch, GPU -> pinned CPU, every layout on both streams.

Needs a GPU and vLLM 0.26 (on the offline host: PYTHONPATH=/tmp/site). Skips without
either; a missing GPU fails instead when PROXIMA_EXPECT_GPU=1. About 30 s:

    PROXIMA_EXPECT_GPU=1 PYTHONPATH=/tmp/site python3 -m pytest -o addopts="" -m gpu tests/gpu/test_copy_gpu.py -q

Asserts what the copy did (bytes, descriptor counts), never how fast it was.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from proxima.bench import copy as copy_bench

pytestmark = pytest.mark.gpu
EXPECT = os.environ.get("PROXIMA_EXPECT_GPU", "")
if EXPECT not in ("", "0", "1"):
    raise pytest.UsageError(f"PROXIMA_EXPECT_GPU must be 0 or 1, got {EXPECT!r}")
torch = pytest.importorskip("torch") if EXPECT != "1" else __import__("torch")


@pytest.fixture(scope="module", autouse=True)
def gpu_and_vllm():
    if not torch.cuda.is_available():
        if EXPECT == "1":
            pytest.fail("PROXIMA_EXPECT_GPU=1 but torch.cuda.is_available() is False")
        pytest.skip("needs an NVIDIA GPU")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM 0.26 (on the offline GPU host: PYTHONPATH=/tmp/site)")


def test_copy_table_every_layout_on_both_streams(tmp_path):
    out = tmp_path / "copy.json"
    assert copy_bench.main(["--reps", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["checks_ok"]
    assert [(r["layout"], r["stream"]) for r in rows] == [
        (name, stream) for name in copy_bench.LAYOUTS for stream in copy_bench.STREAMS]
    assert {r["layout"]: r["descriptors"] for r in rows} == {
        "scattered": 4096, "stock-like": 54 * 32, "proxima-like": 11 * 32, "one run": 32,
        "proxima-like, per block": 4096}
    for r in rows:
        assert r["bytes"] == 256 << 20
        if r["stream"] == "side":        # the offload worker's path must work
            assert "error" not in r and r["check_ok"]
            # the stream held until the batch is queued: the events time the copies alone,
            # never longer than a call that also waits for its own submission
            assert r["held_submit_s"] < copy_bench.HOLD_S
            assert r["dma_s"] <= r["call_s"] * 1.05
            assert r["gbps"] > 10, r              # PCIe on any GPU host, far above a stall
