"""GPU and host memory around vLLM's sleep (vLLM 0.26's ``CuMemAllocator``; the one place
that knows how its sleep copies and what it frees). Both are set up while a model that may
sleep starts (the elastic connector's worker side, ``sleep_mode``).

**Host memory pinned at start-up** (:func:`pin_for_sleep`). vLLM's level-1 sleep copies every
allocation tagged ``weights`` into a new pinned host tensor of the same size
(``torch.empty(size, dtype=uint8, device="cpu", pin_memory=...)``), then frees the GPU
memory; its wake copies back and drops the host tensors. Pinning ~15 GiB of host memory is
what makes a first sleep slow on an idle GPU: 7.6 s of vLLM's sleep for an 8B model's
weights on an H100, and 0.33 s for the second sleep of the same process, because torch's
host allocator keeps freed pinned memory and serves the same sizes from it
(docs/results/h100-2026-12-06-s28/NOTES.md; without vLLM, ``tools/gpu/pin_rate.py``: 10.58 s
the first time, 0.30 s the second, s27). :func:`pin_for_sleep` does the first time's work
while the engine starts: a pinned host tensor of each ``weights`` allocation's size, all at
once as the sleep holds them, freed into torch's cache, so that a first sleep copies only
(0.33 s on an idle H100, s37). The host memory stays pinned from then on, as it did after a
first sleep. While another engine's burst runs on the GPU the copy itself is slow (6.4-8.6 s
for the same weights, s37): the GPU is shared in time between the two processes.

**torch's GPU cache kept across the sleep** (:func:`keep_cache_across_sleep`). The sleep ends
with ``empty_cache()`` (``torch.cuda``'s; vLLM 0.33: ``torch.accelerator``'s), which gives the
GPU the blocks torch keeps for the forward's activations. A woken engine then allocates them
again at its first forward, from whatever the GPU's other engines left: on an H100 (s37) the
other engine had grown into that memory and the woken one died of CUDA out-of-memory at its
first batch (94 MiB short). The GPU's ledger already counts those blocks as held while
asleep (all the engine holds besides KV, less the weights), and the wake makes room for the
weights (and the GPU's free margin) only; so the sleep keeps torch's cache, and the wake
finds it where it was.
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


def keep_cache_across_sleep() -> None:
    """Let the sleep of vLLM's sleep-mode allocator (``CuMemAllocator`` on CUDA) leave
    torch's GPU cache as it is (:func:`keeping_cache`; see the module's doc)."""
    from vllm.device_allocator import get_mem_allocator_instance

    allocator = get_mem_allocator_instance()           # the one vLLM's sleep uses
    if not getattr(allocator.sleep, "proxima_keeps_cache", False):
        allocator.sleep = keeping_cache(allocator.sleep)
        log.info("Proxima: this engine's sleeps keep torch's GPU cache (its activations' "
                 "blocks), so that a wake finds them")


def keeping_cache(sleep: Callable) -> Callable:
    """``sleep`` with ``empty_cache()`` (``torch.cuda``'s; vLLM 0.33 calls
    ``torch.accelerator``'s) doing nothing while it runs, given back after it, even when it
    fails. A sleep already so wrapped comes back as it is."""
    if getattr(sleep, "proxima_keeps_cache", False):
        return sleep

    def sleep_keeping_cache(*args, **kwargs):
        import torch

        modules = [m for m in (torch.cuda, getattr(torch, "accelerator", None))
                   if m is not None and hasattr(m, "empty_cache")]
        saved = [(m, m.empty_cache) for m in modules]
        for module in modules:
            module.empty_cache = _keep_cache
        try:
            return sleep(*args, **kwargs)
        finally:
            for module, empty_cache in saved:
                module.empty_cache = empty_cache

    sleep_keeping_cache.proxima_keeps_cache = True
    return sleep_keeping_cache


def _keep_cache() -> None:
    """``empty_cache`` while vLLM's sleep runs: the cache stays."""
