"""KV compaction's mechanism on the scheduler side: vLLM's state read into the planner's
:class:`~proxima.allocator.planner.PoolView`, a plan applied to vLLM's structures by its
net effect, and the step's :class:`~proxima.vllm.compaction_worker.CompactionWork` for
the workers. A part of :class:`~proxima.vllm.compaction_v1.Compactor` (which decides
when and what to move, and sets the state these methods share: the pool, the KV manager,
the view, the pinned blocks, the step's relocations and table changes, the counters).

How a relocation of a LIVE or a CACHED block changes vLLM's structures, and why no
scheduling decision changes: :mod:`proxima.vllm.compaction_v1`.
"""

from __future__ import annotations

from proxima.allocator.planner import (CACHED, FIXED, FREE, LIVE, Plan, PoolView,
                                       schedule_phases)
from proxima.vllm.compaction_worker import CompactionWork


class PlanApplication:
    """Reading vLLM into a view, applying plans, handing the step's work out (a part of
    :class:`~proxima.vllm.compaction_v1.Compactor`)."""

    def take_work(self) -> CompactionWork | None:
        """This step's copies and table changes (None when nothing moved), for the workers."""
        if self._plan_seconds:
            self.plan_ms.add(self._plan_seconds * 1000)
        if not self._relocations:
            return None
        relocations, self._relocations = self._relocations, []
        tables, self._tables = self._tables, {}
        phases = schedule_phases(relocations)
        by_row: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
        # a request preempted later in the same schedule() holds no blocks any more (its
        # row goes on the worker); its moved blocks went back to the pool with it
        holding = {(mgr.kv_cache_group_id, r) for mgr in self._managers()
                   for r, blocks in mgr.req_to_blocks.items() if blocks}
        for (req_id, group, idx), new_id in sorted(tables.items()):
            if (group, req_id) not in holding:
                continue
            cols, ids = by_row.setdefault((req_id, group), ([], []))
            cols.append(idx)
            ids.append(new_id)
        self._seq += 1
        c = self.counters
        c["steps_with_moves"] += 1
        c["phases"] += len(phases)
        self.blocks_per_step.add(len(relocations))
        return CompactionWork(self._seq, tuple(tuple(p) for p in phases),
                              tuple((rid, g, tuple(cols), tuple(ids))
                                    for (rid, g), (cols, ids) in by_row.items()),
                              len(relocations))

    # ------------------------------------------------------------------ reading vLLM
    def _managers(self):
        kv = self.kv_manager
        return kv.coordinator.single_type_managers if kv is not None else ()

    def view(self) -> PoolView:
        """The pool as the planner sees it now (built once per step, kept up to date as
        plans are applied). O(num_blocks) in C plus O(blocks held by requests)."""
        if self._view is not None:
            return self._view
        pool = self.pool
        n = pool.num_gpu_blocks
        kinds = bytearray([CACHED]) * n          # free blocks outside the buddy: the LRU tier
        for start, end in pool.free_block_queue.buddy.free_runs():
            kinds[start:end] = bytes(end - start)
        for mgr in self._managers():
            for blocks in mgr.req_to_blocks.values():
                for block in blocks:                 # the null block: FIXED just below
                    kinds[block.block_id] = LIVE
        kinds[pool.null_block.block_id] = FIXED
        if self.allocatable is not None:
            G = self.granule_blocks
            for g in range(-(-n // G)):
                if not self.allocatable(g):
                    kinds[g * G:(g + 1) * G] = bytes([FIXED]) * len(range(g * G, min(n, (g + 1) * G)))
        null = pool.null_block.block_id
        self._pinned.discard(null)
        scratch = [null]
        if self.scratch_blocks:
            first = self.scratch_first
            kinds += bytes([FIXED]) * (first + self.scratch_blocks - n)
            scratch += range(first, first + self.scratch_blocks)
        self._view = PoolView(kinds, self.granule_blocks, self._pinned, scratch=scratch)
        return self._view

    # ------------------------------------------------------------------ applying
    def apply(self, plan: Plan) -> bool:
        """Apply ``plan`` to vLLM's structures (module doc), by its net effect (each moved
        content from its first to its last id; a stay in the scratch id leaves no trace),
        after checking that every block involved is what the view said: a mismatch pins
        that block, drops the plan (the view is rebuilt next time) and returns False."""
        if not plan:
            return True
        moves = plan.final_positions()                 # original id -> final id
        holders = self._holders(set(moves))
        bad = self._mismatch(moves, holders)
        if bad is not None:
            self.counters["replans"] += 1
            self._pinned.add(bad)
            self._view = None
            return False
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        pool = self.pool
        blocks = pool.blocks
        queue = pool.free_block_queue
        kinds = self._view.kinds
        c = self.counters
        # Take every moved content off its block: reference counts, owners, and the
        # prefix-cache entries (parked on stand-in blocks, vLLM's own move_block_hashes).
        parked = {}
        cached_moves = []
        for i, (x, y) in enumerate(moves.items()):
            src = blocks[x]
            stand_in = None
            if src.block_hash is not None or x in pool.cached_block_hashes_by_block:
                stand_in = KVCacheBlock(block_id=-2 - i)
                pool.move_block_hashes(src, stand_in)
            parked[x] = (src.ref_cnt, stand_in)
            if src.ref_cnt == 0:
                cached_moves.append((src, blocks[y]))
        final = set(moves.values())
        taken = [y for y in final if y not in moves]          # were free, hold content now
        freed = [x for x in moves if x not in final]          # held content, free now
        queue.relocate(cached_moves, freed, taken, moves=moves)
        for x, y in moves.items():
            ref_cnt, stand_in = parked[x]
            blocks[x].ref_cnt = 0
        for x, y in moves.items():
            ref_cnt, stand_in = parked[x]
            dst = blocks[y]
            dst.ref_cnt = ref_cnt
            if stand_in is not None:
                pool.move_block_hashes(stand_in, dst)
            for mgr, req_id, idx in holders.get(x, ()):
                mgr.req_to_blocks[req_id][idx] = dst
                self._tables[(req_id, mgr.kv_cache_group_id, idx)] = y
            c["live_moved" if ref_cnt else "cached_moved"] += 1
            if ref_cnt > 1:
                c["shared_moved"] += 1
        if self._single is not None:            # moved blocks are no longer where they were
            for x in moves:
                self._single.pop(x, None)
                if x < len(self._maps.lone):
                    self._maps.lone[x] = 0
        new_kinds = {y: kinds[x] for x, y in moves.items()}
        for x in freed:
            kinds[x] = FREE
        for y, k in new_kinds.items():
            kinds[y] = k
        self._relocations += plan.relocations
        scratch = self._view.scratch
        c["scratch_used"] += sum(1 for _, d in plan.relocations if d in scratch)
        c["relocations"] += plan.blocks_moved
        c["bytes_moved"] += plan.blocks_moved * self.bytes_per_block
        return True

    def _holders(self, ids: set[int]) -> dict[int, list]:
        """``{block id: [(manager, request id, position), ...]}`` for the given ids."""
        out: dict[int, list] = {}
        for mgr in self._managers():
            for req_id, blocks in mgr.req_to_blocks.items():
                for idx, block in enumerate(blocks):
                    if block.block_id in ids and not block.is_null:
                        out.setdefault(block.block_id, []).append((mgr, req_id, idx))
        return out

    def _mismatch(self, moves: dict[int, int], holders: dict[int, list]) -> int | None:
        """The first block whose real state differs from what the plan assumed, or None:
        a moved LIVE block must be held exactly by the owners found (its reference count),
        a moved CACHED block must be in the LRU tier with a hash, a block that receives a
        content and held none must be a free block of the buddy tier."""
        blocks = self.pool.blocks
        queue = self.pool.free_block_queue
        kinds = self._view.kinds
        for x in moves:
            blk = blocks[x]
            if kinds[x] == LIVE:
                if blk.ref_cnt < 1 or blk.ref_cnt != len(holders.get(x, ())):
                    return x
            elif kinds[x] == CACHED:
                if blk.ref_cnt or blk.block_hash is None or blk.next_free_block is None:
                    return x
            else:
                return x
        for y in moves.values():
            if y not in moves:
                blk = blocks[y]
                if blk.ref_cnt or blk.block_hash is not None or not queue.buddy.is_free(y):
                    return y
        return None
