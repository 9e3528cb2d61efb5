"""Migration planner: which KV blocks to move where, so that granules empty out. Pure
Python, standard library only (no torch, no vLLM).

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
copy-on-write endpoints, ...), see :mod:`proxima.engines.compaction_v1`. *Scratch* ids
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

Goals (each returns a :class:`Plan`, possibly empty, never raising for a full pool):

* :func:`plan_evacuate` -- empty the given granules (elastic mode: a granule pinned by a
  long request is emptied so that it can be unmapped);
* :func:`plan_pack` -- move the live blocks of the sparsest granules into the densest,
  so that as many granules as possible hold no live block (the reclaimable fraction).

(There is no goal that makes a request's blocks one run: the project measured contiguity
to buy vLLM nothing -- the copies run at the PCIe limit whatever the layout -- and run
merging left the reclaimable fraction as it was, 0.904 -> 0.894 on ``pressure``.)

Cost: building a view is O(num_blocks) (C-speed scans of a bytearray); the goals are
O(granules log granules + ids examined), bounded by the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence


FREE, CACHED, LIVE, FIXED = 0, 1, 2, 3
KIND_NAMES = {FREE: "free", CACHED: "cached", LIVE: "live", FIXED: "fixed"}
_CONTENT = (CACHED, LIVE)


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
        if k in _CONTENT:
            content[i] = i
    for step, (a, b) in enumerate(plan.relocations):
        where = f"relocation {step} ({a} -> {b})"
        for x in (a, b):
            if type(x) is not int or not 0 <= x < n:
                raise PlanError(f"{where}: id {x!r} is outside the pool 0..{n - 1}")
            if x in view.pinned:
                raise PlanError(f"{where}: block {x} is pinned")
        if kinds[a] not in _CONTENT:
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
    state = {i: i for i, k in enumerate(view.kinds) if k in _CONTENT}
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


# ----------------------------------------------------------------------------- building

class _Builder:
    """A plan under construction over a private copy of the view's kinds."""

    def __init__(self, view: PoolView, budget: int, max_phases: int | None) -> None:
        if type(budget) is not int or budget < 0:
            raise PlanError(f"budget must be an integer >= 0 (blocks), got {budget!r}")
        if max_phases is not None and (type(max_phases) is not int or max_phases < 1):
            raise PlanError(f"max_phases must be None or an integer >= 1, got {max_phases!r}")
        self.view = view
        self.kinds = bytearray(view.kinds)
        self.pinned = view.pinned
        self.scratch = set(view.scratch)
        self.budget = budget
        self.max_phases = max_phases
        self.relocations: list[tuple[int, int]] = []
        self._last_write: dict[int, int] = {}
        self._last_read: dict[int, int] = {}
        G = view.granule_blocks
        self.live = [self.kinds.count(LIVE, g * G, (g + 1) * G) for g in range(view.num_granules)]

    @property
    def left(self) -> int:
        return self.budget - len(self.relocations)

    def phase_of(self, a: int, b: int) -> int:
        return 1 + max(self._last_write.get(a, -1), self._last_read.get(b, -1),
                       self._last_write.get(b, -1))

    def fits(self, pairs: Sequence[tuple[int, int]]) -> bool:
        """Whether relocating ``pairs`` (in order) stays within the budget and phase cap."""
        if len(pairs) > self.left:
            return False
        if self.max_phases is None:
            return True
        lw, lr = dict(), dict()
        for a, b in pairs:
            p = 1 + max(lw.get(a, self._last_write.get(a, -1)), lr.get(b, self._last_read.get(b, -1)),
                        lw.get(b, self._last_write.get(b, -1)))
            if p >= self.max_phases:
                return False
            lr[a] = max(lr.get(a, self._last_read.get(a, -1)), p)
            lw[b] = p
        return True

    def relocate(self, a: int, b: int) -> None:
        kinds = self.kinds
        # The builder's own preconditions (check_plan verifies them again independently).
        if kinds[a] not in _CONTENT or a in self.pinned or b in self.pinned or (
                kinds[b] != FREE and not (b in self.scratch and kinds[b] == FIXED)):
            raise PlanError(f"internal: cannot relocate {a} ({KIND_NAMES[kinds[a]]}) -> "
                            f"{b} ({KIND_NAMES[kinds[b]]})")
        p = self.phase_of(a, b)
        if self._last_read.get(a, -1) < p:
            self._last_read[a] = p
        self._last_write[b] = p
        if kinds[a] == LIVE:
            G = self.view.granule_blocks
            self.live[a // G] -= 1
            self.live[b // G] += 1
        kinds[b], kinds[a] = kinds[a], (FIXED if a in self.scratch else FREE)
        self.relocations.append((a, b))

    def plan(self) -> Plan:
        return Plan(self.relocations, schedule_phases(self.relocations))

    # -- finding ids
    def find(self, kind: int, granules: Iterable[int], exclude: set[int] | None = None):
        """The ids of ``kind``, not pinned, in ``granules`` (in the order given), read live."""
        kinds, pinned = self.kinds, self.pinned
        G, n = self.view.granule_blocks, self.view.num_blocks
        for g in granules:
            i, end = g * G, min((g + 1) * G, n)
            while True:
                i = kinds.find(kind, i, end)
                if i < 0:
                    break
                if i not in pinned and (exclude is None or i not in exclude):
                    yield i
                i += 1


def _first(it):
    return next(it, None)


def plan_evacuate(view: PoolView, granules: Iterable[int], budget: int, *,
                  cached_too: bool = True, max_phases: int | None = None) -> tuple[Plan, bool]:
    """Move the content out of ``granules`` into FREE blocks of other granules.

    LIVE blocks always go; CACHED ones too with ``cached_too`` (so the granules hold
    nothing and can be unmapped without evicting). Destinations: FREE blocks outside the
    evacuated granules, in the granules with the most LIVE blocks first (so that what moves
    packs). Without ``cached_too``, a LIVE block may also take a CACHED block's place,
    that block's content moving to a FREE block of the evacuated granules (an exchange).

    Returns the plan and whether every given granule is now free of what it had to give
    up (False when a pinned block stays, space or the budget ran out).
    """
    targets = sorted({int(g) for g in granules})
    for g in targets:
        if not 0 <= g < view.num_granules:
            raise PlanError(f"granule {g} is outside the pool's {view.num_granules} granules")
    b = _Builder(view, budget, max_phases)
    out = set(targets)
    order = sorted((g for g in range(view.num_granules) if g not in out),
                   key=lambda g: (-b.live[g], g))
    kinds_to_move = _CONTENT if cached_too else (LIVE,)
    done = True
    for g in targets:
        for kind in (LIVE, CACHED) if cached_too else (LIVE,):
            for src in list(b.find(kind, (g,))):
                dst = _first(b.find(FREE, order))
                pairs = [(src, dst)] if dst is not None else None
                if pairs is None and kind == LIVE and not cached_too:
                    cached = _first(b.find(CACHED, order))
                    spare = _first(b.find(FREE, targets))
                    if cached is not None and spare is not None:
                        pairs = [(cached, spare), (src, cached)]
                if pairs is None or not b.fits(pairs):
                    done = False
                    break
                for a, d in pairs:
                    b.relocate(a, d)
            if not done:
                break
        if not done:
            break
    kinds = b.kinds
    G = view.granule_blocks
    clear = done and all(kinds[i] not in kinds_to_move
                         for g in targets for i in range(g * G, min((g + 1) * G, view.num_blocks)))
    return b.plan(), clear


def plan_pack(view: PoolView, budget: int, *, max_phases: int | None = None) -> Plan:
    """Empty the sparsest granules of LIVE blocks into the densest ones.

    Repeatedly: the granule with the fewest LIVE blocks (all movable) is emptied into
    granules that hold more LIVE blocks than it (ties: the lower granule wins), if those
    have room for all of them: a FREE block, else a CACHED block whose content moves to a
    FREE block outside the receiving granules or through the scratch id (an exchange: no
    cache entry is lost). A granule is only started when it can be emptied within the
    budget and the phase cap, so every block moved empties a granule. Stops when no sparser
    granule can be emptied into denser ones (or after a few that could not).
    """
    b = _Builder(view, budget, max_phases)
    kinds, pinned = b.kinds, view.pinned
    G, n = view.granule_blocks, view.num_blocks
    blocked = {i // G for i in pinned if kinds[i] == LIVE}          # cannot be emptied
    granules = [g for g in range(view.num_granules)
                if kinds.count(FIXED, g * G, min((g + 1) * G, n)) < min(G, n - g * G)]
    room = [0] * view.num_granules          # FREE or CACHED ids, not pinned
    free = [0] * view.num_granules
    for g in granules:
        lo, hi = g * G, min((g + 1) * G, n)
        free[g] = kinds.count(FREE, lo, hi)
        room[g] = free[g] + kinds.count(CACHED, lo, hi)
    for i in pinned:
        if kinds[i] in (FREE, CACHED):
            room[i // G] -= 1
            free[i // G] -= kinds[i] == FREE
    failures = 0
    while b.left > 0 and failures < 8:
        by_density = sorted(granules, key=lambda g: (-b.live[g], g))
        progress = False
        room_before = 0                      # room of the granules denser than src_g
        free_before = 0
        prefix = []
        for g in by_density:
            prefix.append((room_before, free_before))
            room_before += room[g]
            free_before += free[g]
        for r in range(len(by_density) - 1, 0, -1):      # the sparsest first
            src_g = by_density[r]
            need = b.live[src_g]
            if need == 0 or src_g in blocked or need > b.left:
                continue
            room_denser, free_denser = prefix[r]
            if room_denser < need:
                continue
            if max_phases is not None and \
                    2 * (need - free_denser - len(view.scratch)) + 1 > max_phases:
                continue                     # the exchanges beyond the scratch ids chain
            denser = [g for g in by_density[:r] if room[g]]
            spares_from = [src_g] + by_density[:r:-1]
            pairs = _empty_into(b, src_g, denser, spares_from)
            if pairs is None:
                failures += 1
                if failures >= 8:
                    break
                continue
            for x, d in pairs:
                if kinds[x] == LIVE and x not in b.scratch:
                    room[x // G] += 1
                if kinds[d] == FREE and d not in b.scratch:
                    free[d // G] -= 1
                if kinds[x] == LIVE and d not in b.scratch:
                    room[d // G] -= 1
                b.relocate(x, d)
                if x not in b.scratch:
                    free[x // G] += 1
            progress = True
            break
        if not progress:
            break
    return b.plan()


def _empty_into(b: _Builder, src_g: int, denser: list[int],
                spares_from: list[int]) -> list[tuple[int, int]] | None:
    """The relocations that move every LIVE block of ``src_g`` into ``denser`` granules,
    or None if they do not all fit (space, spares, budget or phase cap).

    A LIVE block goes to a FREE block of a denser granule, else to a CACHED one whose
    content first moves to a spare outside the denser granules: a FREE block of a sparser
    granule (the content stays there), else an empty scratch id (emptied at the end into a
    block this granule's moves vacated; scratch ids in parallel), else a vacated block
    (one exchange after the other)."""
    sources = list(b.find(LIVE, (src_g,)))
    if len(sources) != b.live[src_g]:
        return None                                  # a pinned LIVE block stays
    free_dst = b.find(FREE, denser)
    cached_dst = b.find(CACHED, denser)
    pairs: list[tuple[int, int]] = []
    used: set[int] = set()
    vacated: list[int] = []
    spare_iter = b.find(FREE, spares_from)
    # empty scratch ids, the least recently written last (popped first): parallel phases
    scratch = sorted((x for x in b.view.scratch if b.kinds[x] == FIXED),
                     key=lambda x: -max(b._last_write.get(x, -1), b._last_read.get(x, -1)))
    parked: list[int] = []                           # scratch ids holding a content
    for src in sources:
        dst = next(free_dst, None)
        while dst is not None and dst in used:
            dst = next(free_dst, None)
        if dst is not None:
            pairs.append((src, dst))
            used.add(dst)
        else:
            cached = next(cached_dst, None)
            if cached is None:
                return None
            spare = next(spare_iter, None)
            while spare is not None and spare in used:
                spare = next(spare_iter, None)
            if spare is None and scratch:
                spare = scratch.pop()
                parked.append(spare)
            elif spare is None and vacated:
                spare = vacated.pop()
            if spare is None:
                return None
            used.add(spare)
            pairs += [(cached, spare), (src, cached)]
        vacated.append(src)
    for x in parked:
        pairs.append((x, vacated.pop()))
    return pairs if b.fits(pairs) else None
