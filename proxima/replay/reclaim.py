"""How much of the KV pool could be given back, sampled every replay step, for either pool.

Granule ``g`` is block ids ``[g * G, (g + 1) * G)`` (``--granule-blocks G``; 32 by default:
one 2 MiB piece of a Llama-3.1-8B layer's KV, 64 KiB pages). Each step, read off vLLM's
own blocks (``ref_cnt > 0``: a live block, in use by a request):

* ``reclaimable``: granules without a live block -- memory an elastic pool can release
  (their free blocks at no cost, their cached blocks by evicting them, as stock would
  when reusing them). Granule 0 holds vLLM's null block and never counts.
* ``packed ideal``: the granules that would hold no live block if the live blocks (and the
  null block) were packed into the fewest granules: ``granules - ceil((live + 1) / G)``.
* ``mapped`` (elastic mode): granules backed by memory; stock's pool is mapped whole.

Means are over every step (fractions of the pool's granules); the timeline keeps up to
:data:`TIMELINE_POINTS` evenly spaced samples for the plot.
"""

from __future__ import annotations

from operator import attrgetter

TIMELINE_POINTS = 400
#: 2 MiB of one layer's KV for Llama-3.1-8B (16 tokens x 8 KV heads x (K, V) x 128 x bf16
#: = 64 KiB pages): the H200's VMM granularity, the granule of elastic KV memory.
DEFAULT_GRANULE_BLOCKS = 32
#: one 16-token block of Llama-3.1-8B over all 32 layers: what a moved block costs to copy
LLAMA_8B_BYTES_PER_BLOCK = 32 * 64 * 1024
_REF = attrgetter("ref_cnt")


class ReclaimTally:
    """Per-step samples of one pool (see the module doc)."""

    def __init__(self, num_blocks: int, granule_blocks: int, block_bytes: int = 0,
                 on_sample=None) -> None:
        if granule_blocks < 1:
            raise ValueError(f"granule_blocks must be >= 1, got {granule_blocks}")
        self.num_blocks = num_blocks
        self.G = granule_blocks
        self.num_granules = -(-num_blocks // granule_blocks)
        self.block_bytes = block_bytes
        self.samples = 0
        self._reclaimable = 0
        self._ideal = 0
        self._mapped = 0
        self._live = 0
        self._rows: list[tuple[int, int, int, int, int]] = []   # step, mapped, used, recl, live
        self._every = 1
        #: ``fn(step, blocks)`` called at every sample, before it is counted (the no-move
        #: bounds of :mod:`proxima.replay.oracle` record the live blocks there)
        self.on_sample = on_sample

    def sample(self, step: int, blocks, mapped: int | None = None) -> None:
        """One step's state: ``blocks`` is vLLM's block list, ``mapped`` the mapped
        granules (None: all)."""
        if self.on_sample is not None:
            self.on_sample(step, blocks)
        refs = list(map(_REF, blocks))
        refs[0] = 1                               # the null block: never reclaimable
        G, ng = self.G, self.num_granules
        used = sum(1 for lo in range(0, self.num_blocks, G) if any(refs[lo:lo + G]))
        live = len(refs) - refs.count(0)          # the null block included
        ideal = ng - -(-live // G)
        mapped = ng if mapped is None else mapped
        self.samples += 1
        self._reclaimable += ng - used
        self._ideal += ideal
        self._mapped += mapped
        self._live += live - 1
        if self.samples % self._every == 0:
            self._rows.append((step, mapped, used, ng - used, live - 1))
            if len(self._rows) >= 2 * TIMELINE_POINTS:
                self._rows = self._rows[::2]
                self._every *= 2

    def means(self) -> dict:
        n, ng = self.samples or 1, self.num_granules
        out = {
            "granule_blocks": self.G,
            "num_granules": ng,
            "reclaimable_granule_fraction": self._reclaimable / n / ng,
            "packed_ideal_fraction": self._ideal / n / ng,
            "mapped_granule_fraction": self._mapped / n / ng,
            "mean_live_blocks": self._live / n,
        }
        ideal = out["packed_ideal_fraction"]
        out["reclaimable_vs_ideal"] = out["reclaimable_granule_fraction"] / ideal if ideal else 0.0
        if self.block_bytes:
            out["mean_mapped_bytes"] = self._mapped / n * self.G * self.block_bytes
        return out

    def timeline(self) -> list[tuple[int, int, int, int, int]]:
        """``(step, mapped granules, granules with live blocks, reclaimable granules, live
        blocks)``, evenly spaced."""
        return list(self._rows)
