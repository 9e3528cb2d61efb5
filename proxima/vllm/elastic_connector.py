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
race the step in flight. The same metadata carries KV compaction's block moves
(:func:`proxima.vllm.compaction_worker.install_worker_hook`); other connectors compose
with it through vLLM's ``MultiConnector``, which calls each child's hooks in order
(Proxima's first: see :func:`proxima.vllm.elastic_v1.with_elastic_connector`).

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
  tables), sleep mode (docs/results/sleep-mode/NOTES.md), vLLM's V1 model runner.

Order of events for one granule: the scheduler side makes its blocks unallocatable and
sends ``UNMAP`` with step N; the worker hands it to its mapping thread at step N's
``start_load_kv``, which waits for the device and unmaps while step N's forward runs. To
grow, ``MAP`` goes with step N, the worker's thread maps and zero-fills it during the
following steps and the worker reports it in the output of the step in which it is done;
only when every worker has reported it are the blocks allocatable, so no forward can read
a granule whose map failed or has not finished (:mod:`proxima.memory.background`; with
``map_in_background: false`` both happen before step N's forward, which waits).

Who decides (scheduler side, at :meth:`ProximaElasticConnector.bind_gpu_block_pool`): with
Proxima's block pool, its free queue becomes granule-aware
(:class:`proxima.vllm.elastic_pool.GranuleFreeQueue`: mapped capacity only, live blocks
packed) and :class:`proxima.vllm.elastic_control.ElasticController` orders each step
boundary's work: KV compaction, then :class:`proxima.memory.policy.GrowShrinkPolicy`
(``policy: auto``; a shrink short of releasable granules gets them emptied by the compactor
first), then the ``compactor`` option's step hook (the tests' forced cycles,
``tests/support/forced.py``). This connector carries the result. A stock pool gets the
channel only (``policy: off``: the whole pool stays mapped).
"""

from __future__ import annotations

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
from proxima.vllm import compaction_options, compaction_worker, elastic_v1, sleep_memory
from proxima.vllm.elastic_control import ElasticController
from proxima.vllm.status import percentiles
from proxima.errors import UserError
from proxima.ioutil import publish_text_later
from proxima.memory.channel import MAPPED, UNMAPPED, ChannelError, ElasticChannel
from proxima.memory.layout import check_block_major, granule_blocks
from proxima.memory.ops import OpBatch, Report, merge_reports

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

logger = logging.getLogger("vllm.proxima")

STATS_EVERY_S = 0.5      # the stats file is rewritten at least this often while steps run


@dataclass
class ElasticMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step: the step's ops (None: nothing to do) and KV
    compaction's copies and block-table changes (None: none; applied by
    :func:`proxima.vllm.compaction_worker.install_worker_hook`'s hook, before the ops)."""

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
    """The granule in block ids from the KV cache config alone (the scheduler has no
    tensors); each worker derives it from its views, checked on the first report."""
    from proxima.memory.kv import region_block_strides

    sizes, _ = elastic_v1.kv_regions(kv_cache_config)
    if not sizes:
        raise UserError(f"{elastic_v1.CONNECTOR}: this model has no KV cache to map")
    return granule_blocks(region_block_strides(sizes, kv_cache_config.num_blocks), granule_bytes)


def _current_stream() -> int:
    """The CUDA stream the forward is about to run on (zero-fills of new granules go
    there, ahead of it); 0 where CUDA was never started (CPU tests)."""
    import torch

    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_initialized() else 0


class ProximaElasticConnector(KVConnectorBase_V1, SupportsHMA):
    """Carries :mod:`proxima.memory.ops` batches to the workers; loads and saves nothing."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = elastic_v1.ElasticOptions.from_extra(
            self._kv_transfer_config.kv_connector_extra_config)
        self._composed = compaction_options.composed_in_multiconnector()
        self.channel: ElasticChannel | None = None
        #: the scheduler side's decisions (None: worker, or policy off)
        self.controller: ElasticController | None = None
        self.clock = time.monotonic         # the policy's clock (the replay sets a fake one)
        self.steps = 0
        self._stats_written = 0.0           # when the stats file was last written (monotonic)
        self._step_began: float | None = None     # when the last step with tokens began
        self._step_ms: deque[float] = deque(maxlen=256)       # ms between step starts
        self._build_ms: deque[float] = deque(maxlen=256)      # ms in build_connector_meta
        self._pool = None
        self._memory = None
        self._applied: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._background = None             # proxima.memory.background.BackgroundOps
        self._short = False
        #: set around vLLM's sleep (POST /proxima/sleep): no idle steps are asked for, since
        #: vLLM's pause completes only once the engine has no work (has_requests counts this
        #: connector's pending push work), and an asleep engine has nothing to step for
        self._sleeping = False
        if role == KVConnectorRole.WORKER:
            parallel = vllm_config.parallel_config
            if parallel.data_parallel_size > 1:
                raise UserError("elastic KV memory does not support data parallelism "
                                f"(data_parallel_size={parallel.data_parallel_size}): idle "
                                "ranks read stale block ids; unset PROXIMA_ELASTIC")
            model = vllm_config.model_config
            if model is not None and model.enable_sleep_mode and not self.options.sleep_mode:
                # allowed only as proxima serve --sleep-mode sets it up (sleep_mode: the KV
                # given back by the idle release before the sleep, the wake coordinated
                # through the GPU's ledger): Proxima's KV is outside vLLM's memory pool and
                # nothing Proxima allocates through torch is in it (NOTES.md, point 2)
                raise UserError("vLLM's sleep mode is not supported with elastic KV memory "
                                "on its own (its sleep would not give back Proxima's KV, and a "
                                "wake is not coordinated with the GPU's other engines: "
                                "docs/results/sleep-mode/NOTES.md); use --sleep-after SECONDS "
                                "per model of proxima serve --model NAME=PATH, or "
                                "--idle-release, and drop --enable-sleep-mode")
            # --- KV compaction (issue 14): its scratch granules past the pool, and the
            # worker applies its moves before the forward
            compaction = compaction_options.worker_side(vllm_config, self.options.compaction,
                                                   self._composed)
            elastic_v1.install_allocation_hook(
                self.options, vllm_config,
                spare_granules=compaction.scratch_granules if compaction is not None else 0)
            if compaction is not None:
                compaction_worker.install_worker_hook()
            # ---

    # the scheduler side's parts, as the controller holds them (None: worker, policy off)
    queue = property(lambda self: getattr(self.controller, "queue", None),
                     doc="the pool's granule-aware free queue")
    policy = property(lambda self: getattr(self.controller, "policy", None),
                      doc="the grow/shrink policy (policy auto)")
    shared = property(lambda self: getattr(self.controller, "shared", None),
                      doc="the policy stepped with the GPU's ledger (policy auto)")
    compactor = property(lambda self: getattr(self.controller, "compactor", None),
                         doc="KV compaction's Compactor (scheduler side)")

    @property
    def step_hook(self):
        """The ``compactor`` option's step hook (tests)."""
        return getattr(self.controller, "step_hook", None)

    @step_hook.setter
    def step_hook(self, hook) -> None:
        self.controller.step_hook = hook

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
        self._memory = memory
        if self.options.sleep_mode:
            # a model that sleeps: its sleeps release the weights without a copy, and its
            # wake finds torch's cache where it was (docs in sleep_memory)
            try:
                sleep_memory.set_up_sleep(keep_weights=sleep_memory.weights_stay(
                    self._vllm_config))
            except Exception as exc:  # noqa: BLE001 - vLLM's sleep as it is
                logger.warning("Proxima: this engine's sleeps are vLLM's own (%s: %s): each "
                               "copies the weights to the host and empties torch's GPU "
                               "cache", type(exc).__name__, exc)
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
        if batch is None:
            return
        if self._background is not None:
            self._background.submit(batch.seq, batch.ops)
            return
        failed = self._memory.apply(batch.ops, stream=_current_stream())
        self._done(batch.seq, failed)

    def _done(self, seq: int, failed) -> None:
        self._applied.append((seq, tuple(failed)))
        if failed and not self._short:
            logger.warning("Proxima elastic KV: the GPU has no memory for %d more granules "
                           "now; serving at the current size", sum(n for _, n in failed))
        self._short = bool(failed)

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
        times = compaction_worker.take_worker_times()
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
        opts, kvc = self.options, self._kv_cache_config
        g = predicted_granule_blocks(kvc, elastic_v1.grain_of(opts, kvc))  # each worker reports
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
        queue = use_granules(g, opts.eviction_policy(), mapped=startup)
        ch.state[startup:] = bytes([UNMAPPED]) * (ch.num_granules - startup)
        ch.listeners.append(self._on_map)
        if initial < startup:                    # warm-up needed more than the initial size
            queue.release(range(initial, startup))
            ch.unmap(initial, startup - initial)
        self.controller = ElasticController(
            opts, self._vllm_config, kvc, gpu_block_pool, queue, ch, self.bytes_per_granule,
            self._composed, clock=lambda: self.clock())
        gpu_block_pool.proxima.elastic = self.status
        policy = self.controller.policy
        target = policy.startup_granules if policy is not None else 0
        logger.info("Proxima elastic KV: %d granules of %d blocks (%.1f MiB each), %d mapped "
                    "at start-up, %d kept%s; policy %s, eviction %s", ch.num_granules, g,
                    self.bytes_per_granule / 2**20, startup, initial,
                    f", grown to {target} before the first request where the GPU has room"
                    if target > initial else "", opts.policy, queue.eviction)

    def _on_map(self, granules: range, ok: bool) -> None:
        if ok:
            self.queue.on_mapped(granules)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    @property
    def requires_kv_delivery(self) -> bool:    # vLLM 0.33 asks: see vllm_v1_compat
        return False                            # no KV is handed off

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
        if self.controller is not None:     # compaction, then the policy, then a step hook
            self.controller.step(scheduler_output, self.steps)
        compactor = self.compactor
        batch = self.channel.build()
        work = compactor.take_work() if compactor is not None else None
        if self.options.stats_file and time.monotonic() - self._stats_written >= STATS_EVERY_S:
            self.write_stats()            # a stats file follows busy and idle steps alike
        if batch is not None and self._pool is not None:
            publish = getattr(self._pool, "publish_status", None)
            if publish is not None:
                publish(now=True, wait=False)   # the new mapping shows at once (a thread
                                                # writes it: the step does not wait)
        elif (self.options.idle_sleep_s and scheduler_output.total_num_scheduled_tokens == 0
              and self.shared is not None and self.shared.wants_step() and not self.channel.pending
              and not self._pool.proxima.expected_tokens):
            # An idle engine kept stepping (a release's delay, its first step, another engine's
            # demand): sleep a little per empty step, not spin (new requests wait that long).
            time.sleep(self.shared.idle_pause(self.options.idle_sleep_s))
        return ElasticMetadata(batch, compaction=work)

    def _verify(self, scheduler_output) -> None:
        """No block handed out this step may lie in a granule that is not mapped."""
        ch = self.channel
        state = ch.state
        # Every granule mapped (a fixed pool, a grown one): no block can be in an unmapped
        # granule, nothing to look at (one C-speed count over the granules' states).
        if ch.count(MAPPED) == ch.num_granules:
            return
        G = ch.granule_blocks
        lists = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        lists += [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids) if ids]
        for req_id, groups in lists:
            for ids in groups:
                for b in ids:
                    if state[b // G] != MAPPED:      # ch.allocatable(b), inline
                        raise ChannelError(
                            f"request {req_id} was given block {b}, in granule "
                            f"{ch.granule_of(b)}, which is not mapped")

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
        """Ops to deliver or confirm, or the policy must step (``SharedPolicyStep.wants_step``:
        a release waiting, a first step, another engine's demand): the engine keeps stepping
        (empty steps) -- vLLM 0.26's hook to keep an idle scheduler alive (``has_requests``)."""
        if self.channel is None or self._sleeping:
            return False
        return (self.channel.pending or (self.shared is not None and self.shared.wants_step())
                or (self.step_hook is not None and self.step_hook.pending()))

    # ================================================================ control
    def control(self, request: dict) -> dict:
        """The ``proxima_kv`` utility (engine loop, between steps): apply ``min_bytes`` /
        ``max_bytes`` (None: no maximum but the pool) if given, act on them now, and return
        :meth:`status`. A bad request is ``{"error": ...}``."""
        if self.policy is None:
            return {"error": f"elastic KV runs with policy {self.options.policy!r}: its size "
                             "is fixed (start it with policy auto to set min/max)",
                    **self.status()}
        request = dict(request or {})
        if "sleeping" in request:           # POST /proxima/sleep and /proxima/wake_up
            if not isinstance(request["sleeping"], bool):
                return {"error": f"sleeping must be true or false, got {request['sleeping']!r}"}
            self._sleeping = request.pop("sleeping")
        if "asleep_bytes" in request:
            answer = self._asleep(request.pop("asleep_bytes"))
            if answer is not None:
                return answer
        if "release_now" in request:        # POST /proxima/sleep {"release": true}
            if request.pop("release_now") is not True:
                return {"error": "release_now must be true"}
            if self.policy.release_idle_now():
                self.controller.step_policy()
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
            self.controller.step_policy()
            logger.info("Proxima elastic KV: limits set to min %d, max %s bytes", lo,
                        "pool" if hi is None else hi)
        return self.status()

    def _asleep(self, freed) -> dict | None:
        """``asleep_bytes``: the GPU memory vLLM's sleep frees (the weights), taken off what
        this engine's ledger record says it holds besides KV while it sleeps (0: awake
        again, the record's full figure back), so the other engines may use it; the wake
        first asks for it back. None when done, else the error answer."""
        if isinstance(freed, bool) or not isinstance(freed, int) or freed < 0:
            return {"error": f"asleep_bytes must be a number of bytes from 0, got {freed!r}"}
        ledger = self.shared.ledger if self.shared is not None else None
        if ledger is None:
            return None
        full = getattr(self, "_nonkv_awake", None)
        if full is None:
            full = self._nonkv_awake = ledger.nonkv
        ledger.nonkv = max(0, full - freed)
        try:
            if not ledger.repost():
                self.shared.post()
        except OSError:
            pass                            # a full or vanished /dev/shm: it serves on
        logger.info("Proxima elastic KV: the ledger counts %d bytes besides KV (%s)",
                    ledger.nonkv, "asleep" if freed else "awake")
        return None

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
               **(self.step_hook.stats() if self.step_hook is not None else {}), **ch.stats}
        B = getattr(self, "bytes_per_granule", 0)
        out["bytes_per_granule"] = B
        if self.queue is not None:
            out["pool"] = self.queue.granule_stats()
        if self.policy is not None:
            out.update(self.policy.snapshot())
            out["events"] = self.policy.stats.events[-20:]     # (time, grow/shrink/fail, n)
            ledger = self.shared.ledger if self.shared is not None else None
            out.update(ledger=str(ledger.path) if ledger is not None else None,
                       unmet_bytes=self.policy.unmet_bytes,
                       others_unmet_bytes=self.shared.others_unmet_bytes if self.shared else 0)
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
            if self.shared is not None:
                self.shared.close()          # this engine's claim leaves the ledger
        elif self._background is not None:
            self._background.close()
