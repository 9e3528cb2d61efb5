"""Proxima inside vLLM 0.26's V1 engine. Thin: the placement logic is proxima.allocator's.

What changes when active, and nothing else:

* ``BlockPool.free_block_queue`` (vLLM's ``FreeKVCacheBlockQueue``, a doubly linked list
  in eviction order) becomes a :class:`~proxima.vllm.free_queue.ProximaFreeQueue` with
  the same methods (its tiers: see that module). Every
  other line of ``BlockPool`` -- ref counts, the null block, prefix-cache hashing and
  eviction, KV events, metrics -- is vLLM's own code, run unchanged.
* Each ``SingleTypeKVCacheManager.allocate_new_blocks`` (the one place that knows which
  request a block is for) tells the queue "continue after this request's last block" and
  how many blocks the request may still need (one :class:`~proxima.allocator.hint.
  AllocationHint`, ``queue.hint``), so prefill chunks and decode steps extend the
  request's run in place.

The pool chooses its queue when it is built (:class:`ProximaFreeQueue`, or the elastic
pool's granule-aware one): the wrappers below ask the queue what it does
(``takes_hints``, ``classes_preempted``), not a registry.
"""

from __future__ import annotations

import logging

from proxima.vllm import activation
from proxima.vllm.contiguity import idle, running_blocks_per_run
from proxima.vllm import patches
from proxima.vllm.free_queue import ProximaFreeQueue  # noqa: F401 - vLLM's queue's stand-in
from proxima.vllm.patches import Patch
from proxima.vllm.pool_state import PoolState
from proxima.vllm.status import STATUS_INTERVAL_S, StatusWriter

logger = logging.getLogger("vllm.proxima")

PATCHES = "v1"          # the name of this adapter's patch set (proxima.vllm.patches)


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
            # Proxima's one attribute on the pool: everything it keeps per pool
            self.proxima = PoolState(StatusWriter(STATUS_INTERVAL_S))
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
            (:class:`proxima.vllm.elastic_pool.GranuleFreeQueue`) with ``mapped``
            granules backed (None: all). Only on a fresh pool (nothing handed out but the
            null block); returns the new queue."""
            from proxima.allocator.eviction import EvictionPolicy
            from proxima.vllm.elastic_pool import GranuleFreeQueue

            queue = self.free_block_queue
            if queue.num_free_blocks != self.num_gpu_blocks - 1 or len(queue._lru):
                raise RuntimeError("the pool's free queue can become granule-aware only "
                                   "before any block was handed out")
            queue = GranuleFreeQueue(
                self.blocks, reserved=(self.null_block.block_id,),
                granule_blocks=granule_blocks, eviction=eviction or EvictionPolicy(),
                mapped=mapped,
                evict=self._maybe_evict_cached_block if self.enable_caching else None)
            queue.tick(self.proxima.steps)
            self.free_block_queue = queue
            self.proxima.tick = queue.tick
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
            queue, state = self.free_block_queue, self.proxima
            per_request = running_blocks_per_run(state.managers)
            import vllm

            out = {
                "active": True, "engine": "vllm-v1", "vllm_version": vllm.__version__,
                "num_blocks": self.num_gpu_blocks, "block_size": self.hash_block_size,
                "allocator": queue.buddy.stats(), "num_evictable": queue.num_evictable,
                "num_free_blocks": queue.num_free_blocks, "demoted_total": queue.demoted,
                "running_blocks_per_run": per_request,
                "finished_blocks_per_run": state.finished.as_status(),
                "alloc_seconds_total": queue.alloc_seconds, "steps": state.steps,
                **({"compaction": state.compaction.stats()}
                   if state.compaction is not None else {}),
            }
            granule_stats = getattr(queue, "granule_stats", None)
            if granule_stats is not None:
                out["granules"] = granule_stats()
            if state.elastic is not None:
                out["elastic"] = state.elastic()
            return out

        def publish_status(self, check: bool = False, now: bool = False,
                           wait: bool | None = None) -> None:
            """Write the status file (if PROXIMA_STATS_FILE is set): at most once a second,
            unless ``check`` (invariants checked now) or ``now``. Every snapshot carries the
            last invariant verdict, renewed at most once a minute (``StatusWriter``, which
            also says when it is on disk: ``wait``)."""
            self.proxima.status.publish(self.proxima_stats, self.free_block_queue.buddy,
                                        force=now, check=check, wait=wait)

    return ProximaBlockPool


# ----------------------------------------------------------------------------- patching

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
        if not getattr(queue, "takes_hints", False):      # a stock queue: no hints
            return original(self, request_id, num_tokens, *args, **kwargs)
        state = pool.proxima
        last = req_blocks[-1] if req_blocks else None
        total = state.expected_tokens.get(request_id)
        if total is None:
            room = None
        else:
            # Blocks it may still need; with a partial prefix hit vLLM first takes a
            # copy-on-write block for the shared last one, so the run holds one more.
            room = -(-total // self.block_size) - have + partial_hit
            room = room if room > 0 else 0
        # The one place a hint is set: vLLM's get_new_blocks pops with popleft_n(n) alone,
        # so the queue holds it for the pops of this call. after: the request's last block;
        # spread: room for everyone twice over, so runs spread out (they may outgrow their
        # room), else pack (RunAllocator.allocate); end: the step this request is expected
        # to finish at, now + the tokens it may still generate (elastic placement groups
        # blocks that end together).
        queue.hint = (                  # (after, room, spread, end): a plain tuple is a hint
            None if last is None or last.is_null else last.block_id, room,
            2 * state.expected_blocks <= pool.num_gpu_blocks,
            state.steps + (total - num_tokens if total and total > num_tokens else 0))
        try:
            new_blocks = original(self, request_id, num_tokens, *args, **kwargs)
        finally:
            queue.hint = None
            if state.status.path is not None and self not in state.managers:
                state.managers.append(self)      # the status reads their tables
        compaction = state.compaction
        if compaction is not None and new_blocks:
            # KV compaction may place the new blocks elsewhere (proxima.vllm.compaction_v1)
            return compaction.on_allocate(self, request_id, new_blocks)
        return new_blocks

    allocate_new_blocks.__wrapped__ = original
    allocate_new_blocks.__doc__ = original.__doc__
    return allocate_new_blocks


def _wrap_add_request(original):
    def add_request(self, request) -> None:
        # Remember how long the request may grow (prompt + max_tokens): the growth hint.
        pool = self.kv_cache_manager.block_pool
        state = getattr(pool, "proxima", None)
        if state is not None:
            state.expect(request.request_id, request.num_prompt_tokens + request.max_tokens,
                         pool.hash_block_size)
        return original(self, request)

    add_request.__wrapped__ = original
    add_request.__doc__ = original.__doc__
    return add_request


def _wrap_free(original):
    def free(self, request) -> None:
        pool = self.block_pool
        if not request.is_finished() and getattr(pool.free_block_queue, "classes_preempted",
                                                 False):
            # elastic mode: blocks freed by a preemption are cached as their own class
            queue = pool.free_block_queue
            queue.free_class = PREEMPTED_CLASS
            try:
                return original(self, request)
            finally:
                queue.free_class = 0
        state = getattr(pool, "proxima", None)
        if not request.is_finished() or state is None:
            return original(self, request)          # preemption, or a stock pool
        state.forget(request.request_id, pool.hash_block_size)
        if state.status.path is None:
            return original(self, request)
        managers = self.coordinator.single_type_managers
        state.finished.add(managers, request.request_id)
        original(self, request)
        if idle(managers):
            pool.publish_status(now=True)

    free.__wrapped__ = original
    free.__doc__ = original.__doc__
    return free


def _wrap_new_step_starts(original):
    def new_step_starts(self) -> None:
        pool = self.block_pool
        state = getattr(pool, "proxima", None)
        if state is not None:
            state.steps += 1               # the metrics' "allocator seconds per step"
            if state.tick is not None:
                state.tick(state.steps)
            if state.status.path is not None:
                pool.publish_status()      # at most once a second (once a step, not per
                                           # allocation: the clock read is the whole cost)
            state.kv_manager = self        # the managers' block lists, for KV compaction
        return original(self)

    new_step_starts.__wrapped__ = original
    new_step_starts.__doc__ = original.__doc__
    return new_step_starts


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def is_active() -> bool:
    """Whether Proxima is installed in vLLM's V1 classes."""
    return patches.is_applied(PATCHES)


def activate() -> None:
    """Install Proxima into vLLM's V1 classes (idempotent). Engines built afterwards use it.

    The version policy is asked first (:func:`proxima.vllm.patches.gate`): an
    untested vLLM is refused unless ``PROXIMA_ALLOW_UNTESTED_VLLM=1`` (ActivationError,
    nothing patched). Whether Proxima is wanted at all (``PROXIMA_ALLOCATOR``) is the
    caller's question: the plugin asks it."""
    if patches.is_applied(PATCHES):
        return
    patches.apply(patches.PatchSet(PATCHES, "v1", _patches))


def _patches() -> list:
    """The V1 patches (built after the version gate)."""
    global ProximaBlockPool
    import vllm
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.sched.scheduler as scheduler
    import vllm.v1.core.single_type_kv_cache_manager as managers

    if ProximaBlockPool is None:
        ProximaBlockPool = _block_pool_class()
    manager = kv_cache_manager.KVCacheManager
    out = [Patch(coordinator, "BlockPool", ProximaBlockPool),
           Patch(scheduler.Scheduler, "add_request",
                 _wrap_add_request(scheduler.Scheduler.add_request)),
           Patch(manager, "free", _wrap_free(manager.free)),
           Patch(manager, "new_step_starts", _wrap_new_step_starts(manager.new_step_starts))]
    base = managers.SingleTypeKVCacheManager
    plain = vllm.__version__ in PLAIN_ALLOCATE_RELEASES
    for cls in (base, *_all_subclasses(base)):
        if "allocate_new_blocks" in cls.__dict__:
            out.append(Patch(cls, "allocate_new_blocks",
                             _wrap_allocate_new_blocks(cls.__dict__["allocate_new_blocks"],
                                                       plain=plain and cls is base)))
    return out


#: The vLLM releases whose ``SingleTypeKVCacheManager.allocate_new_blocks`` the fast path
#: of :func:`_wrap_allocate_new_blocks` was written against (0.26.0; 0.33.0 has the same
#: body): a request holding blocks enough and no partial prefix hit gets a new empty list
#: and nothing else happens. tests/contract checks that on the installed release when it
#: is listed here; any other release (an untested one under the override, a subclass's
#: own method) gets the plain wrapper, a call straight through.
PLAIN_ALLOCATE_RELEASES = ("0.26.0", "0.33.0")


def deactivate() -> None:
    """Undo :func:`activate`: engines built afterwards are stock vLLM again."""
    patches.restore(PATCHES)
