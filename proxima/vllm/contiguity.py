"""Contiguity of vLLM V1's block tables, measured the same way for stock and Proxima.

Proxima's pool (:mod:`proxima.vllm.vllm_v1`) and the read-only observer of stock vLLM
(:mod:`proxima.vllm.observe_v1`) both publish, in the status file:

* ``running_blocks_per_run``: for every request holding blocks, its blocks divided by its
  runs of consecutive ids (:func:`running_blocks_per_run`);
* ``finished_blocks_per_run``: the same for every request's whole KV when it finishes, just
  before vLLM frees it (:class:`FinishedTally`): the contiguity an offload or transfer of
  that request would meet.

They read vLLM's own block tables (each single-type manager's ``req_to_blocks``); vLLM's
null block (a sliding window's placeholder) is not counted.
"""

from __future__ import annotations

from proxima.allocator import count_runs


def ids_per_run(ids: list[int]) -> float | None:
    """Block ids divided by their runs of consecutive ids (None for no ids)."""
    return len(ids) / count_runs(ids) if ids else None


def blocks_per_run(blocks) -> float | None:
    """:func:`ids_per_run` of vLLM ``KVCacheBlock`` objects, the null block left out."""
    return ids_per_run([b.block_id for b in blocks if not b.is_null])


def running_blocks_per_run(managers) -> list[float]:
    """For each request holding blocks in vLLM's single-type ``managers``: its blocks per
    run (1.0 = every block apart)."""
    values = (blocks_per_run(blocks) for m in managers for blocks in m.req_to_blocks.values())
    return [v for v in values if v is not None]


class FinishedTally:
    """Blocks per run of every request's whole KV when it finishes. One value per request
    and KV-cache group; published as ``finished_blocks_per_run`` (count and mean)."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0

    def add(self, managers, request_id: str) -> None:
        for manager in managers:
            blocks = manager.req_to_blocks.get(request_id)
            value = blocks_per_run(blocks) if blocks else None
            if value is not None:
                self.count += 1
                self.total += value

    def as_status(self) -> dict:
        return {"count": self.count, "mean": self.total / self.count if self.count else None}


def idle(managers) -> bool:
    """True when no request holds blocks (the end of a batch: time for a final snapshot)."""
    return not any(m.req_to_blocks for m in managers)
