"""The granule derived from vLLM 0.26's real KV layouts (backend shapes, stride orders and
the V2 runner's own reshape code, run on CPU tensors)."""

import pytest

from proxima.vllm import elastic_v1, vllm_v1_compat
from proxima.vllm.elastic_connector import predicted_granule_blocks
from proxima.memory.kv import region_block_strides
from proxima.memory.layout import LayoutError, check_block_major, granule_blocks

if vllm_v1_compat.kv_layout_generation() != "per-layer":
    pytest.skip("vLLM 0.26's KV layouts (0.33's: test_elastic_views.py)",
                allow_module_level=True)

MiB = 1 << 20


@pytest.fixture(params=["NHD", "HND"])
def layout(request):
    from vllm.v1.attention.backends.utils import set_kv_cache_layout

    set_kv_cache_layout(request.param)
    yield request.param
    set_kv_cache_layout(None)


def backends():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return [FlashAttentionBackend, FlashInferBackend, TritonAttentionBackend]


def views(backend, num_blocks, heads, head_size, packing=None, padded=None):
    """The view vLLM's V2 runner gives an attention layer, over a CPU raw tensor."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head_size,
                             dtype=torch.bfloat16, page_size_padded=padded)
    shape = backend.get_kv_cache_shape(num_blocks, 16, heads, head_size)
    order = backend.get_kv_cache_stride_order()
    stride = packing[1] if packing else spec.page_size_bytes
    raw = torch.zeros(stride * num_blocks, dtype=torch.int8)
    view = _reshape_attention_kv_cache(raw, spec, shape, order, num_blocks, packing)
    return spec, raw, view


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.__name__)
@pytest.mark.parametrize("heads, head_size, granule", [(8, 128, 32), (2, 64, 256)],
                         ids=["llama-8b", "tiny"])
def test_vllm_backends_are_block_major_and_the_granule_follows_the_page(
        layout, backend, heads, head_size, granule):
    spec, raw, view = views(backend, 64, heads, head_size)
    check_block_major(view.shape, view.stride(), view.element_size(),
                      view.data_ptr() - raw.data_ptr(), 64, spec.page_size_bytes)
    assert granule_blocks([spec.page_size_bytes], 2 * MiB) == granule


def test_packed_and_padded_layouts_stay_in_their_blocks(layout):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as fa

    spec, raw, view = views(fa, 32, 8, 128)
    page = spec.page_size_bytes
    # two layers packed in one 2-page block stride (vLLM's packed layout), the second at +page
    spec, raw, view = views(fa, 32, 8, 128, packing=(page, 2 * page))
    check_block_major(view.shape, view.stride(), view.element_size(),
                      view.data_ptr() - raw.data_ptr(), 32, 2 * page)
    with pytest.raises(LayoutError):
        check_block_major(view.shape, view.stride(), view.element_size(),
                          view.data_ptr() - raw.data_ptr(), 32, page)
    if layout == "NHD":   # padding between pages (num-blocks-first layouts only)
        spec, raw, view = views(fa, 32, 8, 128, padded=page + 4096)
        check_block_major(view.shape, view.stride(), view.element_size(), 0, 32, page + 4096)


def test_the_scheduler_predicts_the_granule_the_worker_derives():
    import torch
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            KVCacheTensor)

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(32)]
    config = KVCacheConfig(
        num_blocks=4000,
        kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * 4000, shared_by=[n])
                          for n in layers],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    sizes, where = elastic_v1.kv_regions(config)
    assert len(sizes) == 32 and where[layers[5]] == 5
    assert predicted_granule_blocks(config, 2 * MiB) == 32 == granule_blocks(
        region_block_strides(sizes, 4000), 2 * MiB)
    packed = KVCacheConfig(
        num_blocks=4000,
        kv_cache_tensors=[KVCacheTensor(size=2 * spec.page_size_bytes * 4000, shared_by=[n],
                                        offset=i * spec.page_size_bytes,
                                        block_stride=2 * spec.page_size_bytes)
                          for i, n in enumerate(layers[:2])],
        kv_cache_groups=[KVCacheGroupSpec(layers[:2], spec)])
    sizes, where = elastic_v1.kv_regions(packed)
    assert sizes == [2 * spec.page_size_bytes * 4000] and set(where.values()) == {0}
    assert predicted_granule_blocks(packed, 2 * MiB) == 16
