"""The run allocator: hands out the block ids of one preallocated KV-cache pool as few
contiguous runs as it can.

:class:`RunAllocator` is an extent allocator: it keeps the free ids as maximal runs filed
by the order of their length (:class:`~proxima.allocator.free_runs.FreeRuns`, Linux's
``free_area`` holding runs instead of aligned blocks), hands out ids, never memory (the
caller maps them to its blocks), and takes what its caller knows about the next ids as
an explicit hint (:mod:`proxima.allocator.hint`).

Placement (:meth:`RunAllocator.allocate`):

1. ``hint.after=x`` and ``x+1 .. x+n`` free: those ids (the caller's run grows in place;
   the hot path, inline in :meth:`RunAllocator.allocate`).
2. A new run of ``n`` ids with ``want = max(n, hint.room)`` ids of space behind its
   start, placed by the passes of :mod:`proxima.allocator.run_placement` (spread, pack
   after a claim, smallest fit) and claiming the ids past it.
3. No single run holds ``n`` ids: whole runs, longest first, then the remainder by
   step 2 (:func:`~proxima.allocator.run_placement.gather`). The allocator never refuses
   while ``num_free >= n``.

Costs of the operations: growing in place O(1) (a few list stores; a set move when the
run drops an order); a new run O(log N + CANDIDATES), rising to the runs of one order
when no higher order has a run; :meth:`~RunAllocator.free` a C-speed sort and check of
the ids (plus a Python pass over them when they form several ranges) and O(1) per range;
:meth:`~RunAllocator.take` O(1) plus a C-speed scan of its run.

Every public method validates its arguments first: a bad argument raises
:class:`~proxima.allocator.errors.AllocationError` naming the value, and nothing has
changed. This module imports nothing beyond the standard library.
"""

from __future__ import annotations

from reprlib import repr as short_repr
from typing import Iterable

from proxima.allocator.errors import AllocationError
from proxima.allocator.free_runs import ALLOCATED, FREE, RESERVED, FreeRuns
from proxima.allocator.hint import AllocationHint
from proxima.allocator.run_placement import gather, place

_INTS = {int}
_NONE = object()


class RunAllocator(FreeRuns):
    """Contiguous-run allocator over the ids ``0..num_blocks-1`` (see the module doc).

    Args:
        num_blocks: size of the pool, an int ``>= 1``.
        reserved: ids that are never handed out (e.g. vLLM's null block ``0``).
    """

    __slots__ = ()

    # --------------------------------------------------------------- operations

    def allocate(self, n: int, hint: AllocationHint | tuple | None = None) -> list[int]:
        """Hand out ``n`` distinct free ids, as few contiguous runs as possible.

        Args:
            n: number of ids, an int ``0 <= n <= num_free``.
            hint: None or a hint: an :class:`~proxima.allocator.hint.AllocationHint` or
                the plain tuple ``(after, room, spread, end)`` (the same hint); this
                reads ``after``, ``room`` and ``spread`` (``end`` is the elastic queue's):

                * ``after``: ``None`` or the caller's last id (an ALLOCATED id): if
                  ``after+1 .. after+n`` are all free, exactly those are returned (the
                  caller's run grows in place).
                * ``room``: ``None`` or an int ``>= 0``: the ids the caller expects to
                  need in all from here (values below ``n`` count as ``n``). A new run
                  is placed where that many stay free behind its start, if such a place
                  exists, and claims the ids past the run (see
                  :mod:`~proxima.allocator.free_runs`). Only a preference, never a
                  reservation.
                * ``spread``: True or False: the pool has ample space for everyone's
                  room: share free space out buddy-style (split the largest slack) so
                  that runs can outgrow their stated room. False packs new runs right
                  after their neighbours' claims, which keeps the most space whole when
                  the pool is getting full. Read only with ``room``.

        Returns:
            the ids in order: ascending within each run, runs in the order taken.

        Raises:
            AllocationError: a bad argument, or ``n`` above ``num_free``; nothing changed.
        """
        if hint is None:
            after = room = None
            spread = False
        else:
            if type(hint) is not tuple and type(hint) is not AllocationHint:
                raise _not_a_hint(hint)
            try:
                after, room, spread, _ = hint      # unpacked: cheaper than three lookups
            except ValueError:
                raise _not_a_hint(hint) from None
        if (type(n) is not int or n < 1
                or (room is not None and (type(room) is not int or room < 0))
                or (spread is not False and spread is not True)):
            return self._nothing_or_refusal(n, after, room, spread)
        if after is not None:
            state = self._state
            if type(after) is not int or not 0 <= after < self.num_blocks \
                    or state[after] != ALLOCATED:
                raise self._bad_after(after)
            start = after + 1
            run_end = self._run_end
            end = run_end[start]           # 0 unless a free run starts right after `after`
            if end - start >= n:
                # Grow in place: the hot path (once per decoded block of every request).
                # The run [start, end) gives up its first n ids; it stays filed under
                # its end (its claim too, at end - 1), and moves to a lower order only
                # when its length drops below a power of two.
                stop = start + n
                length = end - start
                rest = length - n
                run_end[start] = 0
                if rest:
                    run_end[stop] = end
                    self._run_start[end - 1] = stop
                    if (rest ^ length) >= rest:       # the top bit changed: new order
                        areas = self._claimed_area if self._claim[end - 1] >= end \
                            else self._free_area
                        areas[length.bit_length() - 1].discard(end)
                        areas[rest.bit_length() - 1].add(end)
                else:
                    self._unlink_run(start, end)       # used up
                self.num_free -= n
                if n == 1:
                    state[start] = ALLOCATED
                    return [start]
                state[start:stop] = b"\x01" * n
                return self._ids[start:stop]
        if n > self.num_free:               # (growth above cannot have: its run holds n)
            return self._nothing_or_refusal(n, after, room, spread)
        want = n if room is None or room <= n else room
        where = place(self, n, want, spread and room is not None)
        if where is None:
            return gather(self, n)
        start, run_start, run_end_ = where
        stop = start + n
        self._take(start, stop, run_start, run_end_, start + want if want > n else 0)
        return self._ids[start:stop]

    def allocate_all(self) -> list[int]:
        """Hand out every free id, ascending (a request that needs all that is free: no
        placement choice is left). O(R log R) plus the ids."""
        ids: list[int] = []
        state = self._state
        run_end = self._run_end
        claim = self._claim
        for start, end in self.free_runs():
            state[start:end] = b"\x01" * (end - start)
            run_end[start] = 0
            claim[end - 1] = 0
            ids += self._ids[start:end]
        for area in (*self._free_area, *self._claimed_area):
            area.clear()
        self._num_runs = 0
        self.num_free = 0
        return ids

    def take(self, block_id: int) -> None:
        """Allocate one specific free id (a cached block that a prefix hit claims back).

        Raises :class:`AllocationError` if ``block_id`` is not a free id; nothing changed.
        """
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            raise AllocationError(f"cannot take id {block_id!r}: the pool's ids are "
                                  f"0..{self.num_blocks - 1}")
        if self._state[block_id] != FREE:
            what = "reserved" if self._state[block_id] == RESERVED else "allocated"
            raise AllocationError(f"cannot take id {block_id}: it is not free ({what})")
        run_start = self._run_containing(block_id)
        self._take(block_id, block_id + 1, run_start, self._run_end[run_start])

    def allocate_within(self, n: int, lo: int, hi: int, after: int | None = None) -> list[int]:
        """Up to ``n`` free ids of ``[lo, hi)`` (fewer when fewer are free there): the ids
        right after ``after`` first when they lie in the range and are free (the caller's
        run grows in place), then the longest free run there, then the next longest, each
        taken from its start. Claims are ignored (a granule-aware caller places by
        granule). O(runs in the range) plus C-speed scans.

        Raises :class:`AllocationError` for a bad argument; nothing changed."""
        if type(n) is not int or n < 0:
            raise AllocationError(f"cannot allocate {n!r} blocks: n must be an integer >= 0")
        if type(lo) is not int or type(hi) is not int or not 0 <= lo <= hi <= self.num_blocks:
            raise AllocationError(f"allocate_within: [{lo!r}, {hi!r}) is not a range of the "
                                  f"pool 0..{self.num_blocks}")
        if after is not None and (type(after) is not int or not 0 <= after < self.num_blocks
                                  or self._state[after] != ALLOCATED):
            raise self._bad_after(after)
        out: list[int] = []
        if n == 0:
            return out
        state = self._state
        pieces = []                                   # (length, start, stop) inside [lo, hi)
        i = state.find(FREE, lo, hi)
        while i >= 0:
            end = state.find(ALLOCATED, i, hi)
            end = hi if end < 0 else end
            reserved = state.find(RESERVED, i, end)
            end = reserved if reserved >= 0 else end
            pieces.append((end - i, i, end))
            i = state.find(FREE, end, hi)
        if after is not None:
            first = [p for p in pieces if p[1] == after + 1]
            rest = [p for p in pieces if p[1] != after + 1]
            rest.sort(key=lambda p: (-p[0], p[1]))
            pieces = first + rest
        else:
            pieces.sort(key=lambda p: (-p[0], p[1]))
        for length, start, stop in pieces:
            take = min(n - len(out), length)
            run_start = self._run_containing(start)
            self._take(start, start + take, run_start, self._run_end[run_start])
            out += self._ids[start:start + take]
            if len(out) == n:
                break
        return out

    def take_range(self, start: int, stop: int) -> None:
        """Allocate the free ids ``[start, stop)`` (all must be free and none reserved):
        e.g. a granule of memory that is given back, whose ids stop being free capacity.

        Raises :class:`AllocationError` if one is not free; nothing changed."""
        if type(start) is not int or type(stop) is not int or \
                not 0 <= start < stop <= self.num_blocks:
            raise AllocationError(f"take_range: [{start!r}, {stop!r}) is not a non-empty "
                                  f"range of the pool 0..{self.num_blocks}")
        if self._state.count(FREE, start, stop) != stop - start:
            bad = next(i for i in range(start, stop) if self._state[i] != FREE)
            raise AllocationError(f"cannot take id {bad}: it is not free")
        i = start
        while i < stop:
            run_start = self._run_containing(i)
            run_end = self._run_end[run_start]
            end = min(run_end, stop)
            self._take(i, end, run_start, run_end)
            i = end

    def free(self, ids: Iterable[int]) -> None:
        """Give ``ids`` back, in any order, as few ranges as they form (vLLM frees a
        request's blocks tail first: one range). Each range merges with its free
        neighbours (a claim on the run after it ends: its owner is what was freed).

        All ids are checked first: a value that is not an int id of the pool, a reserved
        or not allocated id, or an id listed twice raises :class:`AllocationError` and
        nothing changes. So does an empty collection: a caller that frees nothing has
        lost track of what it holds (a used-up iterator, a list it emptied) or should not
        have called; one that may have nothing to give back checks first. Cost: sorting
        and checking the ids in C (a descending or ascending list sorts in one pass), plus
        O(1) per range.
        """
        try:
            ordered = sorted(ids)
        except TypeError:                   # not iterable, or items that do not compare
            ordered = None
        if ordered == []:
            raise AllocationError(f"cannot free {short_repr(ids)}: no ids given; call free "
                                  f"only with ids to give back")
        if ordered is None or set(map(type, ordered)) != _INTS:
            raise _not_ids(ids)
        first, last = ordered[0], ordered[-1]
        if first < 0 or last >= self.num_blocks:
            raise AllocationError(f"cannot free id {first if first < 0 else last}: the "
                                  f"pool's ids are 0..{self.num_blocks - 1}")
        if last - first == len(ordered) - 1 and ordered == self._ids[first:last + 1]:
            ranges = [(first, last + 1)]
        else:
            ranges = _ranges_of_sorted(ordered)
        state = self._state
        for start, end in ranges:
            if state.count(ALLOCATED, start, end) != end - start:
                bad = next(i for i in range(start, end) if state[i] != ALLOCATED)
                what = "reserved" if state[bad] == RESERVED else "not allocated (double free?)"
                raise AllocationError(f"cannot free id {bad}: it is {what}")
        for start, end in ranges:
            self._give_back_range(start, end)

    def __repr__(self) -> str:
        return (f"RunAllocator(num_blocks={self.num_blocks}, num_free={self.num_free}, "
                f"largest_free_run={self.largest_free_run}, runs={self._num_runs})")

    # ------------------------------------------------------------- validation

    def _nothing_or_refusal(self, n, after, room, spread) -> list[int]:
        """The slow side of :meth:`allocate`'s first test: ``[]`` for a valid ``n == 0``,
        else the :class:`AllocationError` for the first bad argument."""
        if type(n) is not int or n < 0:
            raise AllocationError(f"cannot allocate {n!r} blocks: n must be an integer >= 0")
        if after is not None and (type(after) is not int or not 0 <= after < self.num_blocks
                                  or self._state[after] != ALLOCATED):
            raise self._bad_after(after)
        if room is not None and (type(room) is not int or room < 0):
            raise AllocationError(f"room must be None or an integer >= 0, got {room!r}")
        if spread is not False and spread is not True:
            raise AllocationError(f"spread must be True or False, got {spread!r}")
        if n == 0:
            return []
        raise AllocationError(f"cannot allocate {n} blocks: only {self.num_free} of "
                              f"{self.num_blocks} are free")

    def _bad_after(self, after) -> AllocationError:
        if type(after) is not int:
            return AllocationError(f"after must be None or a block id (an int), got {after!r}")
        if not 0 <= after < self.num_blocks:
            return AllocationError(f"after={after} is outside the pool 0..{self.num_blocks - 1}")
        what = "free" if self._state[after] == FREE else "reserved"
        return AllocationError(f"after={after} is {what}: it must be the caller's last "
                               f"allocated id")



def _not_a_hint(hint) -> AllocationError:
    return AllocationError(f"hint must be None, an AllocationHint or a tuple (after, room, "
                           f"spread, end), got {short_repr(hint)}")


def _not_ids(ids) -> AllocationError:
    """The error for a :meth:`RunAllocator.free` argument that holds a non-int."""
    try:
        items = list(ids)
    except TypeError:
        return AllocationError(f"cannot free {ids!r}: give a collection of block ids (ints)")
    bad = next((i for i in items if type(i) is not int), _NONE)
    if bad is _NONE:                # a one-shot iterator, used up by the failed sort
        return AllocationError(f"cannot free {short_repr(ids)}: give block ids (ints)")
    return AllocationError(f"cannot free id {bad!r}: block ids are ints")


def _ranges_of_sorted(ordered: list[int]) -> list[tuple[int, int]]:
    """Ranges ``(start, end)`` of consecutive ids in an ascending list; an id listed twice
    is an :class:`AllocationError`."""
    ranges = []
    start = prev = ordered[0]
    for i in ordered[1:]:
        if i != prev + 1:
            if i == prev:
                raise AllocationError(f"cannot free id {i}: it is listed twice")
            ranges.append((start, prev + 1))
            start = i
        prev = i
    ranges.append((start, prev + 1))
    return ranges


def count_runs(block_ids) -> int:
    """Number of maximal runs of consecutive ascending ids (``[4, 5, 6, 9]`` -> 2; 0 if
    empty): how many pieces a block table is in."""
    runs = 1 if block_ids else 0
    prev = None
    for block_id in block_ids:
        if prev is not None and block_id != prev + 1:
            runs += 1
        prev = block_id
    return runs
