"""Contiguous-run allocator over the block ids of one preallocated KV-cache pool.

The pool is the id range ``0..num_blocks-1``; each id is FREE, ALLOCATED or RESERVED
(never handed out: vLLM's null block). The allocator hands out ids, never memory: the
caller maps them to its blocks.

State (every item is verified by :meth:`BuddyAllocator.check`):

* ``_state[i]``: FREE, ALLOCATED or RESERVED; exactly ``num_free`` ids are FREE.
* The *free runs*: the maximal ranges ``[s, e)`` of consecutive FREE ids. A run is
  recorded at both ends, ``_run_end[s] == e`` (``_run_end`` is 0 at every other index,
  so ``_run_end[x + 1]`` says at once whether the ids after ``x`` are free, and how
  many) and ``_run_start[e - 1] == s`` (read only at a run's last id).
* ``_free_area[k]``: the ends ``e`` of the free runs whose length has order ``k``
  (``2**k <= e - s < 2**(k + 1)``) and that have unclaimed ids (see claims);
  ``_claimed_area[k]`` the same for the runs claimed whole. This is Linux's
  ``free_area[order]`` holding runs instead of aligned blocks; a run is filed under
  its end, which stays put while the run is eaten from the front (growth in place).
  Placement looks for space in ``_free_area`` only.
* *Claims*: ``_claim[e - 1] = c`` at the last id of a free run ``[s, e)`` says that
  the owner of the allocated run just before it expects to grow to ``c``
  (``0 < c <= num_blocks``; the ids ``[s, min(c, e))`` are *claimed*; 0 elsewhere).
  Lifetime: :meth:`allocate` sets a claim when it places a new run with ``room``, on
  the free run right behind it. The claim then belongs to that free run: it stays put
  while the owner grows into the run (the absolute end does not move), and keeps to the
  left part when the run is cut and with the merged run when ids after it are freed;
  it ends when the run is used up, and when the ids before the run are freed (the
  owner is gone: the merged run starts claim-free). Placement keeps new runs clear of
  claimed ids while it can, so a claim is a preference, never a reservation: it costs
  no capacity. Claims are state beyond the free set: two pools with the same free ids
  but different claims may place a run differently (:meth:`claims` lists them).

The *buddy view* is derived, not stored: every free run splits into the maximal
aligned power-of-two blocks it contains (:meth:`free_blocks`), which is the
canonical decomposition a buddy system with eager merging (Linux's ``__free_one_page``)
keeps. Placement uses it to split slack buddy-style (:meth:`_split_point`).

Placement (:meth:`allocate`), each step a small function returning a place or None:

1. ``after=x`` and ``x+1 .. x+n`` free: those ids (the caller's run grows in place;
   the hot path, inline in :meth:`allocate`).
2. A new run of ``n`` ids with ``want = max(n, room)`` ids of space behind its start:

   a. ``spread`` (the pool has room for everyone twice over): the largest slack past
      a claim, split buddy-style (:meth:`_split_largest_slack`);
   b. pack: the tightest run whose unclaimed part holds ``want``, right after the
      claim (:meth:`_pack_after_claim`);
   c. claims ignored: the smallest run that holds ``want``, else ``n``
      (:meth:`_smallest_fit`, Linux's ``__rmqueue_smallest``), split buddy-style.

   The chosen run is cut by :meth:`_take` (Linux's ``expand``: what is left on
   either side goes back as free runs).
3. No single run holds ``n`` ids: whole runs, longest first, then the remainder by
   step 2 (:meth:`_gather`). The allocator never refuses while ``num_free >= n``.

A further preference (e.g. for ids in already mapped memory) is one more function in
:meth:`_place`'s chain, reading the same queries.

Queries and their cost (``N = num_blocks``, ``R`` = number of free runs):
:meth:`is_free` O(1); ``num_free``, :attr:`num_free_runs`, :meth:`free_runs_by_order`
O(1) / O(log N); :attr:`largest_free_run` O(runs of the highest order);
:meth:`free_runs` O(R log R); :meth:`free_blocks`, :meth:`free_blocks_by_order`
O(R log N); :meth:`free_ids_from` O(ids yielded) plus a C-speed scan of the ids it
passes; :meth:`claims` O(R log R).

Costs of the operations: growing in place O(1) (a few list stores; a set move when the
run drops an order); a new run O(log N + CANDIDATES), rising to the runs of one order
when no higher order has a run; :meth:`free` a C-speed sort and check of the ids (plus
a Python pass over them when they form several ranges) and O(1) per range;
:meth:`take` O(1) plus a C-speed scan of its run;
building O(N) in C; :meth:`check` O(N), mostly in C.

Every public method validates its arguments first: a bad argument raises
:class:`AllocationError` naming the value, and nothing has changed. This module
imports nothing beyond the standard library.
"""

from __future__ import annotations

import re
from itertools import chain, compress
from reprlib import repr as short_repr
from typing import Iterable, Iterator

FREE = 0
ALLOCATED = 1
RESERVED = 2

CANDIDATES = 16               # free runs examined per placement pass

_FREE_RUNS = re.compile(rb"\x00+")        # FREE == 0: maximal runs of FREE bytes
_INTS = {int}
_NONE = object()


class AllocationError(ValueError):
    """A request the allocator refuses: a bad argument (named in the message) or more ids
    than are free. Nothing has changed when it is raised."""


class InvariantError(RuntimeError):
    """:meth:`BuddyAllocator.check` found the allocator's structures inconsistent."""


class BuddyAllocator:
    """Contiguous-run allocator over the ids ``0..num_blocks-1`` (see the module doc).

    Args:
        num_blocks: size of the pool, an int ``>= 1``.
        reserved: ids that are never handed out (e.g. vLLM's null block ``0``).
    """

    __slots__ = ("num_blocks", "max_order", "num_free", "_state", "_run_end", "_run_start",
                 "_free_area", "_claimed_area", "_num_runs", "_reserved", "_claim", "_ids")

    def __init__(self, num_blocks: int, reserved: Iterable[int] = ()) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise AllocationError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        try:
            reserved_ids = sorted(set(reserved))
        except TypeError:
            raise AllocationError(f"reserved must be block ids (ints), got "
                                  f"{short_repr(reserved)}") from None
        for rid in reserved_ids:
            if type(rid) is not int:
                raise AllocationError(f"reserved id {rid!r} is not a block id (an int)")
            if not 0 <= rid < num_blocks:
                raise AllocationError(
                    f"reserved id {rid!r} is outside the pool 0..{num_blocks - 1}")
        self.num_blocks = num_blocks
        self.max_order = num_blocks.bit_length() - 1       # order of the longest run
        self.num_free = 0
        self._reserved = frozenset(reserved_ids)
        # Per-id arrays. Python lists index faster than array.array (no boxing).
        self._state = bytearray(num_blocks)                 # all FREE
        self._run_end = [0] * (num_blocks + 1)
        self._run_start = [0] * num_blocks
        self._free_area: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._claimed_area: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._claim = [0] * num_blocks
        # Every id once, so that a run of ids is a slice (no int objects made per call).
        self._ids = list(range(num_blocks))
        self._num_runs = 0
        start = 0
        for rid in reserved_ids + [num_blocks]:
            if rid < num_blocks:
                self._state[rid] = RESERVED
            if rid > start:
                self._link_run(start, rid)
                self.num_free += rid - start
            start = rid + 1

    # ------------------------------------------------------------------ queries

    @property
    def largest_free_run(self) -> int:
        """Length of the longest range of consecutive free ids. O(runs of the top order)."""
        run_start = self._run_start
        for area, claimed in zip(reversed(self._free_area), reversed(self._claimed_area)):
            if area or claimed:
                return max(end - run_start[end - 1] for end in (*area, *claimed))
        return 0

    @property
    def num_free_runs(self) -> int:
        """Number of maximal ranges of consecutive free ids. O(1)."""
        return self._num_runs

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks in the buddy view (:meth:`free_blocks`). O(R log N)."""
        return sum(self.free_blocks_by_order())

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free_run / num_free``; 0.0 for an empty or fully free pool."""
        if self.num_free == 0:
            return 0.0
        return 1.0 - self.largest_free_run / self.num_free

    @property
    def reserved(self) -> frozenset[int]:
        return self._reserved

    def is_free(self, block_id: int) -> bool:
        """Whether ``block_id`` may be handed out now. False outside the pool. O(1)."""
        if type(block_id) is not int:
            raise AllocationError(f"is_free({block_id!r}): a block id is an int")
        return 0 <= block_id < self.num_blocks and self._state[block_id] == FREE

    def free_runs(self) -> list[tuple[int, int]]:
        """Every free run ``(start, end)``, ascending. O(R log R)."""
        run_start = self._run_start
        return sorted((run_start[end - 1], end) for areas in (self._free_area, self._claimed_area)
                      for area in areas for end in area)

    def free_runs_by_order(self) -> list[int]:
        """``[k] -> number of free runs whose length is in [2**k, 2**(k+1))``. O(log N)."""
        return [len(a) + len(b) for a, b in zip(self._free_area, self._claimed_area)]

    def free_blocks(self) -> Iterator[tuple[int, int]]:
        """The buddy view: ``(head, order)`` of every maximal aligned block of free ids
        (``[head, head + 2**order)``), ascending. Derived from the runs: O(R log N)."""
        for start, end in self.free_runs():
            yield from aligned_blocks(start, end)

    def free_blocks_by_order(self) -> list[int]:
        """``[k] -> number of blocks of 2**k ids`` in the buddy view. O(R log N)."""
        counts = [0] * (self.max_order + 1)
        for _, order in self.free_blocks():
            counts[order] += 1
        return counts

    def free_ids_from(self, first: int = 0) -> Iterator[int]:
        """The free ids ``>= first``, ascending, read live (ids freed or taken while the
        iterator is suspended are seen). O(ids yielded) plus C-speed scans of the ids
        between runs."""
        if type(first) is not int or first < 0:
            raise AllocationError(f"free_ids_from({first!r}): give an id >= 0")
        state = self._state
        run_end = self._run_end
        n = self.num_blocks
        i = state.find(FREE, first) if first < n else -1
        if i >= 0 and not run_end[i]:           # `first` lies inside a run: find its end
            end = state.find(ALLOCATED, i)
            end = n if end < 0 else end
            reserved = state.find(RESERVED, i, end)
            end = reserved if reserved >= 0 else end
            yield from range(i, end)
            i = state.find(FREE, end)
        while i >= 0:
            end = run_end[i]
            yield from range(i, end)
            i = state.find(FREE, end)

    def claims(self) -> dict[int, int]:
        """``{start of a free run: end of its claimed ids}`` for every free run whose
        first ids are claimed by its left neighbour (see the module doc). O(R log R)."""
        claim = self._claim
        return {start: min(claim[end - 1], end) for start, end in self.free_runs()
                if claim[end - 1] > start}

    def stats(self) -> dict:
        """The cheap statistics in one dict (for metrics and the status file)."""
        return {
            "num_blocks": self.num_blocks,
            "num_free": self.num_free,
            "largest_free_run": self.largest_free_run,
            "num_free_runs": self._num_runs,
            "fragmentation": self.fragmentation,
            "free_runs_by_order": self.free_runs_by_order(),
        }

    # --------------------------------------------------------------- operations

    def allocate(self, n: int, after: int | None = None, room: int | None = None,
                 spread: bool = False) -> list[int]:
        """Hand out ``n`` distinct free ids, as few contiguous runs as possible.

        Args:
            n: number of ids, an int ``0 <= n <= num_free``.
            after: ``None`` or the caller's last id (an ALLOCATED id): if ``after+1 ..
                after+n`` are all free, exactly those are returned (the caller's run
                grows in place).
            room: ``None`` or an int ``>= 0``: the ids the caller expects to need in all
                from here (values below ``n`` count as ``n``). A new run is placed where
                that many stay free behind its start, if such a place exists, and
                claims the ids past the run (see the module doc). Only a preference,
                never a reservation.
            spread: True or False: the pool has ample space for everyone's room:
                share free space out buddy-style (split the largest slack) so that runs
                can outgrow their stated room. False packs new runs right after their
                neighbours' claims, which keeps the most space whole when the pool is
                getting full. Read only with ``room``.

        Returns:
            the ids in order: ascending within each run, runs in the order taken.

        Raises:
            AllocationError: a bad argument, or ``n`` above ``num_free``; nothing changed.
        """
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
        place = self._place(n, want, spread and room is not None)
        if place is None:
            return self._gather(n)
        start, run_start, run_end_ = place
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

    # ------------------------------------------------------------------- checking

    def check(self) -> None:
        """Verify every invariant of the module doc in O(N); raise :class:`InvariantError`
        naming the first one broken. Does not rely on ``assert`` (works under -O)."""
        try:
            self._check()
        except InvariantError:
            raise
        except Exception as exc:        # a structure so broken that reading it failed
            raise InvariantError(f"allocator state is corrupt: reading it raised "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _check(self) -> None:
        n = self.num_blocks
        state = self._state
        if len(state) != n or len(self._run_end) != n + 1 or len(self._run_start) != n \
                or len(self._claim) != n or len(self._free_area) != self.max_order + 1 \
                or len(self._claimed_area) != self.max_order + 1:
            raise InvariantError("a per-id array or the order index has the wrong length")
        free, allocated, reserved = state.count(FREE), state.count(ALLOCATED), \
            state.count(RESERVED)
        if free + allocated + reserved != n:
            raise InvariantError(f"{n - free - allocated - reserved} ids have a state other "
                                 f"than FREE, ALLOCATED or RESERVED")
        if free != self.num_free:
            raise InvariantError(f"num_free is {self.num_free} but {free} ids are FREE")
        if reserved != len(self._reserved) or any(state[r] != RESERVED for r in self._reserved):
            raise InvariantError("the RESERVED ids differ from the reserved set")
        runs = [(m.start(), m.end()) for m in _FREE_RUNS.finditer(state)]
        if len(runs) != self._num_runs:
            raise InvariantError(f"num_free_runs is {self._num_runs} but the FREE ids form "
                                 f"{len(runs)} runs")
        run_end, run_start = self._run_end, self._run_start
        marked = list(compress(range(n + 1), run_end))
        if marked != [s for s, _ in runs]:
            stray = sorted(set(marked) ^ {s for s, _ in runs})[:5]
            raise InvariantError(f"run starts are marked at the wrong ids (e.g. {stray})")
        claim = self._claim
        areas: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        claimed: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        for s, e in runs:
            if run_end[s] != e or run_start[e - 1] != s:
                raise InvariantError(f"free run [{s}, {e}) is recorded as [{s}, {run_end[s]})"
                                     f" / [{run_start[e - 1]}, {e})")
            (claimed if claim[e - 1] >= e else areas)[(e - s).bit_length() - 1].add(e)
        for name, held_areas, expected_areas in (("free_area", self._free_area, areas),
                                                 ("claimed_area", self._claimed_area, claimed)):
            for order, (held, expected) in enumerate(zip(held_areas, expected_areas)):
                if held != expected:
                    wrong = sorted(held ^ expected)[:5]
                    raise InvariantError(f"{name}[{order}] is wrong about the runs ending at "
                                         f"{wrong}")
        ends = {e - 1 for _, e in runs}
        for i in compress(range(n), claim):
            if i not in ends or not 0 < claim[i] <= n:
                raise InvariantError(f"claim {claim[i]} at id {i}: a claim lives at the "
                                     f"last id of a free run and lies in (0, num_blocks]")

    def __repr__(self) -> str:
        return (f"BuddyAllocator(num_blocks={self.num_blocks}, num_free={self.num_free}, "
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

    # ------------------------------------------------------------- placement

    def _place(self, n: int, want: int, spread: bool) -> tuple[int, int, int] | None:
        """Where a new run of ``n`` ids starts: ``(start, run_start, run_end)``, the start
        and the free run it is cut from; None when no single run holds ``n`` ids. The
        passes of the module doc, in order (``want >= n``: the space the run expects)."""
        place = self._split_largest_slack(want) if spread else None
        if place is None:
            place = self._pack_after_claim(want)
        if place is None:
            place = self._smallest_fit(want)
        if place is None and want > n:
            place = self._smallest_fit(n)
        return place

    def _split_largest_slack(self, want: int) -> tuple[int, int, int] | None:
        """Spread: in the highest order whose runs have one, the run with the most
        unclaimed space, if that holds ``2 * want``: the new run takes the head of the
        largest aligned block there that leaves ``want`` ids to the run's end, so the
        slack before it stays free for the left neighbour and the slack after it is ours.
        Repeated, free space is shared out evenly (runs can outgrow their claims)."""
        best = self._best_run(want, 2 * want, downward=True)
        if best is None:
            return None
        start, end, lo = best
        return self._split_point(start, lo, end, want), start, end

    def _pack_after_claim(self, want: int) -> tuple[int, int, int] | None:
        """Pack: the tightest run whose unclaimed part holds ``want``, in the lowest order
        that has one (else the roomiest in the highest); the new run starts right after
        the claim of its left neighbour, keeping the rest of the run whole."""
        best = self._best_run(want, want, downward=False)
        if best is None:
            best = self._best_run(want, want, downward=True)
        if best is None:
            return None
        start, end, lo = best
        return lo, start, end

    def _best_run(self, want: int, space: int, downward: bool) -> tuple[int, int, int] | None:
        """``(start, end, first unclaimed id)`` of a free run with ``space`` unclaimed ids:
        orders are examined from the lowest that may hold ``want`` ids up (the tightest
        such run of the first order that has one) or from the highest down (the roomiest),
        CANDIDATES runs at most."""
        areas = self._free_area
        run_start = self._run_start
        claim = self._claim
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

    def _smallest_fit(self, want: int) -> tuple[int, int, int] | None:
        """Claims ignored (Linux's ``__rmqueue_smallest``): the shortest run of at least
        ``want`` ids among those examined in the lowest order that has one, split
        buddy-style (:meth:`_split_point`). Finds a run whenever one is long enough."""
        areas, claimed = self._free_area, self._claimed_area
        run_start = self._run_start
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
        return self._split_point(start, start, end, want), start, end

    @staticmethod
    def _split_point(run_start: int, lo: int, end: int, want: int) -> int:
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

    def _gather(self, n: int) -> list[int]:
        """No single run holds ``n`` ids: whole runs, longest first (lowest start among
        equals), until the remainder fits one run, which step 2 then places."""
        ids: list[int] = []
        for start, end in sorted(self.free_runs(), key=lambda run: run[0] - run[1]):
            if end - start >= n:
                break
            self._take(start, end, start, end)
            ids += self._ids[start:end]
            n -= end - start
        start, run_start, run_end = self._place(n, n, False)
        self._take(start, start + n, run_start, run_end)
        ids += self._ids[start:start + n]
        return ids

    def _run_containing(self, block_id: int) -> int:
        """Start of the free run holding the free id ``block_id``: one past the nearest
        id to its left that is not free (C-speed scans, bounded by the run)."""
        state = self._state
        allocated = state.rfind(ALLOCATED, 0, block_id)
        reserved = state.rfind(RESERVED, allocated + 1, block_id)
        return max(allocated, reserved) + 1

    # ------------------------------------------------------------- bookkeeping

    def _link_run(self, start: int, end: int, claim: int = 0) -> None:
        """Record the free run ``[start, end)`` with its claim (0: none)."""
        self._run_end[start] = end
        self._run_start[end - 1] = start
        self._claim[end - 1] = claim
        areas = self._claimed_area if claim >= end else self._free_area
        areas[(end - start).bit_length() - 1].add(end)
        self._num_runs += 1

    def _unlink_run(self, start: int, end: int) -> int:
        """Forget the free run ``[start, end)``; returns its claim."""
        self._run_end[start] = 0
        claim = self._claim[end - 1]
        self._claim[end - 1] = 0
        areas = self._claimed_area if claim >= end else self._free_area
        areas[(end - start).bit_length() - 1].discard(end)
        self._num_runs -= 1
        return claim

    def _take(self, start: int, stop: int, run_start: int, run_end: int,
              claim: int = 0) -> None:
        """Allocate ``[start, stop)`` out of the free run ``[run_start, run_end)`` (Linux's
        ``expand``): what is left on either side goes back as free runs, the left part
        with the run's claim, the right part with ``claim`` (that of the new run's owner,
        capped at the pool; 0 for none)."""
        kept = self._unlink_run(run_start, run_end)
        if run_start < start:
            self._link_run(run_start, start, kept)
        if stop < run_end:
            self._link_run(stop, run_end, min(claim, self.num_blocks))
        self._state[start:stop] = b"\x01" * (stop - start)
        self.num_free -= stop - start

    def _give_back_range(self, start: int, end: int) -> None:
        """Free the allocated ids ``[start, end)`` and merge the range with the free runs
        on either side. The merged run keeps the claim of the run on the left, if any; the
        claim of the run on the right ends (its owner ended at ``end - 1``)."""
        state = self._state
        state[start:end] = bytes(end - start)
        self.num_free += end - start
        run_start, run_end, claim = start, end, 0
        if start and state[start - 1] == FREE:
            run_start = self._run_start[start - 1]
            claim = self._unlink_run(run_start, start)
        if end < self.num_blocks and state[end] == FREE:
            run_end = self._run_end[end]
            self._unlink_run(end, run_end)
        self._link_run(run_start, run_end, claim)


def aligned_blocks(start: int, end: int) -> Iterator[tuple[int, int]]:
    """``(head, order)`` of the maximal aligned power-of-two blocks that make up the ids
    ``[start, end)``, ascending: the buddy decomposition of a free run."""
    while start < end:
        size = (start & -start) if start else 1 << (end.bit_length())
        while start + size > end:
            size >>= 1
        yield start, size.bit_length() - 1
        start += size


def _not_ids(ids) -> AllocationError:
    """The error for a :meth:`BuddyAllocator.free` argument that holds a non-int."""
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
