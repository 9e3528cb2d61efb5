"""Host memory for vLLM's sleep, pinned at start-up (vLLM 0.26's ``CuMemAllocator``; the one
place that knows how its sleep copies).

vLLM's level-1 sleep copies every allocation tagged ``weights`` into a new pinned host
tensor of the same size (``torch.empty(size, dtype=uint8, device="cpu", pin_memory=...)``),
then frees the GPU memory; its wake copies back and drops the host tensors. Pinning ~15 GiB
of host memory is what makes a first sleep slow: 7.6 s of vLLM's sleep for an 8B model's
weights on an H100, and 0.33 s for the second sleep of the same process, because torch's
host allocator keeps freed pinned memory and serves the same sizes from it
(docs/results/h100-2026-12-06-s28/NOTES.md; without vLLM, ``tools/gpu/pin_rate.py``: 10.58 s
the first time, 0.30 s the second, s27).

:func:`pin_for_sleep` does the first time's work while the engine starts: it takes a pinned
host tensor of each ``weights`` allocation's size, all at once as the sleep holds them, and
frees them into torch's cache, so that a model's first sleep (the one another engine's burst
waits for) copies only. The host memory stays pinned from then on, as it does today after
a first sleep.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("vllm.proxima")     # vLLM's handlers: in the engine's log

WEIGHTS_TAG = "weights"         # what vLLM's level-1 sleep offloads (the rest is discarded)


def weights_sizes(allocator) -> list[int]:
    """The byte sizes of the allocator's ``weights`` allocations, as its sleep copies them
    (``pointer_to_data``: pointer -> AllocationData, ``handle[1]`` the size)."""
    return [data.handle[1] for data in allocator.pointer_to_data.values()
            if data.tag == WEIGHTS_TAG]


def pin_sizes(sizes: list[int], empty: Callable[[int], object]) -> float:
    """Take ``empty(size)`` for each size, all held at once as the sleep holds them, then
    free them (into torch's host cache): the seconds it took."""
    began = time.monotonic()
    held = [empty(size) for size in sizes]
    del held
    return time.monotonic() - began


def _pinned(size: int):
    import torch

    return torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=True)


def pin_for_sleep() -> tuple[int, float]:
    """Pin host memory for the sleep of vLLM's sleep-mode allocator (``CuMemAllocator`` on
    CUDA) and leave it in torch's cache: (bytes, seconds). Nothing where host memory cannot
    be pinned (vLLM's ``PIN_MEMORY``) or the allocator's pool holds no weights."""
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.utils.torch_utils import PIN_MEMORY

    sizes = weights_sizes(get_mem_allocator_instance())   # the allocator vLLM's sleep uses
    if not PIN_MEMORY or not sizes:
        return 0, 0.0
    seconds = pin_sizes(sizes, _pinned)
    log.info("Proxima: pinned %.2f GiB of host memory for this engine's sleeps in %.2f s "
             "(%d weight allocations): a sleep copies into it", sum(sizes) / 2**30, seconds,
             len(sizes))
    return sum(sizes), seconds
