"""Which granules of a pool hold live, cached and free ids: the state elastic KV memory places by.

A *granule* is ``granule_blocks`` (``G``) consecutive ids: granule ``g`` is ids
``[g * G, min((g + 1) * G, num_blocks))``, the unit in which KV memory is mapped and given
back (:mod:`proxima.memory`). Every id of a mapped granule is in exactly one state:

* *live*: handed out (vLLM: ``ref_cnt > 0``); the reserved null block counts as live and
  keeps granule 0 from ever being empty;
* *cached*: free but holding prefix-cache content, in the LRU tier (evictable);
* *free*: free without content (the run allocator's FREE ids).

An unmapped granule holds no id in any of these states (its owner keeps its ids out of the
run allocator). :class:`GranuleIndex` keeps per granule the live and cached counts (free
is derived) and two things placement decides by:

* **Lifetimes.** Each live id carries the step at which its owner is expected to finish
  (``end``: now + the tokens the request may still generate; a block shared by several
  requests keeps the latest). A granule becomes empty at ``T[g]``, the latest end of its
  live ids. A new block that ends at ``E`` costs nothing in a granule with ``T[g] >= E``
  and extends any other granule's life by ``E - T[g]`` (an empty granule's by ``E -
  now``). So :meth:`place` picks, among granules holding live ids that have room, the one
  with the smallest ``T[g] >= E``, else the largest ``T[g]``: blocks that die together
  sit together, and granules empty out whole.
* **The eviction window.** Cached ids in LRU order (mirroring the owner's LRU tier, by id)
  each with the step it was cached at. The *window* is the cached ids cached at or before
  ``now - horizon`` (and, when ``max_window`` is set, among the ``max_window`` oldest):
  ids old enough that they are unlikely to be hit again
  (:class:`~proxima.allocator.eviction.ReuseHorizon` learns the horizon from the ages at
  which cached blocks *are* hit). Placement treats window ids as room, like free ids.
  Strict LRU is ``max_window=0``: no early eviction at all. The LRU lists per class and
  the window are :class:`~proxima.allocator.granule_lru.CachedLru`'s, this index's base.

Public state for other planners (issue 14's compaction reads it): :attr:`live`,
:attr:`cached`, :meth:`free_count`, :attr:`mapped`, :attr:`end_of_granule` (``T``),
:meth:`granule_of`, :meth:`ids_of`, :meth:`cached_ids` (LRU order), :meth:`in_window`,
:meth:`state_of`, :meth:`empty_granules`, :meth:`summary`. :meth:`check` verifies every
invariant in O(N + granules) (:mod:`proxima.allocator.granule_check`).

Pure Python, standard library only; the owner (``proxima.vllm.elastic_pool``) calls the
transition methods in the order things happen and picks ids with the queries.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable

from proxima.allocator.granule_check import check_index
from proxima.allocator.granule_lru import CLASSES, FINISHED, PREEMPTED, CachedLru

LIVE, CACHED, FREE, UNMAPPED = "live", "cached", "free", "unmapped"
FOREVER = 1 << 62                     # the end of a reserved id: never
# how GranuleIndex._refile last filed a granule in its emptiness sets
_FILED_NOT_EMPTY, _FILED_VACANT, _FILED_SOME_FREE, _FILED_ALL_CACHED, _UNFILED = range(5)

__all__ = ["CACHED", "CLASSES", "FINISHED", "FOREVER", "FREE", "LIVE", "PREEMPTED",
           "UNMAPPED", "GranuleIndex"]


class GranuleIndex(CachedLru):
    """Per-granule state of a pool of ``num_blocks`` ids (see the module doc).

    Args:
        num_blocks: ids ``0..num_blocks-1``.
        granule_blocks: ids per granule (``G >= 1``).
        reserved: ids that are live forever (vLLM's null block).
        mapped: granules mapped at the start (default: all); the others hold no id.
        max_window: None (window by age only) or the most cached ids in the window.
    """

    def __init__(self, num_blocks: int, granule_blocks: int, reserved: Iterable[int] = (0,),
                 mapped: Iterable[int] | None = None, max_window: int | None = None) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if type(granule_blocks) is not int or granule_blocks < 1:
            raise ValueError(f"granule_blocks must be an integer >= 1, got {granule_blocks!r}")
        G = granule_blocks
        self.num_blocks = num_blocks
        self.granule_blocks = G
        self.num_granules = ng = -(-num_blocks // G)
        self.max_window = max_window
        self.now = 0                              # the owner's clock (steps)
        self.size = [G] * ng
        self.size[-1] = num_blocks - (ng - 1) * G
        self.reserved = frozenset(reserved)
        self.live = [0] * ng
        self.cached = [0] * ng
        self.win = [0] * ng                       # window ids per granule
        self.mapped = bytearray(ng)
        for g in (range(ng) if mapped is None else mapped):
            self.mapped[g] = 1
        self.end = [-1] * num_blocks              # live ids: expected end step; else -1
        self.end_of_granule = [-1] * ng           # T[g]: latest end of its live ids
        for rid in self.reserved:
            g = rid // G
            if not self.mapped[g]:
                raise ValueError(f"reserved id {rid} lies in granule {g}, which must be mapped")
            self.live[g] += 1
            self.end[rid] = FOREVER
            self.end_of_granule[g] = FOREVER
        self.num_live = len(self.reserved)         # sum(live), kept as it changes
        self._init_lru(num_blocks, ng)
        # Placement candidates: mapped granules holding live ids with room (free or window
        # ids), sorted by (T[g], g); _key[g] their entry (None: not a candidate).
        self._cand: list[tuple[int, int]] = []
        self._key: list[tuple[int, int] | None] = [None] * ng
        self._empty: set[int] = set()
        self._vacant: set[int] = set()        # empty, every id free
        self._empty_free: set[int] = set()    # empty, some ids free and some cached
        # how each granule is filed in the three sets above (_FILED_*; _UNFILED: never yet)
        self._filed = bytearray([_UNFILED]) * ng
        for g in range(ng):
            self._refile(g)

    # ------------------------------------------------------------------ queries
    def granule_of(self, block_id: int) -> int:
        return block_id // self.granule_blocks

    def ids_of(self, g: int) -> range:
        G = self.granule_blocks
        return range(g * G, g * G + self.size[g])

    def free_count(self, g: int) -> int:
        """Free ids (no content) of granule ``g``; 0 for an unmapped one."""
        return self.size[g] - self.live[g] - self.cached[g] if self.mapped[g] else 0

    @property
    def num_mapped(self) -> int:
        return self.mapped.count(1)

    @property
    def num_empty(self) -> int:
        """Mapped granules without a live id (what :meth:`empty_granules` lists). O(1)."""
        return len(self._empty)

    def place(self, end: int) -> int | None:
        """The granule for a new live id that ends at ``end`` (see the module doc): among
        mapped granules holding live ids with room, the smallest ``T[g] >= end``, else the
        largest ``T[g]``; None when no such granule has room. O(log granules)."""
        cand = self._cand
        if not cand:
            return None
        i = bisect_left(cand, (end, -1))
        return cand[i][1] if i < len(cand) else cand[-1][1]

    def take_window(self, g: int, n: int, end: int) -> list[int]:
        """Up to ``n`` window ids of granule ``g``, oldest first, handed out: as
        :meth:`window_ids_in` then :meth:`cached_to_live` (same state after, same ids)."""
        ids = self.window_ids_in(g, n)
        if not ids:
            return ids
        if not self.live[g]:
            self.cached_to_live(ids, end)
            return ids
        # Fast path: ``g`` holds live ids before and after, so it stays filed as not empty
        # (the emptiness sets do not change); only its candidate key may, filed once at the
        # end (the candidates are a sorted list: where they are filed from does not
        # matter). The ids are window ids, so none is a class's boundary; without a count
        # bound taking them out of the window lets no other id in (see _unlink).
        nxt, prev, cls, in_win = self._next, self._prev, self._cls, self._in_win
        lists, ng, win_size = self._win_lists, self.num_granules, self._win_size
        bounded = self.max_window is not None
        ends = self.end
        for i in ids:
            c = cls[i]
            in_win[i] = 0
            del lists[c * ng + g][0]        # the ids are the oldest of their class's list
            self.win[g] -= 1
            win_size[c] -= 1
            p, q = prev[i], nxt[i]
            nxt[p] = q
            prev[q] = p
            prev[i] = nxt[i] = -1
            if bounded:
                self._fit_window(c)
            ends[i] = end
        k = len(ids)
        self.cached[g] -= k
        self.num_cached -= k
        live = self.live[g] = self.live[g] + k
        self.num_live += k
        # Before the take ``g`` held live ids and a window id: a placement candidate filed
        # under (T[g], g), and not empty. After it, it still holds live ids (the emptiness
        # sets do not change), and its key changes only if T[g] grew or no room is left (no
        # free id, no window id): _refile runs in exactly those cases.
        if end > self.end_of_granule[g]:
            self.end_of_granule[g] = end
            self._refile(g)
        elif not self.win[g] and live + self.cached[g] == self.size[g]:
            self._refile(g)
        return ids

    def empty_granules(self) -> list[tuple[int, int]]:
        """``(g, cached ids)`` of every mapped granule without a live id, ascending."""
        return sorted((g, self.cached[g]) for g in self._empty)

    def empty_with_free(self) -> int | None:
        """A mapped granule without live ids that has free ids: one holding no cached ids
        if there is one (its cached content stays where it can still be released), else
        one that has some; None if there is none. O(1)."""
        for bucket in (self._vacant, self._empty_free):
            for g in bucket:
                return g
        return None

    def state_of(self, block_id: int, is_free) -> str:
        """LIVE, CACHED, FREE or UNMAPPED for ``block_id``; ``is_free(id)`` is the owner's
        run allocator's query (free ids are not tracked one by one here)."""
        g = block_id // self.granule_blocks
        if not self.mapped[g]:
            return UNMAPPED
        if self._prev[block_id] != -1:
            return CACHED
        return FREE if is_free(block_id) else LIVE

    def summary(self) -> dict:
        """Counts for the status file and metrics (O(granules))."""
        live_ids = self.num_live
        G = self.granule_blocks
        return {
            "granule_blocks": G, "num_granules": self.num_granules,
            "mapped_granules": self.num_mapped, "live_blocks": live_ids - len(self.reserved),
            "cached_blocks": self.num_cached, "window_blocks": self.window_size,
            "live_granules": self.num_granules - self.live.count(0),
            "empty_granules": self.num_empty,
            "empty_free_only_granules": sum(1 for g in self._empty if not self.cached[g]),
            "packed_granules": -(-live_ids // G),
        }

    # ------------------------------------------------------------------ transitions
    # Each moves ids from the state named first to the second; the owner guarantees the
    # states (check() verifies them, the calls do not).

    def free_to_live(self, ids: Iterable[int], end: int) -> None:
        self._to_live(ids, end)

    def cached_to_live(self, ids: Iterable[int], end: int) -> None:
        """A prefix-cache hit, or an eviction that hands the id straight out."""
        ids = list(ids)
        self._unlink(ids)
        self._to_live(ids, end)

    def live_to_free(self, ids: Iterable[int]) -> None:
        self._from_live(ids)

    def live_to_cached(self, ids: Iterable[int], cls: int = FINISHED) -> None:
        """Freed with content: the most recently used end of the LRU order, in order;
        ``cls`` says why (FINISHED or PREEMPTED)."""
        ids = list(ids)
        self._from_live(ids)
        self._append(ids, cls)

    def cached_to_free(self, ids: Iterable[int]) -> None:
        """Content dropped, the id stays free (prefix-cache reset, release of a granule)."""
        self._unlink(ids)

    def set_end(self, ids: Iterable[int], end: int) -> None:
        """Live ``ids`` are now expected to live until ``end`` at least (ids that are no
        longer live are skipped)."""
        G, ends, T = self.granule_blocks, self.end, self.end_of_granule
        touched = set()
        for i in ids:
            if 0 <= ends[i] < end:
                ends[i] = end
                g = i // G
                if end > T[g]:
                    T[g] = end
                    touched.add(g)
        for g in touched:
            self._refile(g)

    def move(self, moves: dict[int, int]) -> None:
        """KV compaction moved contents, all at once: ``moves`` maps each id that held a
        content (live or cached) to the id that holds it now; a destination is a free id or
        another source (a permutation). A live id's expected end and a cached id's place in
        the LRU order, class, age and window membership go with its content. O(moves)."""
        if not moves:
            return
        G, nxt, prev, ng = self.granule_blocks, self._next, self._prev, self.num_granules
        ends = self.end
        cached = {x: y for x, y in moves.items() if prev[x] != -1}
        live = {x: y for x, y in moves.items() if x not in cached}
        for x in live:
            if ends[x] < 0:
                raise ValueError(f"move: id {x} holds no content")
        for y in moves.values():
            if y not in moves and (prev[y] != -1 or ends[y] >= 0):
                raise ValueError(f"move: destination {y} is not free")
        # cached: each destination takes its source's links (through the map: a neighbour
        # that moves too is found at its destination), stamp, order, class and window
        def where(i: int) -> int:
            return cached.get(i, i)

        saved = [(y, where(prev[x]), where(nxt[x]), self._stamp[x], self._seq[x],
                  self._cls[x], self._in_win[x]) for x, y in cached.items()]
        touched = set()
        for x in cached:
            if self._in_win[x]:
                g = x // G
                self._in_win[x] = 0
                self._win_lists[self._cls[x] * ng + g].remove(x)
                self.win[g] -= 1
            prev[x] = nxt[x] = -1
            self.cached[x // G] -= 1
            touched.add(x // G)
        for c in range(CLASSES):
            self._boundary[c] = where(self._boundary[c])
        for y, p, q, stamp, seq, cls, in_win in saved:
            prev[y], nxt[y] = p, q
            nxt[p] = y
            prev[q] = y
            self._stamp[y], self._seq[y], self._cls[y] = stamp, seq, cls
            g = y // G
            self.cached[g] += 1
            if in_win:
                self._in_win[y] = 1
                insort(self._win_lists[cls * ng + g], y, key=self._seq.__getitem__)
                self.win[g] += 1
            touched.add(g)
        # live: off their ids, then onto the destinations with the same expected ends
        by_end: dict[int, list[int]] = {}
        for x, y in live.items():
            by_end.setdefault(ends[x], []).append(y)
        self._from_live(live)
        for end, ys in by_end.items():
            self._to_live(ys, end)
        for g in touched:
            self._refile(g)

    def unmap(self, g: int) -> None:
        """Granule ``g`` (no live or cached id) stops holding ids."""
        if not self.mapped[g] or self.live[g] or self.cached[g]:
            raise ValueError(f"granule {g} cannot be unmapped: mapped={self.mapped[g]}, "
                             f"live={self.live[g]}, cached={self.cached[g]}")
        self.mapped[g] = 0
        self._refile(g)

    def map(self, g: int) -> None:
        """Granule ``g`` is backed again: all its ids are free."""
        if self.mapped[g]:
            raise ValueError(f"granule {g} is already mapped")
        self.mapped[g] = 1
        self._refile(g)

    # ------------------------------------------------------------------ internals
    def _to_live(self, ids: Iterable[int], end: int) -> None:
        G, live, ends, T = self.granule_blocks, self.live, self.end, self.end_of_granule
        touched = set()
        n = 0
        for i in ids:
            g = i // G
            live[g] += 1
            n += 1
            ends[i] = end
            if end > T[g]:
                T[g] = end
            touched.add(g)
        self.num_live += n
        for g in touched:
            self._refile(g)

    def _from_live(self, ids: Iterable[int]) -> None:
        G, live, ends, T = self.granule_blocks, self.live, self.end, self.end_of_granule
        touched = set()
        stale = set()
        n = 0
        for i in ids:
            g = i // G
            live[g] -= 1
            n += 1
            if ends[i] >= T[g]:
                stale.add(g)
            ends[i] = -1
            touched.add(g)
        self.num_live -= n
        for g in stale:
            lo = g * G
            T[g] = max(ends[lo:lo + self.size[g]]) if live[g] else -1
        for g in touched:
            self._refile(g)

    def _refile(self, g: int) -> None:
        """File granule ``g`` as a placement candidate (or not), and as empty (or not)."""
        live = self.live[g]
        mapped = self.mapped[g]
        size = self.size[g]
        cached = self.cached[g]
        old = self._key[g]
        if mapped and 0 < live < size and (size - live - cached > 0 or self.win[g]):
            T = self.end_of_granule[g]
            if old is None or old[0] != T:
                key = (T, g)
                cand = self._cand
                if old is not None:
                    del cand[bisect_left(cand, old)]
                insort(cand, key)
                self._key[g] = key
        elif old is not None:
            cand = self._cand
            del cand[bisect_left(cand, old)]
            self._key[g] = None
        # The emptiness sets change only when the granule's filing changes. This early out
        # is what keeps a refile cheap, and it keeps the sets' history exactly as it was
        # when every refile added and discarded: adding a present member or discarding an
        # absent one leaves a set untouched, so the sets see the same effective changes in
        # the same order (empty_with_free returns the first member a set iterates, and that
        # depends on the set's history).
        if mapped and live == 0:
            filed = _FILED_VACANT if cached == 0 else (
                _FILED_SOME_FREE if cached < size else _FILED_ALL_CACHED)
        else:
            filed = _FILED_NOT_EMPTY
        if filed == self._filed[g]:
            return
        self._filed[g] = filed
        if filed != _FILED_NOT_EMPTY:
            self._empty.add(g)
            if filed == _FILED_VACANT:
                self._vacant.add(g)
                self._empty_free.discard(g)
            else:
                self._vacant.discard(g)
                if filed == _FILED_SOME_FREE:
                    self._empty_free.add(g)
                else:
                    self._empty_free.discard(g)
        else:
            self._empty.discard(g)
            self._vacant.discard(g)
            self._empty_free.discard(g)

    # ------------------------------------------------------------------ checking
    def check(self, live_ids: Iterable[int] | None = None,
              cached_order: Iterable[int] | None = None) -> None:
        """Verify the invariants; with ``live_ids`` / ``cached_order`` (the owner's truth:
        the ids handed out, the LRU tier oldest first) also that the counts agree with
        them. Raises :class:`~proxima.allocator.errors.InvariantError`
        (:func:`~proxima.allocator.granule_check.check_index`)."""
        check_index(self, live_ids, cached_order)
