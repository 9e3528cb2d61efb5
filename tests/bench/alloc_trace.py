"""A recorded mix of KV block allocations, replayed on Proxima and on vLLM's free queue.

The trace is what vLLM's scheduler asks of its block pool while serving a ShareGPT-like
load (lognormal prompt/output lengths, up to 256 requests in flight): for each request one
prefill allocation, then one block every 16 decoded tokens, then a free of every block;
now and then a just-freed block is claimed back (``remove``, what a prefix-cache hit does).
Ops are request-level (``alloc rid n total`` / ``free rid`` / ``hit``), so each allocator
replays them with its own ids.

Every side sees the operations in vLLM's real order: a request's blocks are freed tail
first (``SingleTypeKVCacheManager.free`` reverses the block table, and ``BlockPool``
hands blocks without a hash to ``prepend_n`` in that order). Three replays:

* ``replay_vllm``: vLLM 0.26's ``FreeKVCacheBlockQueue`` (``popleft_n``, ``prepend_n``,
  ``remove``) over ``KVCacheBlock`` objects;
* ``replay_proxima``: ``proxima.allocator.RunAllocator`` on ids (``allocate`` with the
  growth hint the V1 adapter computes, ``free`` of the reversed ids, ``take``);
* ``replay_proxima_queue``: Proxima's drop-in ``ProximaFreeQueue`` over the same
  ``KVCacheBlock`` objects, hints set as ``_wrap_allocate_new_blocks`` sets them.

Each returns a :class:`Tally` of what it did; the three tallies of one trace are equal.
The pool is built by ``setup_*`` outside the timed replay. The three loops are written
out on purpose: one loop calling per-side functions would add a call per operation to
every side and blur a comparison of sub-microsecond operations.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

BLOCK = 16


class Tally(NamedTuple):
    ops: int
    allocated: int        # ids handed out by allocations
    freed: int            # ids given back
    taken: int            # just-freed ids claimed back (``hit``)
    free_at_end: int      # free ids once the trace is over


def make_trace(num_requests: int = 2000, in_flight: int = 256, seed: int = 0):
    rng = random.Random(seed)
    ops: list[tuple] = []
    live: dict[int, list[int]] = {}        # rid -> [blocks held, blocks still to grow]
    next_rid = 0
    while next_rid < num_requests or live:
        while next_rid < num_requests and len(live) < in_flight:
            prompt = max(4, min(4096, int(rng.lognormvariate(math.log(220), 1.0))))
            out = max(1, min(2048, int(rng.lognormvariate(math.log(180), 0.9))))
            first = -(-prompt // BLOCK)
            total = -(-(prompt + out) // BLOCK)
            ops.append(("alloc", next_rid, first, total))
            live[next_rid] = [first, total - first]
            next_rid += 1
        rid = rng.choice(list(live))
        held, todo = live[rid]
        if todo:
            ops.append(("alloc", rid, 1, held + todo))
            live[rid] = [held + 1, todo - 1]
        else:
            ops.append(("free", rid))
            del live[rid]
            if rng.random() < 0.2:
                ops.append(("hit",))
    return ops


def setup_proxima(num_blocks: int):
    from proxima.allocator import RunAllocator

    return RunAllocator(num_blocks, reserved=(0,))


def replay_proxima(ops, a) -> Tally:
    held: dict[int, list[int]] = {}
    last_freed: list[int] = []
    allocated = freed = taken = 0
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            _, rid, n, total = op
            ids = held.get(rid)
            if ids is None:
                held[rid] = a.allocate(n, (None, total, False, 0))
            else:
                ids += a.allocate(n, (ids[-1], total - len(ids), False, 0))
            allocated += n
        elif kind == "free":
            ids = held.pop(op[1])
            ids.reverse()                      # vLLM's order: tail first
            a.free(ids)
            freed += len(ids)
            last_freed = ids
        elif last_freed and a.is_free(last_freed[0]):
            a.take(last_freed[0])
            held[-len(held) - 1] = [last_freed[0]]
            taken += 1
    return Tally(len(ops), allocated, freed, taken, a.num_free)


def _kv_blocks(num_blocks: int):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return [KVCacheBlock(i) for i in range(num_blocks)]


def setup_vllm(num_blocks: int):
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    q = FreeKVCacheBlockQueue(_kv_blocks(num_blocks))
    q.popleft()                            # the null block, as BlockPool does
    return q


def replay_vllm(ops, q) -> Tally:
    held: dict[int, list] = {}
    last_freed: list = []
    allocated = freed = taken = 0
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            _, rid, n, _total = op
            got = q.popleft_n(n)
            if rid in held:
                held[rid] += got
            else:
                held[rid] = got
            allocated += n
        elif kind == "free":
            got = held.pop(op[1])
            got.reverse()                      # vLLM's order: tail first
            q.prepend_n(got)
            freed += len(got)
            last_freed = got
        elif last_freed and last_freed[0].prev_free_block is not None:
            q.remove(last_freed[0])
            held[-len(held) - 1] = [last_freed[0]]
            taken += 1
    return Tally(len(ops), allocated, freed, taken, q.num_free_blocks)


def setup_proxima_queue(num_blocks: int):
    from proxima.vllm.vllm_v1 import ProximaFreeQueue

    return ProximaFreeQueue(_kv_blocks(num_blocks), reserved=(0,))


def replay_proxima_queue(ops, q) -> Tally:
    held: dict[int, list] = {}
    last_freed: list = []
    allocated = freed = taken = 0
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            _, rid, n, total = op
            got = held.get(rid)
            if got is None:
                q.hint = (None, total, False, 0)
                held[rid] = q.popleft_n(n)
            else:
                q.hint = (got[-1].block_id, total - len(got), False, 0)
                got += q.popleft_n(n)
            q.hint = None
            allocated += n
        elif kind == "free":
            got = held.pop(op[1])
            got.reverse()                      # vLLM's order: tail first
            q.prepend_n(got)
            freed += len(got)
            last_freed = got
        elif last_freed and q.buddy.is_free(last_freed[0].block_id):
            q.remove(last_freed[0])
            held[-len(held) - 1] = [last_freed[0]]
            taken += 1
    return Tally(len(ops), allocated, freed, taken, q.num_free_blocks)
