"""The cached ids of a granule index in LRU order, and its eviction window.

Cached ids (free, holding prefix-cache content) are kept in least-recently-used order,
one doubly linked list per *class* of origin (FINISHED: freed when its request ended;
PREEMPTED: freed by a preemption, to be computed again), each id with the step it was
cached at. The owner's single LRU tier is the merge of the classes by arrival. The
*window* of a class is its cached ids cached at or before ``now - horizon`` (the
horizons come from :mod:`proxima.allocator.eviction` at every :meth:`CachedLru.tick`;
with ``max_window``, only among that many oldest): ids old enough to be evicted out of
LRU order, which placement treats as room.

:class:`CachedLru` is a part of :class:`~proxima.allocator.granules.GranuleIndex` (its
base class): it keeps the lists and the window, and counts a granule's cached and window
ids in the index's ``cached`` and ``win``; when a granule's window count changes it asks
the index to refile the granule (``_refile``), whose order of calls placement depends on.
Pure Python, standard library only.
"""

from __future__ import annotations

from heapq import merge
from itertools import islice
from typing import Iterable, Iterator

FINISHED, PREEMPTED = 0, 1            # why a cached block was freed (its reuse differs)
CLASSES = 2                           # (window_ids_in merges exactly two)


class CachedLru:
    """The LRU lists per class and the eviction window of a granule index (module doc).

    Reads the index's ``num_blocks``, ``granule_blocks``, ``num_granules``,
    ``max_window``, ``now``, ``cached`` and ``win``; calls its ``_refile(g)``."""

    def _init_lru(self, num_blocks: int, ng: int) -> None:
        """The empty lists and window (called by the index's ``__init__``)."""
        # Cached ids in LRU order, one doubly linked list per *class* of origin (FINISHED:
        # freed when its request ended; PREEMPTED: freed by a preemption, to be computed
        # again), over ids with sentinels HEAD/TAIL of class c at N + 2c, N + 2c + 1. The
        # owner's single LRU tier is their merge by arrival (_seq).
        self._next = [-1] * (num_blocks + 2 * CLASSES)
        self._prev = [-1] * (num_blocks + 2 * CLASSES)
        for c in range(CLASSES):
            head, tail = num_blocks + 2 * c, num_blocks + 2 * c + 1
            self._next[head] = tail
            self._prev[tail] = head
        self._stamp = [0] * num_blocks            # the step an id was cached at
        self._seq = [0] * num_blocks              # the order ids were cached in
        self._clock = 0
        self._cls = bytearray(num_blocks)
        self._in_win = bytearray(num_blocks)
        # window ids of class c in granule g, oldest first, at _win_lists[c * ng + g]: ids
        # enter a class's window in LRU order and leave it from the young end (a longer
        # horizon) or anywhere (a hit), so each list stays in LRU order by appending
        self._win_lists: list[list[int]] = [[] for _ in range(CLASSES * ng)]
        self._win_size = [0] * CLASSES
        # per class: the oldest cached id outside the window, the window's threshold
        self._boundary = [num_blocks + 2 * c + 1 for c in range(CLASSES)]
        self._threshold = [-1] * CLASSES
        self.num_cached = 0

    # ------------------------------------------------------------------ queries
    @property
    def window_size(self) -> int:
        return sum(self._win_size)

    def in_window(self, block_id: int) -> bool:
        return bool(self._in_win[block_id])

    def _class_ids(self, c: int) -> Iterator[int]:
        nxt, n = self._next, self.num_blocks
        i, tail = nxt[n + 2 * c], n + 2 * c + 1
        while i != tail:
            yield i
            i = nxt[i]

    def cached_ids(self) -> Iterator[int]:
        """The cached ids, least recently used first (all classes, by arrival)."""
        seq = self._seq
        return iter(sorted((i for c in range(CLASSES) for i in self._class_ids(c)),
                           key=seq.__getitem__))

    def oldest_cached(self, k: int) -> list[int]:
        """The ``k`` least recently used cached ids (fewer if there are fewer)."""
        nxt, seq, n = self._next, self._seq, self.num_blocks
        heads = [nxt[n + 2 * c] for c in range(CLASSES)]
        tails = [n + 2 * c + 1 for c in range(CLASSES)]
        out = []
        while len(out) < k:
            best = -1
            for c in range(CLASSES):
                i = heads[c]
                if i != tails[c] and (best < 0 or seq[i] < seq[heads[best]]):
                    best = c
            if best < 0:
                break
            out.append(heads[best])
            heads[best] = nxt[heads[best]]
        return out

    def class_of(self, block_id: int) -> int:
        """FINISHED or PREEMPTED: why the cached ``block_id`` was freed."""
        return self._cls[block_id]

    def cached_at(self, block_id: int) -> int:
        return self._stamp[block_id]

    def window_ids_in(self, g: int, n: int) -> list[int]:
        """Up to ``n`` window ids of granule ``g``, oldest first."""
        lists = self._win_lists
        done, again = lists[g], lists[self.num_granules + g]    # FINISHED, PREEMPTED
        if not again:
            return done[:n]
        if not done:
            return again[:n]
        return list(islice(merge(done, again, key=self._seq.__getitem__), n))


    # ------------------------------------------------------------------ changes
    def tick(self, now: int, horizons) -> None:
        """The owner's clock reads ``now``; the window of class ``c`` becomes its cached ids
        cached at or before ``now - horizons[c]`` (None: none), each class within
        ``max_window`` of its oldest."""
        self.now = now
        for c in range(CLASSES):
            h = horizons[c]
            self._threshold[c] = -1 if h is None else now - h
            self._fit_window(c)

    def _fit_window(self, c: int) -> None:
        threshold = self._threshold[c]
        cap = self.num_blocks if self.max_window is None else self.max_window
        stamp, prev, nxt = self._stamp, self._prev, self._next
        tail = self.num_blocks + 2 * c + 1
        b = self._boundary[c]
        while self._win_size[c] and (self._win_size[c] > cap or stamp[prev[b]] > threshold):
            b = prev[b]
            self._leave_window(b)
        if b == tail or self._win_size[c] >= cap or stamp[b] > threshold:
            self._boundary[c] = b         # nothing enters (most ticks)
            return
        # Entering (inline _enter_window): a granule is refiled at its first id only. Its
        # filing cannot change after that within this loop: entering changes only window
        # counts, and its candidate key depends on them only through "win > 0", true from
        # its first id on. (Its first refile may still move it between the emptiness sets
        # -- a caller's pending change -- at the same point as before.)
        G, win, in_win, win_size = self.granule_blocks, self.win, self._in_win, self._win_size
        lists, base = self._win_lists, c * self.num_granules
        seen: set[int] = set()
        while b != tail and win_size[c] < cap and stamp[b] <= threshold:
            g = b // G
            in_win[b] = 1
            lists[base + g].append(b)
            win[g] += 1
            win_size[c] += 1
            if g not in seen:
                seen.add(g)
                self._refile(g)
            b = nxt[b]
        self._boundary[c] = b

    def _append(self, ids: list[int], cls: int) -> None:
        nxt, prev, G = self._next, self._prev, self.granule_blocks
        tail = self.num_blocks + 2 * cls + 1
        last = prev[tail]
        stamp, seq, now = self._stamp, self._seq, self.now
        kind = self._cls
        clock = self._clock
        cached = self.cached
        # Every cached id of the class in the window, and a window that takes ids as young
        # as now (horizon 0): all of ``ids`` enter it here, in the append's own pass. The
        # general path (append, then _fit_window enters them in order and refiles each
        # granule at its first id, after which the refiles of the touched granules change
        # nothing) leaves the same state after the same refiles in the same order.
        enter = (self._boundary[cls] == tail and now <= self._threshold[cls]
                 and self.max_window is None)
        win, in_win = self.win, self._in_win
        lists, base = self._win_lists, cls * self.num_granules
        granules = []
        for i in ids:
            clock += 1
            seq[i] = clock
            stamp[i] = now
            kind[i] = cls
            prev[i] = last
            nxt[last] = i
            last = i
            g = i // G
            cached[g] += 1
            granules.append(g)
            if enter:
                in_win[i] = 1
                lists[base + g].append(i)
                win[g] += 1
        nxt[last] = tail
        prev[tail] = last
        self._clock = clock
        self.num_cached += len(ids)
        if enter:
            self._win_size[cls] += len(ids)
            for g in dict.fromkeys(granules):        # in order of first id
                self._refile(g)
            return
        if self._boundary[cls] == tail:
            self._boundary[cls] = ids[0]
            self._fit_window(cls)
        for g in set(granules):      # (a set built as before: the same order of refiles)
            self._refile(g)

    def _unlink(self, ids: Iterable[int]) -> None:
        nxt, prev, G = self._next, self._prev, self.granule_blocks
        touched = set()
        count = 0
        bounded = self.max_window is not None
        for i in ids:
            c = self._cls[i]
            was_in = self._in_win[i]
            if was_in:
                self._leave_window(i)
            elif self._boundary[c] == i:
                self._boundary[c] = nxt[i]
            p, q = prev[i], nxt[i]
            nxt[p] = q
            prev[q] = p
            prev[i] = nxt[i] = -1
            if was_in and bounded:
                # the next oldest may enter the window. Only a count bound can let one in:
                # the window was fitted (its ids are the oldest cached at or before the
                # threshold, the boundary the first that is not), and taking a window id out
                # leaves that so, so by age alone nothing enters or leaves.
                self._fit_window(c)
            g = i // G
            self.cached[g] -= 1
            touched.add(g)
            count += 1
        self.num_cached -= count
        for g in touched:
            self._refile(g)

    def _leave_window(self, i: int) -> None:
        g = i // self.granule_blocks
        self._in_win[i] = 0
        self._win_lists[self._cls[i] * self.num_granules + g].remove(i)
        self.win[g] -= 1
        self._win_size[self._cls[i]] -= 1
        self._refile(g)
