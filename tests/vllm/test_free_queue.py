"""ProximaFreeQueue against vLLM 0.26's FreeKVCacheBlockQueue, and the two places where
vLLM calls the queue in ways the plain scheduler replay does not: copy-on-write of a
partial prefix hit, and the simple CPU offload connector's walk from a cursor.
All on CPU with vLLM's real classes."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest

from proxima.allocator import AllocationHint, count_runs
from proxima.vllm import vllm_v1


def kv_blocks(n: int):
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return [KVCacheBlock(i) for i in range(n)]


def both_queues(n: int):
    """(stock queue, its blocks), (Proxima's queue, its blocks), each with the null block
    taken out as BlockPool does."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    stock_blocks, our_blocks = kv_blocks(n), kv_blocks(n)
    stock = FreeKVCacheBlockQueue(stock_blocks)
    stock.popleft()
    ours = vllm_v1.ProximaFreeQueue(our_blocks, reserved=(0,))
    return (stock, stock_blocks), (ours, our_blocks)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------------------ iter_blocks_after

def test_the_walk_is_the_eviction_order_hashless_first_then_least_recently_used():
    (stock, sb), (ours, ob) = both_queues(32)
    for q, blocks in ((stock, sb), (ours, ob)):
        got = q.popleft_n(20)
        q.append_n([blocks[i] for i in (9, 4, 7)])       # cached, freed in this order
        q.prepend_n([blocks[i] for i in (15, 14)])       # hash-less, freed tail first
        assert q.num_free_blocks == 31 - 20 + 5
    walk_stock, walk_ours = ids(stock.iter_blocks_after(None)), ids(ours.iter_blocks_after(None))
    assert len(walk_stock) == len(walk_ours) == 16
    # the cached tier in the same LRU order, after the same number of hash-less blocks
    assert walk_stock[-3:] == walk_ours[-3:] == [9, 4, 7]
    assert sorted(walk_stock[:-3]) == sorted(walk_ours[:-3])
    assert walk_ours[:-3] == sorted(walk_ours[:-3])        # Proxima's buddy tier: by id
    assert ids(ours.get_all_free_blocks()) == walk_ours


def test_a_cursor_in_the_cached_tier_continues_after_it_and_sees_later_frees():
    (stock, sb), (ours, ob) = both_queues(32)
    walks = []
    for q, blocks in ((stock, sb), (ours, ob)):
        q.popleft_n(31)
        q.append_n([blocks[i] for i in (3, 5, 8, 13)])
        cursor = blocks[5]
        walk = q.iter_blocks_after(cursor)
        first = next(walk).block_id
        q.append_n([blocks[21]])                         # freed while the walk is paused
        walks.append([first] + ids(walk))
    assert walks[0] == walks[1] == [8, 13, 21]


def test_a_cursor_that_left_the_queue_yields_nothing_as_in_stock():
    (stock, sb), (ours, ob) = both_queues(32)
    for q, blocks in ((stock, sb), (ours, ob)):
        q.popleft_n(31)
        q.append_n([blocks[i] for i in (3, 5, 8)])
        q.remove(blocks[5])                              # a prefix hit takes it back
        assert list(q.iter_blocks_after(blocks[5])) == []
        assert ids(q.iter_blocks_after(blocks[3])) == [8]
    held = ours.popleft_n(1)[0]                          # a buddy-tier block, allocated
    assert list(ours.iter_blocks_after(held)) == []


def test_a_cursor_in_the_buddy_tier_continues_with_the_free_ids_above_it():
    (_, _), (ours, blocks) = both_queues(40)
    ours.popleft_n(39)
    ours.prepend_n([blocks[i] for i in (30, 29, 12, 11, 10)])
    ours.append_n([blocks[i] for i in (2, 3)])
    assert ids(ours.iter_blocks_after(None)) == [10, 11, 12, 29, 30, 2, 3]
    assert ids(ours.iter_blocks_after(blocks[12])) == [29, 30, 2, 3]
    assert ids(ours.iter_blocks_after(blocks[30])) == [2, 3]


def test_the_walk_reads_the_tier_live_without_copying_it():
    """O(blocks yielded): a walk over a long LRU tier follows the links as they are when
    it reaches them (a copy would still show the removed block)."""
    (_, _), (ours, blocks) = both_queues(5000)
    ours.popleft_n(4999)
    ours.append_n(blocks[1:])
    walk = ours.iter_blocks_after(blocks[10])
    assert next(walk).block_id == 11
    ours.remove(blocks[12])
    assert next(walk).block_id == 13


# ------------------------------------------------------------------ copy-on-write

def partial_hit_tables(proxima: bool):
    """Request "b" hits 48 tokens of "a"'s 64 with 32-token blocks: vLLM's manager records
    a partial hit (as HybridKVCacheCoordinator does for hybrid models with a finer
    prefix-match unit) and allocate_new_blocks takes a copy-on-write block for the shared
    last block, then the new blocks. "c" holds the ids right after "a"."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    if proxima:
        vllm_v1.activate()
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=200, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=32,
                             hash_block_size=32, enable_caching=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(32, sha256)

    def request(rid, prompt):
        return Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                       arrival_time=0.0, block_hasher=hasher,
                       sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))

    for rid, first in (("a", 100), ("c", 900)):
        r = request(rid, list(range(first, first + 64)))
        manager.allocate_slots(r, r.num_tokens)
    pool = manager.block_pool
    if proxima:                   # what the wrapped Scheduler.add_request records for "b"
        pool.proxima.expected_tokens["b"] = 256
        pool.proxima.expected_blocks += 8
    group = manager.coordinator.single_type_managers[0]
    shared = list(group.req_to_blocks["a"])
    group.add_local_computed_blocks("b", shared, 48, 0)
    assert "b" in group._partial_hit_reqs
    new = group.allocate_new_blocks("b", 48 + 200, 48 + 200)
    table = ids(group.req_to_blocks["b"])
    vllm_v1.deactivate()
    return ids(shared), table, ids(new), pool.get_num_free_blocks()


def test_copy_on_write_block_and_new_blocks_form_one_run():
    shared_s, table_s, new_s, free_s = partial_hit_tables(proxima=False)
    shared_p, table_p, new_p, free_p = partial_hit_tables(proxima=True)
    for shared, table, new in ((shared_s, table_s, new_s), (shared_p, table_p, new_p)):
        assert table[0] == shared[0] and table[1] != shared[1]      # the tail was copied
        assert table[1:] == new and len(table) == 8
    assert free_s == free_p
    assert count_runs(new_p) == 1, new_p        # the CoW block, then the rest behind it


def test_the_hint_set_on_the_queue_continues_over_its_pops_until_the_caller_clears_it():
    _, (ours, _) = both_queues(64)
    ours.hint = AllocationHint(room=8)      # as the manager wrapper sets it
    first = ids(ours.popleft_n(1))          # vLLM's copy-on-write block ...
    rest = ids(ours.popleft_n(3))           # ... then the new blocks: one run
    assert first + rest == list(range(first[0], first[0] + 4))
    assert ours.hint == AllocationHint(after=rest[-1], room=4)
    ours.hint = None                        # the wrapper's call is over
    other = ids(ours.popleft_n(2))          # another request: clear of the claimed room
    assert other == [first[0] + 8, first[0] + 9]
    assert ours.hint is None


# ------------------------------------------------------------------ simple CPU offload

def offload_scheduler(proxima: bool, num_blocks: int, lazy: bool, cpu_blocks: int,
                      max_num_batched_tokens: int):
    """vLLM's Scheduler with SimpleCPUOffloadConnector (what VLLM_USE_SIMPLE_KV_OFFLOAD=1
    with --kv-offloading-size selects), built as proxima.replay.driver_v1 builds one."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from proxima.vllm.vllm_v1_compat import kv_cache_tensors
    from proxima.replay.driver_v1 import TINY_LLAMA

    model_dir = tempfile.mkdtemp(prefix="proxima-tiny-llama-")
    (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
    cache = CacheConfig(block_size=16, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    page = spec.page_size_bytes * 2                      # two layers share the tensor
    transfer = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": cpu_blocks * page,
                                   "lazy_offload": lazy})
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=4096),
        cache_config=cache,
        scheduler_config=SchedulerConfig(max_num_seqs=64,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=4096, is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"), kv_transfer_config=transfer)
    kv_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=kv_cache_tensors(num_blocks, page, ["layer.0", "layer.1"]),
        kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)])
    if proxima:
        vllm_v1.activate()
    return Scheduler(vllm_config=config, kv_cache_config=kv_config,
                     structured_output_manager=StructuredOutputManager(config),
                     block_size=16, log_stats=True)


def offload_replay(proxima: bool, num_blocks: int, lazy: bool, cpu_blocks: int = 256,
                   max_num_batched_tokens: int = 2048):
    """Conversations of four turns, each resending its history (prefix reuse), three
    requests arriving per step; the worker's transfers complete at once. Returns every
    step's decisions: scheduled tokens per request, preemptions, GPU blocks stored and
    loaded, free GPU blocks."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    scheduler = offload_scheduler(proxima, num_blocks, lazy, cpu_blocks, max_num_batched_tokens)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    rng = random.Random(0)
    histories = [[rng.randint(3, 30000) for _ in range(rng.randint(40, 300))] for _ in range(12)]
    pending = []
    for turn in range(4):
        for c, history in enumerate(histories):
            history += [rng.randint(3, 30000) for _ in range(rng.randint(10, 60))]
            pending.append((f"c{c}t{turn}", list(history), rng.randint(8, 40)))
    log = []
    try:
        while pending or scheduler.has_requests():
            for rid, prompt, max_tokens in pending[:3]:
                scheduler.add_request(Request(
                    request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                    arrival_time=0.0, block_hasher=hasher,
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
            del pending[:3]
            out = scheduler.schedule()
            meta = out.kv_connector_metadata
            req_ids = list(out.num_scheduled_tokens)
            loaded = {r for reqs in meta.load_event_to_reqs.values() for r in reqs}
            done = KVConnectorOutput(
                finished_recving=loaded if meta.load_event >= 0 else None,
                kv_connector_worker_meta=(SimpleCPUOffloadWorkerMetadata({meta.store_event: 1})
                                          if meta.store_event >= 0 else None))
            scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[] if scheduler.requests[r].is_prefill_chunk else [5]
                                   for r in req_ids],
                logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
                kv_connector_output=done))
            log.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids),
                        len(meta.store_gpu_blocks), len(meta.load_gpu_blocks),
                        scheduler.kv_cache_manager.block_pool.get_num_free_blocks()))
            assert len(log) < 5000, "the replay does not finish"
    finally:
        vllm_v1.deactivate()
    if proxima:
        scheduler.kv_cache_manager.block_pool.free_block_queue.buddy.check()
    return log


@pytest.mark.parametrize("lazy, max_num_batched_tokens, num_blocks", [
    (True, 2048, 160),          # a full pool: cached blocks come back from the CPU
    (True, 128, 200),           # a small target: the walk often stops in the hash-less tier
    (True, 256, 800),
    (True, 512, 1200),          # a roomy pool: walks cross long hash-less tiers
    (False, 2048, 160),
    (False, 256, 800),
], ids=lambda v: {True: "lazy", False: "eager"}.get(v, str(v)) if isinstance(v, bool) else str(v))
def test_simple_cpu_offload_decides_the_same_on_both_pools(lazy, max_num_batched_tokens,
                                                           num_blocks):
    """Lazy mode walks the GPU free queue with iter_blocks_after from its cursor each step
    (target: 2 x max_num_batched_tokens worth of blocks); eager mode stores what requests
    computed. Either way the scheduler and the connector decide the same on Proxima's
    pool as on stock's, step by step: requests and tokens scheduled, preemptions, blocks
    stored to and loaded from the CPU, free blocks. (The pools were chosen where an
    earlier ProximaFreeQueue, walking only its cached tier, or the hash-less tier by id
    without stock's positions, decided differently.)"""
    stock = offload_replay(False, num_blocks, lazy, 32, max_num_batched_tokens)
    proxima = offload_replay(True, num_blocks, lazy, 32, max_num_batched_tokens)
    assert sum(step[2] for step in stock) > 0, "nothing was offloaded"
    if lazy and num_blocks <= 200:
        # (eager mode on a full pool brings blocks back on vLLM 0.26 but not on 0.33,
        # whose eager policy changed; the lazy walk from a cursor is what must be seen)
        assert sum(step[3] for step in stock) > 0, "nothing came back from the CPU"
    assert len(proxima) == len(stock)
    for i, (ours, theirs) in enumerate(zip(proxima, stock)):
        assert ours == theirs, f"step {i}: Proxima {ours[1:]} vs stock {theirs[1:]}"


# ------------------------------------------------------------------ the hot path

def test_a_request_that_needs_no_block_is_answered_as_vllm_would_without_its_call(
        monkeypatch):
    """The scheduler calls allocate_new_blocks for every scheduled request every step;
    Proxima's wrapper answers those that hold blocks enough itself (vLLM's base method
    would return an empty list and touch nothing: tests/contract checks that on each
    release of vllm_v1.PLAIN_ALLOCATE_RELEASES), and hands every other call to vLLM."""
    import vllm
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core import single_type_kv_cache_manager as managers
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    assert vllm.__version__ in vllm_v1.PLAIN_ALLOCATE_RELEASES     # the tested releases
    base = managers.SingleTypeKVCacheManager
    stock = base.__dict__["allocate_new_blocks"]
    reached = []                 # calls that reach vLLM's base method through the wrapper

    def counted(self, *args, **kwargs):
        reached.append(args[0])
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(base, "allocate_new_blocks", counted)
    vllm_v1.activate()
    try:
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        manager = KVCacheManager(config, max_model_len=4096, scheduler_block_size=32,
                                 hash_block_size=32, enable_caching=False)
        r = Request(request_id="a", prompt_token_ids=list(range(100, 164)), pooling_params=None,
                    arrival_time=0.0, sampling_params=SamplingParams(max_tokens=8))
        manager.allocate_slots(r, r.num_tokens)
        group = manager.coordinator.single_type_managers[0]
        pool = manager.block_pool
        table = list(group.req_to_blocks["a"])
        calls = []
        original = pool.get_new_blocks
        pool.get_new_blocks = lambda n: calls.append(n) or original(n)
        reached.clear()
        for n in (1, 33, 64):
            assert group.allocate_new_blocks("a", n, n) == []
        assert group.req_to_blocks["a"] == table and calls == [] and reached == []
        grown = group.allocate_new_blocks("a", 65, 65)             # a third block: vLLM's path
        assert calls == [1] and len(grown) == 1 and group.req_to_blocks["a"] == table + grown
        assert reached == ["a"]
        # a request vLLM holds no list for yet goes to vLLM too (its defaultdict adds one)
        assert group.allocate_new_blocks("z", 0, 0) == [] and "z" in group.req_to_blocks
    finally:
        vllm_v1.deactivate()
