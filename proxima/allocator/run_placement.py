"""Where a new run of ids goes: the placement passes of the run allocator.

Each pass is a small function over the free runs (:class:`~proxima.allocator.free_runs.
FreeRuns`) that returns a place ``(start, run_start, run_end)`` -- the start and the free
run it is cut from -- or None. :meth:`~proxima.allocator.runs.RunAllocator.allocate`
calls :func:`place` when its caller's run cannot grow in place; the passes, in order, for
a new run of ``n`` ids with ``want = max(n, room)`` ids of space behind its start:

a. ``spread`` (the pool has room for everyone twice over): the largest slack past a
   claim, split buddy-style (:func:`split_largest_slack`);
b. pack: the tightest run whose unclaimed part holds ``want``, right after the claim
   (:func:`pack_after_claim`);
c. claims ignored: the smallest run that holds ``want``, else ``n``
   (:func:`smallest_fit`, Linux's ``__rmqueue_smallest``), split buddy-style.

The chosen run is cut by ``FreeRuns._take`` (Linux's ``expand``: what is left on either
side goes back as free runs). When no single run holds ``n`` ids, :func:`gather` takes
whole runs, longest first, then places the remainder. A further preference (e.g. for ids
in already mapped memory) is one more function in :func:`place`'s chain, reading the
same queries. A new run costs O(log N + CANDIDATES), rising to the runs of one order when
no higher order has a run. Standard library only.
"""

from __future__ import annotations

from itertools import chain

from proxima.allocator.free_runs import FreeRuns, aligned_blocks

CANDIDATES = 16               # free runs examined per placement pass


def place(a: FreeRuns, n: int, want: int, spread: bool) -> tuple[int, int, int] | None:
    """Where a new run of ``n`` ids starts: ``(start, run_start, run_end)``, the start
    and the free run it is cut from; None when no single run holds ``n`` ids. The
    passes of the module doc, in order (``want >= n``: the space the run expects)."""
    where = split_largest_slack(a, want) if spread else None
    if where is None:
        where = pack_after_claim(a, want)
    if where is None:
        where = smallest_fit(a, want)
    if where is None and want > n:
        where = smallest_fit(a, n)
    return where


def split_largest_slack(a: FreeRuns, want: int) -> tuple[int, int, int] | None:
    """Spread: in the highest order whose runs have one, the run with the most
    unclaimed space, if that holds ``2 * want``: the new run takes the head of the
    largest aligned block there that leaves ``want`` ids to the run's end, so the
    slack before it stays free for the left neighbour and the slack after it is ours.
    Repeated, free space is shared out evenly (runs can outgrow their claims)."""
    best = best_run(a, want, 2 * want, downward=True)
    if best is None:
        return None
    start, end, lo = best
    return split_point(start, lo, end, want), start, end


def pack_after_claim(a: FreeRuns, want: int) -> tuple[int, int, int] | None:
    """Pack: the tightest run whose unclaimed part holds ``want``, in the lowest order
    that has one (else the roomiest in the highest); the new run starts right after
    the claim of its left neighbour, keeping the rest of the run whole."""
    best = best_run(a, want, want, downward=False)
    if best is None:
        best = best_run(a, want, want, downward=True)
    if best is None:
        return None
    start, end, lo = best
    return lo, start, end


def best_run(a: FreeRuns, want: int, space: int, downward: bool) -> tuple[int, int, int] | None:
    """``(start, end, first unclaimed id)`` of a free run with ``space`` unclaimed ids:
    orders are examined from the lowest that may hold ``want`` ids up (the tightest
    such run of the first order that has one) or from the highest down (the roomiest),
    CANDIDATES runs at most."""
    areas = a._free_area
    run_start = a._run_start
    claim = a._claim
    low = want.bit_length() - 1
    orders = range(len(areas) - 1, low - 1, -1) if downward else range(low, len(areas))
    best, best_slack = None, 0
    seen = 0
    for k in orders:
        for end in areas[k]:
            start = run_start[end - 1]
            reach = claim[end - 1]              # the left neighbour's claim
            lo = reach if reach > start else start
            slack = end - lo
            if slack >= space and (best is None or (slack > best_slack if downward
                                                    else slack < best_slack)):
                best, best_slack = (start, end, lo), slack
            seen += 1
            if seen == CANDIDATES:
                return best
        if best is not None:
            return best
    return best


def smallest_fit(a: FreeRuns, want: int) -> tuple[int, int, int] | None:
    """Claims ignored (Linux's ``__rmqueue_smallest``): the shortest run of at least
    ``want`` ids among those examined in the lowest order that has one, split
    buddy-style (:func:`split_point`). Finds a run whenever one is long enough."""
    areas, claimed = a._free_area, a._claimed_area
    run_start = a._run_start
    order = want.bit_length() - 1
    if order >= len(areas):
        return None                     # longer than the pool
    higher = next((k for k in range(order + 1, len(areas)) if areas[k] or claimed[k]),
                  None)
    best = None
    for k in (order, higher):
        if k is None:
            break
        # In `order` runs may be too short: look at all of them when nothing higher
        # exists (else a run that fits could be missed); above it every run fits.
        limit = CANDIDATES if k != order or higher is not None else \
            len(areas[k]) + len(claimed[k])
        for seen, end in enumerate(chain(areas[k], claimed[k])):
            if seen >= limit:
                break
            start = run_start[end - 1]
            if end - start >= want and (best is None or end - start < best[1] - best[0]):
                best = (start, end)
        if best is not None:
            break
    if best is None:
        return None
    start, end = best
    return split_point(start, start, end, want), start, end


def split_point(run_start: int, lo: int, end: int, want: int) -> int:
    """Start of ``want`` ids in the free ids ``[lo, end)`` of the run ``[run_start,
    end)``: ``lo`` when the space is tight (under ``2 * want``), else the head of the
    run's largest buddy block that lies in ``[lo, end - want]`` (the first of the
    largest; ``lo`` if none): a buddy split, the ids before it stay free."""
    if end - lo < 2 * want:
        return lo
    last = end - want
    best, best_order = lo, -1
    for head, order in aligned_blocks(run_start, end):
        if head > last:
            break
        if head >= lo and order > best_order:
            best, best_order = head, order
    return best


def gather(a: FreeRuns, n: int) -> list[int]:
    """No single run holds ``n`` ids: whole runs, longest first (lowest start among
    equals), until the remainder fits one run, which :func:`place` then places."""
    ids: list[int] = []
    for start, end in sorted(a.free_runs(), key=lambda run: run[0] - run[1]):
        if end - start >= n:
            break
        a._take(start, end, start, end)
        ids += a._ids[start:end]
        n -= end - start
    start, run_start, run_end = place(a, n, n, False)
    a._take(start, start + n, run_start, run_end)
    ids += a._ids[start:start + n]
    return ids
