"""A recorded mix of KV block allocations, replayed on Proxima and on vLLM's free queue.

The trace is what vLLM's scheduler asks of its block pool while serving a ShareGPT-like
load (lognormal prompt/output lengths, up to 256 requests in flight): for each request one
prefill allocation, then one block every 16 decoded tokens, then a free of every block;
now and then a prefix-cache hit claims a just-freed block back. Ops are request-level
(``alloc rid n`` / ``free rid`` / ``hit``), so each allocator replays them with its own ids.
"""

from __future__ import annotations

import math
import random

BLOCK = 16


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


def replay_proxima(ops, num_blocks: int) -> int:
    from proxima.allocator import BuddyAllocator

    a = BuddyAllocator(num_blocks, reserved=(0,))
    held: dict[int, list[int]] = {}
    last_freed: list[int] = []
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            _, rid, n, total = op
            ids = held.get(rid)
            if ids is None:
                held[rid] = a.allocate(n, room=total)
            else:
                ids += a.allocate(n, after=ids[-1], room=total - len(ids))
        elif kind == "free":
            ids = held.pop(op[1])
            a.free(ids)
            last_freed = ids
        elif last_freed and a.is_free(last_freed[0]):
            a.take(last_freed[0])
            held[-len(held) - 1] = [last_freed[0]]
    return len(ops)


def replay_vllm(ops, num_blocks: int) -> int:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    q = FreeKVCacheBlockQueue(blocks)
    q.popleft()                            # the null block, as BlockPool does
    held: dict[int, list] = {}
    last_freed: list = []
    for op in ops:
        kind = op[0]
        if kind == "alloc":
            _, rid, n, _total = op
            got = q.popleft_n(n)
            if rid in held:
                held[rid] += got
            else:
                held[rid] = got
        elif kind == "free":
            got = held.pop(op[1])
            q.append_n(list(reversed(got)))   # vLLM frees a request tail first
            last_freed = got
        elif last_freed and last_freed[0].prev_free_block is not None:
            q.remove(last_freed[0])
            held[-len(held) - 1] = [last_freed[0]]
    return len(ops)
