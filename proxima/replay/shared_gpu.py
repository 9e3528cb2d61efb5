"""Two engines on one simulated GPU, on CPU: elastic KV against a static split (issue 33,
item 5).

Each engine is vLLM 0.26's real V1 scheduler (its KV-cache manager, block pool and prefix
cache), driven as :mod:`proxima.replay.driver_v1` drives one: no model runs, every request
whose prefill is complete samples one token a step, to ``max_tokens``.

* **Elastic**: both engines run Proxima's real elastic connector and grow/shrink policy
  (:class:`~proxima.memory.sharing.SharedPolicyStep`), each with a pool as large as the
  whole GPU's KV. They share one GPU of fixed size (:class:`Gpu`): each engine's stand-in
  worker (:class:`GpuWorker`, the replay's :class:`~proxima.replay.elastic.ReplayWorker`)
  maps a granule only while the GPU has room beside what the other engine's worker holds,
  and fails the rest of the map as the driver would; a map is confirmed after the map time
  (``map_gbps``). The engines know each other through a real ledger file
  (:mod:`proxima.memory.ledger`) in a temporary directory, one record each (same pid, two
  names), and see the simulated GPU's free and total memory as NVML's figures. As on the
  GPU, the policy learns that the GPU is full from a failed map (the real connector gives
  it no driver figure to cap its grows; ``ElasticReplay.driver_free`` is not used here),
  posts the unmet demand in the ledger, and the other engine gives back at once. Both
  engines start before the first tick (their warm-ups mapped), then each takes its
  start-up steps in turn (:func:`proxima.replay.driver_v1.start_up`): its start-up grow
  takes no more than NVML's free memory says, after the other's.
  The simulated GPU is the KV's room only: a GPU worker's map also leaves ``gpu_free_low``
  of the whole GPU free for the forward's activations (``KvMemory.keep_free_bytes``), which
  is not modelled, as the static engines' activation memory is not (both lie outside the
  KV's room).
* **Static split**: two stock vLLM engines, each holding half the GPU's KV blocks.

**The clock** is one shared step clock of ``step_seconds`` a tick. At each tick every
engine that holds requests (or, elastic, whose connector says it must: vLLM's
``Scheduler.has_requests``) takes one step, the two in turn (which goes first alternates
each tick, so neither reads the ledger always first); a map handed to a worker in a tick
is confirmed at the end of the first tick after its map time. An engine with nothing to do
does not step; when neither has, the clock jumps to the next arrival (idle time is never
inside a request's wait). So each engine gets one step a tick whether the other is busy or
not: the replay models memory, not compute -- as the one-engine replay, a step does not
lengthen with the tokens it schedules, and two busy engines are not slowed by sharing the
GPU's compute. Both sides run on the same clock, so the comparison is fair: under
alternating bursts only one engine is busy at a time, and under a steady load both are
busy on both sides alike.

Request latency is counted in ticks as the one-engine replay counts steps: a request
arrives at its ``arrival_step`` tick (a closed loop's: when its slot frees), its queue
wait ends at the first tick that schedules it, its first token at the end of the tick
that completes its prefill. ``finish_ticks``: the tick after the last request finished
(trailing idle steps of an elastic engine waiting out a release are not counted).
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass, field

from proxima.replay.elastic import ElasticReplay, ReplayWorker
from proxima.workloads import Workload

ENGINES = ("A", "B")
#: the trailing idle ticks (elastic engines waiting out a release or a cache hold after
#: the last request) are bounded: the run ends there and says so (``idle_cut``)
MAX_TRAILING_TICKS = 20_000


class Gpu:
    """One GPU's room for KV, in granules, shared by the engines' workers."""

    def __init__(self, granules: int, bytes_per_granule: int) -> None:
        self.granules = granules
        self.bytes_per_granule = bytes_per_granule
        self.workers: list[GpuWorker] = []
        self.peak_granules = 0            # the most granules held at once, over the run
        self.now = 0.0                    # seconds, the shared clock (set as it moves)

    def held(self, but=None) -> int:
        """Granules held now: mapped, and unmapped by a worker that is not done yet."""
        return sum(w.holding(self.now) for w in self.workers if w is not but)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes, as NVML would say of the GPU's KV room."""
        B = self.bytes_per_granule
        return max(0, self.granules - self.held()) * B, self.granules * B

    def sample(self) -> None:
        self.peak_granules = max(self.peak_granules, self.held())


class GpuWorker(ReplayWorker):
    """The stand-in worker of one engine on the shared :class:`Gpu`: a map succeeds while
    the GPU holds fewer granules than its room, this engine's and the other's together."""

    def __init__(self, gpu: Gpu, channel, bytes_per_granule: int, map_gbps: float,
                 unmap_gbps: float) -> None:
        self.gpu = gpu
        super().__init__(channel, None, bytes_per_granule, map_gbps, unmap_gbps)
        gpu.workers.append(self)

    @property
    def capacity(self) -> int:
        """The granules this worker may hold now: the GPU's room less the other's."""
        return self.gpu.granules - self.gpu.held(but=self)

    @capacity.setter
    def capacity(self, value) -> None:
        pass                        # ReplayWorker sets a fixed one: here the GPU decides

    def submit(self, meta, now: float) -> None:
        self.gpu.now = max(self.gpu.now, now)
        super().submit(meta, now)


@dataclass
class EngineStats:
    """What one engine's run measured (latency in ticks of the shared clock)."""

    name: str
    requests: int
    completed: int = 0
    preemptions: int = 0
    busy_steps: int = 0
    steps: int = 0
    scheduled_tokens: int = 0       # tokens computed: prefill chunks (recomputes too), decodes
    last_finish_tick: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    arrived: dict = field(default_factory=dict)
    first_scheduled: dict = field(default_factory=dict)
    first_token: dict = field(default_factory=dict)
    finished: set = field(default_factory=set)
    finish_ticks: list = field(default_factory=list)   # the tick each request finished
    blocks_leaked: int = 0
    elastic: dict | None = None

    def waits(self) -> tuple[list[int], list[int]]:
        """(queue waits, TTFTs) of the finished requests, in ticks."""
        q = [self.first_scheduled[r] - self.arrived[r] for r in self.finished
             if r in self.first_scheduled]
        t = [self.first_token[r] - self.arrived[r] for r in self.finished
             if r in self.first_token]
        return q, t


class Engine:
    """One scheduler, its workload and its measurement hooks, stepped by the shared clock."""

    def __init__(self, name: str, workload: Workload, scheduler, hasher) -> None:
        from vllm.v1.request import RequestStatus

        self.name = name
        self.workload = workload
        self.scheduler = scheduler
        self.hasher = hasher
        self.stats = EngineStats(name, len(workload.requests))
        self.pending = sorted(workload.requests, key=lambda r: r.arrival_step)
        self.next_i = 0
        self.in_flight = 0
        self.memory: ElasticMemory | None = None
        kv = scheduler.kv_cache_manager
        original_free = kv.free
        stats = self.stats

        def free(request):             # measurement hook, identical on both sides
            if request.status != RequestStatus.PREEMPTED and request.is_finished():
                stats.preemptions += request.num_preemptions
            return original_free(request)

        kv.free = free
        self._restore = lambda: setattr(kv, "free", original_free)

    # ------------------------------------------------------------------ arrivals
    def admit(self, tick: int) -> None:
        """Hand the scheduler every request due by ``tick`` (a closed loop: while a slot
        is free)."""
        limit = self.workload.concurrency
        while self.next_i < len(self.pending):
            spec = self.pending[self.next_i]
            if limit:
                if self.in_flight >= limit:
                    break
            elif spec.arrival_step > tick:
                break
            self._submit(spec, tick)
            self.next_i += 1
            self.in_flight += 1

    def _submit(self, spec, tick: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.stats.arrived[spec.request_id] = tick
        self.scheduler.add_request(Request(
            request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
            pooling_params=None, arrival_time=0.0,
            sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            block_hasher=self.hasher))

    def next_arrival(self) -> int | None:
        """The tick of the next open-loop arrival (None: none left, or a closed loop)."""
        if self.next_i >= len(self.pending) or self.workload.concurrency:
            return None
        return self.pending[self.next_i].arrival_step

    def done(self) -> bool:
        return self.next_i >= len(self.pending) and not self.scheduler.has_requests()

    # ------------------------------------------------------------------ one step
    def step(self, tick: int) -> None:
        """One scheduler step at ``tick``: schedule, the stand-in model's tokens, the
        stand-in worker's answer (elastic), the scheduler's update."""
        from proxima.replay.driver_v1 import _runner_output

        s = self.stats
        sched = self.scheduler
        out = sched.schedule()
        requests = sched.requests
        sampling = {rid for rid in out.num_scheduled_tokens
                    if not requests[rid].is_prefill_chunk}
        for rid in out.num_scheduled_tokens:
            s.first_scheduled.setdefault(rid, tick)
        for rid in sampling:
            s.first_token.setdefault(rid, tick + 1)
        s.steps += 1
        s.busy_steps += out.total_num_scheduled_tokens > 0
        s.scheduled_tokens += out.total_num_scheduled_tokens
        runner = _runner_output(out, sampling, requests, {})
        if self.memory is not None:
            runner.kv_connector_output = self.memory.worker_output(out, tick)
        for outputs in sched.update_from_output(out, runner).values():
            stats = outputs.scheduler_stats
            if stats is not None:
                s.prefix_hits += stats.prefix_cache_stats.hits
                s.prefix_queries += stats.prefix_cache_stats.queries
            for o in outputs.outputs:
                if o.finish_reason is not None and o.request_id not in s.finished:
                    s.finished.add(o.request_id)
                    s.completed += 1
                    s.last_finish_tick = tick + 1
                    s.finish_ticks.append(tick + 1)
                    self.in_flight -= 1

    def close(self) -> None:
        self._restore()
        pool = self.scheduler.kv_cache_manager.block_pool
        held = self.memory.queue.held_blocks() if self.memory is not None else 0
        self.stats.blocks_leaked = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks() - held
        if self.memory is not None:
            self.stats.elastic = self.memory.report()
            self.memory.close()


class ElasticMemory:
    """One elastic engine's connector on the shared GPU: its clock (the shared one), its
    stand-in worker, its record in the GPU's ledger, the driver's view of the GPU."""

    def __init__(self, name: str, spec: ElasticReplay, scheduler, gpu: Gpu, ledger_file,
                 clock) -> None:
        from proxima.vllm.elastic_v1 import find_connector
        from proxima.memory.ledger import Ledger

        self.spec = spec
        self.connector = c = find_connector(scheduler.connector)
        if c is None or c.queue is None or c.shared is None:
            raise RuntimeError("the two-engine replay's scheduler was built without "
                               "Proxima's elastic connector, pool or policy")
        self.queue = c.queue
        c.clock = clock
        self.worker = GpuWorker(gpu, c.channel, c.bytes_per_granule, spec.map_gbps,
                                spec.unmap_gbps)
        c.shared.ledger = Ledger(ledger_file, name=name)
        c.shared.gpu_memory = gpu.memory
        c.shared.post()

    def worker_output(self, scheduler_output, tick: int):
        from vllm.v1.outputs import KVConnectorOutput

        dt = self.spec.step_seconds
        self.worker.submit(scheduler_output.kv_connector_metadata, tick * dt)
        return KVConnectorOutput(kv_connector_worker_meta=self.worker.report((tick + 1) * dt))

    def mapped_bytes(self) -> int:
        """Mapped memory as the scheduler's channel has it confirmed."""
        return self.queue.granules.num_mapped * self.connector.bytes_per_granule

    def report(self) -> dict:
        status = self.connector.status()
        for noise in ("events", "step_ms", "connector_ms", "pool"):
            status.pop(noise, None)
        status["ledger"] = "stand-in"          # a temporary file: its name is noise
        return status

    def close(self) -> None:
        self.connector.shared.close()


@dataclass
class SideResult:
    """One side's run: the engines' stats, the memory timeline, the clock's end."""

    side: str                                  # "elastic" or "static"
    engines: list[EngineStats]
    #: (tick, mapped bytes of A, of B), a row at each change (static: one row)
    memory: list[tuple[int, int, int]]
    ticks: int                                 # the ticks stepped through, idle ones too
    finish_ticks: int
    gpu_bytes: int
    peak_mapped_bytes: int                     # the most KV memory held at once
    idle_cut: bool = False


def run_side(workloads: tuple[Workload, Workload], *, elastic: ElasticReplay | None,
             gpu_bytes: int, block_size: int = 16, max_num_seqs: int = 1024,
             max_num_batched_tokens: int = 16384, max_model_len: int = 8192,
             granule_blocks: int = 32, enable_prefix_caching: bool = True,
             progress=None) -> SideResult:
    """Replay one side: ``elastic`` given, two elastic Proxima engines sharing a GPU of
    ``gpu_bytes`` of KV (each with a pool of all of it); None, two stock engines with half
    of its blocks each. ``progress(done, total)`` after each finished request."""
    from vllm.utils.gc_utils import freeze_gc_heap
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    from proxima.vllm import vllm_v1
    from proxima.replay.driver_v1 import build_scheduler, start_up

    block_bytes = (elastic or ElasticReplay()).block_bytes(block_size)
    gpu_blocks = gpu_bytes // block_bytes
    common = dict(block_size=block_size, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                  enable_prefix_caching=enable_prefix_caching)
    tmp = tempfile.TemporaryDirectory(prefix="proxima-two-engines-ledger-")
    engines: list[Engine] = []
    now = [0]
    try:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(block_size, sha256)
        if elastic is not None:
            from proxima.memory.ledger import ledger_path
            from proxima.replay.elastic import kv_cache_groups, kv_transfer_config

            spec = elastic
            # the managers' hooks (growth hints, the expected blocks of held requests) must
            # be live while we run, and before Engine wraps the manager's free
            vllm_v1.activate()
            ledger_file = ledger_path("replay", tmp.name)
            gpu = Gpu(gpu_bytes // (granule_blocks * block_bytes), granule_blocks * block_bytes)
            for name, workload in zip(ENGINES, workloads):
                scheduler = build_scheduler(
                    proxima=True, num_blocks=gpu_blocks, **common,
                    kv_cache_groups=kv_cache_groups(block_size),
                    kv_transfer_config=kv_transfer_config(spec, granule_blocks, block_size))
                engine = Engine(name, workload, scheduler, hasher)
                engine.memory = ElasticMemory(name, spec, scheduler, gpu, ledger_file,
                                              lambda: now[0] * spec.step_seconds)
                engines.append(engine)
            # both engines up (their warm-ups mapped), then each one's start-up steps, in
            # turn: B's start-up grow sees what A's took
            for engine in engines:
                start_up(engine.scheduler, engine.memory.connector, engine.memory.worker)
        else:
            gpu = None
            for name, workload in zip(ENGINES, workloads):
                engines.append(Engine(name, workload, build_scheduler(
                    proxima=False, num_blocks=gpu_blocks // 2, **common), hasher))
        freeze_gc_heap()             # as vLLM's EngineCore does after start-up
        return _run(engines, gpu, now, elastic is not None, gpu_bytes, gpu_blocks,
                    block_bytes, progress)
    finally:
        for engine in engines:
            engine.close()
        gc.unfreeze()
        if elastic is not None:
            vllm_v1.deactivate()
        tmp.cleanup()


def _run(engines: list[Engine], gpu: Gpu | None, now: list, elastic: bool, gpu_bytes: int,
         gpu_blocks: int, block_bytes: int, progress) -> SideResult:
    total = sum(e.stats.requests for e in engines)
    if elastic:
        memory = [(0, *(e.memory.mapped_bytes() for e in engines))]
    else:
        memory = [(0, *([gpu_blocks // 2 * block_bytes] * len(engines)))]
    tick = 0
    idle_cut = False
    last_done = -1
    while not all(e.done() for e in engines):
        now[0] = tick
        if gpu is not None:
            gpu.now = tick * engines[0].memory.spec.step_seconds
        for e in engines:
            e.admit(tick)
        active = [e for e in engines if e.scheduler.has_requests()]
        if not active:
            arrivals = [t for t in (e.next_arrival() for e in engines) if t is not None]
            if not arrivals:            # a closed loop whose slots are all free: admit
                tick += 1
                continue
            tick = max(tick + 1, min(arrivals))
            continue
        if tick % 2:
            active.reverse()            # neither engine always steps (reads the ledger) first
        for e in active:
            e.step(tick)
            if elastic:
                gpu.sample()            # what the workers hold, maps in flight included
        if elastic:
            row = (tick + 1, *(e.memory.mapped_bytes() for e in engines))
            if row[1:] != memory[-1][1:]:
                memory.append(row)
        done = sum(e.stats.completed for e in engines)
        if progress is not None and done != last_done:
            progress(done, total)
            last_done = done
        tick += 1
        finish = max(e.stats.last_finish_tick for e in engines)
        if done == total and tick - finish > MAX_TRAILING_TICKS:
            idle_cut = True
            break
    finish = max(e.stats.last_finish_tick for e in engines)
    peak = gpu.peak_granules * gpu.bytes_per_granule if elastic else \
        len(engines) * (gpu_blocks // 2) * block_bytes
    return SideResult("elastic" if elastic else "static", [e.stats for e in engines], memory,
                      tick, finish, gpu_bytes, peak, idle_cut)
