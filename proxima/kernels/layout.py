"""Where each block of a KV cache lives in memory: byte regions read off the tensors.

What vLLM 0.26 allocates (V2 model runner, ``vllm/v1/worker/gpu/attn_utils.py``):

* ``_allocate_kv_cache``: one raw ``int8`` buffer per layer, ``page_size_bytes *
  num_blocks`` bytes (``KVCacheTensor.size``), or, in the packed layout (``block_stride >
  0``: DeepSeek V4, ``--enable-cross-layers``), one backing shared by all layers, every
  block holding each layer's page at ``offset``.
* ``_reshape_attention_kv_cache``: the raw buffer viewed as the backend's
  ``get_kv_cache_shape`` permuted by ``get_kv_cache_stride_order``. FlashAttention (the
  default on Hopper): logical shape ``(num_blocks, num_kv_heads, block_size, 2 *
  head_size)`` -- K and V share each block's page, K in ``[..., :head_size]`` and V in
  ``[..., head_size:]`` (``FlashAttentionImpl.forward`` splits the last dimension) -- stored
  ``(num_blocks, block_size, num_kv_heads, 2 * head_size)`` (NHD, the default) or in logical
  order (HND, asked for by some KV connectors). FlashInfer and FlexAttention are blocks-first
  too. With ``page_size_padded`` the block stride is the padded page size and the padding
  bytes belong to no tensor element.

So every layer's block ``b`` is one dense page of ``page`` bytes at ``base + b * stride``.
Older layouts put K and V in separate halves, ``(2, num_blocks, ...)`` (vLLM V0, ROCm's
kv-first backends): with ``block_dim=1`` each half is its own region. A move copies the
page of every region; the padding between pages is not copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import product

import torch

__all__ = ["LayoutError", "Region", "regions_of", "page_views", "alignment",
           "flash_attn_kv_caches"]


class LayoutError(ValueError):
    """A KV tensor whose blocks are not dense pages at a fixed stride."""


@dataclass(frozen=True)
class Region:
    """One layer's K+V (or one of K, V) storage: block ``b`` is ``page`` bytes at
    ``base + b * stride``, for ``0 <= b < num_blocks``."""

    base: int
    stride: int
    page: int
    num_blocks: int


def _tensors(kv_caches) -> list[torch.Tensor]:
    if isinstance(kv_caches, torch.Tensor):
        return [kv_caches]
    if isinstance(kv_caches, Mapping):          # vLLM's {layer_name: tensor}
        kv_caches = list(kv_caches.values())
    out = []
    for i, t in enumerate(kv_caches):
        if isinstance(t, (list, tuple)):        # [K, V] pairs of older runners
            out.extend(t)
        elif isinstance(t, torch.Tensor):
            out.append(t)
        else:
            raise LayoutError(f"kv_caches[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if not out:
        raise LayoutError("kv_caches is empty: give one KV tensor per layer")
    return out


def _page_bytes(t: torch.Tensor, where: str) -> int:
    """Bytes of one block of ``t`` (block dimension first), checked to be one dense range
    starting at the block's first element."""
    dims = sorted((st, s) for s, st in zip(t.shape[1:], t.stride()[1:]) if s > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            raise LayoutError(
                f"{where}: a block's elements do not form one dense range (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}); only layouts whose blocks "
                f"are dense pages can be moved")
        expected *= size
    return expected * t.element_size()


def _distinct(kv_caches, block_dim: int) -> list[tuple[Region, torch.Tensor]]:
    """Each distinct region with a tensor over it (block dimension first)."""
    out, seen, devices = [], set(), set()
    for i, t in enumerate(_tensors(kv_caches)):
        if not 0 <= block_dim < t.dim():
            raise LayoutError(f"kv_caches[{i}]: block_dim {block_dim} is not a dimension of a "
                              f"{t.dim()}-d tensor of shape {tuple(t.shape)}")
        devices.add(t.device)
        for idx in product(*(range(s) for s in t.shape[:block_dim])):
            sub = t[idx] if idx else t
            where = f"kv_caches[{i}]" + "".join(f"[{j}]" for j in idx)
            if min(sub.stride(), default=0) < 0:
                raise LayoutError(f"{where}: negative strides {tuple(sub.stride())} are not "
                                  f"supported")
            page = _page_bytes(sub, where)
            stride = sub.stride(0) * sub.element_size()
            if sub.shape[0] > 1 and stride < page:
                raise LayoutError(f"{where}: blocks overlap (block stride {stride} bytes < "
                                  f"page {page} bytes)")
            r = Region(base=sub.data_ptr(), stride=stride, page=page, num_blocks=sub.shape[0])
            if r not in seen:
                seen.add(r)
                out.append((r, sub))
    if len(devices) > 1:
        raise LayoutError(f"kv_caches span several devices ({', '.join(map(str, devices))}): "
                          f"make one mover per device")
    return out


def regions_of(kv_caches, block_dim: int = 0) -> list[Region]:
    """The distinct regions of ``kv_caches``: a tensor, a sequence of per-layer tensors (or
    of ``[K, V]`` pairs) or vLLM's ``{layer_name: tensor}``, all on one device.

    ``block_dim``: the dimension indexed by block id (0 for every vLLM 0.26 backend; 1 for
    kv-first layouts ``(2, num_blocks, ...)``, each K/V half becoming a region). Layers that
    share one tensor (KV sharing) give one region. Raises :class:`LayoutError`.
    """
    return [r for r, _ in _distinct(kv_caches, block_dim)]


def alignment(regions: Sequence[Region]) -> int:
    """The largest power of two <= 16 that divides every base, stride and page (bytes)."""
    g = 16
    for r in regions:
        g = math.gcd(g, r.base, r.stride, r.page)
    return g


def page_views(kv_caches, block_dim: int = 0) -> list[torch.Tensor]:
    """One ``(num_blocks, words per page)`` view per distinct region, over the same memory,
    in :func:`regions_of` order, in the widest integer type (8, 4, 2 or 1 bytes) the
    alignment allows: for torch's ``index_select`` / ``index_copy_`` and slicing, and for
    bit-exact comparisons (a bf16 page may hold NaN patterns)."""
    views = []
    for r, t in _distinct(kv_caches, block_dim):
        es = t.element_size()
        v = t.as_strided((r.num_blocks, r.page // es), (t.stride(0), 1), t.storage_offset())
        v = v.view(torch.uint8)
        for dtype in (torch.int64, torch.int32, torch.int16):
            w = torch.empty((), dtype=dtype).element_size()
            if r.base % w == 0 and r.stride % w == 0 and r.page % w == 0:
                v = v.view(dtype)
                break
        views.append(v)
    return views


def flash_attn_kv_caches(num_layers: int, num_blocks: int, block_size: int,
                         num_kv_heads: int, head_size: int, *, dtype=torch.bfloat16,
                         device="cpu", layout: str = "NHD", page_padding: int = 0,
                         fill: bool = True) -> list[torch.Tensor]:
    """KV tensors as vLLM 0.26's V2 model runner allocates them for FlashAttention.

    Mirrors ``_allocate_kv_cache`` (one zeroed ``int8`` buffer per layer) and
    ``_reshape_attention_kv_cache`` (viewed as ``(num_blocks, block_size, num_kv_heads, 2 *
    head_size)`` for NHD or ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` for
    HND, then permuted to the logical ``(num_blocks, num_kv_heads, block_size, 2 *
    head_size)``; with ``page_padding`` bytes after each page as an ``as_strided`` view, as
    for ``page_size_padded``). ``fill``: random contents instead of zeros.
    For tests and benchmarks; ``tests/kernels`` checks it against vLLM's own functions.
    """
    if layout not in ("NHD", "HND"):
        raise LayoutError(f"layout must be 'NHD' or 'HND', got {layout!r}")
    es = torch.empty((), dtype=dtype).element_size()
    page = block_size * num_kv_heads * 2 * head_size * es
    if page_padding % es:
        raise LayoutError(f"page_padding must be a multiple of the element size {es}, "
                          f"got {page_padding}")
    stride_el = (page + page_padding) // es
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    order = (0, 2, 1, 3) if layout == "NHD" else (0, 1, 2, 3)
    physical = tuple(logical[i] for i in order)
    inv = [order.index(i) for i in range(4)]
    caches = []
    for _ in range(num_layers):
        raw = torch.zeros(num_blocks * (page + page_padding), dtype=torch.int8, device=device)
        if fill:
            raw.random_(-128, 128)
        flat = raw.view(dtype)
        strides = list(torch.empty(physical, device="meta").stride())
        strides[0] = stride_el
        caches.append(torch.as_strided(flat, physical, tuple(strides)).permute(*inv))
    return caches
