"""Proxima's state on one vLLM block pool: one object, ``pool.proxima``.

Proxima's V1 block pool (:mod:`proxima.vllm.vllm_v1`) creates one :class:`PoolState` in its
``__init__`` and keeps it as its only added attribute; the wrappers around vLLM's scheduler
and managers, the elastic connector and KV compaction read and write the pool's Proxima state
through it. A pool without it (``getattr(pool, "proxima", None) is None``) is stock vLLM's.
No vLLM import: this is plain bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from proxima.vllm.contiguity import FinishedTally
from proxima.vllm.status import StatusWriter


@dataclass(eq=False)
class PoolState:
    """What Proxima keeps per block pool.

    ``status``: the status file's writer (the pool chooses its interval); ``expected_tokens``:
    request id -> prompt + max_tokens of each request the scheduler holds (the growth hint's
    room and the elastic forecast); ``expected_blocks``: their sum in blocks (kept by
    :meth:`expect` and :meth:`forget`); ``steps``: scheduler steps seen
    (``KVCacheManager.new_step_starts``); ``tick``: the elastic free queue's clock, called with
    ``steps`` at each step (None: not elastic); ``managers``: the per-group managers seen
    allocating (the status file reads their tables); ``finished``: blocks per run of finished
    requests; ``kv_manager``: the ``KVCacheManager`` that last started a step (KV compaction
    reads its block lists); ``compaction``: the
    :class:`~proxima.vllm.compaction_v1.Compactor`, when one is on; ``elastic``: the elastic
    connector's ``status()``, added to the status file (None: not elastic)."""

    status: StatusWriter
    expected_tokens: dict[str, int] = field(default_factory=dict)
    expected_blocks: int = 0
    steps: int = 0
    tick: Callable[[int], object] | None = None
    managers: list = field(default_factory=list)
    finished: FinishedTally = field(default_factory=FinishedTally)
    kv_manager: object | None = None
    compaction: object | None = None
    elastic: Callable[[], dict] | None = None

    def expect(self, request_id: str, tokens: int, block_size: int) -> None:
        """A request the scheduler now holds may grow to ``tokens`` (once per request)."""
        if request_id not in self.expected_tokens:
            self.expected_tokens[request_id] = tokens
            self.expected_blocks += -(-tokens // block_size)

    def forget(self, request_id: str, block_size: int) -> None:
        """A request finished: its expected size no longer counts."""
        tokens = self.expected_tokens.pop(request_id, None)
        if tokens is not None:
            self.expected_blocks -= -(-tokens // block_size)
