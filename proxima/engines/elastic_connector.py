"""Proxima's KV connector: the scheduler -> worker channel for granule maps and unmaps.

Why a KV connector (vLLM 0.26's ``KVConnectorBase_V1``) and not ``collective_rpc``: the
connector is the one supported path on which the scheduler attaches data to *a step*
(``build_connector_meta``, called at the end of ``Scheduler.schedule`` after the step's
allocations) that every worker receives *before that step's forward* (the V2 runner's
``ActiveKVConnector.pre_forward`` -> ``bind_connector_metadata`` + ``start_load_kv``,
also on steps without tokens via ``no_forward``), and on which the workers answer *in that
step's output* (``build_connector_worker_meta``, aggregated over tensor-parallel workers,
-> ``update_connector_output``). ``collective_rpc`` runs outside the step order: it
cannot say "before the forward that reads block 4,096", and with async scheduling it would
race the step in flight. The same channel carries issue 14's block moves (``MOVE`` ops:
applied in ``start_load_kv``, i.e. after the step's own block zeroing and copy-on-write
copies in the V2 runner's ``update_requests`` and before its forward);
other connectors compose with it through vLLM's ``MultiConnector``, which calls each
child's hooks in order (Proxima's first: see :func:`proxima.engines.elastic_v1.
with_elastic_connector`).

What configuring a connector changes in vLLM 0.26 (read from its source, checked by
``tests/vllm/test_elastic_connector.py`` for the scheduling part):

* scheduling decisions: none. The scheduler asks ``get_num_new_matched_tokens`` for
  each new request (0 here), calls ``update_state_after_alloc`` and ``request_finished``
  (no delayed frees here). ``kv_role`` is ``kv_producer`` because a *consumer* role makes
  the scheduler defer block frees under async scheduling (``defer_block_free``).
* async scheduling, prefix caching, the V2 model runner, FULL and piecewise CUDA graphs:
  unchanged (``requires_piecewise_for_cudagraph`` is False; the KV layout stays NHD,
  since this connector asks for none). The hybrid KV cache manager stays on
  (``SupportsHMA``).
* costs: block hashes are computed even with prefix caching off (connectors may use
  them); attention layers outside a FULL CUDA graph make two no-op calls per layer per
  step (``wait_for_layer_load``/``save_kv_layer``); each step carries a small metadata
  object; the engine keeps stepping (empty steps) while ops wait to be delivered or
  confirmed (``has_pending_push_work``); vLLM logs that the connector API is experimental.
* refused here: data parallelism (idle ranks run dummy batches through stale block
  tables), sleep mode (its allocator owns the KV memory), vLLM's V1 model runner.

Order of events for one granule: the scheduler side makes its blocks unallocatable and
sends ``UNMAP`` with step N; the worker synchronises the device and unmaps before step N's
forward. To grow, ``MAP`` goes with step N, the worker maps (and zero-fills) before step
N's forward and reports; only when the report arrives are the blocks allocatable again, so
no forward can read a granule whose map failed. Until the allocator itself knows granules
(a later helper), :class:`HeldGranules` withholds the blocks of unmapped granules from
vLLM's block pool by holding a reference on them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from proxima.engines import compaction_v1, elastic_v1
from proxima.errors import UserError
from proxima.memory.arena import runs
from proxima.memory.channel import MAPPED, UNMAPPED, ChannelError, ElasticChannel
from proxima.memory.layout import check_block_major, granule_blocks
from proxima.memory.ops import OpBatch, Report, merge_reports

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

logger = logging.getLogger("vllm.proxima")


@dataclass
class ElasticMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step: the step's ops (None: nothing to do) and KV
    compaction's copies and block-table changes (None: none; applied by
    :func:`proxima.engines.compaction_v1.install_worker_hook`'s hook, before the ops)."""

    batch: OpBatch | None = None
    compaction: object | None = None


@dataclass
class ElasticWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: what was applied since the last report, and the GPU time of
    each step's compaction measured since (``(seq, ms)``)."""

    report: Report
    compaction_times: tuple = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ElasticWorkerMetadata)
        return ElasticWorkerMetadata(merge_reports(self.report, other.report),
                                     self.compaction_times + other.compaction_times)


def predicted_granule_blocks(kv_cache_config, granule_bytes: int) -> int:
    """The granule in block ids, from the KV cache config alone (the scheduler process
    has no tensors): block-major regions of ``size / num_blocks`` bytes per block. Each
    worker derives it again from its real tensor views and the scheduler checks they agree
    on the first report."""
    sizes, _ = elastic_v1.kv_regions(kv_cache_config)
    if not sizes:
        raise UserError(f"{elastic_v1.CONNECTOR}: this model has no KV cache to map")
    from proxima.memory.kv import region_block_strides

    return granule_blocks(region_block_strides(sizes, kv_cache_config.num_blocks),
                          granule_bytes)


def _current_stream() -> int:
    """The CUDA stream the forward is about to run on (zero-fills of new granules go
    there, ahead of it); 0 where CUDA was never started (CPU tests)."""
    import torch

    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_initialized() else 0


class HeldGranules:
    """Keeps the blocks of unmapped granules out of vLLM's block pool (stock or Proxima's
    free queue): each is taken with ``BlockPool.touch`` (as a prefix-cache hit would) when
    its granule is released, and given back with ``free_blocks`` once its map is
    confirmed. So the scheduler's free-block count is the mapped capacity and no request
    can be given an unmapped block. A stand-in until the pool accounts for granules."""

    def __init__(self, block_pool: "BlockPool", channel: ElasticChannel) -> None:
        self.pool = block_pool
        self.channel = channel
        self.blocks: dict[int, list] = {}          # granule -> its withheld blocks
        channel.listeners.append(self._on_map)

    def _releasable(self, g: int) -> bool:
        if g == 0 or self.channel.state[g] != MAPPED:
            return False
        blocks = self.pool.blocks
        return all(blocks[b].ref_cnt == 0 and blocks[b].block_hash is None
                   for b in self.channel.blocks_of(g))

    def free_granules(self, limit: int) -> list[int]:
        """Up to ``limit`` granules whose blocks are all free and hold no cached KV."""
        out = []
        for g in range(1, self.channel.num_granules):
            if self._releasable(g):
                out.append(g)
                if len(out) == limit:
                    break
        return out

    def release(self, granules) -> None:
        for run in runs(sorted(granules)):
            for g in run:
                if not self._releasable(g):
                    raise ChannelError(f"granule {g} holds a block in use or cached KV; it "
                                       "cannot be unmapped")
            for g in run:
                blocks = [self.pool.blocks[b] for b in self.channel.blocks_of(g)]
                self.pool.touch(blocks)
                self.blocks[g] = blocks
            self.channel.unmap(run.start, len(run))

    def regrow(self, granules) -> None:
        for run in runs(sorted(granules)):
            self.channel.map(run.start, len(run))

    def _on_map(self, run: range, ok: bool) -> None:
        if ok:
            for g in run:
                blocks = self.blocks.pop(g, None)
                if blocks:
                    self.pool.free_blocks(blocks)


class ForcedCycler:
    """A test policy: every ``every`` steps release up to ``granules`` free granules, map
    them back ``hold`` steps later, and count a cycle once the maps are confirmed."""

    def __init__(self, held: HeldGranules, every: int, hold: int, granules: int) -> None:
        self.held, self.every, self.hold, self.granules = held, every, hold, granules
        self.cycles = 0
        self.out: list[int] = []
        self._since = 0
        self._mapping = False

    def tick(self, step: int) -> bool:
        """Advance at a step boundary; True when a cycle completed now."""
        held, state = self.held, self.held.channel.state
        if not self.out:
            if step % self.every == 0:
                self.out = held.free_granules(self.granules)
                if self.out:
                    held.release(self.out)
                    self._since, self._mapping = step, False
            return False
        if not self._mapping:
            if step - self._since >= self.hold:
                held.regrow(self.out)
                self._mapping = True
            return False
        if any(g in held.blocks for g in self.out):
            retry = [g for g in self.out if state[g] == UNMAPPED and g in held.blocks]
            if retry:                     # the GPU had no memory: ask again
                held.regrow(retry)
            return False
        self.out, self.cycles = [], self.cycles + 1
        return True


class ProximaElasticConnector(KVConnectorBase_V1, SupportsHMA):
    """Carries :mod:`proxima.memory.ops` batches to the workers; loads and saves nothing."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = elastic_v1.ElasticOptions.from_extra(
            self._kv_transfer_config.kv_connector_extra_config)
        self._composed = compaction_v1.composed_in_multiconnector()
        self.channel: ElasticChannel | None = None
        self.held: HeldGranules | None = None
        self.compactor = None                      # compaction_v1.Compactor (scheduler)
        self._mover = None                         # the Triton block mover (worker)
        self.cycler: ForcedCycler | None = None
        self.steps = 0
        self._memory = None
        self._kv_caches: dict | None = None
        self._applied: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._short = False
        if role == KVConnectorRole.WORKER:
            parallel = vllm_config.parallel_config
            if parallel.data_parallel_size > 1:
                raise UserError("elastic KV memory does not support data parallelism "
                                f"(data_parallel_size={parallel.data_parallel_size}): idle "
                                "ranks read stale block ids; unset PROXIMA_ELASTIC")
            model = vllm_config.model_config
            if model is not None and model.enable_sleep_mode:
                raise UserError("elastic KV memory and vLLM's sleep mode both manage the KV "
                                "memory; use one of them (unset PROXIMA_ELASTIC or "
                                "--enable-sleep-mode)")
            elastic_v1.install_allocation_hook(self.options)
            # --- KV compaction (issue 14): the worker applies its moves before the forward
            if compaction_v1.worker_side(vllm_config, self.options.compaction, self._composed):
                compaction_v1.install_worker_hook()
            # ---

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        memory = elastic_v1.kv_memory()
        if memory is None:
            raise UserError("elastic KV memory needs vLLM's V2 model runner (its KV cache "
                            "is allocated where Proxima maps it); this engine uses another "
                            "runner. Unset PROXIMA_ELASTIC or VLLM_USE_V2_MODEL_RUNNER=0")
        seen = set()
        for name, entry in kv_caches.items():
            for view in entry if isinstance(entry, (list, tuple)) else (entry,):
                key = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
                if key in seen:
                    continue
                seen.add(key)
                self._check_view(memory, name, view)
        self._memory, self._kv_caches = memory, kv_caches

    @staticmethod
    def _check_view(memory, name: str, view) -> None:
        ptr = view.data_ptr()
        for r, base in enumerate(memory.arena.region_base):
            if base <= ptr < base + memory.region_sizes[r]:
                check_block_major(view.shape, view.stride(), view.element_size(), ptr - base,
                                  memory.num_blocks, memory.block_strides[r])
                return
        raise UserError(f"KV cache of layer {name} is not in Proxima's mapped range")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        batch = meta.batch if isinstance(meta, ElasticMetadata) else None
        if batch is None:
            return
        failed = self._memory.apply(batch.ops, stream=_current_stream(), mover=self._move)
        self._applied.append((batch.seq, tuple(failed)))
        if failed and not self._short:
            logger.warning("Proxima elastic KV: the GPU has no memory for %d more granules "
                           "now; serving at the current size", sum(n for _, n in failed))
        self._short = bool(failed)

    def _move(self, src: int, dst: int, count: int) -> None:
        # --- KV compaction (issue 14): MOVE ops with the Triton mover, every layer at once,
        # on the current (the forward's) stream
        if self._mover is None:
            from proxima.kernels import KVBlockMover

            self._mover = KVBlockMover(self._kv_caches)
        self._mover.apply([src], [dst], [count])
        # ---

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        times = compaction_v1.take_worker_times()
        if not self._applied and not times:
            return None
        report = Report(tuple(self._applied), self._memory.mapped_granules,
                        self._memory.granule_blocks)
        self._applied = []
        return ElasticWorkerMetadata(report, times)

    # ================================================================ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        g = predicted_granule_blocks(self._kv_cache_config, self.options.granule_bytes)
        self.channel = ElasticChannel(gpu_block_pool.num_gpu_blocks, g)
        self.held = HeldGranules(gpu_block_pool, self.channel)
        initial = self.options.initial_granules
        if initial is not None and initial < self.channel.num_granules:
            self.held.release(range(initial, self.channel.num_granules))
        if self.options.force_cycle_every:
            self.cycler = ForcedCycler(self.held, self.options.force_cycle_every,
                                       self.options.force_cycle_hold,
                                       self.options.force_cycle_granules)
        # A pool that accounts for granules itself (a later helper) takes the channel here.
        bind = getattr(gpu_block_pool.free_block_queue, "bind_elastic_channel", None)
        if bind is not None:
            bind(self.channel)
        # --- KV compaction (issue 14): None when off
        self.compactor = compaction_v1.scheduler_side(
            self._vllm_config, self._kv_cache_config, gpu_block_pool, self.channel,
            self.options.compaction, self._composed)
        # ---

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.steps += 1
        if self.channel is None:
            return ElasticMetadata()
        if self.options.verify:
            self._verify(scheduler_output)
        # --- KV compaction (issue 14): plan and apply on the scheduler's structures now,
        # before the step's output leaves; an elastic policy may ask it to evacuate
        # granules (Compactor.evacuate) before it releases them
        compactor = self.compactor
        if compactor is not None:
            compactor.begin_step(getattr(compactor.pool, "proxima_kv_manager", None),
                                 scheduler_output)
            compactor.step()
        # ---
        if self.cycler is not None:
            self.cycler.tick(self.steps)
        work = compactor.take_work() if compactor is not None else None
        return ElasticMetadata(self.channel.build(), compaction=work)

    def _verify(self, scheduler_output) -> None:
        """No block handed out this step may lie in a granule that is not mapped."""
        allocatable = self.channel.allocatable
        lists = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        lists += [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids) if ids]
        for req_id, groups in lists:
            for ids in groups:
                for b in ids:
                    if not allocatable(b):
                        raise ChannelError(
                            f"request {req_id} was given block {b}, in granule "
                            f"{self.channel.granule_of(b)}, which is not mapped")

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ElasticWorkerMetadata) and self.channel is not None:
            self.channel.on_report(meta.report)
            if self.compactor is not None and meta.compaction_times:
                self.compactor.on_worker_times(meta.compaction_times)
            self.write_stats()            # only steps that carried ops report: cheap

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def has_pending_push_work(self) -> bool:
        return self.channel is not None and self.channel.pending

    def stats(self) -> dict:
        ch = self.channel
        if ch is None:
            return {"steps": self.steps}
        return {"steps": self.steps, "granule_blocks": ch.granule_blocks,
                "num_granules": ch.num_granules, "num_blocks": ch.num_blocks,
                "mapped": ch.count(MAPPED), "unmapped": ch.count(UNMAPPED),
                "held_granules": len(self.held.blocks), "reported_mapped": ch.reported_mapped,
                "forced_cycles": self.cycler.cycles if self.cycler else 0, **ch.stats,
                **({"compaction": self.compactor.stats()} if self.compactor else {})}

    def write_stats(self) -> None:
        path = self.options.stats_file
        if not path:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.stats(), f)
        os.replace(tmp, path)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self.write_stats()
