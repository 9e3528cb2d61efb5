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
sends ``UNMAP`` with step N; the worker hands it to its mapping thread at step N's
``start_load_kv``, which waits for the device and unmaps while step N's forward runs. To
grow, ``MAP`` goes with step N, the worker's thread maps and zero-fills it during the
following steps and the worker reports it in the output of the step in which it is done;
only when every worker has reported it are the blocks allocatable, so no forward can read
a granule whose map failed or has not finished (:mod:`proxima.memory.background`; with
``map_in_background: false`` both happen before step N's forward, which waits).

Growing before the scheduler needs it (issue 33 item 2; ``admit_mapping``, off by
default, see the last point). vLLM's ``schedule()`` allocates for the running
requests, then asks :meth:`~ProximaElasticConnector.get_num_new_matched_tokens` for each
waiting request before it allocates that request's blocks; ``build_connector_meta`` comes
last. A grow decided there (the rule before) came after the admission, and its blocks were
allocatable only once the workers' report came back: a request arriving at an engine
shrunk to its minimum waited at least a step even with instant maps. Now:

* the first ask of a step runs the policy's grow half with the waiting queue's demand
  (prompt + max_tokens of every held request, in one batch);
* the scheduler admits against maps in flight (:meth:`proxima.memory.channel.
  ElasticChannel.admit`), request by request, only the granules a request needs beyond the
  mapped free and cached blocks (what stock admits against): first maps sent earlier and
  expected done within about a step, then this step's grow, at most what the workers map
  in about a step after the maps ahead of it (their map seconds per granule as reported,
  25 GB/s before one was timed). Their ops lead the step's batch, and a step that hands out
  such a block carries the wait point: the workers finish those maps before its forward
  (the step is that much longer; the replay charges it, ``map_wait_steps``). Maps expected
  done by the next step are admitted at the end of the step too, so the running requests'
  growth, allocated before any hook, finds them. A larger need waits for the report, as
  before: one step that waited for the whole grow would hold every request in it.
* A map of an admitted granule cannot fail quietly (its blocks may be in use): the
  channel raises, and the engine stops. Admission pauses while the policy is short (a map
  failed), and a grow asks for no more than the driver says is free where it knows
  (``free_bytes``), but another process can still take the memory between the two: so
  ``admit_mapping`` is off by default, for a GPU that only this engine maps on (a per-GPU
  ledger of the engines' claims, issue 33 item 3, is what can make it safe beside
  others).

Chosen by the CPU replay's figures (docs/results/replay-elastic/growahead/README.md):
with instant maps, admission against maps in flight brings chat, multiturn, bursts,
sharegpt (8,000 blocks), pressure and the shared-prefix trace within 1.02x of stock's
request latency (all but sharegpt's p50, 1.003x, exactly), preemptions no higher; the grow
before admission alone (``grow_ahead``) changes no figure (its maps are still unconfirmed
when the scheduler admits). With the H200's map time (25 GB/s) it does not pay: a step
that waits for admitted maps is longer for every request in it, a burst needs many steps'
worth of maps, and requests admitted early run short of confirmed memory for their
decode growth (sharegpt: 323 preemptions against stock's 286; the trace: TTFT p50 9 steps
against 6 without admission). Hence off by default, with the failure risk above; what
parity at that rate needs is faster maps.

Who decides (scheduler side, at :meth:`ProximaElasticConnector.bind_gpu_block_pool`): with
Proxima's block pool, its free queue becomes granule-aware
(:class:`proxima.engines.elastic_pool.GranuleFreeQueue`: mapped capacity only, live blocks
packed) and :class:`proxima.memory.policy.GrowShrinkPolicy` grows and shrinks it at each
step boundary (``policy: auto``); :class:`ForcedCycler` is a test policy. A stock pool gets
the channel only (``policy: off``: the whole pool stays mapped).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from proxima.config import parse_size
from proxima.engines import compaction_v1, elastic_v1
from proxima.engines.status import percentiles
from proxima.errors import UserError
from proxima.ioutil import publish_text_later
from proxima.memory.arena import runs
from proxima.memory.channel import MAPPED, UNMAPPED, ChannelError, ElasticChannel
from proxima.memory.policy import GrowShrinkPolicy
from proxima.memory.layout import check_block_major, granule_blocks
from proxima.memory.ops import MAP, OpBatch, Report, merge_reports

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

logger = logging.getLogger("vllm.proxima")

STATS_EVERY_S = 0.5      # the stats file is rewritten at least this often while steps run
#: Before the workers have timed a map: what admitting against maps in flight assumes a
#: granule's map and a step take (the H200's measured map rate, issue 33, and the 8B's
#: step under load; proxima.replay.elastic says where each comes from).
ASSUMED_MAP_GBPS = 25.0
ASSUMED_STEP_S = 0.025


@dataclass
class ElasticMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step: the step's ops (None: nothing to do) and KV
    compaction's copies and block-table changes (None: none; applied by
    :func:`proxima.engines.compaction_v1.install_worker_hook`'s hook, before the ops)."""

    batch: OpBatch | None = None
    compaction: object | None = None
    # (batch seq, leading ops): maps to apply before this step's forward, the scheduler
    # having handed out their blocks while they were in flight (None: nothing to wait for)
    wait: tuple[int, int] | None = None
    lead: int = 0      # the batch's first ops that map admitted granules (done first)


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


class ForcedCycler:
    """A test policy: every ``every`` steps release up to ``granules`` granules that hold
    neither live nor cached blocks, map them back ``hold`` steps later, and count a cycle
    once the maps are confirmed (a map the GPU cannot back is asked again).

    ``safe``: release only while the free blocks left in mapped memory cover what the held
    requests may still need (``forecast``) plus ``margin``, so that no allocation ever
    evicts a cached block stock would have kept and no admission changes: the schedule,
    and so greedy output, stay identical to stock's (the GPU identity proof relies on it).
    """

    def __init__(self, queue, channel: ElasticChannel, every: int, hold: int, granules: int,
                 safe: bool = True, forecast=None, margin: int = 0) -> None:
        self.queue, self.channel = queue, channel
        self.every, self.hold, self.granules = every, hold, granules
        self.safe, self.forecast, self.margin = safe, forecast, margin
        self.cycles = 0
        self.out: list[int] = []
        self._since = 0
        self._mapping = False

    def _candidates(self) -> list[int]:
        q = self.queue
        free_only = sorted((g for g, cached in q.releasable()
                            if not cached and self.channel.state[g] == MAPPED), reverse=True)
        if not self.safe:
            return free_only[:self.granules]
        spare = q.buddy.num_free - (self.forecast() if self.forecast else 0) - self.margin
        out = []
        for g in free_only:
            size = len(q.granules.ids_of(g))
            if len(out) == self.granules or spare < size:
                break
            out.append(g)
            spare -= size
        return out

    def tick(self, step: int) -> bool:
        """Advance at a step boundary; True when a cycle completed now."""
        state = self.channel.state
        if not self.out:
            idle = not self.queue.live_blocks() and not (self.forecast and self.forecast())
            if step % self.every == 0 and not idle:     # an idle engine sleeps: no cycle
                self.out = self._candidates()
                if self.out:
                    self.queue.release(self.out)
                    for run in runs(sorted(self.out)):
                        self.channel.unmap(run.start, len(run))
                    self._since, self._mapping = step, False
            return False
        if not self._mapping:
            if step - self._since >= self.hold:
                for run in runs(sorted(self.out)):
                    self.channel.map(run.start, len(run))
                self._mapping = True
            return False
        if any(state[g] != MAPPED for g in self.out):
            retry = [g for g in self.out if state[g] == UNMAPPED]
            for run in runs(retry):          # the GPU had no memory: ask again
                self.channel.map(run.start, len(run))
            return False
        self.out, self.cycles = [], self.cycles + 1
        return True

def _new_blocks(scheduler_output):
    """``(request id, block ids)`` of the blocks a step hands out (every KV cache group)."""
    for r in scheduler_output.scheduled_new_reqs:
        for ids in r.block_ids:
            yield r.req_id, ids
    cached = scheduler_output.scheduled_cached_reqs
    for rid, groups in zip(cached.req_ids, cached.new_block_ids):
        for ids in groups or ():
            yield rid, ids


class ProximaElasticConnector(KVConnectorBase_V1, SupportsHMA):
    """Carries :mod:`proxima.memory.ops` batches to the workers; loads and saves nothing."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = elastic_v1.ElasticOptions.from_extra(
            self._kv_transfer_config.kv_connector_extra_config)
        self._composed = compaction_v1.composed_in_multiconnector()
        self.channel: ElasticChannel | None = None
        self.queue = None                   # the pool's granule-aware free queue
        self.policy: GrowShrinkPolicy | None = None
        self.compactor = None               # compaction_v1.Compactor (scheduler)
        self._mover = None                  # the Triton block mover (worker)
        self.cycler: ForcedCycler | None = None
        self.clock = time.monotonic         # the policy's clock (the replay sets a fake one)
        self.steps = 0
        self._stats_written = 0.0           # when the stats file was last written (monotonic)
        self._step_began: float | None = None     # when the last step with tokens began
        self._step_ms: deque[float] = deque(maxlen=256)       # ms between step starts
        self._build_ms: deque[float] = deque(maxlen=256)      # ms in build_connector_meta
        self._pool = None
        self._last_allocated = 0
        self._step_allocs: deque[int] = deque(maxlen=64)
        self._memory = None
        self._kv_caches: dict | None = None
        self._applied: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._background = None             # proxima.memory.background.BackgroundOps
        self._grew_ahead = False            # the grow-ahead ran in this schedule()
        self._admissible: list[int] = []    # granules it asked for, not yet admitted
        self._admit_left = 0                # granules this step may still admit in flight
        self._step_s: deque[float] = deque(maxlen=64)   # policy-clock seconds a step
        self._step_at: float | None = None
        self._sent_at: dict[int, tuple[float, int]] = {}   # batch -> (sent at, granules)
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
            elastic_v1.install_allocation_hook(self.options, vllm_config)
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
        if self.options.map_in_background:
            from proxima.memory.background import BackgroundOps

            self._background = BackgroundOps(memory)

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
        wait = getattr(meta, "wait", None)
        if self._background is not None:
            if batch is not None:
                self._background.submit(batch.seq, batch.ops, stream=_current_stream(),
                                        mover=self._move, lead=meta.lead)
            if wait is not None:
                # this step hands out blocks whose map is in flight: those maps first
                self._background.wait_lead(*wait)
            return
        if batch is None:
            return
        failed = self._memory.apply(batch.ops, stream=_current_stream(), mover=self._move)
        self._done(batch.seq, failed)

    def _done(self, seq: int, failed) -> None:
        self._applied.append((seq, tuple(failed)))
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
        if self._background is not None:
            for seq, failed in self._background.poll():
                self._done(seq, failed)
        times = compaction_v1.take_worker_times()
        if not self._applied and not times:
            return None
        stats = self._memory.stats
        report = Report(tuple(self._applied), self._memory.mapped_granules,
                        self._memory.granule_blocks, stats["map_seconds"],
                        stats["unmap_seconds"])
        self._applied = []
        return ElasticWorkerMetadata(report, times)

    # ================================================================ scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: "BlockPool") -> None:
        opts = self.options
        g = predicted_granule_blocks(self._kv_cache_config, opts.granule_bytes)
        # every worker (tensor and pipeline parallel) maps its own layers and reports
        ch = self.channel = ElasticChannel(gpu_block_pool.num_gpu_blocks, g,
                                           workers=self._vllm_config.parallel_config.world_size)
        self._pool = gpu_block_pool
        sizes, _ = elastic_v1.kv_regions(self._kv_cache_config)
        self.bytes_per_granule = g * sum(sizes) // self._kv_cache_config.num_blocks
        startup, initial = elastic_v1.startup_granules(
            opts, self._vllm_config, self._kv_cache_config, g, self.bytes_per_granule)
        self.startup_granules = startup          # what the workers map at start-up
        use_granules = getattr(gpu_block_pool, "proxima_use_granules", None)
        if opts.policy == "off":
            return                               # the whole pool stays mapped, as stock
        if use_granules is None:
            raise UserError(f"{elastic_v1.CONNECTOR} with policy {opts.policy!r} needs "
                            f"Proxima's block pool (PROXIMA_ALLOCATOR=1); with a stock pool "
                            f"only policy 'off' works")
        self.queue = queue = use_granules(g, opts.eviction_policy(), mapped=startup)
        ch.state[startup:] = bytes([UNMAPPED]) * (ch.num_granules - startup)
        ch.listeners.append(self._on_map)
        if initial < startup:                    # warm-up needed more than the initial size
            queue.release(range(initial, startup))
            ch.unmap(initial, startup - initial)
        # --- KV compaction (issue 14): None when off
        self.compactor = compaction_v1.scheduler_side(
            self._vllm_config, self._kv_cache_config, gpu_block_pool, ch,
            opts.compaction, self._composed)
        # ---
        if opts.policy == "auto":
            self.policy = GrowShrinkPolicy(
                queue, ch, self.bytes_per_granule, opts.policy_options(),
                clock=lambda: self.clock(), forecast=self._forecast,
                compactor=self._load_compactor())
            if self.compactor is not None:       # auto mode packs only what could be released
                self.compactor.pack_gate = self.policy.could_shrink
                policy = self.policy               # and merges runs only near the maximum
                self.compactor.capacity_blocks = lambda: policy.max_granules * g
        if opts.force_cycle_every:
            self.cycler = ForcedCycler(queue, ch, opts.force_cycle_every,
                                       opts.force_cycle_hold, opts.force_cycle_granules,
                                       safe=opts.force_cycle_safe, forecast=self._forecast,
                                       margin=self._step_reserve())
        gpu_block_pool.proxima_elastic = self.status
        logger.info("Proxima elastic KV: %d granules of %d blocks (%.1f MiB each), %d mapped "
                    "at start-up, %d kept; policy %s, eviction %s", ch.num_granules, g,
                    self.bytes_per_granule / 2**20, startup, initial, opts.policy,
                    queue.eviction)

    def _load_compactor(self):
        spec = self.options.compactor
        if not spec:
            if self.compactor is not None:       # KV compaction empties granules on demand
                return self.compactor.release_hook()
            return None
        import importlib

        module, _, name = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise UserError(f"{elastic_v1.CONNECTOR}: compactor {spec!r} cannot be loaded "
                            f"({exc}); give module:factory") from None
        return factory(self.queue, self.channel)

    def _forecast(self) -> int:
        """Blocks the requests the scheduler holds may still need (prompt + max_tokens,
        minus what is live): the memory to have before the scheduler runs short."""
        pool = self._pool
        expected = getattr(pool, "proxima_expected_blocks", 0)
        return max(0, expected - self.queue.live_blocks()) if expected else 0

    def _step_reserve(self) -> int:
        """Twice the most blocks one of the last 64 steps allocated (two steps may be in
        flight with async scheduling)."""
        return 2 * max(self._step_allocs, default=0)

    def _on_map(self, granules: range, ok: bool) -> None:
        if ok:      # (admitted granules joined the free queue when they were admitted)
            admitted = self.channel.admitted
            self.queue.on_mapped([g for g in granules if g not in admitted])

    def _step_policy(self, grow_only: bool = False) -> None:
        """The policy's step (``grow_only``: its grow half), with the step reserve read
        now; with ``admit_mapping`` the granules it grows are allocatable at once."""
        reserve = max(self.options.reserve_blocks, self._step_reserve())
        if reserve != self.policy.options.reserve_blocks:    # (a replace validates)
            self.policy.options = dataclasses.replace(self.policy.options,
                                                      reserve_blocks=reserve)
        grown = self.policy.step(grow_only=grow_only)
        if grow_only and self.options.admit_mapping and not self.policy.stats.short:
            self._admissible = grown         # admitted as the requests need them
            self._admit_left = self._admit_cap()

    def _admit_cap(self) -> int:
        """The most granules of this step's grow to admit in flight: what the workers can
        map within about one step from now, after the maps already in flight (their
        mapping thread works in order), so that the step waits a step at most. A larger
        need waits for the map's report, as without admission: a step that waited for
        more would hold every request in it."""
        per, step = self._map_s()
        now = self.clock()
        free_at = max([now] + [end for _, _, end in self._in_flight()])
        if per <= 0:                 # maps that take no time (the replay's --map-gbps 0)
            return self.channel.num_granules
        return max(0, int((now + step - free_at) / per))

    def _map_s(self) -> tuple[float, float]:
        """(map seconds a granule as the workers report it, :data:`ASSUMED_MAP_GBPS`
        before one was timed; the median step on the policy's clock, ASSUMED_STEP_S
        before two steps)."""
        mapped = self.channel.stats["granules_mapped"]
        seconds = self.channel.stats["worker_map_seconds"]
        per = seconds / mapped if mapped else self.bytes_per_granule / (ASSUMED_MAP_GBPS * 1e9)
        step = sorted(self._step_s)[len(self._step_s) // 2] if self._step_s else ASSUMED_STEP_S
        return per, step

    def _in_flight(self):
        """``(batch, granules not admitted, expected end)`` of the maps sent and not yet
        confirmed, oldest first: each batch starts when it was sent or when the one
        before it ends, and takes its granules' map time."""
        per, _ = self._map_s()
        end = 0.0
        out = []
        for seq, granules in self.channel.in_flight():
            sent_at, count = self._sent_at.get(seq, (self.clock(), len(granules)))
            end = max(end, sent_at) + count * per
            out.append((seq, granules, end))
        return out

    def _sent_soon(self):
        """The maps sent in earlier steps, not yet confirmed, expected done within about a
        step from now: admitting against them costs a step at most that wait."""
        _, step = self._map_s()
        horizon = self.clock() + step
        for seq, granules, end in self._in_flight():
            if end > horizon:
                break
            yield seq, granules

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        # vLLM 0.26 asks this for each waiting request it considers, before it allocates
        # the request's blocks: the first ask of a step runs the grow with the waiting
        # queue's demand (grow_ahead), so the memory is there for this step's admission.
        if (self.policy is not None and not self._grew_ahead
                and (self.options.grow_ahead or self.options.admit_mapping)):
            self._grew_ahead = True
            self._step_policy(grow_only=True)
        if self._admit_left > 0:
            # admit_mapping: the blocks this request may take now beyond the mapped free
            # and cached ones (what stock admits against) come from maps in flight: those
            # sent before (whole batches, oldest first) then this step's grow, just enough
            sched = self._vllm_config.scheduler_config
            size = self._pool.hash_block_size
            tokens = min(request.num_tokens - num_computed_tokens, sched.max_num_batched_tokens)
            short = -(-(num_computed_tokens + tokens) // size) + 1 - self.queue.num_free_blocks
            if short > 0:
                G = self.channel.granule_blocks
                n = min(-(-short // G), self._admit_left)
                admit = [g for _, gs in self._sent_soon() for g in gs][:n]
                if len(admit) < n:
                    k = n - len(admit)
                    admit += self._admissible[:k]
                    self._admissible = self._admissible[k:]
                self._admit_left -= len(admit)
                if admit:
                    self.channel.admit(admit)
                    self.queue.on_mapped(admit)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self.steps += 1
        if self.channel is None:
            return ElasticMetadata()
        began = time.perf_counter()
        # one engine step as the scheduler sees it: from a step with tokens to the next
        # step; after an empty step the time between is the engine's idle wait, not a step
        if self._step_began is not None:
            self._step_ms.append(1e3 * (began - self._step_began))
        busy = getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0
        self._step_began = began if busy else None
        try:
            return self._build(scheduler_output)
        finally:
            self._build_ms.append(1e3 * (time.perf_counter() - began))

    def _build(self, scheduler_output) -> KVConnectorMetadata:
        if self.options.verify:
            self._verify(scheduler_output)
        # --- KV compaction (issue 14): plan and apply on the scheduler's structures now,
        # before the step's output leaves and before the policy runs (it may ask the
        # compactor to evacuate granules before it releases them)
        compactor = self.compactor
        if compactor is not None:
            compactor.begin_step(getattr(compactor.pool, "proxima_kv_manager", None),
                                 scheduler_output)
            compactor.step()
        # ---
        if self.queue is not None:
            allocated = self.queue.allocated_total
            self._step_allocs.append(allocated - self._last_allocated)
            self._last_allocated = allocated
        if self.policy is not None:
            self._step_policy()
            self._grew_ahead = False
            self._admissible, self._admit_left = [], 0
            now = self.clock()
            if self._step_at is not None and now > self._step_at:
                self._step_s.append(now - self._step_at)
            self._step_at = now
        if self.cycler is not None:
            self.cycler.margin = self._step_reserve()
            self.cycler.tick(self.steps)
        batch = self.channel.build()
        if batch is not None and self.policy is not None:
            granules = sum(op.count for op in batch.ops if op.code == MAP)
            if granules:
                self._sent_at[batch.seq] = (self.clock(), granules)
                while len(self._sent_at) > 64:
                    self._sent_at.pop(next(iter(self._sent_at)))
        if self.policy is not None and self.options.admit_mapping and not self.policy.stats.short:
            # maps that should be done by the next step: allocatable for it (its running
            # requests' growth is allocated before any connector hook of schedule())
            soon = [g for _, granules in self._sent_soon() for g in granules]
            if soon:
                self.channel.admit(soon)
                self.queue.on_mapped(soon)
        work = compactor.take_work() if compactor is not None else None
        if self.options.stats_file and time.monotonic() - self._stats_written >= STATS_EVERY_S:
            self.write_stats()            # a stats file follows busy and idle steps alike
        if batch is not None and self._pool is not None:
            publish = getattr(self._pool, "publish_status", None)
            if publish is not None:
                publish(now=True, wait=False)   # the new mapping shows at once (a thread
                                                # writes it: the step does not wait)
        elif (self.options.idle_sleep_s and scheduler_output.total_num_scheduled_tokens == 0
              and self.policy is not None and self.policy.pending and not self.channel.pending
              and not getattr(self._pool, "proxima_expected_tokens", None)):
            # An idle engine kept stepping only for a release that waits for its delay:
            # sleep a little per empty step instead of spinning (new requests wait at most
            # this long; vLLM's own loop sleeps 1 ms here).
            time.sleep(min(self.options.idle_sleep_s, self.policy.due_in() or 0.0))
        point = self.channel.wait_point
        lead = point[1] if batch is not None and point and point[0] == batch.seq else 0
        return ElasticMetadata(batch, compaction=work, wait=self._wait_point(scheduler_output),
                               lead=lead)

    def _verify(self, scheduler_output) -> None:
        """No block handed out this step may lie in a granule that is not mapped."""
        ch = self.channel
        state = ch.state
        # Every granule mapped (a fixed pool, a grown one): no block can be in an unmapped
        # granule, nothing to look at (one C-speed count over the granules' states).
        if ch.count(MAPPED) == ch.num_granules:
            return
        G = ch.granule_blocks
        for req_id, ids in _new_blocks(scheduler_output):
            for b in ids:
                if state[b // G] != MAPPED:      # ch.allocatable(b), inline
                    raise ChannelError(
                        f"request {req_id} was given block {b}, in granule "
                        f"{ch.granule_of(b)}, which is not mapped")

    def _wait_point(self, scheduler_output) -> tuple[int, int] | None:
        """What the workers must map before this step's forward (the channel's
        :attr:`~proxima.memory.channel.ElasticChannel.wait_point`), when a block this step
        hands out lies in an admitted granule (None: it touches confirmed memory only)."""
        ch = self.channel
        wait = ch.wait_point
        if wait is None:
            return None
        admitted, G = ch.admitted, ch.granule_blocks
        for _, ids in _new_blocks(scheduler_output):
            if any(b // G in admitted for b in ids):
                return wait
        return None

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ElasticWorkerMetadata) and self.channel is not None:
            self.channel.on_report(meta.report)
            if self.compactor is not None and meta.compaction_times:
                self.compactor.on_worker_times(meta.compaction_times)
            self.write_stats(wait=True)   # only steps that carried ops report: rare

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def has_pending_push_work(self) -> bool:
        """Ops to deliver or confirm, or a release waiting for its delay: the engine keeps
        stepping (empty steps) until they are done -- vLLM 0.26's hook for a connector
        that must keep an idle scheduler alive (``Scheduler.has_requests``)."""
        if self.channel is None:
            return False
        return (self.channel.pending or (self.policy is not None and self.policy.pending)
                or (self.cycler is not None and bool(self.cycler.out)))

    # ================================================================ control
    def control(self, request: dict) -> dict:
        """The ``proxima_kv`` utility (engine loop, between steps): apply ``min_bytes`` /
        ``max_bytes`` (None: no maximum but the pool) if given, act on them now, and return
        :meth:`status`. A bad request is ``{"error": ...}``."""
        if self.policy is None:
            return {"error": f"elastic KV runs with policy {self.options.policy!r}: its size "
                             "is fixed (start it with policy auto to set min/max)",
                    **self.status()}
        if request:
            unknown = sorted(set(request) - {"min_bytes", "max_bytes"})
            if unknown:
                return {"error": f"unknown field(s) {', '.join(unknown)}: give min_bytes "
                                 "and/or max_bytes"}
            try:
                values = {k: (None if v is None else parse_size(v, k)) for k, v in request.items()}
                lo = values.get("min_bytes", self.policy.options.min_bytes)
                if lo is None:
                    lo = 0
                hi = values["max_bytes"] if "max_bytes" in values else self.policy.options.max_bytes
                if hi is not None and hi < lo:
                    raise ValueError(f"max_bytes {hi} is below min_bytes {lo}")
                self.policy.set_limits(lo, hi, clear_max=hi is None)
            except ValueError as exc:
                return {"error": str(exc), **self.status()}
            self.policy.step()
            logger.info("Proxima elastic KV: limits set to min %d, max %s bytes", lo,
                        "pool" if hi is None else hi)
        return self.status()

    # ================================================================ reporting
    def status(self) -> dict:
        """Mapped / used / reclaimable bytes, the limits and the counters (JSON-able)."""
        ch = self.channel
        if ch is None:
            return {"steps": self.steps}
        out = {"steps": self.steps, "policy": self.options.policy,
               "granule_blocks": ch.granule_blocks, "num_granules": ch.num_granules,
               "num_blocks": ch.num_blocks, "mapped": ch.count(MAPPED),
               "unmapped": ch.count(UNMAPPED), "reported_mapped": ch.reported_mapped,
               "forced_cycles": self.cycler.cycles if self.cycler else 0, **ch.stats}
        B = getattr(self, "bytes_per_granule", 0)
        out["bytes_per_granule"] = B
        if self.queue is not None:
            out["pool"] = self.queue.granule_stats()
        if self.policy is not None:
            out.update(self.policy.snapshot())
            out["events"] = self.policy.stats.events[-20:]     # (time, grow/shrink/fail, n)
        else:
            live = self.queue.live_blocks() if self.queue is not None else None
            releasable = self.queue.num_releasable() if self.queue is not None else 0
            out.update(mapped_bytes=ch.count(MAPPED) * B,
                       used_bytes=None if live is None else live * B // ch.granule_blocks,
                       reclaimable_bytes=releasable * B, pool_bytes=ch.num_granules * B)
        if self.compactor is not None:
            out["compaction"] = self.compactor.stats()
        out["step_ms"] = percentiles(self._step_ms, 3)          # the last 256 steps
        out["connector_ms"] = percentiles(self._build_ms, 3)
        return out

    def stats(self) -> dict:
        return self.status()

    def write_stats(self, wait: bool = False) -> None:
        """The stats file: the periodic one written off the scheduler's thread; with
        ``wait`` (a step that carried map/unmap reports, shutdown) on disk at return."""
        path = self.options.stats_file
        if not path:
            return
        self._stats_written = time.monotonic()
        publish_text_later(path, json.dumps(self.status()), wait=wait)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self.write_stats(wait=True)
        elif self._background is not None:
            self._background.close()
