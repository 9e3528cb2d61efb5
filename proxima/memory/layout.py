"""Which bytes of a KV tensor a block id owns, and the granule in block ids (pure Python).

A KV cache region (one raw tensor vLLM allocates) is *block-major* when block ``b`` owns the
bytes ``[b * S, (b + 1) * S)`` for a fixed block stride ``S``: then block ids
``[g * G, (g + 1) * G)`` own one contiguous, aligned slice of every region, and that slice
can be mapped and unmapped on its own. ``G`` -- :func:`granule_blocks` -- is the smallest
block count whose slice is a whole number of the GPU's granules in *every* region.

vLLM 0.26's CUDA attention backends (FlashAttention, FlashInfer, Triton, FlexAttention)
all allocate block-major pages: logical shape ``(num_blocks, kv_heads, block_size,
2 * head_size)``, K and V side by side in the last dimension (not the older ``(2,
num_blocks, ...)`` layout with separate K and V halves), one page per block per layer.
:func:`block_footprint` derives a block's bytes from a view's actual shape and strides, so
a layout that is not block-major (for example K and V in separate halves) is detected and
refused rather than assumed.
"""

from __future__ import annotations

from math import gcd, lcm
from typing import Iterable, Sequence

MAX_SEGMENTS = 4096


class LayoutError(ValueError):
    """A KV tensor layout the granule mapping cannot serve."""


def granule_blocks(block_strides: Iterable[int], granule_bytes: int) -> int:
    """Smallest ``G`` such that ``G * S`` is a multiple of ``granule_bytes`` for every block
    stride ``S`` (bytes per block in each region)."""
    g = 1
    for stride in block_strides:
        if stride <= 0:
            raise LayoutError(f"a block stride must be positive, got {stride}")
        g = lcm(g, granule_bytes // gcd(stride, granule_bytes))
    return g


#: The grains ``auto_granule_bytes`` tries, largest first: one physical allocation per region
#: and granule, so the larger the grain the fewer driver calls a grow makes. Measured on an
#: H100 (tools/gpu/map_rate.py, docs/results/map-rate-h100/): about 70 us per allocation whatever
#: its size, so 30 GB/s at 2 MiB, 241 GB/s at 16 MiB, 481 GB/s at 32 MiB.
AUTO_GRAINS = (32 << 20, 16 << 20, 8 << 20, 4 << 20, 2 << 20)
#: ... as long as the pool keeps at least this many granules (memory is given back a granule
#: at a time, and granule 0 holds the null block and is never unmapped).
AUTO_MIN_GRANULES = 8


def auto_granule_bytes(block_strides: Iterable[int], num_blocks: int) -> int:
    """The mapping grain per region when none is given: the largest of
    :data:`AUTO_GRAINS` that leaves the pool of ``num_blocks`` at least
    :data:`AUTO_MIN_GRANULES` granules, else the smallest. Pure: the scheduler (from vLLM's
    KV cache config) and every worker (from its tensors) compute the same."""
    strides = list(block_strides)
    for grain in AUTO_GRAINS:
        if num_blocks // granule_blocks(strides, grain) >= AUTO_MIN_GRANULES:
            return grain
    return AUTO_GRAINS[-1]


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, length in sorted(intervals):
        if out and start <= out[-1][0] + out[-1][1]:
            s, l = out[-1]
            out[-1] = (s, max(l, start + length - s))
        else:
            out.append((start, length))
    return out


def block_footprint(shape: Sequence[int], strides: Sequence[int], itemsize: int,
                    block_dim: int, blocks_per_block: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """Bytes of block 0 of a strided view, and the stride between blocks.

    ``shape``/``strides`` (elements) describe the view, ``block_dim`` its block dimension;
    ``blocks_per_block`` kernel blocks along it make one block of the caller (vLLM's
    scheduler block may span several kernel blocks). Returns ``(block_stride_bytes,
    [(offset, length), ...])``: block ``b`` owns those intervals shifted by
    ``b * block_stride_bytes`` (offsets relative to the view's first element).
    """
    dims = [(shape[i], strides[i]) for i in range(len(shape)) if i != block_dim]
    dims.append((blocks_per_block, strides[block_dim]))
    intervals = [(0, itemsize)]
    for size, stride in sorted(dims, key=lambda d: d[1]):
        if size == 1:
            continue
        if stride < 0:
            raise LayoutError(f"negative stride {stride} in a KV view")
        if len(intervals) * size > MAX_SEGMENTS * 4:
            raise LayoutError(f"KV view {tuple(shape)} / {tuple(strides)} splits a block "
                              f"into too many pieces")
        step = stride * itemsize
        intervals = _merge([(s + j * step, l) for j in range(size) for s, l in intervals])
    if len(intervals) > MAX_SEGMENTS:
        raise LayoutError(f"a block of KV view {tuple(shape)} / {tuple(strides)} has "
                          f"{len(intervals)} separate pieces")
    return blocks_per_block * strides[block_dim] * itemsize, intervals


def guess_block_dim(shape: Sequence[int], strides: Sequence[int], num_blocks: int) -> int:
    """The dimension holding the (kernel) blocks: a multiple of ``num_blocks`` long, the
    largest stride among such (the outermost)."""
    candidates = [i for i, n in enumerate(shape) if n >= num_blocks and n % num_blocks == 0]
    if not candidates:
        raise LayoutError(f"no dimension of KV view {tuple(shape)} counts {num_blocks} blocks")
    return max(candidates, key=lambda i: strides[i])


def check_block_major(shape: Sequence[int], strides: Sequence[int], itemsize: int,
                      offset: int, num_blocks: int, block_stride: int,
                      block_dim: int | None = None) -> None:
    """Raise :class:`LayoutError` unless every block ``b`` of the view lies in
    ``[b * block_stride, (b + 1) * block_stride)`` of its region.

    ``offset``: bytes from the region's start to the view's first element.
    """
    if block_dim is None:
        block_dim = guess_block_dim(shape, strides, num_blocks)
    per_block = shape[block_dim] // num_blocks
    stride, pieces = block_footprint(shape, strides, itemsize, block_dim, per_block)
    lo = offset + pieces[0][0]
    hi = offset + pieces[-1][0] + pieces[-1][1]
    if stride != block_stride or lo < 0 or hi > block_stride:
        raise LayoutError(
            f"KV view {tuple(shape)} with strides {tuple(strides)} is not block-major: a "
            f"block spans bytes [{lo}, {hi}) every {stride} bytes, not within its own "
            f"{block_stride}-byte page; elastic KV memory supports block-major layouts "
            f"(vLLM 0.26's CUDA attention backends)")
