"""Which granules of a pool hold live, cached and free ids: the state elastic KV memory places by.

A *granule* is ``granule_blocks`` (``G``) consecutive ids: granule ``g`` is ids
``[g * G, min((g + 1) * G, num_blocks))``, the unit in which KV memory is mapped and given
back (:mod:`proxima.memory`). Every id of a mapped granule is in exactly one state:

* *live*: handed out (vLLM: ``ref_cnt > 0``); the reserved null block counts as live and
  keeps granule 0 from ever being empty;
* *cached*: free but holding prefix-cache content, in the LRU tier (evictable);
* *free*: free without content (the buddy allocator's FREE ids).

An unmapped granule holds no id in any of these states (its owner keeps its ids out of the
buddy allocator). :class:`GranuleIndex` keeps per granule the live and cached counts (free
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
  ids old enough that they are unlikely to be hit again (:class:`ReuseHorizon` learns the
  horizon from the ages at which cached blocks *are* hit). Placement treats window ids as
  room, like free ids. Strict LRU is ``max_window=0``: no early eviction at all.

Public state for other planners (issue 14's compaction reads it): :attr:`live`,
:attr:`cached`, :meth:`free_count`, :attr:`mapped`, :attr:`end_of_granule` (``T``),
:meth:`granule_of`, :meth:`ids_of`, :meth:`cached_ids` (LRU order), :meth:`in_window`,
:meth:`state_of`, :meth:`empty_granules`, :meth:`summary`. :meth:`check` verifies every
invariant in O(N + granules).

Pure Python, standard library only; the owner (``proxima.engines.elastic_pool``) calls the
transition methods in the order things happen and picks ids with the queries.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from dataclasses import dataclass
from heapq import merge
from itertools import islice
from typing import Iterable, Iterator

from proxima.allocator.errors import InvariantError

LIVE, CACHED, FREE, UNMAPPED = "live", "cached", "free", "unmapped"
FOREVER = 1 << 62                     # the end of a reserved id: never
FINISHED, PREEMPTED = 0, 1            # why a cached block was freed (its reuse differs)
CLASSES = 2                           # (window_ids_in merges exactly two)
# how GranuleIndex._refile last filed a granule in its emptiness sets
_FILED_NOT_EMPTY, _FILED_VACANT, _FILED_SOME_FREE, _FILED_ALL_CACHED, _UNFILED = range(5)


@dataclass(frozen=True)
class EvictionPolicy:
    """How far eviction may depart from LRU so that live blocks stay packed.

    A cached block may be evicted out of LRU order (taken for a new block while free ids
    remain elsewhere) only once it is older than the *reuse horizon*: ``horizon`` steps,
    or, with ``horizon=None`` ("auto"), the ``quantile`` of the ages at which cached
    blocks were hit again (:class:`ReuseHorizon`), so that about ``1 - quantile`` of the
    reuse stock would see is put at risk. ``max_window`` bounds the departure by count
    too: only the ``max_window`` least recently used cached blocks (None: no bound by
    count; 0: strict LRU -- cached blocks are evicted only when no free id is left,
    oldest first, exactly as stock vLLM).
    """

    horizon: int | None = None
    quantile: float = 0.99
    max_window: int | None = None
    min_horizon: int = 0

    def __post_init__(self) -> None:
        if self.horizon is not None and (type(self.horizon) is not int or self.horizon < 0):
            raise ValueError(f"eviction horizon must be None (auto) or an integer >= 0 "
                             f"steps, got {self.horizon!r}")
        if not isinstance(self.quantile, (int, float)) or not 0.5 <= self.quantile <= 1.0:
            raise ValueError(f"eviction quantile must lie in [0.5, 1], got {self.quantile!r}")
        if self.max_window is not None and (type(self.max_window) is not int
                                            or self.max_window < 0):
            raise ValueError(f"max_window must be None or an integer >= 0, got "
                             f"{self.max_window!r}")
        if type(self.min_horizon) is not int or self.min_horizon < 0:
            raise ValueError(f"min_horizon must be an integer >= 0, got {self.min_horizon!r}")

    @property
    def strict(self) -> bool:
        return self.max_window == 0

    @classmethod
    def parse(cls, text: str) -> "EvictionPolicy":
        """``lru`` (strict), ``auto`` (the default: learnt horizon), ``auto:Q`` (learnt,
        quantile Q), ``age:N`` (fixed horizon of N steps), ``window:W`` (the W oldest,
        any age). ValueError naming the value otherwise."""
        value = str(text).strip().lower()
        kind, _, arg = value.partition(":")
        try:
            if kind in ("lru", "strict") and not arg:
                return cls(max_window=0)
            if kind == "auto":
                return cls(quantile=float(arg)) if arg else cls()
            if kind == "age" and arg:
                return cls(horizon=int(arg))
            if kind == "window" and arg:
                return cls(horizon=0, max_window=int(arg))
        except ValueError as exc:
            if "eviction" in str(exc) or "max_window" in str(exc):
                raise ValueError(f"eviction policy {text!r}: {exc}") from None
        raise ValueError(f"eviction policy {text!r}: give lru, auto, auto:Q (0.5 <= Q <= 1), "
                         f"age:N (steps) or window:W (blocks)")

    def __str__(self) -> str:
        if self.strict:
            return "lru"
        if self.horizon is None:
            base = "auto" if self.quantile == 0.99 else f"auto:{self.quantile:g}"
        elif self.horizon == 0 and self.max_window is not None:
            return f"window:{self.max_window}"
        else:
            base = f"age:{self.horizon}"
        return base if self.max_window is None else f"{base},max_window={self.max_window}"


class ReuseHorizon:
    """The reuse horizon of an ``auto`` :class:`EvictionPolicy`, in steps.

    Reuse ages are the steps between a block being cached and being hit again; a lookup
    that misses a block evicted early (a *ghost*: it would have been a hit had it been
    kept) counts as a reuse at the age it has then. The horizon is ``margin`` times the
    ``quantile`` of the last ``samples`` reuse ages, plus one. Ages are censored (a block
    not hit *yet* may be hit later), so until the pool has been watched for ``warmup``
    steps the horizon is at least the time watched: nothing is evicted early before there
    was time to see it reused. With no reuse seen after that, the horizon is
    ``min_horizon``: nothing cached is worth keeping out of LRU order. A pool that went
    idle starts a new period (:meth:`restart`): the warm-up applies again, since the reuse
    of one burst says little about the next one's (a burst over twice the contexts comes
    back to each twice as late).
    """

    def __init__(self, quantile: float = 0.99, samples: int = 4096, min_horizon: int = 0,
                 ghosts: int = 65536, warmup: int = 256, margin: float = 1.25) -> None:
        self.quantile = quantile
        self.min_horizon = min_horizon
        self.warmup = warmup
        self.margin = margin
        self._ages: deque[int] = deque(maxlen=samples)
        self._ghosts: OrderedDict = OrderedDict()           # key -> step it was cached at
        self._max_ghosts = ghosts
        self._sorted: list[int] | None = []
        self._since: int | None = None                       # first step anything was cached
        self.hits = 0
        self.ghost_hits = 0

    def watching(self, step: int) -> None:
        """Something was cached at ``step`` (the first call starts the warm-up)."""
        if self._since is None:
            self._since = step

    def restart(self, step: int) -> None:
        """A new busy period starts at ``step`` (the pool was idle: no live block): the
        reuse seen before need not be this load's, so the warm-up floor applies again from
        here (the ages seen stay samples). Before anything was cached it changes nothing:
        the first warm-up starts with the first cached block (:meth:`watching`)."""
        if self._since is not None:
            self._since = step

    def on_hit(self, age: int) -> None:
        self._ages.append(age)
        self._sorted = None
        self.hits += 1

    def on_early_eviction(self, key, cached_at: int) -> None:
        """A block holding ``key`` (its prefix-cache hash) was evicted out of LRU order."""
        ghosts = self._ghosts
        ghosts[key] = cached_at
        ghosts.move_to_end(key)
        if len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def on_miss(self, key, now: int) -> bool:
        """A lookup missed ``key``; True (and counted as a reuse) when it was a ghost."""
        cached_at = self._ghosts.pop(key, None)
        if cached_at is None:
            return False
        self.ghost_hits += 1
        self.on_hit(now - cached_at)
        return True

    def horizon(self, now: int) -> int:
        watched = 0 if self._since is None else now - self._since
        floor = min(watched, self.warmup) if watched < self.warmup else 0
        if not self._ages:
            return max(self.min_horizon, floor)
        if self._sorted is None:
            self._sorted = sorted(self._ages)
        ages = self._sorted
        k = min(len(ages) - 1, max(0, math.ceil(self.quantile * len(ages)) - 1))
        return max(self.min_horizon, floor, int(self.margin * ages[k]) + 1)


class GranuleIndex:
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

    def place(self, end: int) -> int | None:
        """The granule for a new live id that ends at ``end`` (see the module doc): among
        mapped granules holding live ids with room, the smallest ``T[g] >= end``, else the
        largest ``T[g]``; None when no such granule has room. O(log granules)."""
        cand = self._cand
        if not cand:
            return None
        i = bisect_left(cand, (end, -1))
        return cand[i][1] if i < len(cand) else cand[-1][1]

    def window_ids_in(self, g: int, n: int) -> list[int]:
        """Up to ``n`` window ids of granule ``g``, oldest first."""
        lists = self._win_lists
        done, again = lists[g], lists[self.num_granules + g]    # FINISHED, PREEMPTED
        if not again:
            return done[:n]
        if not done:
            return again[:n]
        return list(islice(merge(done, again, key=self._seq.__getitem__), n))

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
        buddy query (free ids are not tracked one by one here)."""
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

    # ------------------------------------------------------------------ checking
    def check(self, live_ids: Iterable[int] | None = None,
              cached_order: Iterable[int] | None = None) -> None:
        """Verify the invariants; with ``live_ids`` / ``cached_order`` (the owner's truth:
        the ids handed out, the LRU tier oldest first) also that the counts agree with
        them. Raises :class:`InvariantError`."""
        G, ng = self.granule_blocks, self.num_granules
        order = list(self.cached_ids())
        if len(order) != self.num_cached or len(set(order)) != len(order):
            raise InvariantError(f"the cached list holds {len(order)} ids ({len(set(order))} "
                                 f"distinct), num_cached is {self.num_cached}")
        if cached_order is not None and list(cached_order) != order:
            raise InvariantError("the cached ids are not in the owner's LRU order")
        cached = [0] * ng
        for i in order:
            cached[i // G] += 1
        if cached != self.cached:
            g = next(g for g in range(ng) if cached[g] != self.cached[g])
            raise InvariantError(f"granule {g}: {self.cached[g]} cached ids counted, "
                                 f"{cached[g]} in the list")
        window = []
        for c in range(CLASSES):
            ids = list(self._class_ids(c))
            if any(self._cls[i] != c for i in ids):
                raise InvariantError(f"an id in the list of class {c} is of another class")
            if [self._stamp[i] for i in ids] != sorted(self._stamp[i] for i in ids) or \
                    [self._seq[i] for i in ids] != sorted(self._seq[i] for i in ids):
                raise InvariantError(f"class {c}: cached ids not in the order they came")
            cap = len(ids) if self.max_window is None else self.max_window
            w = []
            for i in ids[:cap]:
                if self._stamp[i] > self._threshold[c]:
                    break
                w.append(i)
            if [i for i in ids if self._in_win[i]] != w or self._win_size[c] != len(w):
                raise InvariantError(f"class {c}: the window is not its oldest cached ids "
                                     f"old enough")
            rest = ids[len(w):]
            tail = self.num_blocks + 2 * c + 1
            if self._boundary[c] != (rest[0] if rest else tail):
                raise InvariantError(f"class {c}: window boundary at {self._boundary[c]}, "
                                     f"expected {rest[0] if rest else 'the end'}")
            window += w
        win = [0] * ng
        for i in window:
            win[i // G] += 1
        if win != self.win:
            raise InvariantError("per-granule window counts are wrong")
        lists = [[] for _ in range(CLASSES * ng)]
        for i in window:                   # each class's window ids in LRU order
            lists[self._cls[i] * ng + i // G].append(i)
        if lists != self._win_lists:
            raise InvariantError("the per-granule window lists are not the window ids of "
                                 "their class and granule, oldest first")
        if live_ids is not None:
            live = [0] * ng
            for i in (*live_ids, *self.reserved):
                live[i // G] += 1
                if self.end[i] < 0:
                    raise InvariantError(f"live id {i} has no expected end")
            if live != self.live:
                g = next(g for g in range(ng) if live[g] != self.live[g])
                raise InvariantError(f"granule {g}: {self.live[g]} live ids counted, "
                                     f"{live[g]} handed out")
        for g in range(ng):
            if not self.mapped[g] and (self.live[g] or self.cached[g]):
                raise InvariantError(f"unmapped granule {g} holds live or cached ids")
            if self.live[g] + self.cached[g] > self.size[g]:
                raise InvariantError(f"granule {g} holds more ids than it has")
            span = self.end[g * G:g * G + self.size[g]]
            if sum(1 for e in span if e >= 0) != self.live[g]:
                raise InvariantError(f"granule {g}: ends recorded for other than its live ids")
            if self.end_of_granule[g] != (max(span) if self.live[g] else -1):
                raise InvariantError(f"granule {g}: T is {self.end_of_granule[g]}, its live "
                                     f"ids end at {max(span)}")
            want = (self.end_of_granule[g], g) if (
                self.mapped[g] and 0 < self.live[g] < self.size[g]
                and (self.free_count(g) > 0 or self.win[g])) else None
            if self._key[g] != want:
                raise InvariantError(f"granule {g} is filed as {self._key[g]}, expected {want}")
            empty = bool(self.mapped[g] and not self.live[g])
            if (g in self._empty) != empty or (g in self._vacant) != (
                    empty and not self.cached[g]) or (g in self._empty_free) != (
                    empty and 0 < self.cached[g] < self.size[g]):
                raise InvariantError(f"granule {g}'s emptiness is recorded wrongly")
        if self._cand != sorted(k for k in self._key if k is not None):
            raise InvariantError("the placement candidates are not the filed granules, sorted")
        if self.num_live != sum(self.live):
            raise InvariantError(f"num_live is {self.num_live}, the granules hold "
                                 f"{sum(self.live)} live ids")
