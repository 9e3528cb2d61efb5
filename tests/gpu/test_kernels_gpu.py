"""Issue 14 item 2 on a GPU: the Triton block mover against torch (byte for byte), under
CUDA-graph capture, and its bandwidth against torch's alternatives (pytest-benchmark).

Needs torch with CUDA and Triton; no vLLM. Skips without a GPU; fails instead when
PROXIMA_EXPECT_GPU=1. On the H200 (about a minute):

    PROXIMA_EXPECT_GPU=1 python3 -m pytest -o addopts="" -m gpu tests/gpu/test_kernels_gpu.py -q

(with pytest-benchmark installed the benchmarks run and print their table; without it they
skip).

The full bandwidth table: ``python3 -m proxima.bench.kv_moves`` (docs/benchmarks.md).
Speed is reported, never asserted.
"""

from __future__ import annotations

import os
import random

import pytest

pytestmark = pytest.mark.gpu
EXPECT = os.environ.get("PROXIMA_EXPECT_GPU", "")
if EXPECT not in ("", "0", "1"):
    raise pytest.UsageError(f"PROXIMA_EXPECT_GPU must be 0 or 1, got {EXPECT!r}")

if EXPECT == "1":
    import torch
    import triton  # noqa: F401 - a GPU host must have it
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")

from proxima.bench import kv_moves  # noqa: E402
from proxima.kernels import KVBlockMover  # noqa: E402
from proxima.kernels.layout import flash_attn_kv_caches, page_views  # noqa: E402
from proxima.kernels.moves import runs_of  # noqa: E402
from proxima.kernels.reference import apply_runs_torch  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if EXPECT == "1":
        pytest.fail("PROXIMA_EXPECT_GPU=1 but torch.cuda.is_available() is False")
    pytest.skip("needs an NVIDIA GPU")


def raw_bytes(t):
    """The whole allocation under ``t``, as bytes (padding included)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def make(kind: str, layers: int = 4, num_blocks: int = 256):
    if kind in ("nhd", "hnd", "padded"):
        kv = flash_attn_kv_caches(layers, num_blocks, 16, 8, 128, device="cuda", fill=False,
                                  layout="HND" if kind == "hnd" else "NHD",
                                  page_padding=512 if kind == "padded" else 0)
        return kv, 0
    if kind == "kv_first":           # (2, num_blocks, block_size, heads, head): vLLM V0
        return [torch.empty(2, num_blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
                for _ in range(layers)], 1
    if kind == "odd":                # 6-byte pages: 2-byte words, no 16-byte hint
        return [torch.empty(num_blocks, 3, dtype=torch.int16, device="cuda")
                for _ in range(layers)], 0
    raise AssertionError(kind)


def random_batch(rng, num_blocks, slot=8):
    slots = list(range(num_blocks // slot))
    rng.shuffle(slots)
    k = len(slots) // 3
    src, dst, n = [], [], []
    for a, b in zip(slots[:k], slots[k:2 * k]):
        length = rng.randint(1, slot)
        src.append(a * slot + rng.randint(0, slot - length))
        dst.append(b * slot + rng.randint(0, slot - length))
        n.append(length)
    return src, dst, n


@pytest.mark.parametrize("kind", ["nhd", "hnd", "padded", "kv_first", "odd"])
def test_kernel_equals_the_torch_reference_byte_for_byte(kind):
    kv, block_dim = make(kind)
    twin, _ = make(kind)
    raws = [raw_bytes(t) for t in kv]
    twin_raws = [raw_bytes(t) for t in twin]
    kernel = KVBlockMover(kv, block_dim=block_dim)
    assert kernel.backend == "triton"
    reference = KVBlockMover(twin, block_dim=block_dim, backend="torch")
    rng = random.Random(kind)
    for _ in range(3):
        for r, t in zip(raws, twin_raws):
            r.random_(0, 256)
            t.copy_(r)
        before = [r.clone() for r in raws]
        src, dst, n = random_batch(rng, 256)
        kernel.apply(src, dst, n)
        reference.apply(src, dst, n)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(raws, twin_raws)), kind
        assert not all(torch.equal(a, b) for a, b in zip(raws, before)), "nothing moved"


def test_llama_shaped_request_moves_like_the_reference():
    """32 layers, 64 KiB pages; one request of 128 blocks in 11 runs plus 40 single blocks."""
    kv = flash_attn_kv_caches(32, 640, 16, 8, 128, device="cuda")
    views = page_views(kv)
    before = [v.clone() for v in views]
    src = [16 * i for i in range(11)] + [300 + 2 * i for i in range(40)]
    dst = [400 + 12 * i for i in range(11)] + [541 + 2 * i for i in range(40)]
    n = [12] * 10 + [8] + [1] * 40
    plan = KVBlockMover(kv).apply(src, dst, n)
    assert plan.bytes_moved == 168 * 32 * 65536
    expected = [b.clone() for b in before]
    apply_runs_torch(expected, list(zip(src, dst, n)))
    torch.cuda.synchronize()
    assert all(torch.equal(v, e) for v, e in zip(views, expected))


def test_a_captured_cuda_graph_replays_new_moves_of_the_same_size():
    kv = flash_attn_kv_caches(8, 128, 16, 8, 128, device="cuda")
    views = page_views(kv)
    mover = KVBlockMover(kv)
    plan = mover.plan([0, 20], [64, 90], [4, 2])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mover.apply(plan)                   # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mover.apply(plan)
    for src, dst, n in (([8, 40], [100, 70], [4, 2]), ([30, 1], [120, 50], [2, 4])):
        for v in views:
            v[dst[0]:dst[0] + n[0]].zero_()
        plan.pairs.copy_(mover.plan(src, dst, n).pairs)
        graph.replay()
        torch.cuda.synchronize()
        for v in views:
            for s, d, k in zip(src, dst, n):
                assert torch.equal(v[d:d + k], v[s:s + k])


def test_the_bandwidth_script_runs_and_checks(tmp_path):
    out = tmp_path / "moves.json"
    rc = kv_moves.main(["--layers", "8", "--runs", "1,16", "--singles", "64", "--peak-mib",
                        "256", "--budget-s", "0.02", "--json", str(out)])
    assert rc == 0
    import json
    report = json.loads(out.read_text())
    assert report["checks_ok"] and report["peak"]["gbps"] > 0
    assert {r["method"] for r in report["rows"]} == {"triton", "index", "runs"}


# --- pytest-benchmark: the kernel against torch on a Llama-3.1-8B-shaped cache ----------

@pytest.fixture(scope="module")
def llama_cache():
    cases, num_blocks = kv_moves.make_cases([1, 64], [128], 16, seed=0)
    kv = flash_attn_kv_caches(32, num_blocks, 16, 8, 128, device="cuda")
    return kv, {c[0]: c[1:] for c in cases}


@pytest.mark.parametrize("batch", ["1 x 16-block runs", "64 x 16-block runs",
                                   "128 scattered blocks"])
@pytest.mark.parametrize("method", ["triton", "index", "runs"])
def test_bench_move(request, llama_cache, batch, method):
    try:
        benchmark = request.getfixturevalue("benchmark")
    except pytest.FixtureLookupError:
        pytest.skip("needs pytest-benchmark (python3 -m proxima.bench.kv_moves gives the table)")
    kv, cases = llama_cache
    src, dst, n = cases[batch]
    views = page_views(kv)
    mover = KVBlockMover(kv, backend="torch" if method == "index" else "triton")
    plan = mover.plan(src, dst, n)
    merged = runs_of(plan.pairs[0].tolist(), plan.pairs[1].tolist())
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def call():
        if method == "runs":
            apply_runs_torch(views, merged)
        else:
            mover.apply(plan)
        torch.cuda.synchronize()

    def cold_l2():
        scratch.zero_()
        torch.cuda.synchronize()

    benchmark.pedantic(call, setup=cold_l2, rounds=20, warmup_rounds=2)
    benchmark.extra_info.update(bytes_moved=plan.bytes_moved, runs=len(merged))
    if benchmark.stats:                  # None under --benchmark-disable (one plain call)
        median = benchmark.stats.stats.median
        benchmark.extra_info["gbps_read_plus_write"] = 2 * plan.bytes_moved / median / 1e9
