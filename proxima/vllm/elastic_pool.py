"""Proxima's free queue in elastic mode: mapped capacity only, live blocks packed by granule.

:class:`GranuleFreeQueue` is :class:`~proxima.vllm.free_queue.ProximaFreeQueue` (same
methods, same two tiers, same vLLM code around it) plus a
:class:`~proxima.allocator.granules.GranuleIndex`:

* **Mapped capacity.** The ids of a granule that is not mapped (or whose map is not
  confirmed yet) are taken out of the buddy allocator, so they are neither handed out nor
  counted: ``num_free_blocks`` -- what vLLM's scheduler admits against -- is the free and
  cached blocks of mapped granules. No admission is made that memory cannot back.
* **Placement** (:meth:`GranuleFreeQueue.popleft_n`), in this order: the free ids of the
  request's own granule (growth in place first); then, repeatedly, the granule with the
  most live blocks that has room -- its free ids, else its cached blocks that lie in the
  eviction window (the ``window`` least recently used; :class:`~proxima.allocator.
  granules.EvictionPolicy`); then free ids anywhere (in granules holding no live block);
  then, as stock, the least recently used cached blocks. Within mapped capacity it never
  refuses while enough blocks are free, and with ``window=0`` the cached blocks it evicts
  are exactly stock's (strict LRU).
* **Release and regrowth** (:meth:`release`, :meth:`on_mapped`): a granule without live
  blocks is released by evicting its cached blocks (counted: ``released_cached``, as stock
  would evict them when reusing the memory) and taking its ids; a confirmed map gives the
  ids back.

Without elastic mode the pool keeps :class:`ProximaFreeQueue`; nothing here runs.
"""

from __future__ import annotations

from typing import Callable, Iterable

from proxima.allocator.eviction import EvictionPolicy, ReuseHorizon
from proxima.allocator.hint import continued
from proxima.allocator.granules import CLASSES, FINISHED, GranuleIndex
from proxima.vllm.free_queue import ProximaFreeQueue, _clock


class GranuleFreeQueue(ProximaFreeQueue):
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue`` over granules (see the module doc).

    Args:
        blocks: vLLM's ``KVCacheBlock`` list (all free, as a fresh pool's).
        reserved: the null block's id.
        granule_blocks: block ids per granule.
        eviction: how far eviction may depart from LRU.
        mapped: granules mapped at the start (default: all); granule 0 always.
        evict: ``fn(block)`` dropping a block's prefix-cache hashes (vLLM's
            ``BlockPool._maybe_evict_cached_block``), for the blocks a release evicts;
            None leaves hashes alone.

    The owner sets ``hint`` before each allocation (its ``end``: the step the request
    being served is expected to finish at; a pop without a hint places as the last hinted
    one did) and calls :meth:`tick` once per scheduler step.
    """

    classes_preempted = True        # the manager's free wrapper marks a preemption's blocks

    def __init__(self, blocks: list, reserved: tuple[int, ...] = (0,), *, granule_blocks: int,
                 eviction: EvictionPolicy = EvictionPolicy(), mapped: int | None = None,
                 evict: Callable[[object], object] | None = None) -> None:
        super().__init__(blocks, reserved)
        n = len(blocks)
        granules = -(-n // granule_blocks)
        mapped = granules if mapped is None else max(1, min(mapped, granules))
        self.granules = GranuleIndex(n, granule_blocks, reserved, mapped=range(mapped),
                                     max_window=eviction.max_window)
        self.eviction = eviction
        # one horizon per class of cached block: freed when its request finished, or by a
        # preemption (computed again soon: its reuse is of another kind)
        self.reuse = [ReuseHorizon(eviction.quantile, min_horizon=eviction.min_horizon)
                      for _ in range(CLASSES)]
        self.free_class = FINISHED      # set by the free wrapper around a preemption
        self.evict = evict
        self.last_end = 0               # the end of the last hint (for pops without one)
        self.now = 0
        self.allocated_total = 0        # blocks handed out since the start (popleft_n)
        self.early_evictions = 0        # cached blocks taken out of LRU order (the window)
        self.released_cached = 0        # cached blocks evicted because their granule went
        self._revived: list[int] = []   # prefix hits whose owner's end is not known yet
        self._idle = False              # the last tick saw no live block (a new period next)
        self.busy_periods = 0           # ticks that found live blocks after an idle one
        buddy = self.buddy
        for g in range(mapped, granules):
            ids = self.granules.ids_of(g)
            buddy.take_range(ids.start, ids.stop)
        self.num_free_blocks = buddy.num_free
        self.tick(0)

    @property
    def horizons(self) -> tuple:
        """Per class of cached block (finished, preempted): the steps it must have aged
        before it may be evicted out of LRU order (None: never, strict LRU)."""
        policy = self.eviction
        if policy.strict:
            return (None,) * CLASSES
        if policy.horizon is not None:
            return (policy.horizon,) * CLASSES
        now = self.now
        return tuple([r.horizon(now) for r in self.reuse])

    def tick(self, step: int) -> None:
        """A scheduler step starts: the window follows the clock and the horizons. The first
        step with live blocks after a step without any starts a new busy period: each
        horizon's warm-up begins again (:meth:`ReuseHorizon.restart`)."""
        self.now = step
        if not self.live_blocks():
            self._idle = True
        elif self._idle:
            self._idle = False
            self.busy_periods += 1
            for r in self.reuse:
                r.restart(step)
        self.granules.tick(step, self.horizons)

    # ------------------------------------------------------------------ handing out
    def popleft_n(self, n: int) -> list:
        if n <= 0:
            return []
        t0 = _clock()
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks: {self.num_free_blocks} are free in "
                             f"mapped memory")
        buddy, gi = self.buddy, self.granules
        hint = self.hint
        if hint is None:
            after, end = None, self.last_end
        else:
            after, _, _, end = hint                 # (after, room, spread, end)
            self.last_end = end
        G = gi.granule_blocks
        if self._revived:
            gi.set_end(self._revived, end)
            self._revived = []
        ids: list[int] = []
        need = n
        # 1. the request's own granule: in place first, then its other free and window ids
        if after is not None:
            need = self._take_in(after // G, need, ids, end, after)
        # 2. the granule holding live blocks whose life covers this block's best (free ids,
        #    then window ids: cached blocks old enough to go out of LRU order)
        while need:
            g = gi.place(end)
            if g is None:
                break
            need = self._take_in(g, need, ids, end, None)
        # 3. free ids in a granule without live blocks (stock, too, hands out free ids
        #    before it evicts a cached block)
        while need and buddy.num_free:
            g = gi.empty_with_free()
            lo = g * G
            got = buddy.allocate_within(need, lo, lo + gi.size[g])
            gi.free_to_live(got, end)
            ids += got
            need -= len(got)
        # 4. as stock: the least recently used cached blocks
        if need:
            victims = gi.oldest_cached(need)
            self._take_cached(victims, end)
            self.demoted += need
            ids += victims
        if hint is not None:                        # the run continues in the next pop
            self.hint = continued(hint, ids[-1], n)
        free = buddy.num_free
        if free < self._walk_low:
            self._walk_low = free
        self.num_free_blocks -= n
        self.allocated_total += n
        out = list(map(self._blocks.__getitem__, ids))
        self.alloc_seconds += _clock() - t0
        return out

    def _take_in(self, g: int, need: int, ids: list[int], end: int, after: int | None) -> int:
        """Free ids of granule ``g`` (those after ``after`` first), then its window ids;
        returns what is still needed."""
        gi = self.granules
        if gi.free_count(g):
            lo = g * gi.granule_blocks
            got = self.buddy.allocate_within(need, lo, lo + gi.size[g], after)
            gi.free_to_live(got, end)
            ids += got
            need -= len(got)
        if need and gi.win[g]:
            got = gi.take_window(g, need, end)     # out of the window, live now
            self._note_early(got)
            blocks, remove = self._blocks, self._lru.remove
            for i in got:
                remove(blocks[i])
            self.demoted += len(got)
            ids += got
            need -= len(got)
        return need

    def _note_early(self, ids: list[int]) -> None:
        """Cached blocks evicted out of LRU order: remembered (by hash) as ghosts, so that
        a later lookup missing them counts as reuse the horizon must cover."""
        blocks, gi, reuse = self._blocks, self.granules, self.reuse
        class_of, cached_at = gi.class_of, gi.cached_at
        for i in ids:
            key = blocks[i].block_hash
            if key is not None:
                reuse[class_of(i)].on_early_eviction(key, cached_at(i))
        self.early_evictions += len(ids)

    def _take_cached(self, ids: list[int], end: int) -> None:
        """Cached blocks leave the LRU tier to be handed out (vLLM's get_new_blocks drops
        their hashes, as it does for stock's victims)."""
        blocks, lru = self._blocks, self._lru
        for i in ids:
            lru.remove(blocks[i])
        self.granules.cached_to_live(ids, end)

    def _pop_lru(self, k: int) -> list[int]:
        ids = self.granules.oldest_cached(k)
        if len(ids) < k:
            raise ValueError(f"Cannot get {k} more free blocks: only {len(ids)} cached "
                             f"blocks are evictable")
        blocks, lru = self._blocks, self._lru
        for i in ids:
            lru.remove(blocks[i])
        self.granules.cached_to_free(ids)
        self.demoted += k
        return ids

    # ------------------------------------------------------------------ giving back
    def remove(self, block) -> None:
        """A prefix-cache hit takes a free block back (its owner's end follows)."""
        bid = block.block_id
        gi = self.granules
        if block.next_free_block is not None:
            self.reuse[gi.class_of(bid)].on_hit(self.now - gi.cached_at(bid))
            self._lru.remove(block)
            gi.cached_to_live((bid,), self.now)
        else:
            self.buddy.take(bid)
            gi.free_to_live((bid,), self.now)
            if self.buddy.num_free < self._walk_low:
                self._walk_low = self.buddy.num_free
        self._revived.append(bid)
        self.num_free_blocks -= 1

    def on_lookup_miss(self, key) -> None:
        """vLLM's prefix-cache lookup missed ``key`` (a block hash with its group)."""
        for reuse in self.reuse:
            if reuse.on_miss(key, self.now):
                break

    def append(self, block) -> None:
        self.append_n((block,))

    def append_n(self, blocks) -> None:
        if blocks:
            self._lru.extend(blocks)
            self.granules.live_to_cached([b.block_id for b in blocks], self.free_class)
            self.reuse[self.free_class].watching(self.now)
            self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks) -> None:
        if blocks:
            ids = [b.block_id for b in blocks]
            self.buddy.free(ids)
            self.granules.live_to_free(ids)
            self.num_free_blocks += len(blocks)

    # ------------------------------------------------------------------ granules
    def held_blocks(self) -> int:
        """Ids of granules that are not mapped (or whose map is not confirmed): out of the
        queue, but in use by no request."""
        gi = self.granules
        return sum(gi.size[g] for g in range(gi.num_granules) if not gi.mapped[g])

    def live_blocks(self) -> int:
        """Blocks in use by requests (the null block not counted)."""
        gi = self.granules
        return gi.num_live - len(gi.reserved)

    def hot_cached_blocks(self) -> int:
        """Cached blocks younger than the reuse horizon (not in the eviction window)."""
        gi = self.granules
        return gi.num_cached - gi.window_size

    def num_releasable(self) -> int:
        """How many granules :meth:`releasable` lists, without listing them. O(1)."""
        return self.granules.num_empty

    def releasable(self) -> list[tuple[int, int]]:
        """``(granule, cached blocks)`` of the mapped granules without live blocks, the
        cheapest to release first: fewest cached blocks younger than the reuse horizon,
        then fewest cached blocks, then the highest granule."""
        gi = self.granules
        return sorted(gi.empty_granules(),
                      key=lambda gc: (gc[1] - gi.win[gc[0]], gc[1], -gc[0]))

    def release(self, granules: Iterable[int]) -> int:
        """Stop handing out the blocks of ``granules`` (each mapped, without live blocks):
        their cached blocks are evicted (hashes dropped) and their ids taken. Returns the
        cached blocks evicted. The caller unmaps the memory (the channel)."""
        gi, buddy, blocks, lru = self.granules, self.buddy, self._blocks, self._lru
        todo = list(granules)
        for g in todo:
            if g == 0 or not 0 < g < gi.num_granules or not gi.mapped[g] or gi.live[g]:
                why = ("it holds the null block" if g == 0 else "it is not in the pool"
                       if not 0 < g < gi.num_granules else "it is not mapped"
                       if not gi.mapped[g] else f"{gi.live[g]} of its blocks are in use")
                raise ValueError(f"granule {g} cannot be released: {why}")
        evicted = 0
        for g in todo:
            span = gi.ids_of(g)
            cached = [i for i in span if blocks[i].next_free_block is not None]
            for i in cached:
                block = blocks[i]
                lru.remove(block)
                if self.evict is not None:
                    self.evict(block)
            if cached:
                gi.cached_to_free(cached)
                buddy.free(cached)
            buddy.take_range(span.start, span.stop)
            gi.unmap(g)
            self.num_free_blocks -= len(span)
            evicted += len(cached)
        self.released_cached += evicted
        self._walk_held = self._walk_pos = None
        if buddy.num_free < self._walk_low:
            self._walk_low = buddy.num_free
        return evicted

    def relocate(self, cached_moves, freed, taken, moves=None) -> None:
        """As :meth:`ProximaFreeQueue.relocate`; ``moves`` (every moved content, ``{old id:
        new id}``, live ones included) keeps the granule index in step. Required here."""
        if moves is None:
            raise ValueError("relocate on a granule-aware pool needs every move (moves=)")
        super().relocate(cached_moves, freed, taken)
        self.granules.move(moves)

    def exchange(self, free, taken) -> None:
        """As :meth:`ProximaFreeQueue.exchange`: ``free`` becomes the request's (live, with
        ``taken``'s expected end), ``taken`` takes ``free``'s place (cached or free)."""
        cached = free.next_free_block is not None
        fid, tid = free.block_id, taken.block_id
        super().exchange(free, taken)
        self.granules.move({fid: tid, tid: fid} if cached else {tid: fid})

    def on_mapped(self, granules: Iterable[int]) -> None:
        """The memory of ``granules`` is backed again (confirmed): their blocks are free."""
        gi, buddy = self.granules, self.buddy
        for g in granules:
            span = gi.ids_of(g)
            gi.map(g)
            buddy.free(list(span))
            self.num_free_blocks += len(span)

    def granule_stats(self) -> dict:
        out = self.granules.summary()
        out.update(eviction=str(self.eviction), horizon_steps=list(self.horizons),
                   early_evictions=self.early_evictions, released_cached=self.released_cached,
                   busy_periods=self.busy_periods,
                   reuse_hits=[r.hits for r in self.reuse],
                   ghost_hits=[r.ghost_hits for r in self.reuse])
        return out

    def check(self) -> None:
        """The buddy's and the granule index's invariants, and that they agree with the
        tiers (O(N)); InvariantError on the first broken one."""
        from proxima.allocator import InvariantError

        buddy, gi, blocks = self.buddy, self.granules, self._blocks
        buddy.check()
        cached = [b.block_id for b in self._lru.after(None)]
        live = [i for i in range(len(blocks))
                if i not in gi.reserved and gi.mapped[i // gi.granule_blocks]
                and not buddy.is_free(i) and blocks[i].next_free_block is None]
        gi.check(live_ids=live, cached_order=cached)
        expected = buddy.num_free + len(self._lru)
        if self.num_free_blocks != expected:
            raise InvariantError(f"num_free_blocks is {self.num_free_blocks}, the mapped "
                                 f"free and cached blocks are {expected}")
        for g in range(gi.num_granules):
            if not gi.mapped[g] and any(buddy.is_free(i) for i in gi.ids_of(g)):
                raise InvariantError(f"unmapped granule {g} has free ids in the buddy")
