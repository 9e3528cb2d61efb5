"""Elastic KV memory in the CPU replay: the real connector and policy, a stand-in worker.

``proxima replay --elastic`` builds the scheduler with Proxima's KV connector
(:mod:`proxima.vllm.elastic_connector`) exactly as an engine would: its scheduler side
makes the pool granule-aware and runs the grow/shrink policy at every step boundary. There
is no GPU: :class:`ReplayWorker` answers each step's ops as the workers would (maps succeed
while the simulated GPU has room: ``gpu_bytes``), so every decision -- what is mapped when,
what is released, which cached blocks that evicts -- is the real code's. The engine's
start-up steps (its policy's first step and start-up grow, :func:`proxima.replay.driver_v1.
start_up`) run before the trace's first step, as a server is up before its load comes.

Time is simulated seconds on one clock: the step count times ``step_seconds`` (every
scheduler step, busy or empty, lasts that long). The policy reads it, and the stand-in
worker maps and unmaps on it as the H200's mapping thread does (one batch at a time, in
order): a batch handed over in step N starts when the batch before it is done (at the
earliest at step N's start), takes its granules' bytes over ``map_gbps`` (``MAP_GBPS_H200``
in ``proxima replay``; 0, at once, in :class:`ElasticReplay`) plus those unmapped over
``unmap_gbps``, and is reported in the output of the
first step that ends after that; only then are the granules allocatable. While the
scheduler waits for such a report it steps empty steps (the connector's pending work), so
a map's time shows as steps in the requests' queue wait and time to first token. Why
seconds on the step clock and not a fixed count of steps per map: the release delay and
the map time are both seconds on the GPU, and the policy already counts in them; 25 ms a
step (the default) is about what the H200 measured per step of the 8B under a steady load
(an elastic engine's step p50 of 21-25 ms in session 7's (d) windows, ~26 ms a step, phase
by phase, in session 16's; docs/benchmarks.md 7.3); a shorter step counts a map as more
steps, which errs against elastic KV. The step does not lengthen with the tokens it
schedules, on either side.

With ``policy="fixed"`` the pool places by granule with the whole pool mapped: the
placement alone, whose reclaimable fraction the proof measures.

The KV cache is shaped like Llama-3.1-8B's (32 layers, 8 KV heads of 128, bf16: a 64 KiB
page per layer and block, 2 MiB per block over all layers), so ``granule_blocks`` block
ids are ``granule_blocks * 64 KiB`` of each layer (32 = 2 MiB, the H200's granularity).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from proxima.memory.ops import MAP, UNMAP, Report

LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 32, 8, 128, 2

#: GB/s (10**9 bytes a second) the H200's worker maps KV at, granules of 2 MiB per layer
#: (the default, 64 MiB over the 8B's 32 layers; each a cuMemCreate + cuMemMap per layer),
#: the mapping thread on: ~3 s of worker map time per burst of 1,168 granules (78.4 GB) on
#: the documented user path (two ``proxima serve --elastic`` engines, issue 33, main
#: 5a58932): 26 GB/s, rounded down. The other figures on record are lower bounds or
#: another grain: the (d) steady loads of session 19 (docs/results/h200-2026-12-05-s19,
#: ``worker_map_seconds`` over the grows still listed in ``elastic_events``: 7-12 GB/s, an
#: underestimate, the list has lost each run's first grows, and small grows of 15-27
#: granules each pay a per-grow cost); session 4's VMM test (a first 2 GiB map with its
#: zero-fill in 364.6 ms: 5.9 GB/s); the two-engine runs with 1 GiB granules (32 MiB per
#: layer: 100-480 GB/s, docs/results/h200-2026-12-0[1-4]-*/call*-two_engines.json).
MAP_GBPS_H200 = 25.0
#: GB/s the H200's worker unmaps at: session 4's VMM test, 1 GiB in 15.6 ms
#: (docs/results/h200-2026-12-01-s4/call1-vmm_timings.json). It runs on the same thread as
#: the maps, so an unmap delays the maps behind it.
UNMAP_GBPS_H200 = 69.0


def check_runs_here(flag: str, driver, version: str, hint: str = "") -> None:
    """Refuse ``flag`` (one line) where the replay cannot run elastic KV: a vLLM of the V0
    engine, or one whose scheduler side Proxima does not read. ``hint`` ends the V0 line."""
    from proxima.vllm import elastic_v1
    from proxima.errors import UserError

    if driver.ENGINE != "v1":
        raise UserError(f"{flag} needs vLLM's V1 engine; vLLM {version} runs the V0 "
                        f"one{hint}")
    reason = elastic_v1.unsupported_reason("scheduler")
    if reason:
        raise UserError(f"{flag}: {reason}")


def auto_granule_blocks(num_blocks: int, block_size: int) -> int:
    """The granule the product picks for a pool of ``num_blocks`` of the 8B shape when none
    is given (:func:`proxima.memory.layout.auto_granule_bytes`), in block ids."""
    from proxima.memory.layout import auto_granule_bytes

    page = page_bytes(block_size)
    return auto_granule_bytes([page] * LAYERS, num_blocks) // page


def resolve_rates(spec: "ElasticReplay", granule_blocks: int, block_size: int) -> None:
    """Fill in the default map and unmap rates (``map_gbps`` None) for this granule: a map
    costs per physical allocation (one per layer and granule), not per byte -- ~70 us
    whatever its size on an H100 (tools/gpu/map_rate.py: 30 GB/s at 2 MiB, 481 at 32 MiB,
    near linear) -- so the H200's measured 25 GB/s (and 69 to unmap) at 2 MiB scale with the
    granule's bytes per layer."""
    if spec.map_gbps is None:
        scale = granule_blocks * page_bytes(block_size) / (2 << 20)
        spec.map_gbps = MAP_GBPS_H200 * scale
        spec.unmap_gbps = UNMAP_GBPS_H200 * scale


def page_bytes(block_size: int) -> int:
    """Bytes of one block of one layer (K and V) of the Llama-3.1-8B shape."""
    return block_size * KV_HEADS * HEAD_SIZE * 2 * DTYPE_BYTES


@dataclass
class ElasticReplay:
    """What ``--elastic`` (or the placement proof) runs. Sizes are bytes of the 8B shape."""

    policy: str = "auto"
    eviction: str = "auto"
    min_bytes: int = 0
    max_bytes: int | None = None
    headroom: float = 0.10
    release_delay_s: float = 10.0
    step_seconds: float = 0.025
    gpu_bytes: int | None = None          # the simulated GPU's room for KV (None: the pool)
    # the worker's map rate, GB/s (0: maps done at once, as before it was timed; the bench
    # scripts' recorded figures keep that; ``proxima replay`` defaults to MAP_GBPS_H200)
    map_gbps: float | None = 0.0        # None: resolve_rates' default for the granule
    unmap_gbps: float = UNMAP_GBPS_H200   # its unmap rate (0, or map_gbps 0: at once)
    # with gpu_bytes: the policy reads what the simulated GPU has free before it grows, as
    # a driver's cuMemGetInfo would say (False: it learns only from failed maps)
    driver_free: bool = True
    extra: dict = field(default_factory=dict)

    def connector_extra(self, granule_blocks: int, block_size: int) -> dict:
        out = {"policy": self.policy, "eviction": self.eviction, "min_bytes": self.min_bytes,
               "max_bytes": self.max_bytes, "headroom": self.headroom,
               "release_delay_s": self.release_delay_s, "idle_sleep_s": 0.0,
               "granule_bytes": granule_blocks * page_bytes(block_size)}
        out.update(self.extra)
        return out

    def block_bytes(self, block_size: int) -> int:
        return LAYERS * page_bytes(block_size)


def kv_cache_groups(block_size: int):
    """One full-attention group of 32 layers shaped like Llama-3.1-8B's KV cache."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.bfloat16)
    return [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], spec)]


def kv_transfer_config(spec: ElasticReplay, granule_blocks: int, block_size: int,
                       compaction: dict | None = None):
    """The elastic connector's config for the replay; ``compaction``: its KV compaction
    settings (:class:`proxima.vllm.compaction_options.CompactionOptions`), None: off."""
    from vllm.config import KVTransferConfig

    from proxima.vllm import elastic_v1

    extra = spec.connector_extra(granule_blocks, block_size)
    extra["compaction"] = compaction or {"mode": "0"}
    return KVTransferConfig(**elastic_v1.connector_config(extra))


class ReplayWorker:
    """The workers' side of the channel without memory: applies each step's ops to a
    count of mapped granules and answers with the report a worker would send. A map
    beyond ``capacity`` granules fails (another process holds the memory).

    Timed as the H200's mapping thread (see the module): :meth:`submit` hands a step's
    batch over at ``now`` and :meth:`report` answers, at the end of a step, for the batches
    done by then, with the worker's map and unmap seconds so far. With ``map_gbps`` 0 every
    batch is done, and reported, in the step that carried it."""

    def __init__(self, channel, capacity: int | None, bytes_per_granule: int = 0,
                 map_gbps: float = 0.0, unmap_gbps: float = 0.0) -> None:
        self.channel = channel
        self.capacity = capacity
        self.mapped = set(g for g in range(channel.num_granules) if channel.state[g] != 1)
        timed = map_gbps > 0 and bytes_per_granule > 0
        self.map_s = bytes_per_granule / (map_gbps * 1e9) if timed else 0.0
        self.unmap_s = bytes_per_granule / (unmap_gbps * 1e9) if timed and unmap_gbps > 0 \
            else 0.0
        self.busy_until = 0.0
        self.queued: deque = deque()     # (done at, (seq, failed), mapped after, map s, unmap s)
        self.map_seconds = 0.0           # reported so far, as a worker's Report counts them
        self.unmap_seconds = 0.0
        self.reported_mapped = len(self.mapped)
        #: (done at, granules): unmaps handed over and not done yet; their memory is still
        #: held on the GPU until then (:meth:`holding`), as a worker thread's unmap is
        self.releasing: deque = deque()

    def submit(self, meta, now: float) -> None:
        """The ops of one step's metadata, handed to the mapping thread at ``now``."""
        batch = getattr(meta, "batch", None)
        if batch is None:
            return
        failed = []
        mapped = unmapped = 0
        for op in batch.ops:
            span = range(op.first, op.first + op.count)
            if op.code == UNMAP:
                unmapped += len(self.mapped.intersection(span))
                self.mapped.difference_update(span)
            elif op.code == MAP:
                for g in span:
                    if g in self.mapped:
                        continue
                    if self.capacity is not None and len(self.mapped) >= self.capacity:
                        failed.append((g, op.first + op.count - g))
                        break
                    self.mapped.add(g)
                    mapped += 1
        # a map that fails made and gave back part of a granule first: one granule's time
        map_s, unmap_s = (mapped + bool(failed)) * self.map_s, unmapped * self.unmap_s
        done = max(now, self.busy_until) + map_s + unmap_s
        self.busy_until = done
        if unmapped:
            self.releasing.append((done, unmapped))
        self.queued.append((done, (batch.seq, tuple(failed)), len(self.mapped), map_s, unmap_s))

    def holding(self, now: float) -> int:
        """Granules holding GPU memory at ``now``: mapped, and unmapped but not done yet
        (what another process on the GPU cannot have yet; this worker's own maps queue
        behind its unmaps, so its own view is :attr:`mapped`)."""
        while self.releasing and self.releasing[0][0] <= now:
            self.releasing.popleft()
        return len(self.mapped) + sum(n for _, n in self.releasing)

    def __call__(self, meta):
        """One step's metadata applied and answered at once, whatever the time it takes
        (a driver without a clock)."""
        self.submit(meta, self.busy_until)
        return self.report(float("inf"))

    def start_up(self, meta):
        """One start-up step's metadata applied and answered at once
        (:func:`proxima.replay.driver_v1.start_up`):
        its map time is spent before the trace's first step, so the worker is free then."""
        busy = self.busy_until
        self.submit(meta, busy)
        self.busy_until = busy
        self.releasing.clear()           # done before the trace's first step
        return self.report(float("inf"))

    def report(self, end: float):
        """The worker metadata of a step that ends at ``end``: the batches done by then
        (None when none is)."""
        applied = []
        while self.queued and self.queued[0][0] <= end:
            _, entry, self.reported_mapped, map_s, unmap_s = self.queued.popleft()
            applied.append(entry)
            self.map_seconds += map_s
            self.unmap_seconds += unmap_s
        if not applied:
            return None
        from proxima.vllm.elastic_connector import ElasticWorkerMetadata

        return ElasticWorkerMetadata(Report(tuple(applied), self.reported_mapped,
                                            self.channel.granule_blocks, self.map_seconds,
                                            self.unmap_seconds))


class ElasticRun:
    """One replay's elastic side: the connector found in the scheduler, its fake clock,
    the stand-in worker, and what it reports."""

    def __init__(self, spec: ElasticReplay, scheduler, granule_blocks: int) -> None:
        from proxima.vllm.elastic_v1 import find_connector

        self.spec = spec
        self.connector = find_connector(scheduler.connector)
        if self.connector is None or self.connector.queue is None:
            raise RuntimeError("the replay scheduler was built without Proxima's elastic "
                               "connector or pool")
        self.queue = self.connector.queue
        self.step = 0
        self.connector.clock = lambda: self.step * spec.step_seconds
        self.bytes_per_granule = self.connector.bytes_per_granule
        capacity = None if spec.gpu_bytes is None else spec.gpu_bytes // self.bytes_per_granule
        self.worker = ReplayWorker(self.connector.channel, capacity, self.bytes_per_granule,
                                   spec.map_gbps, spec.unmap_gbps)
        policy = self.connector.policy
        if policy is not None and capacity is not None and spec.driver_free:
            # what the driver would say is free for this engine (cuMemGetInfo on the GPU):
            # the simulated GPU's room less what the worker has mapped or is mapping
            policy.free_bytes = lambda: max(0, capacity - len(self.worker.mapped)) \
                * self.bytes_per_granule
        self._ledger_dir = None
        if self.connector.shared is not None:
            self._share(spec)

    def _share(self, spec: ElasticReplay) -> None:
        """The GPU ledger and the driver's free memory, stood in for: a ledger file of its
        own in a temporary directory (this engine alone in it), and a GPU of fixed size
        (``gpu_bytes``, else the pool) whose free memory is what this engine leaves."""
        import tempfile

        from proxima.memory.ledger import Ledger, ledger_path

        self._ledger_dir = tempfile.TemporaryDirectory(prefix="proxima-replay-ledger-")
        shared = self.connector.shared
        shared.ledger = Ledger(ledger_path("replay", self._ledger_dir.name))
        B = self.bytes_per_granule
        total = spec.gpu_bytes if spec.gpu_bytes is not None \
            else self.connector.channel.num_granules * B
        worker = self.worker
        shared.gpu_memory = lambda: (max(0, total - len(worker.mapped) * B), total)
        shared.post()

    def before_step(self, step: int) -> None:
        self.step = step

    def worker_output(self, scheduler_output, step: int):
        """The KVConnectorOutput of the step scheduled at ``step`` on the step clock (what
        the workers' answer carries): its ops handed to the worker as the step starts, the
        batches done when it ends reported."""
        from vllm.v1.outputs import KVConnectorOutput

        dt = self.spec.step_seconds
        self.worker.submit(scheduler_output.kv_connector_metadata, step * dt)
        return KVConnectorOutput(kv_connector_worker_meta=self.worker.report((step + 1) * dt))

    def mapped_granules(self) -> int:
        return self.queue.granules.num_mapped

    def unmapped_blocks(self) -> int:
        return self.queue.held_blocks()

    def report(self) -> dict:
        status = self.connector.status()
        status.pop("events", None)
        minutes = self.step * self.spec.step_seconds / 60
        policy = self.connector.policy
        if policy is not None and minutes > 0:
            status["failed_grows_per_minute"] = policy.stats.failed_grow_attempts / minutes
            status["failed_granules_per_minute"] = policy.stats.failed_grows / minutes
        status["simulated_seconds"] = self.step * self.spec.step_seconds
        if status.get("ledger"):
            status["ledger"] = "stand-in"      # a temporary file: its name is noise
        return {"elastic": status, "bytes_per_granule": self.bytes_per_granule}
