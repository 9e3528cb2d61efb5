"""Buddy-system allocator over the block ids of one preallocated KV-cache pool.

The pool is the id range ``0..num_blocks-1``. Every free id belongs to exactly one
*free block*: an aligned power-of-two range ``[head, head + 2**order)`` (Linux's
``free_area[order]``). Blocks are merged eagerly with their buddy
(``head ^ (1 << order)``) whenever both are free, so the set of free blocks is always
the *canonical decomposition* of the free ids: the maximal aligned ranges made only of
free ids. A pool whose size is not a power of two is thereby split into maximal aligned
chunks, and reserved ids (vLLM's null block) simply never join a block.

Beside the blocks the allocator keeps the *free runs*: the maximal ranges of
consecutive free ids, which may span several blocks (e.g. ``[8, 20)`` is the blocks
``[8, 16)`` and ``[16, 20)``). Runs answer the questions that matter to callers:
"are the ids after this request's last block free?" and "what is the longest
contiguous free range?".

Placement policy, in order:

1. ``after=x`` and ``x+1 .. x+n`` free: those ids (the caller's run grows in place).
2. Best fit: the smallest free run of length ``>= max(n, room)`` (else ``>= n``), so big
   runs stay whole. In a run much longer than needed, the ids start at the head of its
   largest buddy block (see ``_place``), leaving room on both sides for growth.
3. No single run holds ``n`` ids: whole runs, largest first, then the remainder by 2.

The allocator never refuses while ``num_free >= n``.

Complexity (``N = num_blocks``, ``D`` = number of distinct free-run lengths,
``D <= sqrt(2 N)``): growing in place is amortised O(1) block splits plus O(log D);
steps 2-3 are O(log N) per run touched; ``free`` is O(log N) per run freed plus a
C-speed pass over the ids. Building the structure is O(N) in C (list repetition)
plus O(log N) blocks per reserved id.

Invariants (checked by :meth:`BuddyAllocator.check`):

* ``_state[i]`` is FREE, ALLOCATED or RESERVED; exactly ``num_free`` ids are FREE.
* The free blocks partition the FREE ids and are the canonical decomposition.
* ``_run_end[s] == e`` and ``_run_start[e - 1] == s`` for every maximal free run
  ``[s, e)``; ``_runs_by_len[e - s]`` holds ``s``; ``_lengths`` is the sorted list of
  keys of ``_runs_by_len``.

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable, Sequence

FREE = 0
ALLOCATED = 1
RESERVED = 2

_PLACE_CANDIDATES = 16        # free runs examined for an unclaimed fit before giving up


class AllocationError(ValueError):
    """A request the allocator cannot satisfy (too many blocks, bad ids)."""


class BuddyAllocator:
    """Contiguous-run allocator over the ids ``0..num_blocks-1``.

    Args:
        num_blocks: size of the pool, any value ``>= 1``.
        reserved: ids that are never handed out (e.g. vLLM's null block ``0``).
    """

    __slots__ = (
        "num_blocks", "max_order", "num_free", "_state", "_head_order", "_tail_head",
        "_free_area", "_run_end", "_run_start", "_runs_by_len", "_lengths", "_run_hist",
        "_num_runs", "_reserved", "_claim",
    )

    def __init__(self, num_blocks: int, reserved: Iterable[int] = ()) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise AllocationError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        reserved_ids = sorted(set(reserved))
        for rid in reserved_ids:
            if not isinstance(rid, int) or not 0 <= rid < num_blocks:
                raise AllocationError(
                    f"reserved id {rid!r} is outside the pool 0..{num_blocks - 1}")
        self.num_blocks = num_blocks
        self.max_order = (num_blocks - 1).bit_length() if num_blocks > 1 else 0
        self.num_free = 0
        self._reserved = frozenset(reserved_ids)
        # Per-id arrays. Python lists index faster than array.array (no boxing).
        self._state = bytearray(num_blocks)               # FREE / ALLOCATED / RESERVED
        self._head_order = [0] * num_blocks               # order + 1 at free block heads
        self._tail_head = [0] * num_blocks                # head, at a free block's last id
        self._run_end = [0] * (num_blocks + 1)            # end, at a free run's first id
        self._run_start = [0] * num_blocks                # start, at a free run's last id
        self._free_area: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._runs_by_len: dict[int, set[int]] = {}
        self._lengths: list[int] = []
        self._run_hist = [0] * (self.max_order + 1)       # free runs by floor(log2 len)
        # Soft claims: at the last id of an allocated run, the end its owner expects to
        # grow to (``start + room``). Placement keeps clear of claimed ids while it can;
        # a claim never stops an allocation (ids are not reserved, only avoided).
        self._claim = [0] * num_blocks
        self._num_runs = 0
        for rid in reserved_ids:
            self._state[rid] = RESERVED
        prev = 0
        for rid in reserved_ids + [num_blocks]:
            if rid > prev:
                self._give_back_range(prev, rid)
            prev = rid + 1

    # ------------------------------------------------------------------ public API

    @property
    def largest_free_run(self) -> int:
        """Length of the longest range of consecutive free ids. O(1)."""
        return self._lengths[-1] if self._lengths else 0

    @property
    def num_free_runs(self) -> int:
        """Number of maximal ranges of consecutive free ids. O(1)."""
        return self._num_runs

    @property
    def num_free_blocks(self) -> int:
        """Number of free buddy blocks (the canonical decomposition). O(log N)."""
        return sum(len(area) for area in self._free_area)

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free_run / num_free``; 0.0 for an empty or fully free pool. O(1)."""
        if self.num_free == 0:
            return 0.0
        return 1.0 - self.largest_free_run / self.num_free

    @property
    def reserved(self) -> frozenset[int]:
        return self._reserved

    def free_blocks_by_order(self) -> list[int]:
        """``[k] -> number of free buddy blocks of 2**k ids``. O(log N)."""
        return [len(area) for area in self._free_area]

    def free_runs_by_order(self) -> list[int]:
        """``[k] -> number of free runs whose length is in [2**k, 2**(k+1))``. O(log N)."""
        return list(self._run_hist)

    def stats(self) -> dict:
        """All cheap statistics in one dict (for metrics and reports)."""
        return {
            "num_blocks": self.num_blocks,
            "num_free": self.num_free,
            "largest_free_run": self.largest_free_run,
            "num_free_runs": self._num_runs,
            "num_free_blocks": self.num_free_blocks,
            "fragmentation": self.fragmentation,
            "free_runs_by_order": self.free_runs_by_order(),
            "free_blocks_by_order": self.free_blocks_by_order(),
        }

    def is_free(self, block_id: int) -> bool:
        return 0 <= block_id < self.num_blocks and self._state[block_id] == FREE

    def allocate(self, n: int, after: int | None = None, room: int | None = None,
                 spread: bool = False) -> list[int]:
        """Hand out ``n`` distinct free ids, as few contiguous runs as possible.

        Args:
            n: number of ids, ``0 <= n <= num_free``.
            after: the caller's last id: if ``after+1 .. after+n`` are all free, exactly
                those are returned (the caller's run grows in place).
            room: the number of ids the caller expects to need in total from here
                (``>= n``): a new run is placed where that many stay free behind it,
                if such a place exists. Only a preference; never a reservation.
            spread: the pool has ample space for everyone's room: share free space out
                buddy-style (split the largest slack) so that runs can outgrow their
                stated room. False packs new runs right after their neighbours' room,
                which keeps the most space whole when the pool is getting full.

        Returns:
            the ids in order: ascending within each run, runs in the order taken.

        Raises:
            AllocationError: ``n`` is negative, not an int, or above ``num_free``.
        """
        if n <= 0:
            if n == 0 and isinstance(n, int):
                return []
            raise AllocationError(f"cannot allocate {n!r} blocks: n must be an integer >= 0")
        if n > self.num_free:
            raise AllocationError(
                f"cannot allocate {n} blocks: only {self.num_free} of "
                f"{self.num_blocks} are free")
        if after is not None:
            start = after + 1
            if 0 < start < self.num_blocks:
                end = self._run_end[start]
                # A run can start at after+1 only if after+1 is free and after is not.
                if end - start >= n:
                    return self._grow(after, start, start + n, end)
        want = n if room is None or room < n else room
        start, run_start = self._place(n, want, spread and room is not None)
        if start < 0:
            return self._allocate_from_runs(n)
        self._take(start, start + n, run_start, self._run_end[run_start])
        self._claim[start + n - 1] = start + want
        return list(range(start, start + n))

    def _grow(self, after: int, start: int, stop: int, end: int) -> list[int]:
        """In-place growth, the hot path (once per decoded block of every request): the
        free run ``[start, end)`` gives up its first ids ``[start, stop)``. The same
        updates as ``_take``, specialised: ``start`` heads both its run and its block."""
        n = stop - start
        length = end - start
        rest = length - n
        by_len = self._runs_by_len
        bucket = by_len[length]
        self._run_end[start] = 0
        renamed = False
        if rest and len(bucket) == 1 and rest not in by_len:
            # The run is alone at its length: relabel that length in place when the sorted
            # list stays sorted (no length strictly between rest and length).
            lengths = self._lengths
            i = bisect_left(lengths, length)
            if i == 0 or lengths[i - 1] < rest:
                lengths[i] = rest
                del by_len[length]
                bucket.clear()
                bucket.add(stop)
                by_len[rest] = bucket
                self._run_end[stop] = end
                self._run_start[end - 1] = stop
                old_order = length.bit_length() - 1
                new_order = rest.bit_length() - 1
                if old_order != new_order:
                    hist = self._run_hist
                    hist[old_order] -= 1
                    hist[new_order] += 1
                renamed = True
        if not renamed:
            self._run_end[start] = end          # _remove_run expects the run intact
            self._remove_run(start, end)
            if rest:
                self._add_run(stop, end)
        if n == 1:
            head_order = self._head_order
            order = head_order[start] - 1
            head_order[start] = 0
            self._free_area[order].discard(start)
            if order:
                self._add_range_blocks(stop, start + (1 << order))
            self._state[start] = ALLOCATED
        else:
            self._take_blocks(start, stop)
            self._state[start:stop] = b"\x01" * n
        self.num_free -= n
        claim = self._claim
        previous = claim[after]
        claim[stop - 1] = previous if previous > stop else stop
        return [start] if n == 1 else list(range(start, stop))

    def allocate_all(self) -> list[int]:
        """Hand out every free id (ascending). O(runs x log N): the pool under pressure,
        where a request needs all that is free and placement has no choice to make."""
        ids: list[int] = []
        for start in sorted(s for bucket in self._runs_by_len.values() for s in bucket):
            end = self._run_end[start]
            self._take(start, end, start, end)
            ids.extend(range(start, end))
        return ids

    def take(self, block_id: int) -> None:
        """Allocate one specific free id (a cached block that a prefix hit claims back).

        O(log N). Raises :class:`AllocationError` if the id is not free.
        """
        if not 0 <= block_id < self.num_blocks or self._state[block_id] != FREE:
            raise AllocationError(f"cannot take id {block_id}: it is not free")
        run_start = self._run_containing(block_id)
        self._take(block_id, block_id + 1, run_start, self._run_end[run_start])

    def free(self, ids: Sequence[int]) -> None:
        """Give ``ids`` back; each merges with its free neighbours and buddies.

        All ids are checked first: an id that is out of range, reserved, not allocated,
        or listed twice raises :class:`AllocationError` and nothing changes.
        O(n) in C for the check plus O(log N) per contiguous run of ids.
        """
        runs = self._runs_of(ids)
        state = self._state
        for start, end in runs:
            if start < 0 or end > self.num_blocks:
                raise AllocationError(
                    f"cannot free id {start if start < 0 else end - 1}: the pool's ids are "
                    f"0..{self.num_blocks - 1}")
            if state.count(ALLOCATED, start, end) != end - start:
                bad = next(i for i in range(start, end) if state[i] != ALLOCATED)
                what = "reserved" if state[bad] == RESERVED else "not allocated (double free?)"
                raise AllocationError(f"cannot free id {bad}: it is {what}")
        if len(runs) > 1:
            ordered = sorted(runs)
            for (s0, e0), (s1, _) in zip(ordered, ordered[1:]):
                if s1 < e0:
                    raise AllocationError(f"cannot free id {s1}: it is listed twice")
        for start, end in runs:
            self._give_back_range(start, end)

    def check(self) -> None:
        """Verify every invariant in O(N); raises AssertionError. For tests and self-checks."""
        n = self.num_blocks
        state = self._state
        assert state.count(FREE) == self.num_free, "num_free differs from the FREE ids"
        covered = bytearray(n)
        for order, area in enumerate(self._free_area):
            size = 1 << order
            for head in area:
                assert head % size == 0, f"block {head} of order {order} is misaligned"
                assert self._head_order[head] == order + 1, f"head {head} not marked"
                assert self._tail_head[head + size - 1] == head, f"tail of {head} not marked"
                for i in range(head, head + size):
                    assert state[i] == FREE and not covered[i], f"id {i} double or not free"
                    covered[i] = 1
                buddy = head ^ size
                assert not (buddy < n and self._head_order[buddy] == order + 1), \
                    f"blocks {head} and {buddy} of order {order} are free buddies, unmerged"
        assert covered.count(1) == self.num_free, "free blocks do not cover the free ids"
        for i in range(n):
            if self._head_order[i]:
                assert i in self._free_area[self._head_order[i] - 1], f"stray head mark {i}"
        runs = []
        i = 0
        while i < n:
            if state[i] == FREE:
                j = i
                while j < n and state[j] == FREE:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        assert len(runs) == self._num_runs, "run count drifted"
        by_len: dict[int, set[int]] = {}
        for s, e in runs:
            assert self._run_end[s] == e and self._run_start[e - 1] == s, f"run [{s},{e}) ends"
            by_len.setdefault(e - s, set()).add(s)
        assert by_len == self._runs_by_len, "run length index drifted"
        assert self._lengths == sorted(by_len), "sorted run lengths drifted"
        hist = [0] * (self.max_order + 1)
        for length in (e - s for s, e in runs):
            hist[length.bit_length() - 1] += 1
        assert hist == self._run_hist, "run histogram drifted"

    def __repr__(self) -> str:
        return (f"BuddyAllocator(num_blocks={self.num_blocks}, num_free={self.num_free}, "
                f"largest_free_run={self.largest_free_run}, runs={self._num_runs})")

    # ------------------------------------------------------------- placement helpers

    def _place(self, n: int, want: int, spread: bool = False) -> tuple[int, int]:
        """Where a new run of ``n`` ids starts, and the free run it lies in.

        A free run's first ids may be *claimed* by the allocated run on its left: the end
        its owner said it expects to reach (``start + room``). Placement avoids claimed
        ids while it can, in three passes over a bounded number of candidate runs:

        1. ``spread`` (the pool has room for everyone): the largest runs first; the new
           run takes the head of the largest buddy block in the unclaimed part that
           still leaves ``want`` ids -- a buddy split: the slack before it stays free for
           the left neighbour, the slack after it is ours. Repeated, free space is
           shared out evenly, so runs can outgrow what they claimed (a conversation's
           next turn continues its previous turn's run).
        2. best fit: the smallest run whose unclaimed part holds ``want`` ids; the new
           run packs right after the claim, keeping the rest of the run whole.
        3. claims ignored: the smallest run of length ``>= want``, else ``>= n``.

        Claims cost no capacity: they are only avoided. Returns ``(-1, -1)`` when no
        single run holds ``n`` ids.
        """
        lengths = self._lengths
        runs_by_len = self._runs_by_len
        i = bisect_left(lengths, want)
        if i < len(lengths):
            state = self._state
            claim = self._claim
            # Pass 1 (spread), largest runs first: split the biggest slack past a claim.
            tried = 0
            for length in (lengths[max(i, len(lengths) - _PLACE_CANDIDATES):][::-1]
                           if spread else ()):
                for run_start in runs_by_len[length]:
                    left = run_start - 1
                    owned = run_start > 0 and state[left] == ALLOCATED
                    lo = max(run_start, claim[left]) if owned else run_start
                    end = run_start + length
                    if end - lo >= 2 * want:
                        start = self._split_point(lo, end, want)
                        return start, run_start
                    tried += 1
                    if tried >= _PLACE_CANDIDATES:
                        break
                if tried >= _PLACE_CANDIDATES:
                    break
            # Pass 2, best fit: pack right after a hard claim.
            for candidates in (lengths[i:i + _PLACE_CANDIDATES],
                               lengths[max(i, len(lengths) - _PLACE_CANDIDATES):][::-1]):
                tried = 0
                for length in candidates:
                    for run_start in runs_by_len[length]:
                        left = run_start - 1
                        lo = run_start
                        if run_start and state[left] == ALLOCATED:
                            lo = max(run_start, claim[left])
                        end = run_start + length
                        if end - lo >= want:
                            return lo, run_start
                        tried += 1
                        if tried >= _PLACE_CANDIDATES:
                            break
                    if tried >= _PLACE_CANDIDATES:
                        break
            length = lengths[i]
        else:
            i = bisect_left(lengths, n)
            if i == len(lengths):
                return -1, -1
            length = lengths[i]
            want = n
        run_start = _pick(runs_by_len[length])
        return self._split_point(run_start, run_start + length, want), run_start

    def _split_point(self, lo: int, end: int, want: int) -> int:
        """Start of ``want`` ids inside the free ids ``[lo, end)``: ``lo`` when the space
        is tight (under ``2 * want``), else the head of its largest buddy block that
        leaves ``want`` ids to ``end`` (a buddy split: the ids before it stay free)."""
        if end - lo < 2 * want:
            return lo
        head_order = self._head_order
        last = end - want                       # the latest start that keeps `want` ids
        head = lo if head_order[lo] else self._block_head(lo)
        best, best_order = lo, 0
        while head <= last:
            order = head_order[head]
            if order > best_order and head >= lo:
                best, best_order = head, order
            head += 1 << (order - 1)
        return best

    def _block_head(self, block_id: int) -> int:
        """Head of the free block holding the free id ``block_id``: climb the orders."""
        head_order = self._head_order
        order = 0
        head = block_id
        while head_order[head] != order + 1:
            order += 1
            head = block_id & -(1 << order)
        return head

    def _run_containing(self, block_id: int) -> int:
        """Start of the free run holding the free id ``block_id``: from its block's head,
        step left block by block (each block's last id records its head)."""
        run_end = self._run_end
        tail_head = self._tail_head
        head = self._block_head(block_id)
        while not run_end[head]:
            head = tail_head[head - 1]
        return head

    def _allocate_from_runs(self, n: int) -> list[int]:
        """No single run holds ``n`` ids: take whole runs, largest first, until the
        remainder fits one run, then place the remainder there."""
        ids: list[int] = []
        while True:
            start, run_start = self._place(n, n)
            if start >= 0:
                self._take(start, start + n, run_start, self._run_end[run_start])
                ids.extend(range(start, start + n))
                return ids
            length = self._lengths[-1]
            start = _pick(self._runs_by_len[length])
            self._take(start, start + length, start, start + length)
            ids.extend(range(start, start + length))
            n -= length

    # ------------------------------------------------------------- run bookkeeping

    def _add_run(self, start: int, end: int) -> None:
        length = end - start
        self._run_end[start] = end
        self._run_start[end - 1] = start
        bucket = self._runs_by_len.get(length)
        if bucket is None:
            self._runs_by_len[length] = {start}
            insort(self._lengths, length)
        else:
            bucket.add(start)
        self._run_hist[length.bit_length() - 1] += 1
        self._num_runs += 1

    def _remove_run(self, start: int, end: int) -> None:
        length = end - start
        self._run_end[start] = 0
        bucket = self._runs_by_len[length]
        bucket.discard(start)
        if not bucket:
            del self._runs_by_len[length]
            lengths = self._lengths
            del lengths[bisect_left(lengths, length)]
        self._run_hist[length.bit_length() - 1] -= 1
        self._num_runs -= 1

    # ------------------------------------------------------------- block bookkeeping

    def _add_block(self, head: int, order: int) -> None:
        self._head_order[head] = order + 1
        self._tail_head[head + (1 << order) - 1] = head
        self._free_area[order].add(head)

    def _add_range_blocks(self, start: int, end: int) -> None:
        """Add the maximal aligned blocks of ``[start, end)``; none may merge outward."""
        while start < end:
            order = ((start & -start) if start else 1 << self.max_order).bit_length() - 1
            while start + (1 << order) > end:
                order -= 1
            self._add_block(start, order)
            start += 1 << order

    def _take_blocks(self, start: int, end: int) -> None:
        """Remove ``[start, end)`` (all free) from the free blocks, splitting at both ends."""
        head_order = self._head_order
        areas = self._free_area
        # The block holding `start` may begin before it (a take inside a block).
        head = start if head_order[start] else self._block_head(start)
        order = head_order[head] - 1
        while True:
            size = 1 << order
            head_order[head] = 0
            areas[order].discard(head)
            block_end = head + size
            if head < start:
                self._add_range_blocks(head, start)
            if block_end >= end:
                if block_end > end:
                    self._add_range_blocks(end, block_end)
                return
            head = block_end
            order = head_order[head] - 1

    def _take(self, start: int, end: int, run_start: int, run_end: int) -> None:
        """Mark ``[start, end)`` allocated; it lies inside the free run ``[run_start, run_end)``."""
        self._remove_run(run_start, run_end)
        if run_start < start:
            self._add_run(run_start, start)
        if end < run_end:
            self._add_run(end, run_end)
        self._take_blocks(start, end)
        self._state[start:end] = b"\x01" * (end - start)
        self.num_free -= end - start

    def _give_back_range(self, start: int, end: int) -> None:
        """Mark ``[start, end)`` free; merge runs with neighbours, blocks with buddies."""
        state = self._state
        state[start:end] = bytes(end - start)
        self.num_free += end - start
        # Runs: join the free run ending at start-1 and the one starting at end.
        run_start, run_end = start, end
        if start > 0 and state[start - 1] == FREE:
            run_start = self._run_start[start - 1]
            self._remove_run(run_start, start)
        if end < self.num_blocks and state[end] == FREE:
            run_end = self._run_end[end]
            self._remove_run(end, run_end)
        self._add_run(run_start, run_end)
        # Blocks: the maximal aligned pieces of [start, end), each climbing while its
        # buddy is a free block of the same order (Linux's __free_one_page).
        head_order = self._head_order
        areas = self._free_area
        max_order = self.max_order
        num_blocks = self.num_blocks
        pos = start
        while pos < end:
            order = ((pos & -pos) if pos else 1 << max_order).bit_length() - 1
            while pos + (1 << order) > end:
                order -= 1
            piece_end = pos + (1 << order)
            head = pos
            while order < max_order:
                buddy = head ^ (1 << order)
                if buddy >= num_blocks or head_order[buddy] != order + 1:
                    break
                head_order[buddy] = 0
                areas[order].discard(buddy)
                head &= ~(1 << order)
                order += 1
            self._add_block(head, order)
            pos = piece_end

    @staticmethod
    def _runs_of(ids: Sequence[int]) -> list[tuple[int, int]]:
        """Split ``ids`` into ranges of consecutive ascending ids (C-speed when already one)."""
        if not ids:
            return []
        first = ids[0]
        n = len(ids)
        if ids[-1] - first == n - 1 and list(ids) == list(range(first, first + n)):
            return [(first, first + n)]
        runs = []
        start = prev = first
        for i in ids[1:]:
            if i != prev + 1:
                runs.append((start, prev + 1))
                start = i
            prev = i
        runs.append((start, prev + 1))
        return runs


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


def _pick(candidates: set[int]) -> int:
    """A deterministic member of a non-empty set: the lowest of a few, else the set's own
    choice (``pop``'s finger keeps that amortised O(1) even in a sparse hash table)."""
    if len(candidates) <= 8:
        return min(candidates)
    choice = candidates.pop()
    candidates.add(choice)
    return choice
