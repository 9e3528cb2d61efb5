"""The elastic free queue's operations in (d)'s closed loop, recorded and replayed alone.

:func:`record` runs the CPU replay of issue 13's proof (d) -- ShareGPT-like requests in a
closed loop of 256 through vLLM's real scheduler (async scheduling) on an elastic Proxima
pool, the default policy -- and records, in order, every call vLLM's block pool and the
elastic connector make on the :class:`~proxima.vllm.elastic_pool.GranuleFreeQueue`: the
hand-outs (``popleft_n`` with the growth hint and expected end set for it, and the ids it
returned), the frees (``append_n`` with the blocks' hashes, ``prepend_n``), prefix-cache
hits (``remove``), lookup misses, ticks, releases and maps.

:func:`replay` builds a fresh queue over fresh ``KVCacheBlock`` objects and makes the same
calls, timing each kind. A hand-out that returns other ids than it did in the recording is
counted in ``mismatches``: a change to the queue that keeps its decisions replays a trace
recorded before it with none. ``thrash`` (floats summed between two calls) stands for
what the scheduler runs between two of them: in an engine the queue's code and data are
mostly out of the cache when it is called.
"""

from __future__ import annotations

import collections
import json
import sys
from time import perf_counter


def replay_d(which: str, requests: int, num_blocks: int):
    """(d)'s closed loop in the CPU replay: ``requests`` ShareGPT-like requests, 256 in
    flight, async scheduling, ``num_blocks`` blocks; ``which`` is stock, proxima or elastic
    (the default policy, a 12 s release delay)."""
    from proxima.replay.driver_v1 import run_replay
    from proxima.replay.elastic import ElasticReplay
    from proxima.workloads import Workload, make_workload

    workload = make_workload("sharegpt", requests)
    workload = Workload(workload.name, workload.requests, 256)
    kw = {"elastic": ElasticReplay(policy="auto", release_delay_s=12)} \
        if which == "elastic" else {}
    return run_replay(workload, proxima=which != "stock", num_blocks=num_blocks,
                      async_scheduling=True, max_num_seqs=256, **kw)


def record(requests: int = 400, num_blocks: int = 20480) -> dict:
    """The queue's calls in the replay of ``requests`` requests (a dict: ``init``, ``ops``)."""
    from proxima.vllm import elastic_pool

    Q = elastic_pool.GranuleFreeQueue
    ops: list[tuple] = []
    init: dict = {}
    saved = {name: Q.__dict__[name] for name in
             ("__init__", "tick", "popleft_n", "remove", "append_n", "prepend_n",
              "on_lookup_miss", "release", "on_mapped")}

    def __init__(self, blocks, reserved=(0,), **kw):
        init.update(num_blocks=len(blocks), reserved=reserved,
                    **{k: v for k, v in kw.items() if k != "evict"})
        saved["__init__"](self, blocks, reserved, **kw)
        self._recording = True                   # from here on (its own first tick too)
        ops.append(("tick", self.now))

    def recorded(name, entry, before=None):
        def call(self, *args):
            if not getattr(self, "_recording", False):
                return saved[name](self, *args)
            pre = before(self) if before else None
            self._recording = False              # the calls it makes itself are not ops
            try:
                out = saved[name](self, *args)
            finally:
                self._recording = True
            ops.append(entry(self, args, out, pre))
            return out
        return call

    def hint(q):                # (after, room, end, spread); a pop without a hint places
        h = q.hint              # as one with neither after nor room and the last end
        if h is None:
            return (None, None, q.last_end, False)
        after, room, spread, end = h                # a hint is this tuple (allocator.hint)
        return (after, room, end, spread)
    patches = {
        "__init__": __init__,
        "tick": recorded("tick", lambda q, a, o, p: ("tick", a[0])),
        "popleft_n": recorded("popleft_n", lambda q, a, o, p: (
            "pop", a[0], *p, [b.block_id for b in o]), hint),
        "remove": recorded("remove", lambda q, a, o, p: ("remove", a[0].block_id)),
        "append_n": recorded("append_n", lambda q, a, o, p: (
            "append", [b.block_id for b in a[0]], q.free_class,
            [b.block_hash for b in a[0]])),
        "prepend_n": recorded("prepend_n", lambda q, a, o, p: (
            "prepend", [b.block_id for b in a[0]])),
        "on_lookup_miss": recorded("on_lookup_miss", lambda q, a, o, p: ("miss", a[0])),
        "release": recorded("release", lambda q, a, o, p: ("release", list(a[0]), o)),
        "on_mapped": recorded("on_mapped", lambda q, a, o, p: ("mapped", list(a[0]))),
    }
    try:
        for name, fn in patches.items():
            setattr(Q, name, fn)
        replay_d("elastic", requests, num_blocks)
    finally:
        for name, fn in saved.items():
            setattr(Q, name, fn)
    return {"init": init, "ops": ops}


def setup(trace: dict):
    """A fresh queue and its blocks, as the recording's start found them."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from proxima.vllm.elastic_pool import GranuleFreeQueue

    init = dict(trace["init"])
    blocks = [KVCacheBlock(i) for i in range(init.pop("num_blocks"))]

    def evict(block):                        # what vLLM's pool does for a released block
        block.reset_hash()

    queue = GranuleFreeQueue(blocks, init.pop("reserved"), evict=evict, **init)
    return queue, blocks


def replay(trace: dict, queue, blocks, thrash: int = 0) -> tuple[dict, int]:
    """Make the recorded calls on ``queue``: (seconds per kind of call, mismatches)."""
    from proxima.allocator import AllocationHint

    seconds: collections.Counter = collections.Counter()
    mismatches = 0
    junk = [float(i) for i in range(thrash)] if thrash else None
    for op in trace["ops"]:
        kind = op[0]
        if junk is not None:
            sum(junk)
        if kind == "pop":
            _, n, after, room, end, spread, want = op
            queue.hint = AllocationHint(after, room, spread, end)
            t0 = perf_counter()
            out = queue.popleft_n(n)
            seconds[kind] += perf_counter() - t0
            queue.hint = None
            got = [b.block_id for b in out]
            for block in out:                    # vLLM's get_new_blocks drops their hashes
                block.reset_hash()
            mismatches += got != want
        elif kind == "append":
            chosen = [blocks[i] for i in op[1]]
            for block, key in zip(chosen, op[3]):
                if block.block_hash != key:          # (a hit kept its hash: it is the same)
                    block.reset_hash()
                    block.set_block_hash(key)
            queue.free_class = op[2]
            t0 = perf_counter()
            queue.append_n(chosen)
            seconds[kind] += perf_counter() - t0
            queue.free_class = 0
        else:
            t0 = perf_counter()
            if kind == "tick":
                queue.tick(op[1])
            elif kind == "remove":
                queue.remove(blocks[op[1]])
            elif kind == "prepend":
                queue.prepend_n([blocks[i] for i in op[1]])
            elif kind == "miss":
                queue.on_lookup_miss(op[1])
            elif kind == "release":
                mismatches += queue.release(op[1]) != op[2]
            elif kind == "mapped":
                queue.on_mapped(op[1])
            else:
                raise ValueError(f"unknown op {kind!r} in the trace")
            seconds[kind] += perf_counter() - t0
    return dict(seconds), mismatches


def main(argv: list[str]) -> int:
    """``python -m tests.bench.elastic_trace [REQUESTS]``: record (d)'s calls (default 1,500
    requests), replay them on fresh queues warm and cold (``thrash`` 100,000 and 400,000
    floats between calls; best of 5, 3 and 2 rounds) and print one JSON line each: the
    hand-outs' mean in us, the frees' (with a hash) and ticks' totals in ms."""
    if len(argv) > 1 or (argv and not argv[0].isdigit()):
        print("usage: python -m tests.bench.elastic_trace [REQUESTS]", file=sys.stderr)
        return 2
    trace = record(int(argv[0]) if argv else 1500)
    pops = sum(1 for op in trace["ops"] if op[0] == "pop")
    for label, thrash, rounds in (("warm", 0, 5), ("cold", 100_000, 3), ("cold400k", 400_000, 2)):
        best = None
        for _ in range(rounds):
            queue, blocks = setup(trace)
            seconds, mismatches = replay(trace, queue, blocks, thrash=thrash)
            if mismatches:
                print(f"elastic_trace: {mismatches} hand-outs differ from the recording",
                      file=sys.stderr)
                return 1
            if best is None or seconds["pop"] < best["pop"]:
                best = seconds
        print(json.dumps({"replay": label, "hand_outs": pops,
                          "us_per_hand_out": round(1e6 * best["pop"] / pops, 2),
                          "frees_ms": round(1e3 * best.get("append", 0.0), 1),
                          "ticks_ms": round(1e3 * best.get("tick", 0.0), 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
