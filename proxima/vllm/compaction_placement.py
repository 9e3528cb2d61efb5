"""KV compaction's placement of fresh allocations (the :class:`~proxima.vllm.
compaction_v1.Compactor`'s part that runs inside vLLM's ``allocate_new_blocks``): the
blocks just handed out to a request hold nothing yet, so they can take the place of any
free block, cached or not (its content copied into them), or of a lone block of another
request, so that the request continues its run or takes the lowest window that holds its
expected length (:func:`proxima.allocator.placement.plan_placement`): live blocks pack
towards low ids and high granules empty out.
"""

from __future__ import annotations

import time

from proxima.allocator.placement import plan_placement
from proxima.allocator.planner import CACHED, FREE, LIVE

OWNERS_EVERY = 4                    # steps between passes over every table for lone blocks


class AllocationPlacement:
    """Placement at allocation time, a part of :class:`~proxima.vllm.compaction_v1.
    Compactor` (which sets the state these methods share: the pool, the view, the step's
    relocations and table changes, the placement maps, the owners found, the counters)."""

    def on_allocate(self, mgr, request_id: str, new_blocks: list) -> list:
        """Where a fresh allocation's blocks go (called by the Proxima pool's manager
        wrapper right after vLLM's ``allocate_new_blocks``, before the step's output is
        built). The blocks just handed out hold nothing yet, so they can take the place of
        any free block, cached or not, whose content (if cached) is copied into them: the
        request continues its run (the ids after its last block), else takes the lowest
        window of non-live ids that holds its expected length (a new run, packed towards
        low ids so that high granules empty out; the rest of the window is claimed for its
        growth). Costs one block copy per cached block displaced, within the step's budget;
        the free count, the LRU order and every hash's content are unchanged."""
        if not self.enabled:
            return new_blocks
        self._sync_step()
        if not self._gain:
            # nothing could be given back now (a pool the load keeps full): placing for
            # release gains nothing, and its copies and its CPU per allocation are not free
            self._count("skipped_full")
            return new_blocks
        t0 = time.perf_counter()
        try:
            return self._place(mgr, request_id, new_blocks)
        finally:                      # placement is planning too (the plan_ms figure)
            self._plan_seconds += time.perf_counter() - t0

    def _place(self, mgr, request_id: str, new_blocks: list) -> list:
        pending_cow = {id(dst) for _, dst in getattr(mgr, "_pending_cow_copies", ())}
        steer = [b for b in new_blocks if id(b) not in pending_cow]
        k = len(steer)
        req_blocks = mgr.req_to_blocks[request_id]
        first = len(req_blocks) - k
        if k == 0 or req_blocks[first:] != steer:
            return new_blocks
        view = self.view()
        kinds = view.kinds
        for b in steer:
            kinds[b.block_id] = LIVE
            self._step_new.add(b.block_id)
            if self._single is not None:
                self._single.pop(b.block_id, None)
            if b.block_id < len(self._maps.lone):
                self._maps.lone[b.block_id] = 0
        prev = req_blocks[first - 1] if first > 0 else None
        ids = [b.block_id for b in steer]
        total = self.pool.proxima.expected_tokens.get(request_id)
        need = max(k, -(-total // mgr.block_size) - first) if total else k
        owners = self._owners()               # the lone blocks, marked in the maps
        movable = owners if k > 1 else ()
        where = plan_placement(view, ids, None if prev is None or prev.is_null else prev.block_id,
                               need, maps=self._maps, owner=request_id, movable=movable,
                               claim_blocks=self.claim_blocks)
        self._count(where.reason)
        result = new_blocks
        if where.targets is not None and where.targets != ids:
            plan = self._exchange(mgr, request_id, first, steer, where.targets)
            if plan is None:
                self._count("exchange_failed")
                where.claim = None
            else:
                cow = [b for b in new_blocks if id(b) in pending_cow]
                result = cow + plan
        self._maps.claim(request_id, where.claim)
        return result

    def _count(self, what: str) -> None:
        self.placements[what] = self.placements.get(what, 0) + 1

    def _exchange(self, mgr, request_id: str, first: int, steer: list, window: list[int]):
        """Give the request the blocks of ``window`` instead of ``steer`` (module doc);
        None, nothing changed, when a block is not what the view said or over budget."""
        pool = self.pool
        blocks = pool.blocks
        queue = pool.free_block_queue
        mine = {b.block_id: b for b in steer}
        spare = [b for b in steer if b.block_id not in window]
        copies = 0
        singles = self._owners()
        for x in window:
            if x in mine:
                continue
            blk = blocks[x]
            if blk.ref_cnt and self._single_ok(singles.get(x), blk):
                copies += 1
                continue
            if blk.ref_cnt or blk.is_null or (
                    blk.next_free_block is None and not queue.buddy.is_free(x)):
                self._view.kinds[x] = LIVE          # the view was stale: a hit or a hold
                return None
            if self.allocatable is not None and not self.allocatable(x // self.granule_blocks):
                return None
            copies += blk.next_free_block is not None
        if len(self._relocations) + copies > self.budget_blocks:
            self.counters["skipped_steps"] += 1
            return None
        if any(b.ref_cnt != 1 or b.block_hash is not None for b in spare):
            return None
        kinds = self._view.kinds
        req_blocks = mgr.req_to_blocks[request_id]
        out = []
        for i, x in enumerate(window):
            blk = mine.get(x)
            if blk is None and x in singles and blocks[x].ref_cnt:
                # a lone block of another request: its content goes to a block just
                # handed out, its owner's table (and the worker's) to that block
                blk = blocks[x]
                given = spare.pop()
                owner_mgr, owner, idx, _ = singles.pop(x)
                self._maps.lone[x] = 0
                if blk.block_hash is not None or x in pool.cached_block_hashes_by_block:
                    pool.move_block_hashes(blk, given)
                owner_mgr.req_to_blocks[owner][idx] = given
                self._tables[(owner, owner_mgr.kv_cache_group_id, idx)] = given.block_id
                self._relocations.append((x, given.block_id))
                self._step_new.add(given.block_id)
                kinds[given.block_id] = LIVE
                self.counters["live_displaced"] += 1
            elif blk is None:
                blk = blocks[x]
                given = spare.pop()
                cached = blk.next_free_block is not None
                queue.exchange(blk, given)
                if cached:
                    pool.move_block_hashes(blk, given)
                    self._relocations.append((x, given.block_id))
                    kinds[given.block_id] = CACHED
                    self.counters["cached_moved"] += 1
                else:
                    kinds[given.block_id] = FREE
                blk.ref_cnt, given.ref_cnt = given.ref_cnt, 0
                kinds[x] = LIVE
            req_blocks[first + i] = blk
            out.append(blk)
        self.counters["steered"] += 1
        self.counters["relocations"] += copies
        self.counters["bytes_moved"] += copies * self.bytes_per_block
        return out

    def _owners(self) -> dict[int, tuple]:
        """The LIVE blocks a placement may displace: held by one request (reference count
        1), not awaiting vLLM's copy-on-write. ``{block id: (manager, request id, position,
        lone)}``; ``lone``: a run of one id in its owner's table (moving it elsewhere
        breaks no run). Found by a pass over every table every ``OWNERS_EVERY`` steps (it
        costs O(blocks in use)); each use checks the entry again (:meth:`_single_ok`: still
        that owner's, not allocated in this step, not awaiting a copy-on-write)."""
        if self._single is None or self.steps - self._owners_step >= OWNERS_EVERY:
            self._owners_step = self.steps
            pinned = set(self._step_new)
            for mgr in self._managers():
                for _, blk in getattr(mgr, "_partial_hit_reqs", {}).values():
                    pinned.add(blk.block_id)
                for a, b in getattr(mgr, "_pending_cow_copies", ()):
                    pinned.update((a.block_id, b.block_id))
            owners = {}
            lone_ids = set()
            for mgr in self._managers():
                for req_id, table in mgr.req_to_blocks.items():
                    ids = [b.block_id for b in table]
                    # a block is lone unless a neighbour in the table is its neighbour id
                    before = [-2] + ids[:-1]
                    after = ids[1:] + [-2]
                    for i, (blk, x, p, q) in enumerate(zip(table, ids, before, after)):
                        if blk.ref_cnt != 1 or blk.is_null or x in pinned:
                            continue
                        lone = p != x - 1 and q != x + 1
                        owners[x] = (mgr, req_id, i, lone)
                        if lone:
                            lone_ids.add(x)
            self._single = owners
            self._maps.resize(len(self.view().kinds))
            mask = self._maps.lone
            mask[:] = bytes(len(mask))
            self._maps.set_lone(lone_ids)
        return self._single

    def _single_ok(self, entry, blk) -> bool:
        if entry is None or blk.ref_cnt != 1 or blk.block_id in self._step_new:
            return False
        mgr, req_id, idx, _ = entry
        table = mgr.req_to_blocks.get(req_id)
        if not (table and idx < len(table) and table[idx] is blk):
            return False
        for m in self._managers():
            if any(b is blk for _, b in getattr(m, "_partial_hit_reqs", {}).values()) or \
                    any(blk is a or blk is b for a, b in getattr(m, "_pending_cow_copies", ())):
                return False
        return True
