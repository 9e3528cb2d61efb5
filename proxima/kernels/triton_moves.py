"""The Triton kernel: one launch copies every moved block of every layer.

Grid ``(moved block, region, chunk)``: program ``(p, r, c)`` copies words ``[c * CHUNK,
(c + 1) * CHUNK)`` of block ``src[p]``'s page to block ``dst[p]``'s page in region ``r``
(one region per layer, or per K/V half; :mod:`proxima.kernels.layout`). The regions'
byte addresses, block strides and page sizes come in as device int64 tensors, so layers
allocated separately (vLLM allocates one buffer per layer) are covered by one launch.
Each program is one straight-line load of ``BLOCK`` words then one store (``CHUNK /
BLOCK`` of them), no masks: the host picks ``CHUNK`` to divide every page. When every
address, stride and page is a multiple of 16 bytes the pointers carry that hint and the
compiler emits 16-byte accesses (``ld.global.v2.b64``); consecutive threads touch
consecutive words, so accesses are coalesced.

Imported only when the Triton backend is used (``proxima.kernels`` never imports Triton
at import time). On CPU tensors the kernel runs in Triton's interpreter (tests).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

__all__ = ["launch", "WORDS"]

# access word size in bytes -> Triton element type
WORDS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}


def _move_pages(pairs_ptr, num_pairs, base_ptr, stride_ptr, page_ptr,
                WORD: tl.constexpr, ALIGN16: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    r = tl.program_id(1)
    start = tl.program_id(2).to(tl.int64) * CHUNK
    page = tl.load(page_ptr + r)                   # words of a page in this region
    if start < page:
        src_block = tl.load(pairs_ptr + p)
        dst_block = tl.load(pairs_ptr + num_pairs + p)
        base = tl.load(base_ptr + r)               # bytes
        stride = tl.load(stride_ptr + r)           # bytes between blocks
        src = (base + src_block * stride).to(tl.pointer_type(WORD)) + start
        dst = (base + dst_block * stride).to(tl.pointer_type(WORD)) + start
        if ALIGN16:
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        offs = tl.arange(0, BLOCK)
        for i in tl.static_range(0, CHUNK, BLOCK):
            tl.store(dst + i + offs, tl.load(src + i + offs))


@functools.cache
def _kernel(interpret: bool):
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(_move_pages)
    return triton.jit(_move_pages, do_not_specialize=["num_pairs"])


def launch(pairs, num_pairs: int, bases, strides, pages, *, num_regions: int,
           max_chunks: int, word_bytes: int, align16: bool, chunk: int, block: int,
           num_warps: int) -> None:
    """Enqueue the copy on the current stream. ``pairs``: int64 ``[2, num_pairs]`` (source
    blocks, then destination blocks); ``bases``/``strides``: int64 bytes per region;
    ``pages``: int64 words per region; ``chunk``/``block``: words, powers of two, ``block``
    divides ``chunk`` and ``chunk`` divides every page."""
    if num_pairs == 0:
        return
    interpret = not pairs.is_cuda
    grid = (num_pairs, num_regions, max_chunks)
    _kernel(interpret)[grid](pairs, num_pairs, bases, strides, pages,
                             WORD=WORDS[word_bytes], ALIGN16=align16, CHUNK=chunk,
                             BLOCK=block, num_warps=num_warps)
