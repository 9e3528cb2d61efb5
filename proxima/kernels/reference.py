"""The torch implementation of a batch of block moves: the fallback without CUDA or Triton,
and the kernel's reference.

Per region (one per layer, or per K/V half), over its ``(num_blocks, words)`` page view
(:func:`proxima.kernels.layout.page_views`): ``index_select`` gathers the source pages into
a temporary, ``index_copy_`` scatters them to the destinations -- two launches and one
temporary of the moved bytes per region. Reading everything before writing anything, it
gives the documented result for every valid batch (:mod:`proxima.kernels.moves`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["apply_torch", "apply_runs_torch"]


def apply_torch(views: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy page ``src[j]`` to page ``dst[j]`` of every view (int64 index tensors on the
    views' device)."""
    for v in views:
        v.index_copy_(0, dst, v.index_select(0, src))


def apply_runs_torch(views: Sequence[torch.Tensor], runs: Sequence[tuple[int, int, int]]) -> None:
    """The same moves as one slice ``copy_`` per run per view (``(src, dst, n)`` runs):
    a contiguous run is one device-to-device copy; the benchmark's "per-run copies"."""
    for v in views:
        for s, d, n in runs:
            v[d:d + n].copy_(v[s:s + n])
