"""KVBlockMover on CPU: the torch backend and the Triton kernel (in Triton's interpreter)
against a byte-level oracle, on the KV layouts vLLM 0.26 allocates (built by vLLM's own
``_reshape_attention_kv_cache`` where vLLM is installed) and on older/odd ones."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from proxima.kernels import KVBlockMover, LayoutError, MoveError, apply_moves  # noqa: E402
from proxima.kernels.layout import flash_attn_kv_caches, page_views, regions_of  # noqa: E402

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton (its interpreter runs the kernel on CPU)"))]

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD = 48, 16, 2, 8       # page: 16*2*16*2 = 1,024 bytes


@dataclass
class Cache:
    """KV tensors plus where every block's bytes are: (raw buffer, offset, stride, page)."""
    kv: list
    raws: list
    geometry: list          # (raw index, byte offset of block 0, block stride, page bytes)
    block_dim: int = 0


def _vllm_views(layout: str, padded: int = 0, layers: int = 3, dtype=torch.bfloat16):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import set_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=dtype)
    if padded:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                                 dtype=dtype, page_size_padded=spec.page_size_bytes + padded)
    set_kv_cache_layout(layout)
    try:
        shape = FlashAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD)
        order = FlashAttentionBackend.get_kv_cache_stride_order()
        raws, kv = [], []
        for _ in range(layers):
            raw = torch.zeros(NUM_BLOCKS * spec.page_size_bytes, dtype=torch.int8)
            raws.append(raw)
            kv.append(_reshape_attention_kv_cache(raw, spec, shape, order, NUM_BLOCKS, None))
        return spec, shape, order, raws, kv
    finally:
        set_kv_cache_layout(None)


def make_cache(kind: str) -> Cache:
    page = BLOCK_SIZE * HEADS * 2 * HEAD * 2
    if kind in ("nhd", "hnd", "padded"):
        if HAS_VLLM:
            spec, _, _, raws, kv = _vllm_views("HND" if kind == "hnd" else "NHD",
                                               padded=256 if kind == "padded" else 0)
            stride = spec.page_size_bytes
        else:
            pad = 256 if kind == "padded" else 0
            kv = flash_attn_kv_caches(3, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD, fill=False,
                                      layout="HND" if kind == "hnd" else "NHD", page_padding=pad)
            raws = [_raw_of(t, NUM_BLOCKS * (page + pad)) for t in kv]
            stride = page + pad
        geometry = [(i, 0, stride, page) for i in range(len(raws))]
    elif kind == "packed":
        # vLLM's packed layout (KVCacheTensor.block_stride > 0): each block holds every
        # layer's page; layer i's page at offset i * page
        pytest.importorskip("vllm")
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.utils import set_kv_cache_layout
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                                 dtype=torch.bfloat16)
        set_kv_cache_layout("NHD")
        try:
            shape = FlashAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD)
            order = FlashAttentionBackend.get_kv_cache_stride_order()
            backing = torch.zeros(NUM_BLOCKS * 3 * page, dtype=torch.int8)
            kv = [_reshape_attention_kv_cache(backing, spec, shape, order, NUM_BLOCKS,
                                              (i * page, 3 * page)) for i in range(3)]
        finally:
            set_kv_cache_layout(None)
        raws = [backing]
        geometry = [(0, i * page, 3 * page, page) for i in range(3)]
    elif kind == "kv_first":
        # (2, num_blocks, block_size, heads, head): K and V in separate halves (vLLM V0)
        half = NUM_BLOCKS * page // 2
        raws = [torch.zeros(2 * half, dtype=torch.int8) for _ in range(2)]
        kv = [r.view(torch.bfloat16).view(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD) for r in raws]
        geometry = [(i, h * half, page // 2, page // 2) for i in range(2) for h in range(2)]
        return Cache(kv, raws, geometry, block_dim=1)
    elif kind == "shared":
        # KV sharing: two layer names bound to one tensor (copied once)
        raw = torch.zeros(NUM_BLOCKS * page, dtype=torch.int8)
        t = raw.view(torch.bfloat16).view(NUM_BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD)
        return Cache({"layers.0.attn": t, "layers.1.attn": t}, [raw], [(0, 0, page, page)])
    elif kind == "odd":
        # 6-byte pages: 2-byte words, no 16-byte hint
        raws = [torch.zeros(NUM_BLOCKS * 6, dtype=torch.int8) for _ in range(2)]
        kv = [r.view(torch.int16).view(NUM_BLOCKS, 3) for r in raws]
        geometry = [(i, 0, 6, 6) for i in range(2)]
    else:
        raise AssertionError(kind)
    return Cache(kv, raws, geometry)


def _raw_of(t, nbytes):
    return torch.as_strided(t, (nbytes // t.element_size(),), (1,), t.storage_offset()) \
        .view(torch.int8)


def random_batch(rng: random.Random, num_blocks: int = NUM_BLOCKS, slot: int = 4):
    """Runs of 1..slot blocks, each in its own aligned slot; sources and destinations in
    different slots, so the batch is valid."""
    slots = list(range(num_blocks // slot))
    rng.shuffle(slots)
    k = rng.randint(1, len(slots) // 2)
    src, dst, n = [], [], []
    for a, b in zip(slots[:k], slots[k:2 * k]):
        length = rng.randint(1, slot)
        off_s, off_d = rng.randint(0, slot - length), rng.randint(0, slot - length)
        src.append(a * slot + off_s)
        dst.append(b * slot + off_d)
        n.append(length)
    return src, dst, n


def fill(cache: Cache, seed: int):
    g = torch.Generator().manual_seed(seed)
    for raw in cache.raws:
        raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))


def expected_after(cache: Cache, before, src, dst, n):
    out = [b.clone() for b in before]
    for ri, off, stride, page in cache.geometry:
        for s, d, k in zip(src, dst, n):
            for j in range(k):
                a, b = off + (s + j) * stride, off + (d + j) * stride
                out[ri][b:b + page] = before[ri][a:a + page]
    return out


KINDS = ["nhd", "hnd", "padded", "packed", "kv_first", "shared", "odd"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_moves_copy_exactly_the_destination_pages(kind, backend):
    cache = make_cache(kind)
    mover = KVBlockMover(cache.kv, block_dim=cache.block_dim, backend=backend)
    assert mover.backend == backend
    rng = random.Random(f"{kind}-{backend}")
    for seed in range(3):
        fill(cache, seed)
        before = [r.clone() for r in cache.raws]
        src, dst, n = random_batch(rng)
        plan = mover.apply(src, dst, n)
        assert plan.num_moved == sum(n)
        assert plan.bytes_moved == sum(n) * sum(g[3] for g in cache.geometry)
        for got, want in zip(cache.raws, expected_after(cache, before, src, dst, n)):
            assert torch.equal(got, want), (kind, backend, src, dst, n)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("chunk_bytes, block_bytes", [(256, None), (256, 64), (16, 16)])
def test_kernel_splits_pages_into_chunks_and_loads(chunk_bytes, block_bytes):
    cache = make_cache("padded")
    mover = KVBlockMover(cache.kv, backend="triton", chunk_bytes=chunk_bytes,
                         block_bytes=block_bytes)
    assert mover.max_chunks == 1024 // chunk_bytes
    fill(cache, 7)
    before = [r.clone() for r in cache.raws]
    src, dst, n = [0, 9, 30], [44, 20, 12], [3, 1, 2]
    mover.apply(src, dst, n)
    for got, want in zip(cache.raws, expected_after(cache, before, src, dst, n)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm")
@pytest.mark.parametrize("layout, pad", [("NHD", 0), ("HND", 0), ("NHD", 256)])
def test_flash_attn_replica_matches_vllms_own_views(layout, pad):
    spec, _, _, _, kv = _vllm_views(layout, padded=pad, layers=1)
    mine = flash_attn_kv_caches(1, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD, layout=layout,
                                page_padding=pad, fill=False)[0]
    assert (mine.shape, mine.stride(), mine.dtype) == (kv[0].shape, kv[0].stride(), kv[0].dtype)
    assert regions_of(mine)[0].stride == regions_of(kv)[0].stride == spec.page_size_bytes


def test_llama_8b_page_is_64_kib_holding_k_and_v():
    kv = flash_attn_kv_caches(2, 4, 16, 8, 128, fill=False)
    regions = regions_of(kv)
    assert [(r.page, r.stride, r.num_blocks) for r in regions] == [(65536, 65536, 4)] * 2
    assert KVBlockMover(kv, backend="torch").bytes_per_block == 2 * 65536


def test_regions_of_kv_first_and_shared_layers():
    cache = make_cache("kv_first")
    assert len(regions_of(cache.kv, block_dim=1)) == 4
    shared = make_cache("shared")
    assert len(regions_of(shared.kv)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_invalid_batch_raises_and_copies_nothing(backend):
    cache = make_cache("nhd")
    fill(cache, 3)
    before = [r.clone() for r in cache.raws]
    mover = KVBlockMover(cache.kv, backend=backend)
    with pytest.raises(MoveError, match="destination block 5 is also a source"):
        mover.apply([0, 5], [5, 9], [1, 1])
    with pytest.raises(MoveError, match="outside the cache's 48 blocks"):
        mover.apply([0], [47], [2])
    assert all(torch.equal(a, b) for a, b in zip(cache.raws, before))


def test_unchecked_plans_expand_like_checked_ones():
    mover = KVBlockMover(make_cache("nhd").kv, backend="torch")
    args = ([40, 7, 12], [20, 3, 30], [3, 1, 2])
    assert torch.equal(mover.plan(*args).pairs, mover.plan(*args, validate=False).pairs)
    assert torch.equal(mover.plan([1, 2], [5, 6]).pairs,
                       mover.plan([1, 2], [5, 6], validate=False).pairs)
    assert mover.apply([], [], []).num_moved == 0


def test_a_plan_is_reusable_and_apply_moves_is_one_shot():
    cache = make_cache("hnd")
    fill(cache, 5)
    before = [r.clone() for r in cache.raws]
    plan = apply_moves(cache.kv, [4], [30], [4], backend="torch")
    KVBlockMover(cache.kv).apply(plan)        # same moves again: same result
    for got, want in zip(cache.raws, expected_after(cache, before, [4], [30], [4])):
        assert torch.equal(got, want)


def test_auto_is_torch_without_cuda():
    assert KVBlockMover(make_cache("nhd").kv).backend == "torch"


@pytest.mark.parametrize("kwargs, needle", [
    ({"backend": "cuda"}, "backend must be one of auto, triton, torch, got 'cuda'"),
    ({"chunk_bytes": 3000}, "chunk_bytes must be a power of two >= 1, got 3000"),
    ({"num_warps": 0}, "num_warps must be a power of two"),
    ({"block_dim": 4}, "block_dim 4 is not a dimension of a 4-d tensor"),
])
def test_bad_mover_arguments(kwargs, needle):
    with pytest.raises(ValueError) as err:
        KVBlockMover(make_cache("nhd").kv, **kwargs)
    assert needle in str(err.value)


def test_layouts_that_are_not_dense_pages_are_refused():
    t = torch.zeros(8, 4, 16)
    with pytest.raises(LayoutError, match="do not form one dense range"):
        regions_of(t[:, :, ::2])
    with pytest.raises(LayoutError, match="blocks overlap"):
        regions_of(torch.zeros(1, 64).expand(8, 64))
    with pytest.raises(LayoutError, match="kv_caches is empty"):
        regions_of([])
    with pytest.raises(LayoutError, match="must be a torch.Tensor"):
        regions_of([t, "x"])


def test_page_views_use_the_widest_word():
    kv = make_cache("nhd").kv
    assert page_views(kv)[0].dtype == torch.int64
    assert page_views(make_cache("odd").kv)[0].dtype == torch.int16


# ----------------------------------------------------------------------------- compiles

def test_the_kernel_compiles_once_whatever_the_move_count():
    """Only the grid follows the batch: the compile-time arguments are the mover's own and
    the count is not specialised on, so a run of steps moving 1, 2, ..., 300 blocks (and
    slices of one upload) costs one Triton compile, not one per count (or per count's
    divisibility by 16, Triton's default integer specialisation)."""
    mover = KVBlockMover(make_cache("nhd").kv, backend="torch")
    keys = set()
    for k in range(1, 301):
        grid, consts = mover.launch_params(k)
        assert grid[0] == k and grid[1:] == (len(mover.regions), mover.max_chunks)
        keys.add(tuple(sorted(consts.items())))
    assert len(keys) == 1
    assert mover.compile_key() == next(iter(keys)) + (("pairs_align", 16),)
    if HAS_TRITON:
        from proxima.kernels import triton_moves

        params = {p.name: p for p in triton_moves._kernel(False).params}
        assert params["num_pairs"].do_not_specialize
        assert [n for n, p in params.items() if not p.is_constexpr and not n.endswith("_ptr")
                ] == ["num_pairs"]              # no other runtime int to specialise on


def test_packed_segments_start_16_byte_aligned():
    from proxima.kernels import pack_int64

    segs = [[1, 2, 3], [], [4], [5, 6], [7, 8, 9, 10, 11]]
    flat, offsets = pack_int64(segs)
    assert all(o % 2 == 0 for o in offsets)             # int64: 16 bytes
    assert [flat[o:o + len(s)] for o, s in zip(offsets, segs)] == segs
    t = torch.tensor(flat, dtype=torch.int64)
    assert all(t[o:].data_ptr() % 16 == t.data_ptr() % 16 for o in offsets)


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_pairs_from_one_upload_equals_apply(backend):
    from proxima.kernels import pack_int64

    a, b = make_cache("nhd"), make_cache("nhd")
    fill(a, 3)
    fill(b, 3)
    phases = [([4, 40], [30, 10], [3, 1]), ([7], [20], [2])]
    for src, dst, n in phases:
        KVBlockMover(a.kv, backend=backend).apply(src, dst, n)
    segs = []
    for src, dst, n in phases:
        s = [x + j for x, m in zip(src, n) for j in range(m)]
        d = [x + j for x, m in zip(dst, n) for j in range(m)]
        segs.append(s + d)
    flat, offsets = pack_int64([[0]] + segs)     # an odd segment first: offsets realign
    data = torch.tensor(flat, dtype=torch.int64)
    mover = KVBlockMover(b.kv, backend=backend)
    for o, seg in zip(offsets[1:], segs):
        mover.apply_pairs(data[o:o + len(seg)], len(seg) // 2)
    assert all(torch.equal(x, y) for x, y in zip(a.raws, b.raws))
