"""KV compaction inside vLLM 0.26 (V1 engine, V2 model runner): the thin part.

The planner (:mod:`proxima.allocator.planner`, pure Python) says which block contents go
where. On the scheduler side, this module decides when and what to plan (the policy, in
:class:`Compactor`) and builds the compactor of an engine (:func:`scheduler_side`);
:mod:`~proxima.vllm.compaction_apply` reads vLLM's state into the planner's view,
applies a plan to vLLM's scheduler structures and hands the copies and the block-table
changes out for the workers; :mod:`~proxima.vllm.compaction_placement` places fresh
allocations; :mod:`~proxima.vllm.compaction_options` holds the settings and the
refusals.

Scheduler side (:class:`Compactor`, one per engine, owned by the elastic KV connector):
at the end of ``Scheduler.schedule`` (``build_connector_meta``: after the step's
allocations, before the output leaves) it plans within a byte budget and applies each
relocation ``a -> b`` to vLLM's structures, in the plan's order:

* a LIVE block: ``b`` (a free, hash-less block) leaves the free queue, takes ``a``'s
  reference count and prefix-cache entries (vLLM's own ``BlockPool.move_block_hashes``),
  replaces ``a`` in every ``req_to_blocks`` list that holds it (all owners of a shared
  prefix block); ``a`` goes back to the free queue without a hash. Reference counts and
  the free count do not change.
* a CACHED block (free, with a prefix-cache entry): ``b`` takes ``a``'s place in the LRU
  tier (``ProximaFreeQueue.relocate``, same eviction order) and its entries;
  ``a`` becomes a plain free block.

So every hash maps to the block that holds its content, and what the scheduler decides
next (admissions, prefix hits, evictions by hash) is what it would have decided without
the move: compaction changes block ids, never a decision.

Worker side (:mod:`proxima.vllm.compaction_worker`): a hook around the V2 runner's
``update_requests`` applies each step's :class:`~proxima.vllm.compaction_worker.
CompactionWork` (the copies and the block-table changes) before the forward reads them.

Refused (at start-up, one clear error): another KV connector beside Proxima's (it may
track block ids), vLLM's KV-cache metrics collector (it tracks blocks by object),
Mamba layers (their blocks are zeroed before the copy point), pipeline parallelism.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from proxima.allocator.placement import PlacementMaps
from proxima.allocator.planner import PoolView, plan_evacuate, plan_pack
from proxima.vllm import activation
from proxima.vllm.compaction_apply import PlanApplication
from proxima.vllm.compaction_options import (DEFAULT_BUDGET_BYTES, DEFAULT_CLAIM_BLOCKS,
                                                DEFAULT_INTERVAL, DEFAULT_MAX_PHASES,
                                                options_for, scratch_first)
from proxima.vllm.compaction_placement import AllocationPlacement
from proxima.vllm.status import percentiles

logger = logging.getLogger("vllm.proxima")

PACK_RETRY = 8                      # auto mode: steps after a pack found nothing, unless freed
SAMPLES = 4096                       # recent per-step figures kept for percentiles


@dataclass
class _Sample:
    steps: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def add(self, value: float) -> None:
        self.steps.append(value)

    def percentiles(self) -> dict:
        return percentiles(self.steps)


class Compactor(PlanApplication, AllocationPlacement):
    """The scheduler side of KV compaction for one vLLM block pool (see the module doc):
    when and what to move. Reading vLLM and applying plans is :class:`~proxima.vllm.
    compaction_apply.PlanApplication`'s part, where fresh allocations go
    :class:`~proxima.vllm.compaction_placement.AllocationPlacement`'s.

    ``granule_blocks``: the granule of the reclaimable measure (and of elastic mapping);
    ``bytes_per_block``: one block's bytes over all layers (the budget's unit);
    ``mode``: :class:`proxima.vllm.activation.CompactionMode`; ``allocatable``: a
    ``granule -> bool`` (the elastic channel's mapped state), None: all mapped.
    """

    def __init__(self, pool, *, granule_blocks: int, bytes_per_block: int,
                 mode: activation.CompactionMode, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 interval: int = DEFAULT_INTERVAL, max_phases: int = DEFAULT_MAX_PHASES,
                 allocatable=None, claim_blocks: int = DEFAULT_CLAIM_BLOCKS,
                 scratch_blocks: int = 0) -> None:
        queue = pool.free_block_queue
        if not hasattr(queue, "relocate"):
            raise activation.ActivationError(
                f"{activation.COMPACTION_ENV} needs Proxima's block pool "
                f"({activation.ENV}=1): vLLM's own free queue cannot relocate a cached block")
        if getattr(pool, "metrics_collector", None) is not None:
            raise activation.ActivationError(
                f"{activation.COMPACTION_ENV} cannot run with vLLM's KV-cache metrics "
                "(--kv-cache-metrics: it tracks blocks by object); switch one of them off")
        if bytes_per_block < 1 or granule_blocks < 1 or budget_bytes < 0 or interval < 1:
            raise ValueError(f"bad compaction settings: {bytes_per_block} bytes per block, "
                             f"granule {granule_blocks}, budget {budget_bytes}, interval "
                             f"{interval}")
        self.pool = pool
        self.granule_blocks = granule_blocks
        self.bytes_per_block = bytes_per_block
        self.mode = mode
        self.enabled = True
        self.budget_blocks = budget_bytes // bytes_per_block
        self.interval = interval
        self.max_phases = max_phases
        self.allocatable = allocatable
        self.kv_manager = None
        self.steps = 0
        self._pinned: set[int] = set()
        self._view: PoolView | None = None
        self._relocations: list[tuple[int, int]] = []
        self._tables: dict[tuple[str, int, int], int] = {}
        self._seq = 0
        self.claim_blocks = claim_blocks
        self._single = None
        self._owners_step = 0
        self._step_new: set[int] = set()
        self.scratch_blocks = scratch_blocks
        self.scratch_first = scratch_first(pool.num_gpu_blocks, granule_blocks)
        self._step_id = None
        self._maps = PlacementMaps(pool.num_gpu_blocks)   # lone blocks and claims
        self.pack_gate = None       # () -> bool: the elastic policy's "could shrink now"
        self._pack_idle: tuple[int, int] | None = None   # (step, free blocks) of an empty pack
        self._gain = True           # this step: pack_gate's answer (placement follows it)
        self._plan_seconds = 0.0
        self.counters = {"steps_with_moves": 0, "relocations": 0, "live_moved": 0,
                         "cached_moved": 0, "bytes_moved": 0, "phases": 0,
                         "evacuations": 0, "evacuations_done": 0, "replans": 0,
                         "skipped_steps": 0, "steered": 0,
                         "live_displaced": 0, "shared_moved": 0,
                         "scratch_used": 0, "pack_skipped": 0}
        self.placements: dict[str, int] = {}
        self.plan_ms = _Sample()
        self.gpu_ms = _Sample()
        self.blocks_per_step = _Sample()
        pool.proxima.compaction = self
        _compactors.add(self)

    def set_enabled(self, on: bool) -> None:
        """Switch compaction on or off between steps (off: no placement, no plans; the
        engine then behaves as elastic mode without compaction). For tests and the GPU
        proof, which compare modes in one engine (tests/support/forced.py)."""
        self.enabled = bool(on)
        self._maps.drop_except(())

    def reset_metrics(self) -> None:
        """Zero the counters and the per-step samples (the settings stay)."""
        for key in self.counters:
            self.counters[key] = 0
        self.placements.clear()
        self.plan_ms, self.gpu_ms, self.blocks_per_step = _Sample(), _Sample(), _Sample()
        self.steps = 0

    # ------------------------------------------------------------------ the step
    def begin_step(self, kv_manager, scheduler_output) -> None:
        """Read what this step's output pins (see the module doc)."""
        self.kv_manager = kv_manager
        self._sync_step()
        self.steps += 1
        self._view = None          # rebuilt: prefix hits and frees since the allocations
        # the owners found at the first allocation stay: each use checks the block again
        pinned = set()
        for req in scheduler_output.scheduled_new_reqs:
            for ids in req.block_ids:
                pinned.update(ids)
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if ids:
                for group in ids:
                    pinned.update(group)
        for copy in scheduler_output.kv_cache_block_copies or ():
            pinned.add(copy.src_block_id)
            pinned.add(copy.dst_block_id)
        for mgr in self._managers():
            for _, block in getattr(mgr, "_partial_hit_reqs", {}).values():
                pinned.add(block.block_id)
        self._pinned |= pinned

    def step(self) -> None:
        """Plan this step's moves every ``interval`` steps (:meth:`plan_step`), timed."""
        if not self.enabled or self.budget_blocks <= 0 or self.steps % self.interval:
            return
        t0 = time.perf_counter()
        self.plan_step()
        self._plan_seconds += time.perf_counter() - t0

    def plan_step(self) -> None:
        """The policy: pack the sparsest granules' live blocks into the densest, when that
        could give memory back (:meth:`_pack_worthwhile`). (The tests' forced compaction,
        ``tests/support/forced.py``, puts another plan here.)"""
        if not self._pack_worthwhile():
            return
        plan = plan_pack(self.view(), self.budget_left(), max_phases=self.max_phases)
        if plan:
            self._pack_idle = None
            self.apply(plan)
        else:                       # nothing to pack now: wait for blocks to be freed
            self._pack_idle = (self.steps, self._free_count())

    def budget_left(self) -> int:
        """Blocks this step may still copy."""
        return max(0, self.budget_blocks - len(self._relocations))

    def _free_count(self) -> int:
        return self.pool.get_num_free_blocks()          # free and cached (freed requests)

    def _pack_worthwhile(self) -> bool:
        """Auto mode packs only when it can gain: (elastic policy) a granule emptied now
        could be given back (``pack_gate``); the live blocks occupy more granules than they
        need; and, after a pack that found nothing to do, only once blocks have been freed
        since (or ``PACK_RETRY`` steps later). A full, busy pool gains nothing from moves:
        they are skipped, planning included."""
        if self.pack_gate is not None and not self.pack_gate():
            self.counters["pack_skipped"] += 1
            return False
        if self._pack_idle is not None:
            step, free = self._pack_idle
            if self.steps - step < PACK_RETRY and self._free_count() <= free:
                self.counters["pack_skipped"] += 1
                return False
        view = self.view()
        live = view.live_per_granule()
        if sum(1 for x in live if x) <= -(-sum(live) // self.granule_blocks):
            self.counters["pack_skipped"] += 1
            return False
        return True

    def evacuate(self, granules: Iterable[int], *, cached_too: bool = True) -> bool:
        """Before a shrink (:meth:`empty_granules`): move the content out of ``granules``
        (within what is left of this step's budget). True when they now hold no block in
        use (and, with ``cached_too``, no cached KV): they can be unmapped this step."""
        granules = list(granules)
        if not self.enabled:
            return False
        t0 = time.perf_counter()
        self.counters["evacuations"] += 1
        plan, clear = plan_evacuate(self.view(), granules,
                                    max(0, self.budget_blocks - len(self._relocations)),
                                    cached_too=cached_too, max_phases=self.max_phases)
        applied = self.apply(plan)
        self._plan_seconds += time.perf_counter() - t0
        if clear and applied:
            self.counters["evacuations_done"] += 1
        return clear and applied

    def empty_granules(self, queue, wanted: int) -> int:
        """Asked by the elastic controller (:mod:`proxima.vllm.elastic_control`) when the
        policy's shrink finds too few releasable granules: empty up to ``wanted`` mapped
        granules of ``queue`` that still hold live blocks -- the fewest live blocks first, as
        far as this step's budget goes -- and return how many it emptied (0: none; the
        shrink then takes what is free)."""
        if not self.enabled or wanted < 1:
            return 0
        view = self.view()
        live = view.live_per_granule()
        null_g = self.pool.null_block.block_id // self.granule_blocks
        order = sorted((g for g in range(view.num_granules)
                        if live[g] and g != null_g
                        and (self.allocatable is None or self.allocatable(g))),
                       key=lambda g: (live[g], -g))
        emptied = 0
        for g in order[:wanted]:
            if self.budget_blocks - len(self._relocations) < live[g]:
                break
            if self.evacuate([g]):
                emptied += 1
        return emptied

    def _sync_step(self) -> None:
        """Start a new step's state at its first event (allocations come before
        :meth:`begin_step`, both inside one ``Scheduler.schedule``)."""
        state = self.pool.proxima
        step = state.steps
        self.kv_manager = state.kv_manager or self.kv_manager
        if step != self._step_id:
            self._step_id = step
            self._gain = self.pack_gate is None or self.pack_gate()
            self._view = None
            self._pinned = set()
            self._plan_seconds = 0.0
            self._step_new = set()
            live = state.expected_tokens
            self._maps.drop_except(live)

    def on_worker_times(self, times: Iterable[tuple[int, float]]) -> None:
        """GPU milliseconds of each step's compaction as the workers measured them."""
        for _, ms in times:
            self.gpu_ms.add(ms)

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict:
        """The figures for the engine status file and ``/metrics``."""
        return {"mode": "auto" if self.enabled else "off",
                "steps": self.steps, "budget_bytes": self.budget_blocks * self.bytes_per_block,
                "bytes_per_block": self.bytes_per_block, **self.counters,
                "placements": dict(self.placements),
                "plan_ms": self.plan_ms.percentiles(), "gpu_ms": self.gpu_ms.percentiles(),
                "blocks_per_moving_step": self.blocks_per_step.percentiles()}


# ----------------------------------------------------------------------------- wiring

_compactors: "weakref.WeakSet[Compactor]" = weakref.WeakSet()


def compactors() -> list["Compactor"]:
    """The compactors of this process's engines (an engine whose scheduler runs in this
    process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or the replay)."""
    return list(_compactors)


def scheduler_side(vllm_config, kv_cache_config, pool, channel, extra,
                   composed: bool = False) -> "Compactor | None":
    """The :class:`Compactor` of an elastic engine's scheduler (None when off)."""
    options = options_for(vllm_config, extra, composed)
    if options is None:
        return None
    if kv_cache_config.needs_kv_cache_zeroing:
        from proxima.errors import UserError

        raise UserError(f"{activation.COMPACTION_ENV}: KV compaction does not support Mamba "
                        "layers (vLLM zeroes their new blocks before the copy point); unset "
                        f"{activation.COMPACTION_ENV}")
    from proxima.vllm import elastic_v1
    from proxima.memory.channel import MAPPED

    sizes, _ = elastic_v1.kv_regions(kv_cache_config)
    bytes_per_block = sum(sizes) // kv_cache_config.num_blocks
    state = channel.state
    compactor = Compactor(
        pool, granule_blocks=channel.granule_blocks, bytes_per_block=bytes_per_block,
        mode=options.mode, budget_bytes=options.budget_mib << 20, interval=options.interval,
        max_phases=options.max_phases, allocatable=lambda g: state[g] == MAPPED,
        claim_blocks=options.claim_blocks,
        scratch_blocks=options.scratch_granules * channel.granule_blocks)
    logger.info("Proxima KV compaction: %s, budget %d MiB (%d blocks of %d KiB) and %d "
                "mover launches per step, %d scratch blocks", compactor.stats()["mode"],
                options.budget_mib, compactor.budget_blocks, bytes_per_block >> 10,
                options.max_phases, compactor.scratch_blocks)
    return compactor
