"""What a migration plan is: the pool view a plan is made for (:class:`PoolView`), the plan
(:class:`Plan`, its phases from :func:`schedule_phases`) and its invariants
(:func:`check_plan`). The goals that build plans are :mod:`proxima.allocator.planner`'s.
Pure Python, standard library only (no torch, no vLLM).

The model
---------
A pool of block ids ``0 .. num_blocks - 1`` split into *granules* of ``granule_blocks``
ids (granule ``g`` = ids ``[g * G, (g + 1) * G)``). Each id has a *kind* (:class:`PoolView`):

``FREE``    no content anyone reads: may be written (a destination);
``CACHED``  free, but holds a prefix-cache entry: its content must survive a move;
``LIVE``    held by one or more requests: its content must survive, and every owner's
            block table is rewritten to the new id;
``FIXED``   never read or written by a plan (the null block, blocks of unmapped
            granules or withheld from the pool).

and a set of *pinned* ids (of any kind) that a plan neither reads nor writes: the caller
names there the blocks written in the same step before the copy point (new blocks, vLLM's
copy-on-write endpoints, ...), see :mod:`proxima.vllm.compaction_v1`. *Scratch* ids
are FIXED ids whose content nobody reads (vLLM's null block): a plan may park a content
there for a while, and leaves them empty.

A *relocation* ``(a, b)``: the content at ``a`` (LIVE or CACHED, not pinned, or a scratch
id holding a content) goes to ``b`` (FREE and not pinned, or an empty scratch id);
afterwards ``b`` has ``a``'s kind and ``a`` is FREE (a scratch id: empty again). A :class:`Plan` is
a sequence of relocations, applied in order: that is its meaning (the *sequential
semantics*), and it is how the engine applies it to the scheduler's structures.

The copies are the plan's *phases*: batches of runs ``(src, dst, n)`` (blocks ``src + k``
to ``dst + k``), applied one after the other, every copy of a batch reading what the
blocks held before the batch (the rule :class:`proxima.kernels.KVBlockMover` applies per
call). :func:`schedule_phases` derives them from the sequence: a relocation goes in the
first phase after the last write of its source and the last read and write of its
destination, so within a phase the destinations are distinct and disjoint from the
sources, and applying the phases in order gives the sequential result. A permutation
(a cycle of blocks that all hold content) is only possible through a FREE block: a plan
breaks each cycle with one spare block (first relocation into the spare, last one out of
it), a FREE block or a scratch id -- with no FREE block in the pool (at mid load with
prefix caching every free block is a cached one) the scratch id is the only spare, and the
exchanges through it run one after the other. A plan never changes how many blocks are
FREE, CACHED or LIVE.

Invariants of every plan a goal returns (:func:`check_plan` verifies them, raising
:class:`PlanError`; the hypothesis tests check them against an independent model):

1. each relocation's source holds content (LIVE or CACHED) and its destination is FREE (or
   an empty scratch id) at that point of the sequence; neither is pinned, FIXED (scratch
   aside) or outside the pool; the scratch ids are empty at the end;
2. the kinds' counts are unchanged by the whole plan (a relocation swaps two kinds);
3. the phases are valid batches (destinations distinct, disjoint from the phase's sources)
   and applying them in order moves every content exactly where the sequence moves it;
4. the plan moves at most ``budget`` blocks (every relocation copies one block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


FREE, CACHED, LIVE, FIXED = 0, 1, 2, 3
KIND_NAMES = {FREE: "free", CACHED: "cached", LIVE: "live", FIXED: "fixed"}
CONTENT = (CACHED, LIVE)          # the kinds whose content a move must keep


class PlanError(ValueError):
    """A plan (or a view) that breaks one of the module's invariants; the message names it."""


# ----------------------------------------------------------------------------- the view

class PoolView:
    """What a goal reads: the kind of every block id, the pinned ids, the granule size.

    Args:
        kinds: one byte per block id (FREE, CACHED, LIVE or FIXED); copied.
        granule_blocks: ids per granule, ``>= 1``.
        pinned: ids no plan may read or write.
        scratch: FIXED ids no one reads, that a plan may use as a transient spare.
    """

    __slots__ = ("num_blocks", "granule_blocks", "num_granules", "kinds", "pinned", "scratch")

    def __init__(self, kinds: bytes | bytearray | Sequence[int], granule_blocks: int,
                 pinned: Iterable[int] = (), scratch: Iterable[int] = ()) -> None:
        if type(granule_blocks) is not int or granule_blocks < 1:
            raise PlanError(f"granule_blocks must be an integer >= 1, got {granule_blocks!r}")
        self.kinds = bytearray(kinds)
        if not self.kinds:
            raise PlanError("a pool view needs at least one block")
        if self.kinds.translate(None, b"\x00\x01\x02\x03"):
            bad = next(k for k in self.kinds if k > FIXED)
            raise PlanError(f"block kind {bad} is not FREE (0), CACHED (1), LIVE (2) or FIXED (3)")
        self.num_blocks = len(self.kinds)
        self.granule_blocks = granule_blocks
        self.num_granules = -(-self.num_blocks // granule_blocks)
        self.pinned = frozenset(pinned)
        for b in self.pinned:
            if type(b) is not int or not 0 <= b < self.num_blocks:
                raise PlanError(f"pinned id {b!r} is outside the pool 0..{self.num_blocks - 1}")
        self.scratch = tuple(sorted(set(scratch)))
        for b in self.scratch:
            if type(b) is not int or not 0 <= b < self.num_blocks or self.kinds[b] != FIXED \
                    or b in self.pinned:
                raise PlanError(f"scratch id {b!r} must be a FIXED, unpinned id of the pool")

    def granule_range(self, g: int) -> range:
        G = self.granule_blocks
        return range(g * G, min((g + 1) * G, self.num_blocks))

    def counts(self) -> dict[int, int]:
        """``{kind: number of ids}``."""
        return {k: self.kinds.count(k) for k in (FREE, CACHED, LIVE, FIXED)}

    def live_per_granule(self) -> list[int]:
        G, kinds = self.granule_blocks, self.kinds
        return [kinds.count(LIVE, g * G, (g + 1) * G) for g in range(self.num_granules)]

    def reclaimable_fraction(self) -> float:
        """Granules holding no LIVE block / all granules."""
        return self.live_per_granule().count(0) / self.num_granules


# ----------------------------------------------------------------------------- plans

@dataclass
class Plan:
    """A sequence of relocations ``(src, dst)`` (see the module doc) and its phases."""

    relocations: list[tuple[int, int]] = field(default_factory=list)
    phases: list[list[tuple[int, int, int]]] = field(default_factory=list)

    @property
    def blocks_moved(self) -> int:
        return len(self.relocations)

    def __bool__(self) -> bool:
        return bool(self.relocations)

    def final_positions(self) -> dict[int, int]:
        """``{original id: id where that content ends}`` for every content the plan moves
        (a content moved twice, e.g. through a spare, appears once)."""
        where: dict[int, int] = {}          # current position -> original position
        for a, b in self.relocations:
            origin = where.pop(a, a)
            where[b] = origin
        return {origin: pos for pos, origin in where.items() if origin != pos}


def schedule_phases(relocations: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
    """The phases of a relocation sequence (module doc), each as runs ``(src, dst, n)``
    sorted by source, merged where both sides continue."""
    last_write: dict[int, int] = {}
    last_read: dict[int, int] = {}
    by_phase: list[list[tuple[int, int]]] = []
    for a, b in relocations:
        p = 1 + max(last_write.get(a, -1), last_read.get(b, -1), last_write.get(b, -1))
        if last_read.get(a, -1) < p:
            last_read[a] = p
        last_write[b] = p
        while len(by_phase) <= p:
            by_phase.append([])
        by_phase[p].append((a, b))
    return [_runs(sorted(pairs)) for pairs in by_phase]


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def check_plan(view: PoolView, plan: Plan, budget: int | None = None) -> None:
    """Verify the module's invariants for ``plan`` on ``view``; raise :class:`PlanError`
    naming the first one broken. O(num_blocks + moved blocks)."""
    kinds = bytearray(view.kinds)
    n = view.num_blocks
    scratch = set(view.scratch)
    content = {}                                  # id -> label of what it holds
    for i, k in enumerate(kinds):
        if k in CONTENT:
            content[i] = i
    for step, (a, b) in enumerate(plan.relocations):
        where = f"relocation {step} ({a} -> {b})"
        for x in (a, b):
            if type(x) is not int or not 0 <= x < n:
                raise PlanError(f"{where}: id {x!r} is outside the pool 0..{n - 1}")
            if x in view.pinned:
                raise PlanError(f"{where}: block {x} is pinned")
        if kinds[a] not in CONTENT:
            raise PlanError(f"{where}: the source is {KIND_NAMES[kinds[a]]}, it holds no content")
        if kinds[b] != FREE and not (b in scratch and kinds[b] == FIXED):
            raise PlanError(f"{where}: the destination is {KIND_NAMES[kinds[b]]}, not free")
        kinds[b], kinds[a] = kinds[a], (FIXED if a in scratch else FREE)
        content[b] = content.pop(a)
    for x in scratch:
        if kinds[x] != FIXED:
            raise PlanError(f"scratch id {x} still holds a content at the end of the plan")
    if {k: kinds.count(k) for k in range(4)} != view.counts():
        raise PlanError("the plan changes how many blocks are free, cached or live")
    if budget is not None and plan.blocks_moved > budget:
        raise PlanError(f"the plan moves {plan.blocks_moved} blocks, over its budget of {budget}")
    # The phases, applied as the mover applies batches, must give the sequential result.
    state = {i: i for i, k in enumerate(view.kinds) if k in CONTENT}
    for p, phase in enumerate(plan.phases):
        reads, writes = [], set()
        for s, d, k in phase:
            if k < 1 or s < 0 or d < 0 or s + k > n or d + k > n:
                raise PlanError(f"phase {p}: run ({s}, {d}, {k}) is outside the pool")
            for j in range(k):
                if d + j in writes:
                    raise PlanError(f"phase {p}: block {d + j} is written twice")
                writes.add(d + j)
                reads.append((s + j, d + j))
        if writes & {s for s, _ in reads}:
            bad = min(writes & {s for s, _ in reads})
            raise PlanError(f"phase {p}: block {bad} is both a source and a destination")
        moved = [(d, state.get(s)) for s, d in reads]
        for d, label in moved:
            state[d] = label
    for i, label in content.items():
        if state.get(i) != label:
            raise PlanError(f"after the phases block {i} holds {state.get(i)!r}, the sequence "
                            f"puts {label!r} there")
    if sum(k for phase in plan.phases for _, _, k in phase) != plan.blocks_moved:
        raise PlanError("the phases copy a different number of blocks than the relocations")
