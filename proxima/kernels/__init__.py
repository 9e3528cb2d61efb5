"""KV-cache block movers: copy blocks of every layer's KV tensor by block id, on the GPU.

``KVBlockMover(kv_caches).apply(src, dst, n)`` moves runs of blocks in all layers at once
(one Triton launch on CUDA; torch ``index_select``/``index_copy_`` elsewhere). Batch rules:
:mod:`proxima.kernels.moves`; the layouts read off vLLM 0.26's tensors:
:mod:`proxima.kernels.layout`.

Importing this package imports neither torch nor Triton: the names below load their
module on first use, and :mod:`proxima.kernels.moves` (the batch rules) is pure Python.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "MoveError": "proxima.kernels.moves",
    "expand_moves": "proxima.kernels.moves",
    "runs_of": "proxima.kernels.moves",
    "KVBlockMover": "proxima.kernels.mover",
    "MovePlan": "proxima.kernels.mover",
    "apply_moves": "proxima.kernels.mover",
    "pack_int64": "proxima.kernels.mover",
    "LayoutError": "proxima.kernels.layout",
    "Region": "proxima.kernels.layout",
    "regions_of": "proxima.kernels.layout",
    "page_views": "proxima.kernels.layout",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'proxima.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
