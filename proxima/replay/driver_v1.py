"""Drive vLLM 0.26's real V1 scheduler on CPU over a workload: stock or Proxima.

No model runs. Each step the "model runner" samples one token for every request whose
prefill is complete (``ignore_eos``: requests run to ``max_tokens``). The scheduler, the
KV-cache manager, the block pool and prefix caching are vLLM's own code; Proxima changes
only the free-block queue (see proxima.vllm.vllm_v1).

The measurement hooks (final block tables, preemption counts, prefix-cache stats, each
request's queue wait and time to first token) are the same for both allocators.

Request latency is counted in steps of the replay's step clock, the same on both sides: a
request arrives at the step it is handed to the scheduler (its ``arrival_step``, or when
the turn it follows finished plus its think time, or when a closed loop's slot frees), its
queue wait ends at the first step that schedules tokens for it and its first token comes at
the end of the step that completes its prefill. Idle time (no request held) is skipped on
the stock side and stepped through on the elastic side while a release waits for its
delay; it never falls inside a request's wait, so the two count alike. ``busy_steps``
counts the steps that scheduled tokens, on both sides.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable

from proxima.replay.reclaim import LLAMA_8B_BYTES_PER_BLOCK, ReclaimTally
from proxima.replay.result import ReplayResult, contiguity
from proxima.workloads import Workload

#: the engine generation this driver replays: what ``proxima replay`` checks its
#: engine-specific options against (``ENGINE_OPTIONS`` there)
ENGINE = "v1"

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def build_scheduler(*, proxima: bool, num_blocks: int, block_size: int = 16,
                    max_num_seqs: int = 1024, max_num_batched_tokens: int = 16384,
                    enable_prefix_caching: bool = True, max_model_len: int = 8192,
                    kv_cache_groups=None, model_dir: str | None = None,
                    async_scheduling: bool = False, kv_transfer_config=None):
    """A real ``vllm.v1.core.sched.scheduler.Scheduler`` for a CPU-only machine.

    ``kv_cache_groups``: vLLM ``KVCacheGroupSpec`` list (default: one full-attention group).
    ``async_scheduling``: vLLM's ``AsyncScheduler`` (what a vLLM 0.26 engine uses by default).
    ``kv_transfer_config``: a vLLM ``KVTransferConfig`` (a KV connector); the KV cache config
    then lists one tensor per layer, as the connector's scheduler side reads it.
    Proxima is installed only while the scheduler is built and stays in its block pool.
    """
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from proxima.vllm.vllm_v1_compat import kv_cache_tensors
    from proxima.vllm import vllm_v1

    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="proxima-tiny-llama-")
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    cache.num_gpu_blocks = num_blocks
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=max_model_len),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False,
            async_scheduling=async_scheduling),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    if kv_cache_groups is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        kv_cache_groups = [KVCacheGroupSpec(["layer.0", "layer.1"], spec)]
    tensors = [] if kv_transfer_config is None else [
        tensor for group in kv_cache_groups
        for tensor in kv_cache_tensors(num_blocks, group.kv_cache_spec.page_size_bytes,
                                       group.layer_names)]
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                              kv_cache_groups=kv_cache_groups)
    was_active = vllm_v1.is_active()
    if proxima:
        vllm_v1.activate()
    else:
        vllm_v1.deactivate()
    try:
        cls = AsyncScheduler if async_scheduling else Scheduler
        return cls(vllm_config=config, kv_cache_config=kv_config,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=block_size, log_stats=True)
    finally:
        # Construction is what picks the pool; leave the classes as the caller had them.
        if was_active:
            vllm_v1.activate()
        else:
            vllm_v1.deactivate()


def run_replay(workload: Workload, *, proxima: bool, num_blocks: int, block_size: int = 16,
               max_num_seqs: int = 1024, max_num_batched_tokens: int = 16384,
               enable_prefix_caching: bool = True, max_model_len: int = 8192,
               progress: Callable[[int, int], None] | None = None,
               timeline_every: int = 0, async_scheduling: bool = False,
               granule_blocks: int = 32, elastic=None, compaction=None,
               compaction_budget_bytes: int | None = None,
               bytes_per_block: int | None = None, on_sample=None) -> ReplayResult:
    """Replay ``workload`` once through one allocator (:class:`ReplayResult`).

    ``timeline_every``: every that many steps, record (step, free or evictable blocks,
    largest run of them, runs) for the plot; 0: no timeline.

    ``async_scheduling``: vLLM's AsyncScheduler with its engine loop's batch queue of two
    (a step is scheduled before the previous one's output is processed), as vLLM 0.26
    runs by default on a GPU; otherwise the synchronous scheduler, one step at a time.

    ``granule_blocks``: sample granule occupancy every step (:mod:`proxima.replay.reclaim`:
    reclaimable fraction and packed ideal, in ``details``). ``compaction``: a
    :class:`proxima.vllm.activation.CompactionMode` (Proxima only): KV compaction is
    planned and applied to the scheduler's structures after every ``schedule()``, as the
    engine does; the copies are not made (no KV on CPU) but counted, in blocks and in
    bytes of ``bytes_per_block`` (default: Llama-3.1-8B's 2 MiB over 32 layers), within
    ``compaction_budget_bytes`` per step. ``on_sample``: ``fn(step, blocks)`` called with
    vLLM's block list wherever the granule tally samples (:mod:`proxima.replay.oracle`)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    from proxima.vllm import vllm_v1
    from proxima.vllm.status import percentiles

    elastic_kw = {}
    if elastic is not None and proxima:
        from proxima.replay.elastic import kv_cache_groups, kv_transfer_config

        comp = None
        if compaction is not None:     # the connector's compactor, as in an elastic engine
            comp = {"mode": str(compaction)}
            if compaction_budget_bytes is not None:
                comp["budget_mib"] = max(1, compaction_budget_bytes >> 20)
        elastic_kw = dict(kv_cache_groups=kv_cache_groups(block_size),
                          kv_transfer_config=kv_transfer_config(elastic, granule_blocks,
                                                                block_size, comp))
    scheduler = build_scheduler(
        proxima=proxima, num_blocks=num_blocks, block_size=block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
        async_scheduling=async_scheduling, **elastic_kw)
    if proxima:
        vllm_v1.activate()       # the managers' growth hints must be live while we run
    # As vLLM's EngineCore does after start-up: move everything built so far (the block
    # pool included) out of the cyclic GC's generations.
    import gc

    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    kv = scheduler.kv_cache_manager
    managers = kv.coordinator.single_type_managers
    pool = kv.block_pool
    elastic_run = None
    if elastic is not None and proxima:
        from proxima.replay.elastic import ElasticRun

        elastic_run = ElasticRun(elastic, scheduler, granule_blocks)
        start_up(scheduler, elastic_run.connector, elastic_run.worker)
    tally = ReclaimTally(num_blocks, granule_blocks,
                         elastic.block_bytes(block_size) if elastic is not None else 0,
                         on_sample=on_sample)

    final_tables: list[list[int]] = []
    preemptions = 0
    original_free = kv.free

    def free(request):           # measurement hook, identical for both allocators
        nonlocal preemptions
        if request.status != RequestStatus.PREEMPTED and request.is_finished():
            blocks = managers[0].req_to_blocks.get(request.request_id, [])
            final_tables.append([b.block_id for b in blocks if not b.is_null])
            preemptions += request.num_preemptions
        return original_free(request)

    kv.free = free

    compactor = None
    if compaction is not None and elastic_run is not None:
        compactor = pool.proxima.compaction     # built by the connector: it plans in schedule()
    elif compaction is not None:
        if not proxima:
            raise ValueError("compaction needs Proxima's block pool (proxima=True)")
        from proxima.vllm.compaction_options import DEFAULT_BUDGET_BYTES
        from proxima.vllm.compaction_v1 import Compactor

        # one granule of scratch blocks past the pool, as an elastic engine has
        compactor = Compactor(
            pool, granule_blocks=granule_blocks,
            bytes_per_block=bytes_per_block or LLAMA_8B_BYTES_PER_BLOCK,
            mode=compaction, scratch_blocks=granule_blocks,
            budget_bytes=DEFAULT_BUDGET_BYTES if compaction_budget_bytes is None
            else compaction_budget_bytes)

    # Requests that follow another (a conversation's next turn) wait for it to finish.
    waiting_on: dict[str, object] = {r.follows: r for r in workload.requests if r.follows}
    pending = sorted((r for r in workload.requests if not r.follows),
                     key=lambda r: r.arrival_step)
    total = len(workload.requests)
    next_i = 0
    in_flight = 0
    completed = 0
    steps = 0
    idle_steps = 0          # elastic: steps with no request left, kept alive by the connector
    busy_steps = 0          # steps that scheduled tokens (an elastic side's idle steps not)
    arrived: dict[str, int] = {}      # request id -> step clock when handed to the scheduler
    first_scheduled: dict[str, int] = {}    # -> the step that first scheduled its tokens
    first_token: dict[str, int] = {}        # -> the end of the step that sampled its first
    scheduled_tokens = 0    # tokens the model runner would compute (prefill chunks, decodes)
    step = 0
    sched_seconds = 0.0
    peak_running = 0
    hits = queries = hits_new = queries_new = 0
    free_run_timeline: list[tuple[int, int, int, int]] = []   # step, free, largest, runs
    finished_ids: set[str] = set()
    released: list[tuple[int, object]] = []

    replies = {r.request_id: r.output_token_ids for r in workload.requests if r.output_token_ids}

    def submit(spec):
        arrived[spec.request_id] = step
        scheduler.add_request(Request(
            request_id=spec.request_id, prompt_token_ids=list(spec.prompt_token_ids),
            pooling_params=None, arrival_time=0.0,
            sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            block_hasher=hasher))

    # Steps scheduled but not yet answered: vLLM 0.26's engine loop keeps up to two in
    # flight with async scheduling (its batch queue), one without.
    depth = 2 if async_scheduling else 1
    in_flight_steps: deque = deque()
    requests = scheduler.requests        # vLLM's live dict: request id -> Request

    try:
        while (next_i < len(pending) or released or scheduler.has_requests()
               or in_flight_steps):
            if released:
                released.sort(key=lambda x: x[0])
                while released and (released[0][0] <= step or not scheduler.has_requests()):
                    due, spec = released.pop(0)
                    step = max(step, due)
                    submit(spec)
            if workload.concurrency:
                while next_i < len(pending) and in_flight < workload.concurrency:
                    submit(pending[next_i])
                    next_i += 1
                    in_flight += 1
            else:
                if not scheduler.has_requests() and next_i < len(pending):
                    step = max(step, pending[next_i].arrival_step)   # skip idle steps
                while next_i < len(pending) and pending[next_i].arrival_step <= step:
                    submit(pending[next_i])
                    next_i += 1
            if scheduler.has_requests():
                if elastic_run is not None:
                    elastic_run.before_step(step)
                    # no request to run or to clean up: this step exists only because the
                    # connector waits out its release delay (Scheduler.has_requests)
                    idle_steps += not (scheduler.has_unfinished_requests()
                                       or scheduler.finished_req_ids)
                t0 = time.perf_counter()
                out = scheduler.schedule()
                if compactor is not None and elastic_run is None:   # as the connector does
                    compactor.begin_step(kv, out)
                    compactor.step()
                    compactor.take_work()
                sched_seconds += time.perf_counter() - t0
                # What the model runner will return for this step: a token for every
                # request whose prefill completes in it (vLLM's own flag, set by schedule()).
                sampling = {rid for rid in out.num_scheduled_tokens
                            if not requests[rid].is_prefill_chunk}
                in_flight_steps.appendleft((out, sampling, step))
                for rid in out.num_scheduled_tokens:
                    first_scheduled.setdefault(rid, step)
                for rid in sampling:
                    first_token.setdefault(rid, step + 1)
                if out.total_num_scheduled_tokens:
                    busy_steps += 1
                steps += 1
                step += 1
                scheduled_tokens += out.total_num_scheduled_tokens
                if len(in_flight_steps) < depth and scheduler.has_requests():
                    continue      # vLLM fills its batch queue before it waits for an output
            out, sampling, at = in_flight_steps.pop()
            runner_output = _runner_output(out, sampling, requests, replies)
            if elastic_run is not None:
                runner_output.kv_connector_output = elastic_run.worker_output(out, at)
            t2 = time.perf_counter()
            engine_outputs = scheduler.update_from_output(out, runner_output)
            sched_seconds += time.perf_counter() - t2
            peak_running = max(peak_running, len(scheduler.running))
            tally.sample(steps, pool.blocks,
                         elastic_run.mapped_granules() if elastic_run is not None else None)
            for outputs in engine_outputs.values():
                # update_from_output already drained the scheduler's stats into here.
                stats = outputs.scheduler_stats
                if stats is not None:
                    pcs = stats.prefix_cache_stats
                    hits_new += pcs.hits
                    queries_new += pcs.queries
                    hits += pcs.hits + pcs.preempted_hits
                    queries += pcs.queries + pcs.preempted_queries
                for o in outputs.outputs:
                    if o.finish_reason is not None and o.request_id not in finished_ids:
                        finished_ids.add(o.request_id)
                        completed += 1
                        in_flight -= 1
                        follower = waiting_on.pop(o.request_id, None)
                        if follower is not None:   # arrives think-time steps from now
                            released.append((step + 1 + follower.arrival_step, follower))
                        if progress:
                            progress(completed, total)
            if timeline_every and steps % timeline_every == 0:
                free_run_timeline.append((steps, *_largest_free_run(pool)))
    finally:
        kv.free = original_free
        gc.unfreeze()
        if proxima:
            vllm_v1.deactivate()

    return ReplayResult(
        allocator="proxima" if proxima else "stock",
        completed=completed,
        steps=steps,
        peak_running=peak_running,
        preemptions=preemptions,
        prefix_hit_rate=hits / queries if queries else 0.0,
        scheduler_ms_per_step=1000 * sched_seconds / steps if steps else 0.0,
        # (elastic: the blocks of unmapped granules are not free, and not leaked either)
        blocks_leaked=pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        - (elastic_run.unmapped_blocks() if elastic_run is not None else 0),
        num_blocks=num_blocks,
        largest_free_run_timeline=free_run_timeline,
        details={"prefix_hit_rate_new_requests": hits_new / queries_new if queries_new else 0.0,
                 "scheduled_tokens": scheduled_tokens,
                 **_latency(finished_ids, arrived, first_scheduled, first_token, percentiles),
                 "busy_steps": busy_steps,
                 **tally.means(), "reclaim_timeline": tally.timeline(),
                 **(elastic_run.report() if elastic_run is not None else {}),
                 **({"idle_steps": idle_steps} if elastic_run is not None else {}),
                 **({"compaction": compactor.stats()} if compactor is not None else {})},
        **contiguity(final_tables),
    )


def start_up(scheduler, connector, worker) -> int:
    """An elastic engine's start-up steps, before the trace's first request; returns how
    many (not counted among the run's steps). As vLLM's engine loop does once the engine
    is up: its connector's work -- the policy's first step, which grows to the start-up
    size where the GPU has room (:func:`proxima.vllm.elastic_v1.startup_target`), a
    release of warm-up granules above an initial size given -- keeps it stepping empty
    steps (``Scheduler.has_requests``) until the policy has stepped and the workers have
    confirmed every op. The stand-in worker maps and unmaps as it would (within the
    simulated GPU's room) and answers at once: a server is up before its load comes (a
    start-up grow of 2 GiB maps in ~5 ms at the 1 GiB grain, 86 ms at 2 MiB), so the
    trace's clock starts after these steps (at 0, as the policy's)."""
    from vllm.v1.outputs import KVConnectorOutput

    policy = connector.policy
    steps = 0
    while connector.channel.pending or (policy is not None and policy.unstepped):
        if steps == 16:
            raise RuntimeError("the elastic engine's start-up did not settle in 16 steps")
        out = scheduler.schedule()
        runner = _runner_output(out, set(), scheduler.requests, {})
        runner.kv_connector_output = KVConnectorOutput(
            kv_connector_worker_meta=worker.start_up(out.kv_connector_metadata))
        scheduler.update_from_output(out, runner)
        steps += 1
    return steps


def _latency(finished, arrived: dict, first_scheduled: dict, first_token: dict,
             percentiles) -> dict:
    """Queue wait and time to first token of the finished requests, in steps of the step
    clock: p50 and p99 (the status files' :func:`~proxima.vllm.status.percentiles`),
    the mean, the most."""
    out = {}
    for name, start in (("queue_wait", first_scheduled), ("ttft", first_token)):
        values = [start[r] - arrived[r] for r in finished if r in start and r in arrived]
        stats = percentiles(values)
        out[f"{name}_p50_steps"] = stats["p50"]
        out[f"{name}_p99_steps"] = stats["p99"]
        out[f"{name}_steps"] = {**stats, "mean": sum(values) / len(values) if values else None}
    return out


def _runner_output(out, sampling: set[str], requests: dict, replies: dict):
    """The ``ModelRunnerOutput`` of one scheduled step: a token (the workload's recorded
    reply, else 5) for each request in ``sampling``, nothing for partial prefills."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = requests.get(rid)
        if rid not in sampling or req is None:
            sampled.append([])
            continue
        reply = replies.get(rid)
        sampled.append([reply[req.num_output_tokens] if reply else 5])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                             pooler_output=[])


def _largest_free_run(pool) -> tuple[int, int, int]:
    """(free blocks, largest run of consecutive free ids, free runs) of the whole pool:
    free means allocatable now or cached-but-evictable, for either allocator."""
    ids = sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    if not ids:
        return (0, 0, 0)
    best = cur = 1
    runs = 1
    for a, b in zip(ids, ids[1:]):
        if b == a + 1:
            cur += 1
            best = max(best, cur)
        else:
            cur = 1
            runs += 1
    return (len(ids), best, runs)
