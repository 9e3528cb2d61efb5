"""The invariants of a :class:`~proxima.allocator.granules.GranuleIndex`, verified in
O(N + granules): :func:`check_index` (what ``GranuleIndex.check`` runs)."""

from __future__ import annotations

from typing import Iterable

from proxima.allocator.errors import InvariantError
from proxima.allocator.granule_lru import CLASSES


def check_index(gi, live_ids: Iterable[int] | None = None,
                cached_order: Iterable[int] | None = None) -> None:
    """Verify the invariants of the granule index ``gi``; with ``live_ids`` /
    ``cached_order`` (the owner's truth: the ids handed out, the LRU tier oldest first)
    also that the counts agree with them. Raises :class:`InvariantError`."""
    G, ng = gi.granule_blocks, gi.num_granules
    order = list(gi.cached_ids())
    if len(order) != gi.num_cached or len(set(order)) != len(order):
        raise InvariantError(f"the cached list holds {len(order)} ids ({len(set(order))} "
                             f"distinct), num_cached is {gi.num_cached}")
    if cached_order is not None and list(cached_order) != order:
        raise InvariantError("the cached ids are not in the owner's LRU order")
    cached = [0] * ng
    for i in order:
        cached[i // G] += 1
    if cached != gi.cached:
        g = next(g for g in range(ng) if cached[g] != gi.cached[g])
        raise InvariantError(f"granule {g}: {gi.cached[g]} cached ids counted, "
                             f"{cached[g]} in the list")
    window = []
    for c in range(CLASSES):
        ids = list(gi._class_ids(c))
        if any(gi._cls[i] != c for i in ids):
            raise InvariantError(f"an id in the list of class {c} is of another class")
        if [gi._stamp[i] for i in ids] != sorted(gi._stamp[i] for i in ids) or \
                [gi._seq[i] for i in ids] != sorted(gi._seq[i] for i in ids):
            raise InvariantError(f"class {c}: cached ids not in the order they came")
        cap = len(ids) if gi.max_window is None else gi.max_window
        w = []
        for i in ids[:cap]:
            if gi._stamp[i] > gi._threshold[c]:
                break
            w.append(i)
        if [i for i in ids if gi._in_win[i]] != w or gi._win_size[c] != len(w):
            raise InvariantError(f"class {c}: the window is not its oldest cached ids "
                                 f"old enough")
        rest = ids[len(w):]
        tail = gi.num_blocks + 2 * c + 1
        if gi._boundary[c] != (rest[0] if rest else tail):
            raise InvariantError(f"class {c}: window boundary at {gi._boundary[c]}, "
                                 f"expected {rest[0] if rest else 'the end'}")
        window += w
    win = [0] * ng
    for i in window:
        win[i // G] += 1
    if win != gi.win:
        raise InvariantError("per-granule window counts are wrong")
    lists = [[] for _ in range(CLASSES * ng)]
    for i in window:                   # each class's window ids in LRU order
        lists[gi._cls[i] * ng + i // G].append(i)
    if lists != gi._win_lists:
        raise InvariantError("the per-granule window lists are not the window ids of "
                             "their class and granule, oldest first")
    if live_ids is not None:
        live = [0] * ng
        for i in (*live_ids, *gi.reserved):
            live[i // G] += 1
            if gi.end[i] < 0:
                raise InvariantError(f"live id {i} has no expected end")
        if live != gi.live:
            g = next(g for g in range(ng) if live[g] != gi.live[g])
            raise InvariantError(f"granule {g}: {gi.live[g]} live ids counted, "
                                 f"{live[g]} handed out")
    for g in range(ng):
        if not gi.mapped[g] and (gi.live[g] or gi.cached[g]):
            raise InvariantError(f"unmapped granule {g} holds live or cached ids")
        if gi.live[g] + gi.cached[g] > gi.size[g]:
            raise InvariantError(f"granule {g} holds more ids than it has")
        span = gi.end[g * G:g * G + gi.size[g]]
        if sum(1 for e in span if e >= 0) != gi.live[g]:
            raise InvariantError(f"granule {g}: ends recorded for other than its live ids")
        if gi.end_of_granule[g] != (max(span) if gi.live[g] else -1):
            raise InvariantError(f"granule {g}: T is {gi.end_of_granule[g]}, its live "
                                 f"ids end at {max(span)}")
        want = (gi.end_of_granule[g], g) if (
            gi.mapped[g] and 0 < gi.live[g] < gi.size[g]
            and (gi.free_count(g) > 0 or gi.win[g])) else None
        if gi._key[g] != want:
            raise InvariantError(f"granule {g} is filed as {gi._key[g]}, expected {want}")
        empty = bool(gi.mapped[g] and not gi.live[g])
        if (g in gi._empty) != empty or (g in gi._vacant) != (
                empty and not gi.cached[g]) or (g in gi._empty_free) != (
                empty and 0 < gi.cached[g] < gi.size[g]):
            raise InvariantError(f"granule {g}'s emptiness is recorded wrongly")
    if gi._cand != sorted(k for k in gi._key if k is not None):
        raise InvariantError("the placement candidates are not the filed granules, sorted")
    if gi.num_live != sum(gi.live):
        raise InvariantError(f"num_live is {gi.num_live}, the granules hold "
                             f"{sum(gi.live)} live ids")
