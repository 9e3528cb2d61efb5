"""Proxima's GPU block allocators for vLLM 0.6.x's V0 block manager (the card stack).

The ids vLLM's ``BlockAllocator`` interface hands out, picked by
:class:`proxima.allocator.RunAllocator` instead of a free deque (see
:mod:`proxima.vllm.vllm_v0` for where they sit and what stays vLLM's):

* :class:`ProximaNaiveBlockAllocator`: ``NaiveBlockAllocator`` over the buddy, with the
  room a sequence still expects reserved behind its run;
* :class:`ProximaPrefixCachingBlockAllocator`: ``PrefixCachingBlockAllocator`` over it,
  evicting in the evictor's LRU order only for the shortfall;
* :class:`ProximaCpuGpuBlockAllocator`: vLLM's CPU (swap) allocator beside the GPU one.

Imports vLLM's V0 block modules; import it only under vLLM 0.6.x (elsewhere
:data:`IMPORT_ERROR` says why, and nothing here works).
"""

from __future__ import annotations

from typing import Callable, List, Optional

from proxima.allocator import AllocationHint, RunAllocator

try:
    from vllm.core.block.common import CopyOnWriteTracker, RefCounter
    from vllm.core.block.cpu_gpu_block_allocator import CpuGpuBlockAllocator
    from vllm.core.block.interfaces import Block, BlockAllocator
    from vllm.core.block.naive_block import BlockPool, NaiveBlock, NaiveBlockAllocator
    from vllm.core.block.prefix_caching_block import PrefixCachingBlockAllocator
    from vllm.core.evictor_v2 import EvictionPolicy
    IMPORT_ERROR: Optional[BaseException] = None
except ImportError as exc:  # another vLLM generation: vllm_v0.activate() explains
    IMPORT_ERROR = exc
    NaiveBlockAllocator = PrefixCachingBlockAllocator = object  # type: ignore
    CpuGpuBlockAllocator = object  # type: ignore
    EvictionPolicy = None  # type: ignore


# ----------------------------------------------------------------------- GPU allocators


def _copy_on_write(allocator, block: Block, place: Callable[[Optional[Block]], int]) -> int:
    """vLLM's ``cow_block_if_not_appendable`` for both of Proxima's allocators: a shared
    last block is released and copied to the id ``place(previous block)`` picks."""
    src_block_id = block.block_id
    assert src_block_id is not None
    if allocator._cow_tracker.is_appendable(block):
        return src_block_id
    allocator._free_block_id(block)
    trg_block_id = place(block.prev_block)
    allocator._cow_tracker.record_cow(src_block_id, trg_block_id)
    return trg_block_id


class ProximaNaiveBlockAllocator(NaiveBlockAllocator):
    """vLLM's ``NaiveBlockAllocator`` with its free deque replaced by a buddy allocator.

    Block ids are ``base .. base + num_blocks - 1`` (the GPU ids start at 0). Everything
    but picking and returning ids (ref counts, CoW tracking, forks, the block-object pool)
    is vLLM's code.

    Room and reservations. ``room_hint`` is the number of blocks the sequence being served
    expects to need from here on, set by :class:`ProximaBlockSpaceManager` and counted
    down as ids are handed out. When a sequence starts a new run with ``room_hint`` above
    what it takes now, the rest of the room is taken from the buddy too and *reserved*
    behind the run's last id: ``_reservations[last] = end`` holds ``last+1 .. end-1`` for
    the sequence whose last block is ``last``. Growing after ``last`` takes those ids
    first. Reserved ids are free as far as vLLM can tell (``get_num_free_blocks`` counts
    them), and any allocation that would otherwise fail takes them back (see
    :meth:`_take_back`), so capacity is exactly stock's. A reservation ends when its
    sequence's last block is freed (finish, preemption, swap out) or is taken back.
    Without reservations the buddy's best fit would fill the free tail behind a growing
    run with the next request (it is the smallest hole that fits).
    """

    def __init__(self, create_block, num_blocks: int, block_size: int,
                 block_ids=None, block_pool=None):
        ids = range(num_blocks) if block_ids is None else block_ids
        base = min(ids) if num_blocks else 0
        if len(ids) != num_blocks or set(ids) != set(range(base, base + num_blocks)):
            raise ValueError(f"Proxima needs consecutive block ids; got {num_blocks} ids "
                             f"that are not {base}..{base + num_blocks - 1}")
        # NaiveBlockAllocator.__init__ minus its free deque, which the buddy replaces.
        self._free_block_indices = None
        self._all_block_indices = frozenset(ids)
        self._refcounter = RefCounter(all_block_indices=self._all_block_indices)
        self._block_size = block_size
        self._cow_tracker = CopyOnWriteTracker(refcounter=self._refcounter.as_readonly())
        if block_pool is None:
            block_pool = BlockPool(block_size, create_block, self, num_blocks * 4)
        self._block_pool = block_pool
        self._base = base
        self.buddy = RunAllocator(num_blocks)
        self.room_hint: Optional[int] = None
        # When no room_hint is set: called (only when ids are handed out) for the room of
        # the sequence being served; the block manager installs it (decode growth).
        self.room_source = None
        self._reservations: dict[int, int] = {}    # last id of a run -> end of its room
        self._births: dict[int, int] = {}          # last id of a run -> when it was placed
        self._clock = 0
        self.num_reserved = 0

    # -- ids (local: 0 .. num_blocks - 1; vLLM's id = local + base)

    def _allocate_block_ids(self, n: int, after: Optional[int] = None,
                            own: bool = True) -> List[int]:
        """``n`` ids for the sequence whose last block is ``after`` (None: a new
        sequence): its reserved room first, then in place, then a new run placed (and
        reserved) for ``room_hint`` blocks. Each id's ref count goes to 1.

        ``own=False``: ``after`` is a block the sequence shares (a prefix-cache hit), so
        the room reserved behind it is another sequence's and is left alone."""
        buddy = self.buddy
        if n > buddy.num_free + self.num_reserved:
            raise BlockAllocator.NoFreeBlocksError()
        base = self._base
        room = self.room_hint
        if room is not None:
            self.room_hint = room - n if room > n else None
        elif self.room_source is not None:
            room = self.room_source()
        last = None if after is None else after - base
        ids: List[int] = []
        if last is not None and own:
            end = self._reservations.pop(last, None)
            if end is not None:
                birth = self._births.pop(last)
                take = min(n, end - last - 1)
                ids = list(range(last + 1, last + 1 + take))
                self.num_reserved -= take
                last += take
                if last + 1 < end:
                    self._reservations[last] = end
                    self._births[last] = birth
                n -= take
        if n:
            if n > buddy.num_free:
                self._take_back(n)
            ids += self._place(n, last, room)
        incr = self._refcounter.incr
        if base:
            ids = [i + base for i in ids]
        for block_id in ids:
            incr(block_id)
        return ids

    def _place(self, n: int, last: Optional[int], room: Optional[int]) -> List[int]:
        """``n`` free ids from the buddy: in place after ``last`` if free, else a new run;
        either way, up to ``room`` ids are reserved where they are free behind it."""
        buddy = self.buddy
        want = room if room is not None and room > n else n
        behind = 0
        if last is not None:
            is_free = buddy.is_free
            while behind < want and is_free(last + 1 + behind):
                behind += 1
            if behind == want:
                return self._reserve(buddy.allocate(want, AllocationHint(last)), n)
        if want > n and buddy.largest_free_run >= want:
            # Rather one new run with all the room than a short piece in place. While
            # most of the pool is free, spread runs out (buddy split of the largest
            # slack) so a run can outgrow its room later (a conversation's next turn).
            spread = 2 * (buddy.num_blocks - buddy.num_free) <= buddy.num_blocks
            return self._reserve(buddy.allocate(want, AllocationHint(None, want, spread)), n)
        if behind >= n:
            return self._reserve(buddy.allocate(behind, AllocationHint(last)), n)
        return buddy.allocate(n, AllocationHint(last, room))

    def _reserve(self, ids: List[int], n: int) -> List[int]:
        """Hand out ``ids[:n]``; keep the rest (consecutive) as the run's room."""
        if len(ids) > n:
            self._reservations[ids[n - 1]] = ids[-1] + 1
            self._births[ids[n - 1]] = self._clock
            self._clock += 1
            self.num_reserved += len(ids) - n
        return ids[:n]

    def _take_back(self, n: int) -> None:
        """Shrink reservations until the buddy has ``n`` free ids: the newest sequence's
        first (V0 preempts the newest first, so the oldest keep their room), each from
        its far end (what the sequence would need last)."""
        buddy = self.buddy
        reservations = self._reservations
        births = self._births
        while buddy.num_free < n:
            last = max(reservations, key=births.__getitem__)
            end = reservations[last]
            cut = max(last + 1, end - (n - buddy.num_free))
            if cut == last + 1:
                del reservations[last]
                del births[last]
            else:
                reservations[last] = cut
            self.num_reserved -= end - cut
            buddy.free(range(cut, end))

    def _allocate_block_id(self, after: Optional[int] = None) -> int:
        return self._allocate_block_ids(1, after)[0]

    def _free_block_id(self, block: Block) -> None:
        block_id = block.block_id
        assert block_id is not None
        if self._refcounter.decr(block_id) == 0:
            local = block_id - self._base
            end = self._reservations.pop(local, None)
            if end is None:
                self.buddy.free((local,))
            else:
                del self._births[local]
                self.num_reserved -= end - local - 1
                self.buddy.free(range(local, end))
        block.block_id = None

    def release_reservation(self, block_id: int) -> None:
        """The run ending at ``block_id`` lost its last holder: give its room back."""
        local = block_id - self._base
        end = self._reservations.pop(local, None)
        if end is not None:
            del self._births[local]
            self.num_reserved -= end - local - 1
            self.buddy.free(range(local + 1, end))

    def release_unreferenced(self, block_id: int) -> None:
        """Give back an id whose ref count is already 0 (an evicted cached block)."""
        self.buddy.free((block_id - self._base,))

    # -- BlockAllocator

    def allocate_immutable_blocks(self, prev_block: Optional[Block],
                                  block_token_ids: List[List[int]],
                                  device=None) -> List[Block]:
        assert device is None
        block_ids = self._allocate_block_ids(
            len(block_token_ids), None if prev_block is None else prev_block.block_id)
        init_block = self._block_pool.init_block
        blocks = []
        for token_ids, block_id in zip(block_token_ids, block_ids):
            prev_block = init_block(prev_block=prev_block, token_ids=token_ids,
                                    block_size=self._block_size, physical_block_id=block_id)
            blocks.append(prev_block)
        return blocks

    def allocate_mutable_block(self, prev_block: Optional[Block], device=None) -> Block:
        assert device is None
        block_id = self._allocate_block_id(
            None if prev_block is None else prev_block.block_id)
        return self._block_pool.init_block(prev_block=prev_block, token_ids=[],
                                           block_size=self._block_size,
                                           physical_block_id=block_id)

    def cow_block_if_not_appendable(self, block: Block) -> int:
        """vLLM's copy-on-write; the copy is placed right after the previous block when
        that id is free (a forked sequence's new last block continues its run)."""
        return _copy_on_write(self, block, lambda prev: self._allocate_block_id(
            None if prev is None else prev.block_id))

    def get_num_free_blocks(self) -> int:
        return self.buddy.num_free + self.num_reserved

    def get_physical_block_id(self, absolute_id: int) -> int:
        # Stock sorts all ids on every call; ours are consecutive.
        return absolute_id - self._base


class ProximaPrefixCachingBlockAllocator(PrefixCachingBlockAllocator):
    """vLLM's ``PrefixCachingBlockAllocator`` over a :class:`ProximaNaiveBlockAllocator`.

    Cache lookups, hashing, the evictor, computed/touched tracking and hit-rate metrics
    are vLLM's. Changed: where truly free ids are taken (grow in place, else place with
    room), and that evicted ids go back to the buddy so a run can be placed over them.
    """

    def __init__(self, num_blocks: int, block_size: int, block_ids=None,
                 eviction_policy=None):
        super().__init__(num_blocks=num_blocks, block_size=block_size, block_ids=block_ids,
                         eviction_policy=eviction_policy or EvictionPolicy.LRU)
        self._hashless_allocator = ProximaNaiveBlockAllocator(
            create_block=self._create_block, num_blocks=num_blocks, block_size=block_size,
            block_ids=block_ids, block_pool=self._block_pool)
        self._refcounter = self._hashless_allocator.refcounter
        self._cow_tracker = CopyOnWriteTracker(refcounter=self._refcounter.as_readonly())

    @property
    def buddy(self) -> RunAllocator:
        return self._hashless_allocator.buddy

    @property
    def room_hint(self) -> Optional[int]:
        return self._hashless_allocator.room_hint

    @room_hint.setter
    def room_hint(self, value: Optional[int]) -> None:
        self._hashless_allocator.room_hint = value

    @property
    def room_source(self):
        return self._hashless_allocator.room_source

    @room_source.setter
    def room_source(self, value) -> None:
        self._hashless_allocator.room_source = value

    # -- ids

    def _evict_into_pool(self, n: int) -> None:
        """Evict ``n`` cached blocks in the evictor's (LRU) order; their ids become free."""
        evictor = self.evictor
        cached = self._cached_blocks
        release = self._hashless_allocator.release_unreferenced
        for _ in range(n):
            block_id, content_hash = evictor.evict()
            del cached[content_hash]
            release(block_id)

    def _take_block_ids(self, n: int, after: Optional[int], own: bool = True) -> List[int]:
        """``n`` ids: truly free ones (reserved room included) first; evict (LRU) only
        for the shortfall, exactly the blocks stock would evict for these ``n``."""
        hashless = self._hashless_allocator
        free = hashless.buddy.num_free + hashless.num_reserved
        if n > free:
            if n > free + self.evictor.num_blocks:
                raise BlockAllocator.NoFreeBlocksError()
            self._evict_into_pool(n - free)
        block_ids = hashless._allocate_block_ids(n, after, own)
        track = self._track_block_id
        for block_id in block_ids:
            track(block_id, computed=False)
        return block_ids

    def _decr_refcount_cached_block(self, block: Block) -> None:
        block_id = block.block_id
        super()._decr_refcount_cached_block(block)
        if self._refcounter.get(block_id) == 0:
            self._hashless_allocator.release_reservation(block_id)

    def _allocate_block_id(self) -> int:
        return self._take_block_ids(1, None)[0]

    # -- BlockAllocator

    def allocate_mutable_block(self, prev_block: Optional[Block], device=None) -> Block:
        assert device is None
        if prev_block is None:
            block_id = self._take_block_ids(1, None)[0]
        else:   # a computed block object is a cache hit: shared, not the sequence's run
            block_id = self._take_block_ids(1, prev_block.block_id,
                                            not prev_block.computed)[0]
        return self._block_pool.init_block(prev_block=prev_block, token_ids=[],
                                           block_size=self._block_size,
                                           physical_block_id=block_id)

    def allocate_immutable_blocks(self, prev_block: Optional[Block],
                                  block_token_ids: List[List[int]],
                                  device=None) -> List[Block]:
        """Stock's per-block cache lookup, in order; then all misses at once, as one run
        that continues the block before the first miss when it can."""
        assert device is None
        init_block = self._block_pool.init_block
        cached_blocks = self._cached_blocks
        query = self.metric_data.query
        blocks: List[Block] = []
        misses: List[Block] = []
        run_after = None if prev_block is None else prev_block.block_id
        run_own = prev_block is None or not prev_block.computed
        for token_ids in block_token_ids:
            block = init_block(prev_block=prev_block, token_ids=token_ids,
                               block_size=self._block_size, physical_block_id=None)
            cached_block_id = cached_blocks.get(block.content_hash)
            if cached_block_id is not None:
                query(hit=True)
                block.block_id = cached_block_id
                self._incr_refcount_cached_block(block)
                if not misses:
                    run_after, run_own = cached_block_id, False
            else:
                query(hit=False)
                misses.append(block)
            blocks.append(block)
            prev_block = block
        if misses:
            block_ids = self._take_block_ids(len(misses), run_after, run_own)
            touched = self._touched_blocks
            for block, block_id in zip(misses, block_ids):
                content_hash = block.content_hash
                if content_hash in cached_blocks:
                    # Two equal blocks in one call: share the first, as promotion would.
                    self._refcounter.decr(block_id)
                    self._untrack_block_id(block_id)
                    self._hashless_allocator.release_unreferenced(block_id)
                    block.block_id = cached_blocks[content_hash]
                    self._incr_refcount_cached_block(block)
                    continue
                block.block_id = block_id
                cached_blocks[content_hash] = block_id
                touched.add(block_id)
        return blocks

    def cow_block_if_not_appendable(self, block: Block) -> int:
        return _copy_on_write(self, block, lambda prev: (
            self._take_block_ids(1, None) if prev is None
            else self._take_block_ids(1, prev.block_id, not prev.computed))[0])

    def get_physical_block_id(self, absolute_id: int) -> int:
        return self._hashless_allocator.get_physical_block_id(absolute_id)


class ProximaCpuGpuBlockAllocator(CpuGpuBlockAllocator):
    """``CpuGpuBlockAllocator`` whose GPU side is Proxima's; the CPU (swap) side is stock."""

    @staticmethod
    def create(allocator_type: str, num_gpu_blocks: int, num_cpu_blocks: int,
               block_size: int) -> "ProximaCpuGpuBlockAllocator":
        gpu_ids = range(num_gpu_blocks)
        cpu_ids = range(num_gpu_blocks, num_gpu_blocks + num_cpu_blocks)
        if allocator_type == "naive":
            gpu = ProximaNaiveBlockAllocator(create_block=NaiveBlock, num_blocks=num_gpu_blocks,
                                             block_size=block_size, block_ids=gpu_ids)
            cpu = NaiveBlockAllocator(create_block=NaiveBlock, num_blocks=num_cpu_blocks,
                                      block_size=block_size, block_ids=cpu_ids)
        elif allocator_type == "prefix_caching":
            gpu = ProximaPrefixCachingBlockAllocator(num_blocks=num_gpu_blocks,
                                                     block_size=block_size, block_ids=gpu_ids)
            cpu = PrefixCachingBlockAllocator(num_blocks=num_cpu_blocks,
                                              block_size=block_size, block_ids=cpu_ids)
        else:
            raise ValueError(f"Unknown allocator type {allocator_type=}")
        return ProximaCpuGpuBlockAllocator(cpu_block_allocator=cpu, gpu_block_allocator=gpu)
