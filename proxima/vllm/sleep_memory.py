"""GPU and host memory around vLLM's sleep (vLLM 0.26's ``CuMemAllocator``; the one place
that knows how its sleep copies and what it frees). Set up once while a model that may sleep
starts (:func:`set_up_sleep`, from the elastic connector's worker side, ``sleep_mode``).

**The weights kept on the host from start-up.** vLLM's level-1 sleep copies every allocation
tagged ``weights`` into a new pinned host tensor, then frees the GPU memory; its wake copies
back and drops the host tensors. The copy is what a sleep for another engine's demand waits
on: 0.33 s for an 8B model's weights on an idle H100, but **6.4-8.6 s** while the other
engine's burst runs on the GPU (two processes share a GPU in time; s37), and only then is the
memory free for the busy engine. The weights do not change while the engine serves, so
:func:`set_up_sleep` copies them once, at start-up, into pinned host memory it keeps
(:func:`copy_weights`), and every sleep then unmaps them without a copy
(:func:`keeping_weights`); the wake copies back as before. The host memory is what vLLM's
sleep held, pinned, from the first sleep on (15.5 GiB for 8B); pinning it at start-up took
6.3-9.3 s per engine (s37), which a first sleep paid before (7.6 s, s28). Not with LoRA or
vLLM's dev mode (its weight-update routes): weights written after start-up would come back
as they were; those sleeps are vLLM's copy.

**torch's GPU cache kept across the sleep** (:func:`keeping_cache`). The sleep ends with
``empty_cache()`` (``torch.cuda``'s; vLLM 0.33: ``torch.accelerator``'s), which gives the GPU
the blocks torch keeps for the forward's activations. A woken engine then allocates them
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


#: the tag a kept weights allocation wears while vLLM's sleep runs: not offloaded, so released
#: without a copy
KEPT_TAG = "proxima-weights-kept-on-host"


def copy_weights(pointer_to_data: dict, empty: Callable[[int], object],
                 copy: Callable[[int, int, int], object]) -> dict[int, object]:
    """A host copy of each ``weights`` allocation of the allocator's ``pointer_to_data``
    (pointer -> AllocationData, ``handle[1]`` the size), as vLLM's sleep makes it:
    ``empty(size)`` and ``copy(host pointer, device pointer, size)``. pointer -> host tensor."""
    kept = {}
    for ptr, data in pointer_to_data.items():
        if data.tag == WEIGHTS_TAG:
            size = data.handle[1]
            host = empty(size)
            copy(host.data_ptr(), ptr, size)
            kept[ptr] = host
    return kept


def keeping_weights(sleep: Callable, pointer_to_data: dict, kept: dict[int, object],
                    default_tag: str = "default") -> Callable:
    """``sleep`` (vLLM's, ``sleep(offload_tags=None)``) that releases the kept ``weights``
    allocations without copying them (they wear :data:`KEPT_TAG` while it runs) and leaves
    each released one its kept host copy as ``cpu_backup_tensor``, which vLLM's wake copies
    back. A sleep that offloads no ``weights`` (level 2) is vLLM's as it is."""

    def sleep_keeping_weights(offload_tags=None):
        tags = ((default_tag,) if offload_tags is None else
                (offload_tags,) if isinstance(offload_tags, str) else tuple(offload_tags))
        held = [] if WEIGHTS_TAG not in tags else [     # asleep already: left as it is
            (ptr, data) for ptr, data in pointer_to_data.items()
            if data.tag == WEIGHTS_TAG and ptr in kept and not data.is_asleep]
        for _, data in held:
            data.tag = KEPT_TAG
        try:
            return sleep(offload_tags=offload_tags)
        finally:
            for ptr, data in held:
                data.tag = WEIGHTS_TAG
                if data.is_asleep:
                    data.cpu_backup_tensor = kept[ptr]

    return sleep_keeping_weights


def wrap(allocator, kept: dict[int, object]) -> None:
    """The allocator's sleep releases the ``kept`` weights without a copy
    (:func:`keeping_weights`; none kept: vLLM's copy), and its sleep and wake keep torch's GPU
    cache (:func:`keeping_cache`; vLLM 0.26 empties it at the sleep's end, 0.33 also at the
    wake's start)."""
    sleep = allocator.sleep
    if kept:
        sleep = keeping_weights(sleep, allocator.pointer_to_data, kept, allocator.default_tag)
    allocator.sleep = keeping_cache(sleep)
    allocator.wake_up = keeping_cache(allocator.wake_up)


def weights_stay(vllm_config) -> bool:
    """Whether the weights stay as loaded while the engine serves, so that a copy made at
    start-up is theirs at every sleep: not with LoRA (adapters are written into weight
    memory as they load) nor in vLLM's dev mode (its routes update weights in place)."""
    from vllm import envs

    return getattr(vllm_config, "lora_config", None) is None and not envs.VLLM_SERVER_DEV_MODE


def set_up_sleep(keep_weights: bool = True) -> tuple[int, float]:
    """Wrap the sleep of vLLM's sleep-mode allocator (``CuMemAllocator`` on CUDA): it keeps
    torch's GPU cache (:func:`keeping_cache`) and, with ``keep_weights``, releases the
    weights without a copy into host memory copied now (:func:`copy_weights`,
    :func:`keeping_weights`). (bytes kept, seconds it took); once per process."""
    import torch
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.utils.torch_utils import PIN_MEMORY

    allocator = get_mem_allocator_instance()           # the one vLLM's sleep uses
    if getattr(allocator.sleep, "proxima_keeps_cache", False):
        return 0, 0.0
    kept, seconds = {}, 0.0
    if keep_weights:
        from vllm.device_allocator import cumem         # loads libcuda: after the check above

        began = time.monotonic()
        torch.cuda.synchronize()                        # the weights as loaded
        kept = copy_weights(allocator.pointer_to_data, lambda size: torch.empty(
            size, dtype=torch.uint8, device="cpu", pin_memory=PIN_MEMORY),
            cumem.libcudart.cudaMemcpy)
        seconds = time.monotonic() - began
    wrap(allocator, kept)
    kept_bytes = sum(host.numel() for host in kept.values())
    if kept:
        log.info("Proxima: copied %.2f GiB of weights to %s host memory in %.2f s (%d "
                 "allocations): this engine's sleeps release them without a copy, and keep "
                 "torch's GPU cache (its activations' blocks) for the wake",
                 kept_bytes / 2**30, "pinned" if PIN_MEMORY else "pageable", seconds,
                 len(kept))
    else:
        log.info("Proxima: this engine's sleeps keep torch's GPU cache (its activations' "
                 "blocks), so that a wake finds them; they copy the weights as vLLM's do")
    return kept_bytes, seconds


def keeping_cache(sleep: Callable) -> Callable:
    """``sleep`` (or ``wake_up``) with ``empty_cache()`` (``torch.cuda``'s; vLLM 0.33 calls
    ``torch.accelerator``'s) doing nothing while it runs, given back after it, even when it
    fails. One already so wrapped comes back as it is."""
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
