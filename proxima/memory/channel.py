"""The scheduler's side of the map/unmap channel: which granules may hold live blocks.

Pure Python (no torch, no vLLM), one instance per engine, driven at step boundaries:

* the pool or a policy calls :meth:`ElasticChannel.unmap` / :meth:`map`
  (between steps, or while the scheduler builds a step);
* :meth:`build` drains what was asked into the step's :class:`~proxima.memory.ops.OpBatch`
  (vLLM: the KV connector's metadata, see :mod:`proxima.vllm.elastic_connector`);
* :meth:`on_report` takes the workers' :class:`~proxima.memory.ops.Report` back.

Granule states, as the scheduler must see them:

``MAPPED``   backed on every worker: its blocks may be handed out.
``UNMAPPED`` not backed (or being released): its blocks must not be handed out. An unmap
             takes effect here at once; the workers release the memory before the
             forward of the step that carries it.
``MAPPING``  a map was sent, not yet confirmed. Still not allocatable: with async
             scheduling the next step is scheduled before this one ran, and workers map
             in the background, so blocks become usable only once every worker's report
             confirms the map (``workers`` of them; a failed map goes back to
             ``UNMAPPED``, and an unmap is queued so that workers that did map release).
"""

from __future__ import annotations

from typing import Callable

from proxima.memory.ops import MAP, UNMAP, Op, OpBatch, Report, validate

MAPPED, UNMAPPED, MAPPING = 0, 1, 2
_STATE = {MAPPED: "mapped", UNMAPPED: "unmapped", MAPPING: "mapping"}


class ChannelError(RuntimeError):
    """A map/unmap request that contradicts the granules' states (a caller bug)."""


class ElasticChannel:
    """Granule states of one KV pool of ``num_blocks`` blocks, ``granule_blocks`` a granule.

    ``listeners`` are called as ``fn(granules: range, ok: bool)`` when a map is confirmed
    (``ok``) or has failed. ``workers``: how many workers must report a batch before its
    maps count as done (vLLM: the world size; each may report it in a different step).
    """

    def __init__(self, num_blocks: int, granule_blocks: int, workers: int = 1) -> None:
        if num_blocks < 1 or granule_blocks < 1 or workers < 1:
            raise ValueError(f"need blocks, a granule size and a worker, got {num_blocks} "
                             f"blocks, granule {granule_blocks}, {workers} workers")
        self.workers = workers
        self.num_blocks = num_blocks
        self.granule_blocks = granule_blocks
        self.num_granules = -(-num_blocks // granule_blocks)
        self.state = bytearray(self.num_granules)          # all MAPPED
        self._queue: list[Op] = []
        self._next_seq = 0
        self._waiting: dict[int, list[range]] = {}         # seq -> its MAP ranges
        self._acks: dict[int, tuple[int, set]] = {}         # seq -> (workers, failures)
        self._unmapping: dict[int, int] = {}                # seq -> workers yet to report
        self.listeners: list[Callable[[range, bool], None]] = []
        self.reported_mapped: int | None = None            # the workers' last count
        self.stats = {"batches": 0, "ops": 0, "granules_unmapped": 0, "granules_mapped": 0,
                      "map_failures": 0, "reports": 0,
                      "worker_map_seconds": 0.0, "worker_unmap_seconds": 0.0}

    # ------------------------------------------------------------------ geometry
    def granule_of(self, block_id: int) -> int:
        return block_id // self.granule_blocks

    def blocks_of(self, granule: int) -> range:
        g = self.granule_blocks
        return range(granule * g, min((granule + 1) * g, self.num_blocks))

    def allocatable(self, block_id: int) -> bool:
        return self.state[block_id // self.granule_blocks] == MAPPED

    def count(self, state: int) -> int:
        return self.state.count(state)

    def ranges(self, state: int) -> list[range]:
        """Maximal granule ranges in ``state``, in order."""
        out, start = [], None
        for g, s in enumerate(bytes(self.state) + bytes([255])):
            if s == state and start is None:
                start = g
            elif s != state and start is not None:
                out.append(range(start, g))
                start = None
        return out

    # ------------------------------------------------------------------ requests
    def _expect(self, first: int, count: int, state: int, what: str) -> None:
        validate([Op.map(first, count)], self.num_granules, self.num_blocks)
        bad = [g for g in range(first, first + count) if self.state[g] != state]
        if bad:
            raise ChannelError(f"cannot {what} granules [{first}, {first + count}): granule "
                               f"{bad[0]} is {_STATE[self.state[bad[0]]]}, not {_STATE[state]}")

    def unmap(self, first: int, count: int = 1) -> None:
        """Release granules ``[first, first + count)`` (all MAPPED, none holding a block in
        use or cached KV: the caller's guarantee). Their blocks stop being allocatable now."""
        validate([Op.unmap(first, count)], self.num_granules, self.num_blocks)
        self._expect(first, count, MAPPED, "unmap")
        self.state[first:first + count] = bytes([UNMAPPED]) * count
        self._queue.append(Op.unmap(first, count))
        self.stats["granules_unmapped"] += count

    def map(self, first: int, count: int = 1) -> None:
        """Ask for granules ``[first, first + count)`` (all UNMAPPED) to be backed again;
        they become allocatable once a report confirms it."""
        self._expect(first, count, UNMAPPED, "map")
        self.state[first:first + count] = bytes([MAPPING]) * count
        self._queue.append(Op.map(first, count))

    def held(self) -> int:
        """Granules holding GPU memory as far as the scheduler knows: mapped, being mapped,
        and released ones whose unmap the workers have not reported done yet (while an unmap
        is queued or in flight, at least the workers' last count). What another engine may
        take is what the workers gave back, not what this side decided to release."""
        n = self.count(MAPPED) + self.count(MAPPING)
        if self.reported_mapped is not None and (
                self._unmapping or any(op.code == UNMAP for op in self._queue)):
            n = max(n, self.reported_mapped)
        return n

    # ------------------------------------------------------------------ the step
    @property
    def pending(self) -> bool:
        """Ops waiting to be sent, maps waiting for their confirmation, or unmaps not yet
        reported done (a worker unmapping in the background says so in a later step: the
        engine must keep stepping to hear it, or ``reported_mapped`` would stay stale)."""
        return bool(self._queue or self._waiting or self._unmapping)

    def build(self) -> OpBatch | None:
        """This step's ops (None when there are none), in the order they were asked for."""
        if not self._queue:
            return None
        ops, self._queue = tuple(self._queue), []
        batch = OpBatch(self._next_seq, ops)
        self._next_seq += 1
        maps = [range(op.first, op.first + op.count) for op in ops if op.code == MAP]
        if maps:
            self._waiting[batch.seq] = maps
        elif any(op.code == UNMAP for op in ops):
            self._unmapping[batch.seq] = self.workers
        self.stats["batches"] += 1
        self.stats["ops"] += len(ops)
        return batch

    def on_report(self, report: Report) -> None:
        """Apply the workers' answer: confirm or fail the maps of the batches it covers."""
        if report.granule_blocks != self.granule_blocks:
            raise ChannelError(
                f"the workers' KV granule is {report.granule_blocks} blocks, the scheduler "
                f"assumed {self.granule_blocks}: the KV layout differs from the one "
                "predicted from the KV cache config")
        self.stats["reports"] += 1
        self.reported_mapped = report.mapped_granules
        self.stats["worker_map_seconds"] = report.map_seconds
        self.stats["worker_unmap_seconds"] = report.unmap_seconds
        for seq, failed, n in report.entries():
            if seq in self._unmapping:
                left = self._unmapping.pop(seq) - n
                if left > 0:
                    self._unmapping[seq] = left
                continue
            if seq not in self._waiting:
                continue
            seen, bad = self._acks.get(seq, (0, set()))
            bad.update(g for first, count in failed for g in range(first, first + count))
            if seen + n < self.workers:                # not every worker has mapped yet
                self._acks[seq] = (seen + n, bad)
                continue
            self._acks.pop(seq, None)
            maps = self._waiting.pop(seq)
            for rng in maps:
                for run, ok in _split(rng, bad):
                    self.state[run.start:run.stop] = bytes([MAPPED if ok else UNMAPPED]) * len(run)
                    if ok:
                        self.stats["granules_mapped"] += len(run)
                    else:
                        self.stats["map_failures"] += len(run)
                        self._queue.append(Op.unmap(run.start, len(run)))   # reconcile
                    for fn in self.listeners:
                        fn(run, ok)


def _split(rng: range, bad: set[int]):
    """``rng`` as consecutive runs, each with whether it is free of ``bad``."""
    start = rng.start
    for g in range(rng.start + 1, rng.stop + 1):
        if g == rng.stop or ((g in bad) != (start in bad)):
            yield range(start, g), start not in bad
            start = g
