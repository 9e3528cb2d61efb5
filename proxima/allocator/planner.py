"""Migration planner: which KV blocks to move where, so that granules empty out. Pure
Python, standard library only (no torch, no vLLM).

The pool view, the plan, its phases and the invariants every plan keeps (checked by
:func:`~proxima.allocator.plans.check_plan`) are :mod:`proxima.allocator.plans`'s; here
are the goals that build plans.

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

from typing import Iterable, Sequence

from proxima.allocator.plans import CACHED, CONTENT, FIXED, FREE, KIND_NAMES, LIVE, Plan, \
    PlanError, PoolView, schedule_phases


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
        if kinds[a] not in CONTENT or a in self.pinned or b in self.pinned or (
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
    kinds_to_move = CONTENT if cached_too else (LIVE,)
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
