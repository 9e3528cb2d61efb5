"""Proxima's free queue for vLLM's V1 block pool: a drop-in ``FreeKVCacheBlockQueue``.

The free ids live in two tiers, the same two vLLM keeps in one list:

* the run allocator (the *buddy tier*, ``queue.buddy``) holds every free id that may be
  handed out now: blocks that were never cached or lost their hash (stock:
  ``prepend_n``, evicted first), plus cached blocks demoted from the LRU tier when the
  buddy alone is too small (they keep their hash until handed out, as in stock, where
  ``get_new_blocks`` evicts them);
* the LRU tier holds free blocks that carry a prefix-cache hash (stock: ``append_n``),
  least recently used first. They are demoted to the buddy, LRU first, only when the
  buddy cannot serve a request: exactly the blocks stock vLLM would evict.

So ``num_free_blocks`` (and with it every admission decision of the scheduler) is the
same as stock's, and whenever stock finds ``n`` blocks Proxima finds them too.

Pure Python over vLLM's ``KVCacheBlock`` objects (duck-typed: nothing of vLLM is
imported). The pool (:mod:`proxima.vllm.vllm_v1`) chooses the queue when it is built:
this one, or the elastic pool's :class:`~proxima.vllm.elastic_pool.GranuleFreeQueue`.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from typing import Iterator

from proxima.allocator import AllocationHint, RunAllocator

_clock = time.perf_counter


class _End:
    """A fake block at either end of the LRU tier's list (as vLLM's queue has)."""

    __slots__ = ("prev_free_block", "next_free_block")

    def __init__(self) -> None:
        self.prev_free_block = self.next_free_block = None


class _LruTier:
    """Free blocks that carry a prefix-cache hash, least recently used first: a doubly
    linked list through the blocks' own ``prev_free_block`` / ``next_free_block``, as
    in vLLM's ``FreeKVCacheBlockQueue``. A block is in the tier iff its links are set
    (every other block's are None). O(1) per block appended, removed or popped."""

    def __init__(self) -> None:
        self.head, self.tail = _End(), _End()
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def extend(self, blocks) -> None:
        """Append ``blocks`` at the most recently used end, in order."""
        tail = self.tail
        last = tail.prev_free_block
        count = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            count += 1
        last.next_free_block = tail
        tail.prev_free_block = last
        self.size += count

    def remove(self, block) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.size -= 1

    def pop_oldest(self, k: int) -> list:
        """The ``k`` least recently used blocks, out of the tier (caller checked k)."""
        out = []
        block = self.head.next_free_block
        for _ in range(k):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.head.next_free_block = block
        block.prev_free_block = self.head
        self.size -= k
        return out

    def after(self, block) -> Iterator:
        """The blocks after ``block`` (None: from the oldest), read live as vLLM's
        queue does: a block that leaves the tier ends the walk."""
        block = self.head.next_free_block if block is None else block.next_free_block
        tail = self.tail
        while block is not None and block is not tail:
            yield block
            block = block.next_free_block


class ProximaFreeQueue:
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue``, backed by the run allocator.

    Eviction order (what ``popleft_n`` hands out first, and what ``iter_blocks_after``
    and ``get_all_free_blocks`` walk): the buddy tier, then the LRU tier, oldest first.
    Stock's list has the same two parts, hash-less blocks first (``prepend_n``), then
    cached blocks (``append_n``); within the hash-less part stock keeps the most
    recently freed first, the buddy keeps no order (walked by ascending id).

    ``hint`` (None or a hint ``(after, room, spread, end)``: an
    :class:`~proxima.allocator.hint.AllocationHint` or a plain tuple) is the one
    place a hint waits for the next pops: vLLM's own ``BlockPool.get_new_blocks`` calls
    ``popleft_n(n)`` with no room for another argument, so the manager wrapper sets
    ``queue.hint`` around one ``allocate_new_blocks`` and clears it after; :meth:`popleft_n`
    passes it to the allocator and replaces it by its continuation, a plain tuple
    (:func:`~proxima.allocator.hint.continued`: ``after`` is the last block
    handed out, ``room`` less what was handed out), so the calls of one
    ``allocate_new_blocks`` (vLLM's copy-on-write block for a partial prefix hit, then the
    new blocks) form one run.
    """

    #: the manager wrapper sets the growth hint on this queue (vLLM's own queue: no)
    takes_hints = True
    #: the blocks a preemption frees are cached as their own class (the elastic queue)
    classes_preempted = False

    def __init__(self, blocks: list, reserved: tuple[int, ...] = (0,)) -> None:
        self._blocks = blocks
        for block in blocks:                # the links mean "in the LRU tier" here
            block.prev_free_block = block.next_free_block = None
        self.buddy = RunAllocator(len(blocks), reserved=reserved)
        self._lru = _LruTier()              # cached free blocks, least recently used first
        self.hint: AllocationHint | tuple | None = None     # for the next pops (class doc)
        self.alloc_seconds = 0.0
        self.demoted = 0
        # The cursor walker's state (iter_blocks_after): the block it holds, stock's
        # position of it (None: stock's front; int: a hash-less entry with that many
        # behind it; _CACHED), and the fewest hash-less blocks since its last walk.
        self._walk_held = None
        self._walk_pos = None
        self._walk_low = 0
        # A plain attribute, as in stock's queue: the scheduler reads it on every step.
        self.num_free_blocks = self.buddy.num_free

    @property
    def num_evictable(self) -> int:
        """Free blocks that still serve prefix-cache hits (the LRU tier)."""
        return len(self._lru)

    def popleft(self):
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list:
        """``n`` free blocks as few contiguous runs as the pool allows (caller checked n)."""
        if n <= 0:
            return []
        t0 = _clock()
        buddy = self.buddy
        hint = self.hint
        if n > buddy.num_free:
            # Everything free goes, plus exactly the blocks stock would evict now: the
            # least recently used cached ones. No placement choice is left, so they go
            # straight out (sorted, starting after the caller's last block).
            victims = self._pop_lru(n - buddy.num_free)     # checks there are enough first
            ids = sorted(buddy.allocate_all() + victims)
            if hint is not None and hint[0] is not None:       # hint[0]: after
                i = bisect_right(ids, hint[0])
                ids = ids[i:] + ids[:i]
        else:
            ids = buddy.allocate(n, hint)
        free = buddy.num_free
        if free < self._walk_low:
            self._walk_low = free                   # stock's hash-less stack ran this low
        if hint is not None:                        # the run continues in the next pop:
            after, room, spread, end = hint         # continued(hint, ids[-1], n) inline
            if after is not None or room is not None:
                self.hint = (ids[-1], None if room is None else (room - n if room > n else 0),
                             spread, end)
        self.num_free_blocks -= n
        blocks = self._blocks
        out = [blocks[ids[0]]] if n == 1 else list(map(blocks.__getitem__, ids))
        self.alloc_seconds += _clock() - t0
        return out

    def _pop_lru(self, k: int) -> list[int]:
        """The ids of the ``k`` least recently used cached blocks, out of the LRU tier.
        (They keep their hash: vLLM's get_new_blocks evicts it when handing them out.)"""
        lru = self._lru
        if k > len(lru):
            raise ValueError(f"Cannot get {k} more free blocks: only {len(lru)} cached "
                             f"blocks are evictable")
        self.demoted += k
        return [block.block_id for block in lru.pop_oldest(k)]

    def _demote(self, k: int) -> None:
        """Move the ``k`` least recently used cached blocks into the buddy tier (the pool's
        reset_prefix_cache, when vLLM's offload connectors drop their cursors too). With
        none cached (a fresh pool, caching off, a second reset) there is nothing to free:
        the buddy refuses an empty free, as it refuses every call that frees nothing."""
        ids = self._pop_lru(k)
        if ids:
            self.buddy.free(ids)
        self._walk_held = self._walk_pos = None

    def remove(self, block) -> None:
        """A free block leaves the queue (a prefix-cache hit claims it back)."""
        if block.next_free_block is not None:
            self._lru.remove(block)
        else:
            self.buddy.take(block.block_id)
            if self.buddy.num_free < self._walk_low:
                self._walk_low = self.buddy.num_free
        self.num_free_blocks -= 1

    def append(self, block) -> None:
        self._lru.extend((block,))
        self.num_free_blocks += 1

    def append_n(self, blocks) -> None:
        """Free blocks with a hash: most recently used end of the LRU tier."""
        if blocks:
            self._lru.extend(blocks)
            self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks) -> None:
        """Free blocks without a hash: straight back to the buddy, in whatever order they
        come (vLLM's is a request's table reversed: one range per run of ids)."""
        if blocks:
            self.buddy.free([b.block_id for b in blocks])
            self.num_free_blocks += len(blocks)

    def relocate(self, cached_moves, freed, taken, moves=None) -> None:
        """KV compaction moved block contents (between steps, all at once): for each
        ``(old, new)`` of ``cached_moves`` (block objects; a ``new`` may be another pair's
        ``old``) ``new`` takes ``old``'s place in the LRU tier, so the eviction order is
        unchanged; the ids ``freed`` are free blocks without a hash now (the buddy takes
        them back), the ids ``taken`` hold content now (they leave the buddy). The caller
        keeps the free count equal (``len(freed) == len(taken)``) and moves the hashes.
        O(moves) plus the buddy's take and free; nothing changes if an id of ``taken`` is
        not free. ``moves`` (every moved content, ``{old id: new id}``) is for a subclass
        that tracks more than the tiers."""
        if len(freed) != len(taken):
            raise ValueError(f"relocate: {len(freed)} ids freed but {len(taken)} taken; "
                             "the free count must not change")
        buddy = self.buddy
        bad = next((i for i in taken if not buddy.is_free(i)), None)
        if bad is not None:
            raise ValueError(f"relocate: block {bad} is not a free block of the buddy tier")
        replaced = {id(old): new for old, new in cached_moves}
        links = []
        for old, new in cached_moves:
            prev, nxt = old.prev_free_block, old.next_free_block
            if prev is None or nxt is None:
                raise ValueError(f"relocate: block {old.block_id} is not in the LRU tier")
            links.append((new, replaced.get(id(prev), prev), replaced.get(id(nxt), nxt)))
        for old, _ in cached_moves:
            old.prev_free_block = old.next_free_block = None
        for new, prev, nxt in links:
            new.prev_free_block, new.next_free_block = prev, nxt
            prev.next_free_block = new
            nxt.prev_free_block = new
            if self._walk_held is not None and id(self._walk_held) in replaced:
                self._walk_held = replaced[id(self._walk_held)]
        for i in taken:
            buddy.take(i)
        if freed:
            buddy.free(list(freed))

    def exchange(self, free, taken) -> None:
        """KV compaction gives a request the free block ``free`` (either tier) instead of
        ``taken``, a block this queue just handed out (no hash, not in the queue):
        ``taken`` takes ``free``'s place -- its slot in the LRU tier (the caller moves the
        cached content and its hash to ``taken``), or its id in the buddy -- so the free
        count and the eviction order are unchanged. O(1) plus the buddy's take and free."""
        if taken.next_free_block is not None or taken.block_hash is not None:
            raise ValueError(f"exchange({free.block_id}, {taken.block_id}): the second must "
                             "be a block handed out, without a hash")
        if free.next_free_block is not None:
            prev, nxt = free.prev_free_block, free.next_free_block
            taken.prev_free_block, taken.next_free_block = prev, nxt
            prev.next_free_block = taken
            nxt.prev_free_block = taken
            free.prev_free_block = free.next_free_block = None
            if self._walk_held is free:
                self._walk_held = taken
        else:
            self.buddy.take(free.block_id)      # checks that ``free`` is free
            self.buddy.free([taken.block_id])

    def get_all_free_blocks(self) -> list:
        """Every free block, in eviction order (see the class doc)."""
        blocks = self._blocks
        return [blocks[i] for i in self.buddy.free_ids_from(0)] + list(self._lru.after(None))

    # ------------------------------------------------------------ walking from a cursor

    def iter_blocks_after(self, cursor) -> Iterator:
        """Free blocks in eviction order after ``cursor`` (None: from the first), live and
        in O(blocks yielded) (plus C-speed scans of allocated ids between free runs).

        vLLM's simple CPU offload (lazy mode) walks stock's queue from a cursor every
        step, counting free blocks until it has covered its target and storing the cached
        ones; its cursor is the last block it went past. What it sees here is what it
        sees in stock's queue:

        * the cached tier is stock's cached part, block for block in the same order: a
          cursor there continues after it; one that left the queue yields nothing;
        * the hash-less tier holds as many blocks as stock's hash-less part, which is a
          stack (``prepend_n`` pushes, ``popleft_n`` pops, nothing leaves from the
          middle), so a stock cursor there is the entry with ``r`` entries behind it, for
          as long as the stack keeps more than ``r``. The buddy has no order, so the
          queue remembers, for the walker it last served, the ``r`` of the block the
          walker went past last (:meth:`_walk`) and how low the tier has run since: a
          walk from that cursor yields ``r`` hash-less blocks then the cached tier, or
          the whole queue once stock's entry would have been popped (stock's walker
          then starts again from the front, as it also does when Proxima handed that
          block out: ``ref_cnt > 0``).

        A cursor this queue did not hand to the walker continues with the free ids above
        it, then the cached tier.
        """
        held, pos = self._walk_held, self._walk_pos
        if pos.__class__ is int and (cursor is held or (cursor is None and held.ref_cnt > 0)):
            return self._walk(cursor, pos if self._walk_low > pos else None)
        if cursor is None or (cursor is held and pos is None):
            return self._walk(cursor, None)
        if cursor.next_free_block is not None:
            return self._walk_cached(cursor)
        if self.buddy.is_free(cursor.block_id):
            return self._walk_by_id(cursor.block_id + 1)
        return iter(())                    # the cursor left the queue (stock: the same)

    def _walk(self, cursor, behind: int | None) -> Iterator:
        """``behind`` hash-less blocks (None: all of them, from stock's front), then the
        cached tier; records what the walker holds after each block it goes past."""
        buddy = self.buddy
        count = buddy.num_free if behind is None else behind
        skip = cursor.block_id if behind is not None and cursor is not None else -1
        self._walk_low = buddy.num_free
        self._walk_held, self._walk_pos = cursor, behind    # if it goes past nothing
        blocks = self._blocks
        for i in buddy.free_ids_from(0):
            if not count:
                break
            if i == skip:
                continue
            count -= 1
            block = blocks[i]
            yield block
            self._walk_held, self._walk_pos = block, count  # stock's entry: count behind
        yield from self._walk_cached(None)

    def _walk_cached(self, cursor) -> Iterator:
        for block in self._lru.after(cursor):
            yield block
            self._walk_held, self._walk_pos = block, _CACHED

    def _walk_by_id(self, first: int) -> Iterator:
        blocks = self._blocks
        for i in self.buddy.free_ids_from(first):
            yield blocks[i]
        yield from self._lru.after(None)


_CACHED = "cached"          # _walk_pos of a walker's cursor in the cached tier
