"""How much KV memory could go back to the GPU: granule occupancy, sampled per step.

The one place this is measured (issues 13 and 14 both report it). A *granule* is
``granule_blocks`` consecutive block ids (granule ``g`` = ids ``[g * G, (g + 1) * G)``),
the unit elastic KV memory maps and unmaps; a block is *live* when a request holds it
(it is in a KV-cache manager's ``req_to_blocks``; the null block never is). Per step:

* ``reclaimable`` = granules holding no live block / all granules (what an elastic pool
  could unmap, evicting at most cached blocks);
* ``packed ideal`` = ``1 - ceil(live / G) / granules`` (the same for a pool whose live
  blocks were packed into as few granules as possible).

:class:`GranuleTally` keeps their means over the sampled steps. Pure Python on vLLM's
objects; O(blocks held by requests) per sample.
"""

from __future__ import annotations

#: 2 MiB of one layer's KV for Llama-3.1-8B (16 tokens x 8 KV heads x (K, V) x 128 x bf16
#: = 64 KiB pages): the H200's VMM granularity, the granule of elastic KV memory.
DEFAULT_GRANULE_BLOCKS = 32
#: one 16-token block of Llama-3.1-8B over all 32 layers: what a moved block costs to copy
LLAMA_8B_BYTES_PER_BLOCK = 32 * 64 * 1024


def live_per_granule(managers, num_blocks: int, granule_blocks: int) -> list[int]:
    """Live blocks in each granule (a block shared by several requests counts once)."""
    live = bytearray(num_blocks)
    for mgr in managers:
        for blocks in mgr.req_to_blocks.values():
            for block in blocks:
                live[block.block_id] = 1
    for mgr in managers:                 # the null block is in tables but never live
        live[mgr.block_pool.null_block.block_id] = 0
        break
    G = granule_blocks
    return [live.count(1, g * G, (g + 1) * G) for g in range(-(-num_blocks // G))]


def sample(managers, num_blocks: int, granule_blocks: int) -> tuple[float, float]:
    """``(reclaimable fraction, packed ideal fraction)`` of the pool now."""
    per = live_per_granule(managers, num_blocks, granule_blocks)
    granules = len(per)
    live = sum(per)
    return per.count(0) / granules, 1.0 - -(-live // granule_blocks) / granules


class GranuleTally:
    """Means of the per-step samples."""

    def __init__(self, granule_blocks: int = DEFAULT_GRANULE_BLOCKS) -> None:
        if type(granule_blocks) is not int or granule_blocks < 1:
            raise ValueError(f"granule_blocks must be an integer >= 1, got {granule_blocks!r}")
        self.granule_blocks = granule_blocks
        self.samples = 0
        self._reclaimable = 0.0
        self._ideal = 0.0

    def add(self, managers, num_blocks: int) -> tuple[float, float]:
        r, i = sample(managers, num_blocks, self.granule_blocks)
        self.samples += 1
        self._reclaimable += r
        self._ideal += i
        return r, i

    def as_details(self) -> dict:
        """``reclaimable_granule_fraction``, ``packed_ideal_fraction`` (means), their ratio
        and the granule size, for a replay result's ``details``."""
        r = self._reclaimable / self.samples if self.samples else 0.0
        i = self._ideal / self.samples if self.samples else 0.0
        return {"granule_blocks": self.granule_blocks, "reclaimable_granule_fraction": r,
                "packed_ideal_fraction": i,
                "reclaimable_vs_ideal": r / i if i else None, "granule_samples": self.samples}
