"""Placement of a fresh allocation's blocks: where the ``k`` blocks just handed out to a
request should be instead (:func:`plan_placement`), so that live blocks pack towards low
ids and high granules empty out. Pure Python, standard library only (no torch, no vLLM);
it reads the planner's :class:`~proxima.allocator.plans.PoolView` and block kinds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Sequence

from proxima.allocator.plans import CACHED, FIXED, FREE, LIVE, PoolView


@dataclass
class Placement:
    """Where a fresh allocation's blocks should go (:func:`plan_placement`).

    ``targets``: the ids the request should hold instead of the ones it was given, in
    table order (None: keep them); ``reason``: which rule decided (for metrics);
    ``claim``: ``(start, end)`` ids the request's run now claims for its growth (None:
    none)."""

    targets: list[int] | None
    reason: str
    claim: tuple[int, int] | None = None


_USABLE = rb"[\x00\x01\x06]"             # FREE, CACHED, lone (displaceable at no run cost)
_ANY_USABLE = re.compile(_USABLE)
_CACHED_ONLY = bytes(1 if i == CACHED else 0 for i in range(256))
_WINDOWS: dict[int, re.Pattern] = {}


class PlacementMaps:
    """What :func:`plan_placement` reads besides the view, as byte masks over the ids, so
    that a placement costs C-speed scans and no Python loop over the pool: ``lone`` (1: a
    lone LIVE block, see :func:`plan_placement`), ``claimed`` (1: inside a request's claim)
    and the claims themselves (``{owner: (start, end)}``). The caller keeps them up to
    date; stale marks only change a preference (every use checks the block again)."""

    def __init__(self, num_blocks: int) -> None:
        self.lone = bytearray(num_blocks)
        self.claimed = bytearray(num_blocks)
        self.claims: dict[str, tuple[int, int]] = {}

    def resize(self, num_blocks: int) -> None:
        for mask in (self.lone, self.claimed):
            if len(mask) < num_blocks:
                mask.extend(bytes(num_blocks - len(mask)))

    def set_lone(self, ids: Iterable[int], value: bool = True) -> None:
        lone, v = self.lone, 1 if value else 0
        for x in ids:
            lone[x] = v

    def claim(self, owner: str, rng: tuple[int, int] | None) -> None:
        """Set ``owner``'s claim to ``rng`` (None or empty: no claim)."""
        old = self.claims.pop(owner, None)
        n = len(self.claimed)
        if old is not None:
            lo, hi = max(old[0], 0), min(old[1], n)
            if hi > lo:
                self.claimed[lo:hi] = bytes(hi - lo)
        if rng is not None and rng[1] > rng[0]:
            self.claims[owner] = rng
            lo, hi = max(rng[0], 0), min(rng[1], n)
            if hi > lo:
                self.claimed[lo:hi] = b"\x01" * (hi - lo)

    def drop_except(self, owners) -> None:
        """Forget the claims of everyone not in ``owners`` (finished requests)."""
        for owner in [o for o in self.claims if o not in owners]:
            self.claim(owner, None)


def plan_placement(view: PoolView, ids: Sequence[int], prev: int | None, need: int, *,
                   maps: PlacementMaps | None = None, owner: str = "",
                   claims: dict[str, tuple[int, int]] | None = None,
                   lone: Iterable[int] = (), movable: Iterable[int] = (),
                   claim_blocks: int = 16) -> Placement:
    """Where ``ids`` (the ``k`` blocks an allocation just handed out, in table order,
    holding nothing yet) should be, for a request whose previous block is ``prev`` (None:
    its first blocks) and which expects ``need`` blocks from here (``>= k``).

    The blocks just handed out can take the place of any block holding nothing anyone
    needs where it is: FREE, CACHED (its content then goes into one of them), a *lone*
    LIVE block of another request (a run of one id in its owner's table; its content
    goes into one of them and its owner's table follows: no run breaks), or, at a cost,
    one of ``movable`` (LIVE blocks of others whose move breaks one of their runs). The
    rules, first that applies:

    1. continue the run: the ``k`` ids after ``prev`` (none pinned, FREE/CACHED/lone);
    2. a window of ``room = min(need, k + claim_blocks)`` ids, else ``k``, the lowest one
       (packs live blocks towards low ids, so high granules empty out), first avoiding
       others' claims and runs of cached blocks (one request's KV, kept together), then
       not; a window of ``room`` claims its tail for the request's growth;
    3. the window of ``k`` that displaces the fewest ``movable`` blocks, if fewer than
       ``k - 1`` (one run broken elsewhere for ``k - 1`` runs saved);
    4. the ``k`` lowest usable ids (scattered, but packed).

    The ids given are kept when they already are a run at least as low as rule 2's
    window. ``maps`` carries the lone blocks and the claims (else built from ``lone`` and
    ``claims``). The view's kinds are read as they are (the caller marks ``ids`` LIVE)."""
    k = len(ids)
    if k == 0:
        return Placement(None, "empty")
    kinds, pinned, n = view.kinds, view.pinned, view.num_blocks
    if maps is None:
        maps = PlacementMaps(n)
        maps.set_lone(x for x in lone if kinds[x] == LIVE)
        for who, rng in (claims or {}).items():
            maps.claim(who, rng)
    maps.resize(n)
    room = min(max(need, k), k + claim_blocks)
    mine = set(ids)
    if prev is not None:
        start = prev + 1
        if list(ids) == list(range(start, start + k)):
            return Placement(None, "grew_in_place", (start + k, start + room))
        lone_mask = maps.lone
        if start + k <= n and all(x in mine or (x not in pinned and (
                kinds[x] in (FREE, CACHED) or (lone_mask[x] and kinds[x] == LIVE)))
                for x in range(start, start + k)):
            return Placement(list(range(start, start + k)), "continued",
                             (start + k, start + room))
    passes = [(room, True, True), (k, True, True), (k, False, True), (room, True, False),
              (k, True, False), (k, False, False)] if k > 1 else \
        [(room, True, False), (k, True, False), (k, False, False)]
    cache: dict[tuple[bool, bool], bytearray] = {}
    target = None
    for m, use_claims, keep_runs in passes:
        key = (use_claims, keep_runs)
        if key not in cache:
            cache[key] = _usable(view, mine, maps, owner, use_claims, keep_runs)
        w = _lowest_window(cache[key], m)
        if w is not None:
            target = w
            break
    consecutive = all(b == a + 1 for a, b in zip(ids, ids[1:]))
    if target is not None:
        if consecutive and ids[0] <= target:
            return Placement(None, "kept_run", (ids[-1] + 1, ids[0] + room))
        claim = (target + k, target + room)
        return Placement(list(range(target, target + k)), "window", claim)
    if k > 1:
        lone_ids = {i for i in range(n) if maps.lone[i]} if any(maps.lone) else set()
        best = _cheapest_window(view, k, mine, lone_ids, set(movable))
        if best is not None and best[1] < k - 1:
            if consecutive and ids[0] == best[0]:
                return Placement(None, "kept_run", (ids[-1] + 1, ids[0] + room))
            return Placement(list(range(best[0], best[0] + k)), "window_displacing",
                             (best[0] + k, best[0] + room))
    if consecutive:
        return Placement(None, "kept_run", (ids[-1] + 1, ids[0] + room))
    for use_claims in (True, False):
        usable = _usable(view, mine, maps, owner, use_claims, False)
        out = [m.start() for m, _ in zip(_ANY_USABLE.finditer(usable), range(k))]
        if len(out) == k:
            return Placement(out, "scattered")
    return Placement(None, "no_place")


_LIVE_ONLY = bytes(1 if i == LIVE else 0 for i in range(256))


def _usable(view: PoolView, mine: set[int], maps: PlacementMaps, owner: str,
            use_claims: bool, keep_runs: bool) -> bytearray:
    """The view's kinds as a byte string whose usable ids are FREE (0), CACHED (1) or lone
    (LIVE + 4 = 6); claimed ids (with ``use_claims``, the owner's own claim excepted),
    cached ids next to another cached id (with ``keep_runs``), pinned, FIXED and other LIVE
    ids are not. Whole-pool arithmetic on big ints: C speed, no per-id Python loop."""
    kinds = view.kinds
    n = len(kinds)
    value = int.from_bytes(kinds, "big")
    lone = int.from_bytes(maps.lone[:n], "big") & int.from_bytes(kinds.translate(_LIVE_ONLY), "big")
    value += lone << 2                                   # LIVE 2 + 4 = 6
    flags = 0
    if use_claims and maps.claims:
        claimed = maps.claimed[:n]
        own = maps.claims.get(owner)
        if own is not None:
            lo, hi = max(own[0], 0), min(own[1], n)
            if hi > lo:
                claimed[lo:hi] = bytes(hi - lo)
        flags |= int.from_bytes(claimed, "big") << 3      # | 8
    if keep_runs:
        cached = int.from_bytes(kinds.translate(_CACHED_ONLY), "big")
        flags |= (cached & ((cached << 8) | (cached >> 8))) << 4     # | 16
    usable = bytearray((value | flags).to_bytes(n, "big"))
    for x in view.pinned:
        if x not in mine:
            usable[x] = FIXED
    for x in mine:
        usable[x] = FREE
    return usable


def _lowest_window(usable: bytearray, m: int) -> int | None:
    pattern = _WINDOWS.get(m)
    if pattern is None:
        pattern = _WINDOWS[m] = re.compile(_USABLE + b"{%d}" % m)
    found = pattern.search(usable)
    return found.start() if found else None


def _cheapest_window(view: PoolView, k: int, mine: set[int], lone: set[int],
                     movable: set[int]) -> tuple[int, int] | None:
    """``(start, cost)`` of the lowest window of ``k`` ids that displaces the fewest
    ``movable`` blocks (FREE, CACHED, lone and own ids cost nothing; anything else cannot
    be displaced), or None."""
    kinds, pinned, n = view.kinds, view.pinned, view.num_blocks
    if n < k:
        return None
    big = k + 1
    # per-id costs from the kinds by translation (C speed), then the few exceptions
    cost = bytearray(kinds[:n].translate(_WINDOW_COST))
    for i in movable:
        if i < n and kinds[i] == LIVE:
            cost[i] = 1
    for i in lone:
        if i < n and kinds[i] == LIVE:
            cost[i] = 0
    for x in pinned:
        if x < n:
            cost[x] = 2
    for x in mine:
        cost[x] = 0
    # windows holding no impossible id (2), the cheapest lowest first
    prefix = list(accumulate(cost, initial=0))
    impossible = list(accumulate((c == 2 for c in cost), initial=0))
    best = None
    for start in range(0, n - k + 1):
        if impossible[start + k] != impossible[start]:
            continue
        window = prefix[start + k] - prefix[start]
        if best is None or window < best[1]:
            best = (start, window)
            if window == 0:
                break
    if best is not None and best[1] >= big:
        return None
    return best


# FREE and CACHED cost nothing; LIVE (unless movable or lone) and FIXED cannot be displaced
_WINDOW_COST = bytes(0 if i in (FREE, CACHED) else 2 for i in range(256))
