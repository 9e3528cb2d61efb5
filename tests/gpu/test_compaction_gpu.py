"""Issue 14 item 3's worker side on a GPU, without vLLM: a step's compaction work applied
to a Llama-3.1-8B-shaped KV cache as vLLM 0.26's V2 runner holds it (FlashAttention's NHD
pages, a persistent int32 block table), by the code the runner's hook calls
(:func:`proxima.vllm.compaction_worker.apply_on_worker`): a plan with a cycle through a
scratch block past the pool, planned by the planner, then checked byte for byte, the
table rewritten, and the GPU time measured with CUDA events.

Needs torch with CUDA and Triton. Skips without a GPU; fails instead when
PROXIMA_EXPECT_GPU=1. On the H200 (seconds):

    PROXIMA_EXPECT_GPU=1 python3 -m pytest -o addopts="" -m gpu tests/gpu/test_compaction_gpu.py -q
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.gpu
EXPECT = os.environ.get("PROXIMA_EXPECT_GPU", "")

if EXPECT == "1":
    import torch
    import triton  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")

from proxima.allocator.planner import plan_pack  # noqa: E402
from proxima.allocator.plans import CACHED, FIXED, FREE, LIVE, PoolView  # noqa: E402
from proxima.vllm import compaction_worker  # noqa: E402
from proxima.kernels.layout import flash_attn_kv_caches  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if torch.cuda.is_available():
        return
    if EXPECT == "1":
        pytest.fail("PROXIMA_EXPECT_GPU=1 but torch.cuda.is_available() is False")
    pytest.skip("needs an NVIDIA GPU")


def test_a_planned_step_moves_every_layer_and_rewrites_the_table():
    G, layers = 8, 32
    # granule 0: null + three lone live blocks of request "a"; granule 1: cached blocks and
    # one live block of "b"; granule 2: the scratch granule past the pool (N = 16)
    kinds = [FIXED, LIVE, LIVE, LIVE, CACHED, CACHED, CACHED, CACHED,
             LIVE, LIVE, LIVE, LIVE, LIVE, CACHED, CACHED, CACHED] + [FIXED] * G
    scratch = list(range(16, 16 + G))
    plan = plan_pack(PoolView(kinds, G, scratch=scratch), 64)
    assert plan and any(d in scratch for _, d in plan.relocations)   # no FREE block: scratch
    kv = flash_attn_kv_caches(layers, 16 + G, 16, 8, 128, device="cuda", fill=True)
    before = [t.clone() for t in kv]
    table = torch.zeros(4, 64, dtype=torch.int32, device="cuda")
    table[0, :3] = torch.tensor([1, 2, 3], dtype=torch.int32)
    runner = SimpleNamespace(
        kv_caches=kv, kv_cache_config=SimpleNamespace(num_blocks=16),
        block_tables=SimpleNamespace(block_tables=[SimpleNamespace(gpu=table)],
                                     blocks_per_kv_block=[1]),
        req_states=SimpleNamespace(req_id_to_index={"a": 0}))
    moves = plan.final_positions()
    new = [moves.get(b, b) for b in (1, 2, 3)]
    work = compaction_worker.CompactionWork(
        1, tuple(tuple(p) for p in plan.phases),
        (("a", 0, (0, 1, 2), tuple(new)),), plan.blocks_moved)
    compaction_worker.apply_on_worker(runner, work)
    torch.cuda.synchronize()
    # compared as bits: random bytes seen as bf16 include NaNs, which never compare equal
    for layer, old in zip(kv, before):
        layer, old = layer.view(torch.int16), old.view(torch.int16)
        for src, dst in moves.items():
            assert torch.equal(layer[dst], old[src]), (src, dst)
        for x in range(1, 16):
            if x not in moves and x not in moves.values():
                assert torch.equal(layer[x], old[x])
    assert table[0, :3].tolist() == new
    compaction_worker.apply_on_worker(runner, compaction_worker.CompactionWork(2, (), (), 0))
    torch.cuda.synchronize()
    compaction_worker.apply_on_worker(runner, compaction_worker.CompactionWork(3, (), (), 0))
    times = compaction_worker.take_worker_times()
    assert times and times[0][0] == 1 and times[0][1] > 0
    print(f"\ncompaction step: {plan.blocks_moved} blocks of {layers} layers in "
          f"{len(plan.phases)} phases, {times[0][1] * 1000:.0f} us on the GPU")


def test_a_move_outside_the_blocks_and_scratch_is_refused():
    kv = flash_attn_kv_caches(2, 16, 16, 8, 128, device="cuda", fill=False)
    runner = SimpleNamespace(
        kv_caches=kv, kv_cache_config=SimpleNamespace(num_blocks=16),
        block_tables=SimpleNamespace(block_tables=[SimpleNamespace(
            gpu=torch.zeros(1, 4, dtype=torch.int32, device="cuda"))], blocks_per_kv_block=[1]),
        req_states=SimpleNamespace(req_id_to_index={}))
    with pytest.raises(RuntimeError, match="lies outside this worker's KV blocks"):
        compaction_worker.apply_on_worker(runner, compaction_worker.CompactionWork(
            1, (((3, 20, 1),),), (), 1))


def test_steps_with_any_move_count_compile_the_kernel_once():
    """Steps moving 1..40 blocks in one or two phases, from one upload per step: the
    kernel's compile cache grows by at most one variant (the first step), never per count
    or per slice offset."""
    from proxima.kernels import triton_moves

    kv = flash_attn_kv_caches(4, 128, 16, 8, 128, device="cuda", fill=True)
    runner = SimpleNamespace(
        kv_caches=kv, kv_cache_config=SimpleNamespace(num_blocks=128),
        block_tables=SimpleNamespace(block_tables=[SimpleNamespace(
            gpu=torch.zeros(2, 128, dtype=torch.int32, device="cuda"))], blocks_per_kv_block=[1]),
        req_states=SimpleNamespace(req_id_to_index={"a": 0}))

    def compiled() -> int:
        return sum(len(c[0]) for c in triton_moves._kernel(False).device_caches.values())

    sizes = []
    for seq, k in enumerate(range(1, 41), start=1):
        phases = (((0, 64, k),),) if k % 2 else (((0, 64, k // 2),), ((k, 100, k // 2),))
        compaction_worker.apply_on_worker(runner, compaction_worker.CompactionWork(
            seq, phases, (("a", 0, (0,), (64,)),), k))
        sizes.append(compiled())
    torch.cuda.synchronize()
    assert sizes[-1] == sizes[0] >= 1, sizes
    assert runner.block_tables.block_tables[0].gpu[0, 0].item() == 64
