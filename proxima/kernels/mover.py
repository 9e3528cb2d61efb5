"""Apply a batch of block moves to every layer's KV cache: the API of ``proxima.kernels``.

    mover = KVBlockMover(kv_caches)           # once: vLLM's per-layer KV tensors
    mover.apply(src=[40, 7], dst=[100, 3], n=[16, 1])   # blocks 40..55 -> 100..115, 7 -> 3

Semantics and the rules a batch must follow: :mod:`proxima.kernels.moves` (destinations
distinct and disjoint from the sources; :class:`MoveError` otherwise, nothing copied).
The copy is enqueued on the current CUDA stream and is ordered with the work around it
like any kernel; the call does not synchronise.

Backends: ``"triton"`` (one launch for all layers: :mod:`proxima.kernels.triton_moves`;
on CPU tensors it runs in Triton's interpreter), ``"torch"`` (``index_select`` /
``index_copy_`` per region: :mod:`proxima.kernels.reference`), ``"auto"`` (Triton on CUDA
when Triton imports, torch otherwise).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from proxima.kernels.layout import alignment, page_views, regions_of
from proxima.kernels.moves import MoveError, expand_moves
from proxima.kernels.reference import apply_torch

__all__ = ["KVBlockMover", "MovePlan", "apply_moves", "pack_int64", "BACKENDS"]

BACKENDS = ("auto", "triton", "torch")


@dataclass
class MovePlan:
    """A validated batch on the device: ``pairs`` is int64 ``[2, num_moved]`` (source
    blocks, destination blocks). Reusable, and its ``pairs`` may be overwritten in place
    with another batch of the same size (e.g. between replays of a captured CUDA graph).
    It is uploaded on the stream current at :meth:`KVBlockMover.plan`; apply it there (or
    make the applying stream wait for that one)."""

    pairs: torch.Tensor
    num_moved: int
    bytes_moved: int          # bytes read (and as many written), all regions


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _pow2_divisor(x: int) -> int:
    return x & -x


class KVBlockMover:
    """Moves blocks of one device's KV cache (all layers) by block id.

    ``kv_caches``: vLLM's per-layer KV tensors (a list, a ``{layer: tensor}`` dict, or one
    tensor); ``block_dim``: the dimension indexed by block id (0 for vLLM 0.26; 1 for
    kv-first ``(2, num_blocks, ...)`` layouts). The mover keeps the tensors alive and reads
    their addresses once: make a new mover if the cache is reallocated.
    ``chunk_bytes``/``block_bytes``/``num_warps``: the kernel's work per program, per load,
    and warps per program (``python3 -m proxima.bench.kv_moves --sweep`` compares them).

    With the Triton backend, ``base_ptrs``, ``block_strides`` (bytes) and ``page_words``
    are the device int64 tensors the kernel reads: one entry per region (layer, or K/V half).
    """

    def __init__(self, kv_caches, *, block_dim: int = 0, backend: str = "auto",
                 chunk_bytes: int = 16384, block_bytes: int | None = None,
                 num_warps: int = 4):
        if backend not in BACKENDS:
            raise MoveError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        for name, v in (("chunk_bytes", chunk_bytes), ("block_bytes", block_bytes),
                        ("num_warps", num_warps)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1
                                  or v & (v - 1)):
                raise MoveError(f"{name} must be a power of two >= 1, got {v!r}")
        self.regions = regions_of(kv_caches, block_dim)
        self._views = page_views(kv_caches, block_dim)
        self.device = self._views[0].device
        self.num_blocks = min(r.num_blocks for r in self.regions)
        self.bytes_per_block = sum(r.page for r in self.regions)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" and _triton_available() else "torch"
        elif backend == "triton" and not _triton_available():
            raise MoveError("backend 'triton' needs the triton package (pip install triton), "
                            "or use backend='torch'")
        self.backend = backend

        align = alignment(self.regions)
        self.word_bytes = min(align, 8)
        self.align16 = align == 16
        pages = [r.page // self.word_bytes for r in self.regions]
        g = 0
        for p in pages:
            g = math.gcd(g, p)
        self.chunk_words = min(_pow2_divisor(g), max(1, chunk_bytes // self.word_bytes))
        self.block_words = min(self.chunk_words,
                               max(1, (block_bytes or chunk_bytes) // self.word_bytes))
        self.max_chunks = max(pages) // self.chunk_words
        self.num_warps = num_warps
        if self.backend == "triton":
            def dev(values):
                return torch.tensor(values, dtype=torch.int64, device=self.device)
            self.base_ptrs = dev([r.base for r in self.regions])
            self.block_strides = dev([r.stride for r in self.regions])
            self.page_words = dev(pages)

    def plan(self, src, dst, n=None, *, validate: bool = True) -> MovePlan:
        """Check the batch (:func:`proxima.kernels.moves.expand_moves`) and upload it
        (asynchronously, on the current stream). ``validate=False`` skips the checks (for a
        caller that has made them)."""
        if validate:
            s, d = expand_moves(src, dst, n, self.num_blocks)
            pairs = torch.tensor([s, d], dtype=torch.int64)
        else:
            pairs = _expand_unchecked(src, dst, n)
        if self.device.type == "cuda":
            # pinned + non_blocking: the upload is queued on the current stream instead of
            # waiting on the host for the work already queued there (a pageable copy would)
            pairs = pairs.pin_memory().to(self.device, non_blocking=True)
        k = pairs.shape[1]
        return MovePlan(pairs=pairs, num_moved=k, bytes_moved=k * self.bytes_per_block)

    def launch_params(self, num_moved: int) -> tuple[tuple[int, int, int], dict]:
        """The Triton launch of a batch of ``num_moved`` blocks: ``(grid, compile-time
        arguments)``. Only the grid depends on the batch: the compile-time arguments (and
        so the compiled kernel, :meth:`compile_key`) are the mover's own, the count is a
        runtime argument that Triton does not specialise on, and every pairs buffer is
        16-byte aligned (:func:`pack_int64`), so one mover compiles its kernel once,
        whatever the move counts."""
        grid = (num_moved, len(self.regions), self.max_chunks)
        return grid, dict(WORD=self.word_bytes, ALIGN16=self.align16,
                          CHUNK=self.chunk_words, BLOCK=self.block_words,
                          num_warps=self.num_warps)

    def compile_key(self) -> tuple:
        """What Triton compiles the kernel for (one compile per distinct key, per process):
        the compile-time arguments and the pointer alignment, never the move count."""
        _, consts = self.launch_params(1)
        return tuple(sorted(consts.items())) + (("pairs_align", PAIRS_ALIGN_BYTES),)

    def apply_pairs(self, pairs: torch.Tensor, num_moved: int) -> None:
        """Apply moves already expanded to single blocks and on the mover's device, with no
        check and no upload (the worker's path: one upload per step for every phase):
        ``pairs`` is a 1-D int64 tensor whose first ``2 * num_moved`` entries are the
        sources then the destinations, starting 16-byte aligned (a segment of
        :func:`pack_int64` is)."""
        if num_moved == 0:
            return
        if self.backend == "torch":
            apply_torch(self._views, pairs[:num_moved], pairs[num_moved:2 * num_moved])
            return
        from proxima.kernels.triton_moves import launch

        kwargs = dict(num_regions=len(self.regions), max_chunks=self.max_chunks,
                      word_bytes=self.word_bytes, align16=self.align16,
                      chunk=self.chunk_words, block=self.block_words, num_warps=self.num_warps)
        args = (pairs, num_moved, self.base_ptrs, self.block_strides, self.page_words)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                launch(*args, **kwargs)
        else:
            launch(*args, **kwargs)

    def apply(self, src, dst=None, n=None, *, validate: bool = True) -> MovePlan:
        """Apply a batch: ``apply(src, dst, n)`` (run starts and lengths; ``n=None``: single
        blocks) or ``apply(plan)``. Returns the plan (reusable)."""
        plan = src if isinstance(src, MovePlan) else self.plan(src, dst, n, validate=validate)
        if plan.num_moved == 0:
            return plan
        if self.backend == "torch":
            apply_torch(self._views, plan.pairs[0], plan.pairs[1])
            return plan
        from proxima.kernels.triton_moves import launch
        args = (plan.pairs, plan.num_moved, self.base_ptrs, self.block_strides, self.page_words)
        kwargs = dict(num_regions=len(self.regions), max_chunks=self.max_chunks,
                      word_bytes=self.word_bytes, align16=self.align16,
                      chunk=self.chunk_words, block=self.block_words, num_warps=self.num_warps)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                launch(*args, **kwargs)
        else:
            launch(*args, **kwargs)
        return plan

    __call__ = apply


PAIRS_ALIGN_BYTES = 16          # every segment of pack_int64 starts at a multiple of this
_ALIGN_WORDS = PAIRS_ALIGN_BYTES // 8


def pack_int64(segments) -> tuple[list[int], list[int]]:
    """Concatenate int sequences into one flat list for a single upload, each segment
    starting at an even index (16 bytes of int64: the alignment Triton specialises
    pointers on, so a slice of the uploaded tensor never makes the kernel compile again);
    returns ``(flat, offsets)``."""
    flat: list[int] = []
    offsets: list[int] = []
    for seg in segments:
        pad = -len(flat) % _ALIGN_WORDS
        if pad:
            flat.extend((0,) * pad)
        offsets.append(len(flat))
        flat.extend(seg)
    return flat, offsets


def _expand_unchecked(src, dst, n) -> torch.Tensor:
    s = torch.as_tensor(src, dtype=torch.int64).reshape(-1)
    d = torch.as_tensor(dst, dtype=torch.int64).reshape(-1)
    if n is None:
        return torch.stack([s, d])
    k = torch.as_tensor(n, dtype=torch.int64).reshape(-1)
    first = torch.repeat_interleave(torch.cumsum(k, 0) - k, k)
    offs = torch.arange(int(k.sum()), dtype=torch.int64) - first
    return torch.stack([torch.repeat_interleave(s, k) + offs, torch.repeat_interleave(d, k) + offs])


def apply_moves(kv_caches, src, dst, n=None, **kwargs) -> MovePlan:
    """One-shot :meth:`KVBlockMover.apply` (reads the layout on every call: keep a
    :class:`KVBlockMover` when moving repeatedly). ``kwargs``: the mover's and ``validate``."""
    validate = kwargs.pop("validate", True)
    return KVBlockMover(kv_caches, **kwargs).apply(src, dst, n, validate=validate)
