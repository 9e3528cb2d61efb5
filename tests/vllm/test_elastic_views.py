"""The elastic worker side's KV tensors on CPU (no CUDA call): how each vLLM describes its KV
memory as block-major regions (0.26: a tensor per layer; 0.33: one backing allocation), the
views over a reserved range whose regions are padded to whole granules, and the allocation
hook of each release over the CPU stand-in driver, with CPU tensors in place of the VMM
range. What needs a GPU (mapping, the forward reading the views) is tests/gpu's."""

from __future__ import annotations

import pytest

from proxima.vllm import elastic_v1
from proxima.vllm import vllm_v1_compat as compat
from proxima.memory.kv import KvMemory
from proxima.memory.layout import check_block_major
from tests.memory.fake_driver import FakeDriver

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GRANULE = 2 << 20
one_backing = pytest.mark.skipif(compat.kv_layout_generation() != "one-backing",
                                 reason="vLLM 0.33's one-backing KV description")


def spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # 16 tokens x 2 KV heads x 64 x K+V x bf16: an 8 KiB page, 256 blocks a 2 MiB granule
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def config(num_blocks, tensors=None):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    page = spec().page_size_bytes
    return KVCacheConfig(num_blocks=num_blocks,
                         kv_cache_tensors=tensors or compat.kv_cache_tensors(num_blocks, page,
                                                                             LAYERS),
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec())])


def block_outer(num_blocks):
    from vllm.v1.kv_cache_interface import KVCacheTensor

    page = spec().page_size_bytes
    return [KVCacheTensor(size=num_blocks * len(LAYERS) * page, layers=list(LAYERS),
                          layer_stride=page, block_stride=len(LAYERS) * page)]


class CpuKvMemory(KvMemory):
    """The reserved range on the stand-in driver, its bytes a CPU tensor (what the VMM range
    is on a GPU): same region offsets, padding and spare granules."""

    def __init__(self, *args, **kwargs):
        import torch

        super().__init__(*args, driver=FakeDriver(), **kwargs)
        self.cpu = torch.zeros(self.arena.reserved_bytes, dtype=torch.uint8)

    def offset(self, region: int) -> int:
        return self.arena.region_base[region] - self.arena.base

    def backing(self):
        return self.cpu

    def tensors(self):
        return [self.cpu[self.offset(r):self.offset(r) + size]
                for r, size in enumerate(self.region_sizes)]


def layout():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout.LBNHC


def filled_at(memory, view, block, mark):
    """Fill ``block`` of ``view`` with ``mark`` and return the byte offsets of the backing
    it changed."""
    view[block].fill_(mark)
    changed = (memory.cpu != 0).nonzero().flatten().tolist()
    view[block].zero_()
    return changed


# ----------------------------------------------------------------------------- regions

def test_each_release_s_description_is_one_block_major_region_per_layer():
    page = spec().page_size_bytes
    regions, where, placed = compat.kv_region_layout(config(1000))
    assert [r.stride for r in regions] == [page] * 4
    assert [where[n] for n in LAYERS] == [0, 1, 2, 3]
    sizes, _ = compat.kv_regions(config(1000))
    assert sizes == [1000 * page] * 4
    if compat.kv_layout_generation() == "one-backing":     # one allocation, layer-outermost
        assert [r.base for r in regions] == [i * 1000 * page for i in range(4)]
        assert len(placed) == 1 and placed[0][1] == 0


@one_backing
def test_a_block_outermost_layout_is_one_region_of_every_layer_s_pages():
    page = spec().page_size_bytes
    regions, where, _ = compat.kv_region_layout(config(1000, block_outer(1000)))
    assert regions == [compat.KvRegion(0, 4 * page)] and set(where.values()) == {0}
    assert elastic_v1.kv_regions(config(1000, block_outer(1000)))[0] == [4000 * page]


@one_backing
def test_heads_outside_blocks_are_refused_not_mapped_wrong():
    from vllm.v1.kv_cache_interface import KVCacheTensor

    page = spec().page_size_bytes
    heads_outer = [KVCacheTensor(size=1000 * 4 * page, layers=list(LAYERS),
                                 layer_stride=1000 * page, block_stride=page // 2)]
    with pytest.raises(ValueError, match="not block-major"):
        compat.kv_region_layout(config(1000, heads_outer))


# ----------------------------------------------------------------------------- views

@one_backing
@pytest.mark.parametrize("blocks_outer", [False, True], ids=["layer-outer", "block-outer"])
def test_without_padding_the_views_are_vllm_s_own(blocks_outer):
    """512 blocks are two whole granules: the reserved range is laid out exactly as vLLM's
    own allocation, and every view has vLLM's shape, strides and offset."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    cfg = config(512, block_outer(512) if blocks_outer else None)
    theirs = allocate_kv_cache(cfg, torch.device("cpu"), layout())
    regions, _, _ = compat.kv_region_layout(cfg)
    backing = torch.zeros(theirs[LAYERS[0]].untyped_storage().nbytes(), dtype=torch.int8)
    ours = compat.kv_views(backing, [r.base for r in regions], cfg, layout())
    assert ours.keys() == theirs.keys()
    for name in LAYERS:
        a, b = ours[name], theirs[name]
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == \
            (b.shape, b.stride(), b.storage_offset(), b.dtype), name


@one_backing
@pytest.mark.parametrize("spare", [0, 1], ids=["pool", "with-scratch"])
def test_over_padded_regions_each_layer_s_block_lands_in_its_granule(spare):
    """1000 blocks are not whole granules: each layer's region is padded to 1024 blocks in
    the reserved range (and KV compaction's scratch granule follows it), so the views take
    the range's layer stride; block b of layer l is still b pages into region l."""
    cfg = config(1000)
    page = spec().page_size_bytes
    memory = CpuKvMemory(compat.kv_regions(cfg)[0], 1000, granule_bytes=GRANULE,
                         spare_granules=spare)
    assert memory.granule_blocks == 256 and memory.num_granules == 4
    offsets = [memory.offset(r) for r in range(4)]
    assert offsets == [r * (4 + spare) * 256 * page for r in range(4)]
    views = compat.kv_views(memory.backing(), offsets, cfg, layout())
    for l, name in enumerate(LAYERS):
        view = views[name]
        check_block_major(view.shape, view.stride(), view.element_size(),
                          view.data_ptr() - memory.cpu.data_ptr() - offsets[l], 1000, page)
        for block in (0, 255, 256, 999):
            start = offsets[l] + block * page        # bf16 1.0 is 0x3f80: no zero byte
            assert filled_at(memory, view, block, 1.0) == list(range(start, start + page))


# ----------------------------------------------------------------------------- the hook

def test_the_hook_of_this_release_returns_what_vllm_s_would_over_the_reserved_range():
    import torch

    owner, name = compat.kv_allocation()
    cfg = config(1000)
    page = spec().page_size_bytes
    made = []

    def make_memory(kv_cache_config, device):
        made.append(CpuKvMemory(compat.kv_regions(kv_cache_config)[0],
                                kv_cache_config.num_blocks, granule_bytes=GRANULE))
        return made[-1]

    hook = compat.vmm_kv_allocation(name, make_memory)
    if name == "_allocate_kv_cache":                    # 0.26: raw int8, one per layer
        out = hook(cfg, {}, torch.device("cpu"))
    else:                                               # 0.33: the layers' views
        out = hook(cfg, torch.device("cpu"), layout(), None)
    memory, = made
    assert set(out) == set(LAYERS)
    for l, layer in enumerate(LAYERS):
        start = memory.offset(l)
        base = out[layer].data_ptr() - memory.cpu.data_ptr()
        assert base == start
    # block 1 of layer 2, through what the hook returned, is bytes [page, 2 page) of region 2
    target = out[LAYERS[2]]
    if target.dim() == 1:
        target.view(torch.int8)[page:2 * page] = 7
    else:
        target[1].fill_(1.0)
    changed = (memory.cpu != 0).nonzero().flatten().tolist()
    start = memory.offset(2) + page
    assert changed == list(range(start, start + page))


def test_install_patches_this_release_s_allocation_and_deactivate_restores_it(monkeypatch):
    monkeypatch.setenv("PROXIMA_ALLOW_UNPROVEN_ELASTIC", "1")     # 0.33: not proven on a GPU
    owner, name = compat.kv_allocation()
    original = getattr(owner, name)
    try:
        elastic_v1.install_allocation_hook(elastic_v1.ElasticOptions())
        elastic_v1.install_allocation_hook(elastic_v1.ElasticOptions())      # idempotent
        assert getattr(owner, name) is not original
        assert getattr(getattr(owner, name), "proxima_vmm", False)
    finally:
        elastic_v1.deactivate()
    assert getattr(owner, name) is original
