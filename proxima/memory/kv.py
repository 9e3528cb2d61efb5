"""A KV cache whose memory is mapped granule by granule (engine-agnostic).

A KV cache is a few *regions* (raw byte tensors, one per layer for vLLM 0.26), each
``num_blocks`` pages of ``size // num_blocks`` bytes, block-major. :class:`KvMemory`
reserves all of them in one virtual range (:class:`~proxima.memory.arena.VmmArena`),
sized for the whole pool, and maps it by granules of ``granule_blocks`` block ids: granule
``g`` = blocks ``[g * G, (g + 1) * G)`` of every region, each region's slice a whole number
of the GPU's 2 MiB allocation granules. The same block-id range is mapped in every layer,
so the scheduler reasons in block ids only.

It applies the channel's ops (:mod:`proxima.memory.ops`) in order.
"""

from __future__ import annotations

import time
from typing import Sequence

from proxima.memory.arena import VmmArena
from proxima.memory.errors import CannotGrow
from proxima.memory.layout import granule_blocks
from proxima.memory.ops import MAP, UNMAP, Op, validate

GRANULE_BYTES = 2 << 20     # the H200's (and every current NVIDIA GPU's) VMM granularity


def region_block_strides(region_sizes: Sequence[int], num_blocks: int) -> list[int]:
    """Bytes per block in each block-major region."""
    strides = []
    for size in region_sizes:
        if size <= 0 or size % num_blocks:
            raise ValueError(f"a KV region of {size} bytes is not {num_blocks} equal pages")
        strides.append(size // num_blocks)
    return strides


class KvMemory:
    """The KV regions of one worker, in one reserved range, mapped by granules.

    ``mapped``: granules backed at creation (default all of them, as a stock engine would
    allocate; granule 0 always). ``zero_on_map``: zero-fill newly mapped memory (default;
    vLLM does not zero its own KV memory unless its KV cache config asks for it). Raises
    :class:`CannotGrow` if even those cannot be backed -- at start-up that is the same
    failure as stock vLLM running out of memory.

    ``keep_free_bytes``: a map never leaves the GPU with less free memory than this (the
    driver's figure, read once per map op); the granules beyond it are reported as not
    mapped, as if the GPU had refused them. The engine's forward allocates its activations
    through torch outside the KV: a grow that took the last free bytes made the next
    forward fail with out-of-memory (H100, 2026-12-05). 0: map until the driver refuses.
    The granules mapped at creation are not held to it (warm-up needs them).

    ``spare_granules`` (KV compaction's scratch, :mod:`proxima.vllm.compaction_v1`):
    granules reserved and mapped after the pool's last one, block ids from
    ``pool_granules * granule_blocks`` on in every region. They lie past the end of the
    tensors (:meth:`tensors` covers ``num_blocks`` blocks, what vLLM sees) and no op maps
    or unmaps them: only a block mover writing by address reaches them.
    """

    def __init__(self, region_sizes: Sequence[int], num_blocks: int, *,
                 granule_bytes: int = GRANULE_BYTES, device: int = 0, driver=None,
                 mapped: int | None = None, zero_on_map: bool = True,
                 spare_granules: int = 0, keep_free_bytes: int = 0) -> None:
        self.keep_free_bytes = keep_free_bytes
        self.region_sizes = tuple(int(s) for s in region_sizes)
        self.num_blocks = num_blocks
        self.block_strides = region_block_strides(self.region_sizes, num_blocks)
        self.granule_blocks = granule_blocks(self.block_strides, granule_bytes)
        self.num_granules = -(-num_blocks // self.granule_blocks)
        self.spare_granules = spare_granules
        self.arena = VmmArena([self.granule_blocks * s for s in self.block_strides],
                              self.num_granules + spare_granules, device=device,
                              driver=driver, zero_on_map=zero_on_map)
        if granule_bytes % self.arena.granularity:
            self.arena.close()
            raise ValueError(f"granule_bytes={granule_bytes} is not a multiple of the GPU's "
                             f"allocation granularity ({self.arena.granularity} bytes)")
        self.device = device
        self.stats = {"map_ops": 0, "unmap_ops": 0, "granules_mapped": 0,
                      "granules_unmapped": 0, "map_failures": 0, "map_seconds": 0.0,
                      "unmap_seconds": 0.0}
        want = self.num_granules if mapped is None else max(1, min(mapped, self.num_granules))
        result = self.arena.map(0, want)
        if result.ok and spare_granules:
            spare = self.arena.map(self.num_granules, self.num_granules + spare_granules)
            result = result if spare.ok else spare
        if not result.ok:
            self.arena.close()
            raise CannotGrow("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY",
                             f"the GPU cannot back the initial KV cache ({want} granules of "
                             f"{self.arena.bytes_per_unit} bytes)")
        self.arena.driver.synchronize()   # the zero-fill ran on the legacy default stream
        self._tensors: list | None = None

    @property
    def mapped_granules(self) -> int:
        """Mapped granules of the pool (the spare ones not counted)."""
        return self.arena.mapped_units - self.spare_granules

    @property
    def spare_blocks(self) -> range:
        """The block ids of the spare granules (empty without them)."""
        first = self.num_granules * self.granule_blocks
        return range(first, first + self.spare_granules * self.granule_blocks)

    @property
    def bytes_per_granule(self) -> int:
        return self.arena.bytes_per_unit

    def tensors(self) -> list:
        """One ``torch.uint8`` tensor per region, exactly its size (the views vLLM's own
        allocation would return), over the reserved addresses."""
        if self._tensors is None:
            self._tensors = [self.arena.region_tensor(r, size)
                             for r, size in enumerate(self.region_sizes)]
        return self._tensors

    def backing(self):
        """One ``torch.uint8`` tensor over the whole reserved range: region ``r`` starts at
        byte ``arena.region_base[r] - arena.base`` (vLLM 0.33 views every layer in one
        allocation; the views must stay within :meth:`tensors`' bytes of each region)."""
        return self.arena.range_tensor()

    def apply(self, ops: Sequence[Op], *, stream: int = 0) -> list[tuple[int, int]]:
        """Apply ``ops`` in order. Returns the ``(first, count)`` granule ranges that could
        not be mapped for lack of GPU memory (they stay unmapped; nothing raised)."""
        validate(ops, self.num_granules, self.num_blocks)
        failed: list[tuple[int, int]] = []
        stats = self.stats
        for op in ops:
            t0 = time.perf_counter()
            if op.code == MAP:
                stop = op.first + op.count
                cut = self._room_stop(op.first, stop)
                result = self.arena.map(op.first, cut, stream)
                stats["map_ops"] += 1
                stats["granules_mapped"] += result.mapped
                start = cut if result.ok else result.failed.start
                if start < stop:
                    failed.append((start, stop - start))
                    stats["map_failures"] += stop - start
                stats["map_seconds"] += time.perf_counter() - t0
            elif op.code == UNMAP:
                stats["granules_unmapped"] += self.arena.unmap(op.first, op.first + op.count)
                stats["unmap_ops"] += 1
                stats["unmap_seconds"] += time.perf_counter() - t0
        return failed

    def _room_stop(self, first: int, stop: int) -> int:
        """Where a map of granules ``[first, stop)`` stops so that ``keep_free_bytes``
        stay free: after as many unmapped granules as the driver's free memory holds
        beyond it."""
        if not self.keep_free_bytes:
            return stop
        self.arena.driver.use_device()
        free, _ = self.arena.driver.mem_info()
        room = max(0, (free - self.keep_free_bytes) // self.bytes_per_granule)
        for g in range(first, stop):
            if not self.arena.is_mapped(g):
                if room == 0:
                    return g
                room -= 1
        return stop

    def close(self) -> None:
        self._tensors = None
        self.arena.close()
