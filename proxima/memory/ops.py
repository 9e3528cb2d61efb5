"""The commands that travel from the scheduler to the workers, and the workers' answer.

One step carries at most one :class:`OpBatch`; a worker applies its ops in order before
the step's forward pass reads any block id. Two kinds, as small tuples of ints so they
pickle cheaply through vLLM's executor:

* ``MAP(first, count)``: back granules ``[first, first + count)`` with memory (zeroed).
  Idempotent. May fail for lack of GPU memory; the worker says so in its :class:`Report`.
  The scheduler side only hands out blocks of a granule after a report confirmed its map
  ("grow ahead, confirmed"), so no forward ever reads a granule that failed to map.
* ``UNMAP(first, count)``: return those granules' memory (after a device synchronise).
  Idempotent; never fails for a mapped granule. The sender guarantees no block in them is
  in use or holds cached KV.

(Block moves do not travel here: KV compaction's copies go with the step's
``CompactionWork``, :mod:`proxima.vllm.compaction_worker`.)

Granules are counted in block ids: granule ``g`` is blocks ``[g * G, (g + 1) * G)`` with
``G`` = ``granule_blocks`` (see :mod:`proxima.memory.layout`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

MAP, UNMAP = 1, 2
_KIND = {MAP: "map", UNMAP: "unmap"}


class Op(NamedTuple):
    code: int
    first: int      # first granule
    count: int      # granules

    @classmethod
    def map(cls, first: int, count: int = 1) -> "Op":
        return cls(MAP, first, count)

    @classmethod
    def unmap(cls, first: int, count: int = 1) -> "Op":
        return cls(UNMAP, first, count)

    @property
    def kind(self) -> str:
        return _KIND.get(self.code, f"op{self.code}")

    def __str__(self) -> str:
        return f"{self.kind} granules [{self.first}, {self.first + self.count})"


class OpBatch(NamedTuple):
    """The ops of one step, numbered by the scheduler (``seq`` increases by one a batch)."""

    seq: int
    ops: tuple[Op, ...]


class Report(NamedTuple):
    """A worker's answer: for each batch applied since its last report, ``(seq, failed)``
    where ``failed`` lists the ``(first, count)`` granule ranges of that batch's MAP ops
    that the GPU could not back; plus its mapped granule count, its granule size and the
    seconds it has spent mapping and unmapping so far.

    ``counts``: how many workers applied each entry of ``applied`` (empty: one each). A
    worker that maps in the background reports a batch in whichever step its maps end, so
    with tensor parallelism one step's merged report may cover a batch for some workers
    only; the scheduler confirms a map once every worker has reported it
    (:class:`proxima.memory.channel.ElasticChannel`'s ``workers``)."""

    applied: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    mapped_granules: int
    granule_blocks: int
    map_seconds: float = 0.0
    unmap_seconds: float = 0.0
    counts: tuple[int, ...] = ()

    def entries(self):
        """``(seq, failed, workers)`` for each batch covered."""
        counts = self.counts or (1,) * len(self.applied)
        return [(seq, failed, n) for (seq, failed), n in zip(self.applied, counts)]


def merge_reports(a: Report, b: Report) -> Report:
    """Two workers' reports of one step as one (tensor parallelism): a granule failed if it
    failed on any worker; the workers that applied a batch add up; the mapped count is the
    smallest."""
    if a.granule_blocks != b.granule_blocks:
        raise ValueError(f"workers disagree on the granule size: {a.granule_blocks} vs "
                         f"{b.granule_blocks} blocks")
    failed: dict[int, set[tuple[int, int]]] = {}
    workers: dict[int, int] = {}
    for seq, ranges, n in a.entries() + b.entries():
        failed.setdefault(seq, set()).update(ranges)
        workers[seq] = workers.get(seq, 0) + n
    seqs = sorted(failed)
    applied = tuple((seq, tuple(sorted(failed[seq]))) for seq in seqs)
    counts = tuple(workers[seq] for seq in seqs)
    return Report(applied, min(a.mapped_granules, b.mapped_granules), a.granule_blocks,
                  max(a.map_seconds, b.map_seconds), max(a.unmap_seconds, b.unmap_seconds),
                  counts)


def validate(ops: Iterable[Op], num_granules: int, num_blocks: int) -> None:
    """Raise ValueError for an op outside the pool or of an unknown kind."""
    for op in ops:
        if op.code in (MAP, UNMAP):
            if op.count < 1 or op.first < 0 or op.first + op.count > num_granules:
                raise ValueError(f"{op}: outside the pool's {num_granules} granules")
            if op.code == UNMAP and op.first == 0:
                raise ValueError(f"{op}: granule 0 holds the null block and stays mapped")
        else:
            raise ValueError(f"unknown op code {op.code} in {op!r}")
