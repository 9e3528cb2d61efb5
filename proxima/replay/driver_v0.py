"""Replay a workload through vLLM 0.6.x's real V0 scheduler on CPU (the card stack).

No model and no GPU: vLLM's ``Scheduler``, its block manager, block tables and block
allocators run as in ``LLMEngine``; the model runner is replaced by a loop that samples
one token for every scheduled sequence group whose prefill is done (``do_sample``), and
vLLM's own ``SingleStepOutputProcessor`` + ``StopChecker`` append it, finish sequences and
free their blocks, as ``LLMEngine._process_model_outputs`` does.

:func:`run_replay` returns the :class:`~proxima.replay.result.ReplayResult` of one side,
stock or Proxima, on the identical trace, as the V1 driver does; ``proxima replay`` runs it
on the card stack. V0's own figures are in its ``details``: ``ignored``,
``recompute_preemptions``, ``swap_preemptions``, ``own_blocks_per_run`` and
``own_single_run_fraction`` (each request's blocks after the prefix-cache hits it starts
with), ``scheduler_seconds``, ``wall_seconds`` and, for Proxima, ``allocator_stats``.

``prefix_hit_rate`` is vLLM V0's own metric (``get_prefix_cache_hit_rate``): cache hits
over lookups of full prompt blocks (0.0 when prefix caching is off).
"""

from __future__ import annotations

import gc
import time
from typing import Callable, Optional

from proxima.vllm import vllm_v0
from proxima.replay.result import ReplayResult, contiguity
from proxima.workloads import Workload

#: the engine generation this driver replays: what ``proxima replay`` checks its
#: engine-specific options against (``ENGINE_OPTIONS`` there)
ENGINE = "v0"

# Fixed "sampled" token: clear of bos/eos; sequences ignore eos and stop at max_tokens.
SAMPLED_TOKEN = 7
DEFAULT_NUM_CPU_BLOCKS = 2048   # vLLM's swap_space=4 GiB at 2 MiB per block (Llama-3.1-8B)
FREE_RUN_SAMPLES = 100          # samples of (step, num_free, largest_free_run) kept


def run_replay(workload: Workload, *, proxima: bool, num_blocks: int, block_size: int = 16,
               max_num_seqs: int = 1024, max_num_batched_tokens: int = 16384,
               enable_prefix_caching: bool = True, max_model_len: int = 8192,
               progress: Optional[Callable[[int, int], None]] = None,
               timeline_every: int = 0,
               num_cpu_blocks: int = DEFAULT_NUM_CPU_BLOCKS,
               preemption_mode: Optional[str] = None,
               enable_chunked_prefill: bool = False) -> ReplayResult:
    """Drive V0's scheduler over ``workload`` until every request is done.

    Args:
        proxima: build the scheduler with Proxima's block manager (else vLLM's own),
            whatever ``PROXIMA_ALLOCATOR`` says; the version policy applies
            (``vllm_v0.block_manager_class`` asks it).
        num_blocks: GPU KV blocks (vLLM's ``num_gpu_blocks``).
        num_cpu_blocks: swap space in blocks (preemption by swap).
        preemption_mode: None (vLLM's choice: recompute for single sequences), "swap"
            or "recompute".
        progress: called as ``progress(done, total)`` whenever requests finish.
        timeline_every: sample (step, truly free blocks, largest run of them) every that
            many steps for the plot, thinned to at most ``2 * FREE_RUN_SAMPLES``
            samples; 0: no timeline.

    Arrivals (as in the V1 driver): open loop, a request enters at its ``arrival_step``
    (idle steps are skipped, not counted); closed loop (``workload.concurrency``), the
    next request enters whenever fewer than that many are in flight; a request that
    ``follows`` another (a conversation's next turn) enters ``arrival_step`` steps after
    that one finished. The stand-in model answers a request's ``output_token_ids`` when
    the workload gives them (multiturn: the reply the next turn resends), else a fixed
    token.
    """
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.core.scheduler import PreemptionMode, Scheduler
    from vllm.engine.output_processor.single_step import SingleStepOutputProcessor
    from vllm.engine.output_processor.stop_checker import StopChecker
    from vllm.utils import Counter, Device

    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9,
                               swap_space=0, cache_dtype="auto",
                               enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks     # normally set after profiling the GPU
    cache_config.num_cpu_blocks = num_cpu_blocks
    with vllm_v0.block_manager_class(proxima):
        scheduler = Scheduler(scheduler_config, cache_config, lora_config=None)
    block_manager = scheduler.block_manager
    assert isinstance(block_manager, vllm_v0.ProximaBlockSpaceManager) == proxima

    preempted = {PreemptionMode.RECOMPUTE: 0, PreemptionMode.SWAP: 0}
    stock_preempt = scheduler._preempt

    def counting_preempt(seq_group, blocks_to_swap_out, preemption_mode=None):
        mode = stock_preempt(seq_group, blocks_to_swap_out, preemption_mode)
        preempted[mode] += 1
        return mode

    scheduler._preempt = counting_preempt      # count by kind; vLLM's code does the work

    processor = SingleStepOutputProcessor(
        scheduler_config, detokenizer=None, scheduler=[scheduler], seq_counter=Counter(),
        stop_checker=StopChecker(max_model_len, lambda seq: None))
    replay = _Replay(scheduler, processor, workload, max_model_len, block_size, progress,
                     _free_pool_probe(block_manager, proxima), timeline_every)
    # The block-object pools (4 per block) are hundreds of thousands of objects; without
    # this, whichever side happens to trigger a full collection pays seconds for it.
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    try:
        replay.run()
    finally:
        gc.unfreeze()
    wall = time.perf_counter() - start

    gpu_allocator = block_manager.block_allocator._allocators[Device.GPU]
    tables = [t for t, _ in replay.final_tables]
    # The same over each request's own blocks: without the prefix-cache hits it starts
    # with, which are other requests' blocks (and so, for all but one, another run).
    own = contiguity([t[shared:] for t, shared in replay.final_tables])
    steps = replay.steps
    details = {
        "ignored": replay.ignored,
        "recompute_preemptions": preempted[PreemptionMode.RECOMPUTE],
        "swap_preemptions": preempted[PreemptionMode.SWAP],
        "own_blocks_per_run": own["blocks_per_run"],
        "own_single_run_fraction": own["single_run_fraction"],
        "scheduler_seconds": replay.sched_seconds,
        "wall_seconds": wall,
    }
    if proxima:
        stats = gpu_allocator.buddy.stats()
        stats["num_reserved"] = getattr(gpu_allocator, "_hashless_allocator",
                                        gpu_allocator).num_reserved
        details["allocator_stats"] = stats
    return ReplayResult(
        allocator="proxima" if proxima else "stock",
        completed=replay.completed,
        steps=steps,
        peak_running=replay.peak_running,
        preemptions=scheduler.num_cumulative_preemption,
        prefix_hit_rate=max(scheduler.get_prefix_cache_hit_rate(Device.GPU), 0.0),
        scheduler_ms_per_step=1000.0 * replay.sched_seconds / steps if steps else 0.0,
        blocks_leaked=num_blocks - gpu_allocator.get_num_free_blocks(),
        num_blocks=num_blocks,
        largest_free_run_timeline=replay.free_runs,
        details=details,
        **contiguity(tables),
    )


class _Replay:
    """The engine loop: arrivals, ``schedule()``, one sampled token for every group that
    samples, vLLM's output processing, frees. Times schedule + output processing only."""

    def __init__(self, scheduler, processor, workload: Workload, max_model_len: int,
                 block_size: int, progress, free_pool, timeline_every: int = 0) -> None:
        self.scheduler = scheduler
        self.processor = processor
        self.requests = sorted(workload.requests, key=lambda r: r.arrival_step)
        self.concurrency = workload.concurrency
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.progress = progress
        self.free_pool = free_pool
        self.timeline_every = timeline_every
        self.steps = self.peak_running = self.completed = self.ignored = 0
        self.sched_seconds = 0.0
        self.final_tables: list[tuple[list[int], int]] = []
        self.free_runs: list[list[int]] = []

    def run(self) -> None:
        from vllm.inputs import token_inputs
        from vllm.sampling_params import SamplingParams
        from vllm.sequence import (CompletionSequenceGroupOutput, Logprob, Sequence,
                                   SequenceGroup, SequenceOutput)

        scheduler = self.scheduler
        block_manager = scheduler.block_manager
        process_outputs = self.processor.process_outputs
        seq_counter = self.processor.seq_counter
        concurrency = self.concurrency
        max_model_len, block_size = self.max_model_len, self.block_size
        caching = scheduler.cache_config.enable_prefix_caching
        perf_counter = time.perf_counter
        total = len(self.requests)
        # A conversation's next turn waits for the previous one to finish, then arrives
        # ``arrival_step`` steps later (the user's think time), as in the V1 driver.
        followers = {r.follows: r for r in self.requests if getattr(r, "follows", None)}
        pending = [r for r in self.requests if not getattr(r, "follows", None)]
        replies = {r.request_id: r.output_token_ids for r in self.requests
                   if getattr(r, "output_token_ids", None)}
        released: list[tuple[int, object]] = []      # (due step, request), sorted
        logprob = {}
        next_pending = in_flight = done = 0
        clock = steps = 0                 # clock: arrival time in steps, idle included
        sample_every = self.timeline_every

        def submit(spec) -> None:
            seq = Sequence(next(seq_counter), token_inputs(list(spec.prompt_token_ids)),
                           block_size)
            params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True,
                                    detokenize=False)
            scheduler.add_seq_group(SequenceGroup(spec.request_id, [seq], time.time(),
                                                  sampling_params=params))

        while done < total:
            if not scheduler.has_unfinished_seqs():   # idle: jump to the next arrival
                due = [released[0][0]] if released else []
                if next_pending < len(pending) and concurrency is None:
                    due.append(pending[next_pending].arrival_step)
                if due:
                    clock = max(clock, min(due))
            while released and released[0][0] <= clock:
                submit(released.pop(0)[1])
                in_flight += 1
            while next_pending < len(pending) and (
                    pending[next_pending].arrival_step <= clock if concurrency is None
                    else in_flight < concurrency):
                submit(pending[next_pending])
                next_pending += 1
                in_flight += 1
            if not scheduler.has_unfinished_seqs():
                raise RuntimeError(f"replay stalled at step {clock}: {done} of {total} "
                                   f"done and nothing to schedule")

            t0 = perf_counter()
            metadata, outputs, _ = scheduler.schedule()
            finished = []
            for meta, scheduled in zip(metadata, outputs.scheduled_seq_groups):
                seq_group = scheduled.seq_group
                seq_group.update_num_computed_tokens(meta.token_chunk_size or 0)
                if not meta.do_sample:
                    continue
                seq = seq_group.seqs[0]
                reply = replies.get(seq_group.request_id)
                token = reply[seq.get_output_len()] if reply else SAMPLED_TOKEN
                if token not in logprob:
                    logprob[token] = {token: Logprob(0.0)}
                table = None
                if (seq.get_output_len() + 1 >= seq_group.sampling_params.max_tokens
                        or seq.get_len() + 1 > max_model_len):
                    # The table's id list object survives the free that finishing does.
                    table = block_manager.get_block_table(seq)
                    shared = _cache_hit_prefix(block_manager, seq) if caching else 0
                process_outputs(seq_group, [CompletionSequenceGroupOutput(
                    [SequenceOutput(seq.seq_id, token, logprob[token])], None)], False)
                if seq_group.is_finished():
                    finished.append((table, shared))
                    follower = followers.pop(seq_group.request_id, None)
                    if follower is not None:
                        released.append((clock + 1 + follower.arrival_step, follower))
            if finished:
                scheduler.free_finished_seq_groups()
            self.sched_seconds += perf_counter() - t0

            steps += 1
            clock += 1
            released.sort(key=lambda item: item[0])
            self.peak_running = max(self.peak_running, len(scheduler.running))
            self.final_tables += finished
            self.completed += len(finished)
            for ignored in outputs.ignored_seq_groups:      # too long: never scheduled
                follower = followers.pop(ignored.request_id, None)
                if follower is not None:
                    released.append((clock + follower.arrival_step, follower))
                    released.sort(key=lambda item: item[0])
            newly_done = len(finished) + len(outputs.ignored_seq_groups)
            self.ignored += len(outputs.ignored_seq_groups)
            if newly_done:
                done += newly_done
                in_flight -= newly_done
                if self.progress is not None:
                    self.progress(done, total)
            if sample_every and steps % sample_every == 0:
                self.free_runs.append([steps, *self.free_pool()])
                if len(self.free_runs) >= 2 * FREE_RUN_SAMPLES:
                    self.free_runs = self.free_runs[::2]
                    sample_every *= 2
        self.steps = steps


def _cache_hit_prefix(block_manager, seq) -> int:
    """How many of the sequence's first blocks are prefix-cache hits (``computed`` is
    set on a block object only when it was found in the cache)."""
    count = 0
    for block in block_manager.block_tables[seq.seq_id].blocks:
        if not block.computed:
            break
        count += 1
    return count


def _free_pool_probe(block_manager, proxima: bool) -> Callable[[], tuple[int, int]]:
    """``() -> (truly free GPU blocks, longest run of consecutive free ids)``.
    Evictable cached blocks are not counted: they hold data until evicted."""
    from vllm.utils import Device
    gpu = block_manager.block_allocator._allocators[Device.GPU]
    naive = getattr(gpu, "_hashless_allocator", gpu)
    if proxima:
        buddy = naive.buddy
        return lambda: (buddy.num_free, buddy.largest_free_run)

    def probe() -> tuple[int, int]:
        ids = sorted(naive._free_block_indices)
        best = run = 0
        prev = None
        for i in ids:
            run = run + 1 if prev is not None and i == prev + 1 else 1
            best = max(best, run)
            prev = i
        return len(ids), best
    return probe
