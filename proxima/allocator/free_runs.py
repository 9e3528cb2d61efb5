"""The free runs of a pool of block ids: the state the run allocator places by.

The pool is the id range ``0..num_blocks-1``; each id is FREE, ALLOCATED or RESERVED
(never handed out: vLLM's null block). :class:`FreeRuns` keeps which ids are free, as
runs filed by order, with the claims on them; it answers queries and does the
bookkeeping of taking and giving back ranges. Where a new run goes is decided by the
passes of :mod:`proxima.allocator.run_placement`; the operations (allocate, free, take)
and their argument checks are :class:`~proxima.allocator.runs.RunAllocator`'s.

State (every item is verified by :meth:`FreeRuns.check`):

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
  Lifetime: :meth:`~proxima.allocator.runs.RunAllocator.allocate` sets a claim when it
  places a new run with ``room``, on the free run right behind it. The claim then
  belongs to that free run: it stays put while the owner grows into the run (the
  absolute end does not move), and keeps to the left part when the run is cut and with
  the merged run when ids after it are freed; it ends when the run is used up, and when
  the ids before the run are freed (the owner is gone: the merged run starts
  claim-free). Placement keeps new runs clear of claimed ids while it can, so a claim is
  a preference, never a reservation: it costs no capacity. Claims are state beyond the
  free set: two pools with the same free ids but different claims may place a run
  differently (:meth:`claims` lists them).

The *buddy view* is derived, not stored: every free run splits into the maximal
aligned power-of-two blocks it contains (:meth:`free_blocks`), which is the
canonical decomposition a buddy system with eager merging (Linux's ``__free_one_page``)
keeps. Placement uses it to split slack buddy-style
(:func:`~proxima.allocator.run_placement.split_point`).

Queries and their cost (``N = num_blocks``, ``R`` = number of free runs):
:meth:`is_free` O(1); ``num_free``, :attr:`num_free_runs`, :meth:`free_runs_by_order`
O(1) / O(log N); :attr:`largest_free_run` O(runs of the highest order);
:meth:`free_runs` O(R log R); :meth:`free_blocks`, :meth:`free_blocks_by_order`
O(R log N); :meth:`free_ids_from` O(ids yielded) plus a C-speed scan of the ids it
passes; :meth:`claims` O(R log R).

Bookkeeping: :meth:`~FreeRuns._take` (Linux's ``expand``) and
:meth:`~FreeRuns._give_back_range` O(1) per range plus a C-speed fill of its ids;
building O(N) in C; :meth:`check` O(N), mostly in C. This module imports nothing beyond
the standard library.
"""

from __future__ import annotations

import re
from itertools import compress
from reprlib import repr as short_repr
from typing import Iterable, Iterator

from proxima.allocator.errors import AllocationError, InvariantError

FREE = 0
ALLOCATED = 1
RESERVED = 2

_FREE_RUNS = re.compile(rb"\x00+")        # FREE == 0: maximal runs of FREE bytes


class FreeRuns:
    """The free runs of the ids ``0..num_blocks-1`` with their claims (see the module doc).

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

    # ------------------------------------------------------------- bookkeeping

    def _run_containing(self, block_id: int) -> int:
        """Start of the free run holding the free id ``block_id``: one past the nearest
        id to its left that is not free (C-speed scans, bounded by the run)."""
        state = self._state
        allocated = state.rfind(ALLOCATED, 0, block_id)
        reserved = state.rfind(RESERVED, allocated + 1, block_id)
        return max(allocated, reserved) + 1

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
