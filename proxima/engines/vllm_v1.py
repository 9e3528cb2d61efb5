"""Proxima inside vLLM 0.26's V1 engine. Thin: the placement logic is proxima.allocator's.

What changes when active, and nothing else:

* ``BlockPool.free_block_queue`` (vLLM's ``FreeKVCacheBlockQueue``, a doubly linked list
  in eviction order) becomes a :class:`ProximaFreeQueue` with the same methods. Every
  other line of ``BlockPool`` -- ref counts, the null block, prefix-cache hashing and
  eviction, KV events, metrics -- is vLLM's own code, run unchanged.
* Each ``SingleTypeKVCacheManager.allocate_new_blocks`` (the one place that knows which
  request a block is for) tells the queue "continue after this request's last block" and
  how many blocks the request may still need, so prefill chunks and decode steps extend
  the request's run in place.

The free ids live in two tiers, the same two vLLM keeps in one list:

* the buddy allocator holds every free id that may be handed out now: blocks that were
  never cached or lost their hash (stock: ``prepend_n``, evicted first), plus cached
  blocks demoted from the LRU tier when the buddy alone is too small (they keep their
  hash until handed out, as in stock, where ``get_new_blocks`` evicts them);
* the LRU tier holds free blocks that carry a prefix-cache hash (stock: ``append_n``),
  least recently used first. They are demoted to the buddy, LRU first, only when the
  buddy cannot serve a request: exactly the blocks stock vLLM would evict.

So ``num_free_blocks`` (and with it every admission decision of the scheduler) is the
same as stock's, and whenever stock finds ``n`` blocks Proxima finds them too.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from typing import Iterator

from proxima.allocator import BuddyAllocator
from proxima.engines import activation
from proxima.engines.contiguity import FinishedTally, idle, running_blocks_per_run
from proxima.engines.status import STATUS_INTERVAL_S, StatusWriter

logger = logging.getLogger("vllm.proxima")
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
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue``, backed by the buddy allocator.

    Eviction order (what ``popleft_n`` hands out first, and what ``iter_blocks_after``
    and ``get_all_free_blocks`` walk): the buddy tier, then the LRU tier, oldest first.
    Stock's list has the same two parts, hash-less blocks first (``prepend_n``), then
    cached blocks (``append_n``); within the hash-less part stock keeps the most
    recently freed first, the buddy keeps no order (walked by ascending id).

    ``after``/``room``/``spread`` are the growth hint, set by the manager wrapper around
    one ``allocate_new_blocks`` and read by :meth:`popleft_n` (vLLM's own
    ``BlockPool.get_new_blocks`` calls it unchanged). While a hint is set, each
    ``popleft_n`` moves ``after`` to the last block it handed out and takes what it
    handed out off ``room``, so the calls of one ``allocate_new_blocks`` (vLLM's
    copy-on-write block for a partial prefix hit, then the new blocks) form one run.
    """

    def __init__(self, blocks: list, reserved: tuple[int, ...] = (0,)) -> None:
        self._blocks = blocks
        for block in blocks:                # the links mean "in the LRU tier" here
            block.prev_free_block = block.next_free_block = None
        self.buddy = BuddyAllocator(len(blocks), reserved=reserved)
        self._lru = _LruTier()              # cached free blocks, least recently used first
        self.after: int | None = None
        self.room: int | None = None
        self.spread = False
        self.end_for = 0                    # read by the elastic queue only
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
        after = self.after
        room = self.room
        if n > buddy.num_free:
            # Everything free goes, plus exactly the blocks stock would evict now: the
            # least recently used cached ones. No placement choice is left, so they go
            # straight out (sorted, starting after the caller's last block).
            victims = self._pop_lru(n - buddy.num_free)     # checks there are enough first
            ids = sorted(buddy.allocate_all() + victims)
            if after is not None:
                i = bisect_right(ids, after)
                ids = ids[i:] + ids[:i]
        else:
            ids = buddy.allocate(n, after, room, self.spread)
        free = buddy.num_free
        if free < self._walk_low:
            self._walk_low = free                   # stock's hash-less stack ran this low
        if after is not None or room is not None:   # a hint is set: the run continues
            self.after = ids[-1]
            if room is not None:
                self.room = room - n if room > n else 0
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

#: the free-queue classes whose growth hint the manager wrapper sets (elastic mode adds
#: its granule-aware queue, proxima.engines.elastic_pool)
QUEUES = {ProximaFreeQueue}
#: queues that cache the blocks of a preempted request as their own class (elastic mode)
CLASSED_QUEUES: set = set()
PREEMPTED_CLASS = 1                 # proxima.allocator.granules.PREEMPTED


def _block_pool_class():
    from vllm.v1.core.block_pool import BlockPool

    class ProximaBlockPool(BlockPool):
        """vLLM's BlockPool with Proxima's free queue; everything else is inherited."""

        def __init__(self, *args, **kwargs) -> None:
            # vLLM's parameters, whatever they are (0.26: num_gpu_blocks, enable_caching,
            # hash_block_size, enable_kv_cache_events, metrics_collector; 0.33 added
            # num_hash_lookahead_tokens= and medium=), go through; Proxima reads only the
            # attributes stock's __init__ sets.
            super().__init__(*args, **kwargs)
            # Stock's queue linked every block; drop those links, nothing reads them now.
            for block in self.blocks:
                block.prev_free_block = block.next_free_block = None
            self.free_block_queue = ProximaFreeQueue(
                self.blocks, reserved=(self.null_block.block_id,))
            self.proxima_expected_tokens: dict[str, int] = {}   # request id -> tokens
            self.proxima_expected_blocks = 0                    # their sum, in blocks
            self.proxima_managers: list = []   # the per-group managers seen allocating
            self.proxima_steps = 0
            self.proxima_tick = None           # elastic mode: the queue's clock
            self.proxima_finished = FinishedTally()
            self.proxima_status = StatusWriter(STATUS_INTERVAL_S)
            self.proxima_compaction = None      # a compaction_v1.Compactor, when one is on
            import vllm

            logger.info("%s: %d blocks of %d tokens (vLLM %s, V1 engine)", activation.LOG_LINE,
                        self.num_gpu_blocks, self.hash_block_size, vllm.__version__)
            self.publish_status(check=True)

        def reset_prefix_cache(self) -> bool:
            # Elastic mode: the ids of unmapped granules are out of the queue but in use by
            # no request; stock's check ("every block but the null one is free") must count
            # them free, or a reset never succeeds once memory was given back.
            queue = self.free_block_queue
            held = queue.held_blocks() if hasattr(queue, "held_blocks") else 0
            queue.num_free_blocks += held
            try:
                ok = super().reset_prefix_cache()
            finally:
                queue.num_free_blocks -= held
            if ok:
                # Stock dropped every hash; the LRU tier's blocks are plain free blocks now.
                queue = self.free_block_queue
                queue._demote(len(queue._lru))
            return ok

        def proxima_use_granules(self, granule_blocks: int, eviction=None,
                                 mapped: int | None = None):
            """Elastic mode: the free queue becomes a granule-aware one
            (:class:`proxima.engines.elastic_pool.GranuleFreeQueue`) with ``mapped``
            granules backed (None: all). Only on a fresh pool (nothing handed out but the
            null block); returns the new queue."""
            from proxima.allocator.granules import EvictionPolicy
            from proxima.engines.elastic_pool import GranuleFreeQueue

            queue = self.free_block_queue
            if queue.num_free_blocks != self.num_gpu_blocks - 1 or len(queue._lru):
                raise RuntimeError("the pool's free queue can become granule-aware only "
                                   "before any block was handed out")
            queue = GranuleFreeQueue(
                self.blocks, reserved=(self.null_block.block_id,),
                granule_blocks=granule_blocks, eviction=eviction or EvictionPolicy(),
                mapped=mapped,
                evict=self._maybe_evict_cached_block if self.enable_caching else None)
            queue.tick(self.proxima_steps)
            self.free_block_queue = queue
            self.proxima_tick = queue.tick
            if self.enable_caching:
                # Lookups that miss tell the queue which early evictions were reused.
                self.get_cached_block = self._proxima_get_cached_block
            return queue

        def _proxima_get_cached_block(self, block_hash, kv_cache_group_ids):
            # Elastic mode only (bound per instance by proxima_use_granules): vLLM's own
            # lookup; a miss is reported to the queue's reuse horizon.
            found = BlockPool.get_cached_block(self, block_hash, kv_cache_group_ids)
            if found is None:
                from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

                miss = self.free_block_queue.on_lookup_miss
                for group_id in kv_cache_group_ids:
                    miss(make_block_hash_with_group_id(block_hash, group_id))
            return found

        def proxima_stats(self) -> dict:
            queue = self.free_block_queue
            per_request = running_blocks_per_run(self.proxima_managers)
            import vllm

            out = {
                "active": True, "engine": "vllm-v1", "vllm_version": vllm.__version__,
                "num_blocks": self.num_gpu_blocks, "block_size": self.hash_block_size,
                "allocator": queue.buddy.stats(), "num_evictable": queue.num_evictable,
                "num_free_blocks": queue.num_free_blocks, "demoted_total": queue.demoted,
                "running_blocks_per_run": per_request,
                "finished_blocks_per_run": self.proxima_finished.as_status(),
                "alloc_seconds_total": queue.alloc_seconds, "steps": self.proxima_steps,
                **({"compaction": self.proxima_compaction.stats()}
                   if self.proxima_compaction is not None else {}),
            }
            granule_stats = getattr(queue, "granule_stats", None)
            if granule_stats is not None:
                out["granules"] = granule_stats()
            elastic = getattr(self, "proxima_elastic", None)
            if elastic is not None:
                out["elastic"] = elastic()
            return out

        def publish_status(self, check: bool = False, now: bool = False,
                           wait: bool | None = None) -> None:
            """Write the status file (if PROXIMA_STATS_FILE is set): at most once a second,
            unless ``check`` (invariants checked now) or ``now``. Every snapshot carries the
            last invariant verdict, renewed at most once a minute (``StatusWriter``, which
            also says when it is on disk: ``wait``)."""
            self.proxima_status.publish(self.proxima_stats, self.free_block_queue.buddy,
                                        force=now, check=check, wait=wait)

    return ProximaBlockPool


# ----------------------------------------------------------------------------- patching

_saved: list[tuple[object, str, object]] = []
ProximaBlockPool = None


def _wrap_allocate_new_blocks(original, plain: bool = False):
    """Proxima's growth hints around vLLM's ``allocate_new_blocks``. ``plain``: ``original``
    is the base ``SingleTypeKVCacheManager``'s, whose call for a request that holds blocks
    enough and no partial prefix hit only returns a new empty list: then so does this,
    without calling it (the scheduler calls this for every scheduled request every step;
    on the H200 host the extra call layer cost ~0.6 ms a step at 256 requests, section 7.3)."""
    def allocate_new_blocks(self, request_id, num_tokens, *args, **kwargs):
        # Called for every scheduled request every step; most calls need no block, and
        # those go straight through (this is the scheduler's hot loop). Arguments vLLM
        # adds after num_tokens (num_tokens_main_model in 0.26) pass through untouched.
        req_blocks = self.req_to_blocks.get(request_id)
        have = len(req_blocks) if req_blocks else 0
        partial_hit = request_id in self._partial_hit_reqs
        if num_tokens <= have * self.block_size and not partial_hit:
            if plain and have:
                # vLLM 0.26's base method here: no copy-on-write block (no partial hit),
                # cdiv(num_tokens, block_size) - len(req_blocks) <= 0, returns [] (and,
                # the request's list existing, its defaultdict gains no entry)
                return []
            return original(self, request_id, num_tokens, *args, **kwargs)
        pool = self.block_pool
        queue = pool.free_block_queue
        if queue.__class__ not in QUEUES:
            return original(self, request_id, num_tokens, *args, **kwargs)
        last = req_blocks[-1] if req_blocks else None
        queue.after = None if last is None or last.is_null else last.block_id
        total = pool.proxima_expected_tokens.get(request_id)
        # The step this request is expected to finish at (elastic placement groups
        # blocks that end together): now + the tokens it may still generate.
        queue.end_for = pool.proxima_steps + (total - num_tokens if total and
                                              total > num_tokens else 0)
        if total is None:
            queue.room = None
        else:
            # Blocks it may still need; with a partial prefix hit vLLM first takes a
            # copy-on-write block for the shared last one, so the run holds one more.
            room = -(-total // self.block_size) - have + partial_hit
            queue.room = room if room > 0 else 0
        # Room for everyone twice over: spread runs out (they may outgrow their room);
        # otherwise pack them (see BuddyAllocator.allocate).
        queue.spread = 2 * pool.proxima_expected_blocks <= pool.num_gpu_blocks
        try:
            new_blocks = original(self, request_id, num_tokens, *args, **kwargs)
        finally:
            queue.after = queue.room = None
            if pool.proxima_status.path is not None and self not in pool.proxima_managers:
                pool.proxima_managers.append(self)      # the status reads their tables
        compaction = pool.proxima_compaction
        if compaction is not None and new_blocks:
            # KV compaction may place the new blocks elsewhere (proxima.engines.compaction_v1)
            return compaction.on_allocate(self, request_id, new_blocks)
        return new_blocks

    allocate_new_blocks.__wrapped__ = original
    allocate_new_blocks.__doc__ = original.__doc__
    return allocate_new_blocks


def _wrap_add_request(original):
    def add_request(self, request) -> None:
        # Remember how long the request may grow (prompt + max_tokens): the growth hint.
        pool = self.kv_cache_manager.block_pool
        expected = getattr(pool, "proxima_expected_tokens", None)
        if expected is not None and request.request_id not in expected:
            tokens = request.num_prompt_tokens + request.max_tokens
            expected[request.request_id] = tokens
            pool.proxima_expected_blocks += -(-tokens // pool.hash_block_size)
        return original(self, request)

    add_request.__wrapped__ = original
    add_request.__doc__ = original.__doc__
    return add_request


def _wrap_free(original):
    def free(self, request) -> None:
        pool = self.block_pool
        if not request.is_finished() and pool.free_block_queue.__class__ in CLASSED_QUEUES:
            # elastic mode: blocks freed by a preemption are cached as their own class
            queue = pool.free_block_queue
            queue.free_class = PREEMPTED_CLASS
            try:
                return original(self, request)
            finally:
                queue.free_class = 0
        if not request.is_finished() or getattr(pool, "proxima_expected_tokens", None) is None:
            return original(self, request)          # preemption, or a stock pool
        tokens = pool.proxima_expected_tokens.pop(request.request_id, None)
        if tokens is not None:
            pool.proxima_expected_blocks -= -(-tokens // pool.hash_block_size)
        if pool.proxima_status.path is None:
            return original(self, request)
        managers = self.coordinator.single_type_managers
        pool.proxima_finished.add(managers, request.request_id)
        original(self, request)
        if idle(managers):
            pool.publish_status(now=True)

    free.__wrapped__ = original
    free.__doc__ = original.__doc__
    return free


def _wrap_new_step_starts(original):
    def new_step_starts(self) -> None:
        pool = self.block_pool
        if hasattr(pool, "proxima_steps"):
            pool.proxima_steps += 1        # the metrics' "allocator seconds per step"
            if pool.proxima_tick is not None:
                pool.proxima_tick(pool.proxima_steps)
            if pool.proxima_status.path is not None:
                pool.publish_status()      # at most once a second (once a step, not per
                                           # allocation: the clock read is the whole cost)
            pool.proxima_kv_manager = self  # the managers' block lists, for KV compaction
        return original(self)

    new_step_starts.__wrapped__ = original
    new_step_starts.__doc__ = original.__doc__
    return new_step_starts


def _patch(owner, name: str, value) -> None:
    _saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type)
                   else getattr(owner, name)))
    setattr(owner, name, value)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def is_active() -> bool:
    """Whether Proxima is installed in vLLM's V1 classes."""
    return bool(_saved)


def activate() -> None:
    """Install Proxima into vLLM's V1 classes (idempotent). Engines built afterwards use it.

    The version policy is asked first (:func:`proxima.engines.activation.require`): an
    untested vLLM is refused unless ``PROXIMA_ALLOW_UNTESTED_VLLM=1`` (ActivationError,
    nothing patched). Whether Proxima is wanted at all (``PROXIMA_ALLOCATOR``) is the
    caller's question: the plugin asks it."""
    global ProximaBlockPool
    if _saved:
        return
    import vllm

    activation.require("v1", vllm.__version__, activation.installed_version("torch"))
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.sched.scheduler as scheduler
    import vllm.v1.core.single_type_kv_cache_manager as managers

    if ProximaBlockPool is None:
        ProximaBlockPool = _block_pool_class()
    _patch(coordinator, "BlockPool", ProximaBlockPool)
    _patch(scheduler.Scheduler, "add_request", _wrap_add_request(scheduler.Scheduler.add_request))
    _patch(kv_cache_manager.KVCacheManager, "free",
           _wrap_free(kv_cache_manager.KVCacheManager.free))
    _patch(kv_cache_manager.KVCacheManager, "new_step_starts",
           _wrap_new_step_starts(kv_cache_manager.KVCacheManager.new_step_starts))
    base = managers.SingleTypeKVCacheManager
    for cls in (base, *_all_subclasses(base)):
        if "allocate_new_blocks" in cls.__dict__:
            _patch(cls, "allocate_new_blocks",
                   _wrap_allocate_new_blocks(cls.__dict__["allocate_new_blocks"],
                                             plain=cls is base and _plain_allocate(cls)))


# The names vLLM 0.26.0's (and 0.33.0's, the same body) SingleTypeKVCacheManager.
# allocate_new_blocks uses, in order: the partial-hit branch, then cdiv(num_tokens,
# block_size) - len(req_blocks) new blocks, none when that is <= 0.
_PLAIN_ALLOCATE_NAMES = ("_partial_hit_reqs", "pop", "block_pool", "get_new_blocks",
                         "_apply_cow", "new_block_ids", "append", "block_id", "req_to_blocks",
                         "cdiv", "block_size", "len", "extend", "_record_new_block_ids")


def _plain_allocate(cls) -> bool:
    """Whether ``cls.allocate_new_blocks`` is the method the fast path of
    :func:`_wrap_allocate_new_blocks` was written against: its code names exactly what
    vLLM 0.26's does, in the same order, with the same arguments. Any other (another
    vLLM's, a subclass's) keeps the plain wrapper, a call straight through."""
    code = getattr(cls.__dict__.get("allocate_new_blocks"), "__code__", None)
    return (code is not None and code.co_names == _PLAIN_ALLOCATE_NAMES
            and code.co_argcount == 4)


def deactivate() -> None:
    """Undo :func:`activate`: engines built afterwards are stock vLLM again."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
