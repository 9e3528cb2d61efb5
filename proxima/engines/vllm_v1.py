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
from collections import OrderedDict
from typing import Iterator

from proxima.allocator import BuddyAllocator
from proxima.engines import activation
from proxima.engines.contiguity import FinishedTally, idle, running_blocks_per_run
from proxima.engines.status import STATUS_INTERVAL_S, StatusWriter

logger = logging.getLogger("vllm.proxima")


class ProximaFreeQueue:
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue``, backed by the buddy allocator.

    ``after``/``room`` are set by the manager wrapper around one allocation and read by
    :meth:`popleft_n`; vLLM's own ``BlockPool.get_new_blocks`` calls it unchanged.
    """

    def __init__(self, blocks: list, reserved: tuple[int, ...] = (0,)) -> None:
        self._blocks = blocks
        self.buddy = BuddyAllocator(len(blocks), reserved=reserved)
        self._lru: OrderedDict[int, object] = OrderedDict()   # cached free blocks, LRU first
        self.after: int | None = None
        self.room: int | None = None
        self.spread = False
        self.alloc_seconds = 0.0
        self.demoted = 0
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
        t0 = time.perf_counter()
        buddy = self.buddy
        short = n - buddy.num_free
        if short > 0:
            # Everything free goes, plus exactly the blocks stock would evict now: the
            # `short` least recently used cached ones. No placement choice is left, so
            # they go straight out (sorted, starting after the caller's last block).
            victims = self._pop_lru(short)          # checks there are enough first
            ids = sorted(buddy.allocate_all() + victims)
            if self.after is not None:
                i = bisect_right(ids, self.after)
                ids = ids[i:] + ids[:i]
        else:
            ids = buddy.allocate(n, self.after, self.room, self.spread)
        self.num_free_blocks -= n
        blocks = self._blocks
        out = [blocks[i] for i in ids]
        self.alloc_seconds += time.perf_counter() - t0
        return out

    def _pop_lru(self, k: int) -> list[int]:
        """The ids of the ``k`` least recently used cached blocks, out of the LRU tier.
        (They keep their hash: vLLM's get_new_blocks evicts it when handing them out.)"""
        lru = self._lru
        if k > len(lru):
            raise ValueError(f"Cannot get {k} more free blocks: only {len(lru)} cached "
                             f"blocks are evictable")
        self.demoted += k
        return [lru.popitem(last=False)[0] for _ in range(k)]

    def _demote(self, k: int) -> None:
        """Move the ``k`` least recently used cached blocks into the buddy tier."""
        ids = self._pop_lru(k)
        ids.sort()
        self.buddy.free(ids)

    def remove(self, block) -> None:
        """A free block leaves the queue (a prefix-cache hit claims it back)."""
        bid = block.block_id
        if self._lru.pop(bid, None) is None:
            self.buddy.take(bid)
        self.num_free_blocks -= 1

    def append(self, block) -> None:
        self._lru[block.block_id] = block
        self.num_free_blocks += 1

    def append_n(self, blocks) -> None:
        """Free blocks with a hash: most recently used end of the LRU tier."""
        lru = self._lru
        for block in blocks:
            lru[block.block_id] = block
        self.num_free_blocks = self.buddy.num_free + len(lru)

    def prepend_n(self, blocks) -> None:
        """Free blocks without a hash: straight back to the buddy (they merge there)."""
        if blocks:
            self.buddy.free([b.block_id for b in blocks])
            self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list:
        blocks = self._blocks
        return [blocks[i] for i in range(len(blocks)) if self.buddy.is_free(i)] + list(
            self._lru.values())

    def iter_blocks_after(self, cursor) -> Iterator:
        """Cached free blocks in eviction order after ``cursor`` (the offload connectors'
        view: these are the blocks that carry KV worth saving)."""
        started = cursor is None
        for block in list(self._lru.values()):
            if started:
                yield block
            elif block is cursor:
                started = True


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
            self.proxima_finished = FinishedTally()
            self.proxima_status = StatusWriter(STATUS_INTERVAL_S)
            import vllm

            logger.info("%s: %d blocks of %d tokens (vLLM %s, V1 engine)", activation.LOG_LINE,
                        self.num_gpu_blocks, self.hash_block_size, vllm.__version__)
            self.publish_status(check=True)

        def reset_prefix_cache(self) -> bool:
            ok = super().reset_prefix_cache()
            if ok:
                # Stock dropped every hash; the LRU tier's blocks are plain free blocks now.
                queue = self.free_block_queue
                queue._demote(len(queue._lru))
            return ok

        def proxima_stats(self) -> dict:
            queue = self.free_block_queue
            per_request = running_blocks_per_run(self.proxima_managers)
            import vllm

            return {
                "active": True, "engine": "vllm-v1", "vllm_version": vllm.__version__,
                "num_blocks": self.num_gpu_blocks, "block_size": self.hash_block_size,
                "allocator": queue.buddy.stats(), "num_evictable": queue.num_evictable,
                "num_free_blocks": queue.num_free_blocks, "demoted_total": queue.demoted,
                "running_blocks_per_run": per_request,
                "finished_blocks_per_run": self.proxima_finished.as_status(),
                "alloc_seconds_total": queue.alloc_seconds, "steps": self.proxima_steps,
            }

        def publish_status(self, check: bool = False, now: bool = False) -> None:
            """Write the status file (if PROXIMA_STATS_FILE is set): at most once a second,
            unless ``check`` (invariants checked now) or ``now``. Every snapshot carries the
            last invariant verdict, renewed at most once a minute (``StatusWriter``)."""
            self.proxima_status.publish(self.proxima_stats, self.free_block_queue.buddy,
                                        force=now, check=check)

    return ProximaBlockPool


# ----------------------------------------------------------------------------- patching

_saved: list[tuple[object, str, object]] = []
ProximaBlockPool = None


def _wrap_allocate_new_blocks(original):
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        # Called for every scheduled request every step; most calls need no block, and
        # those go straight through (this is the scheduler's hot loop).
        req_blocks = self.req_to_blocks.get(request_id)
        have = len(req_blocks) if req_blocks else 0
        if num_tokens <= have * self.block_size and not self._partial_hit_reqs:
            return original(self, request_id, num_tokens, num_tokens_main_model)
        pool = self.block_pool
        queue = pool.free_block_queue
        if queue.__class__ is not ProximaFreeQueue:
            return original(self, request_id, num_tokens, num_tokens_main_model)
        last = req_blocks[-1] if req_blocks else None
        queue.after = None if last is None or last.is_null else last.block_id
        total = pool.proxima_expected_tokens.get(request_id)
        queue.room = None if total is None else -(-total // self.block_size) - have
        # Room for everyone twice over: spread runs out (they may outgrow their room);
        # otherwise pack them (see BuddyAllocator.allocate).
        queue.spread = 2 * pool.proxima_expected_blocks <= pool.num_gpu_blocks
        try:
            return original(self, request_id, num_tokens, num_tokens_main_model)
        finally:
            queue.after = queue.room = None
            if pool.proxima_status.path is not None:
                if self not in pool.proxima_managers:
                    pool.proxima_managers.append(self)
                pool.publish_status()

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
                   _wrap_allocate_new_blocks(cls.__dict__["allocate_new_blocks"]))


def deactivate() -> None:
    """Undo :func:`activate`: engines built afterwards are stock vLLM again."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
