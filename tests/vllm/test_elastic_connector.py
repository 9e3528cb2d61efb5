"""Proxima's elastic-KV connector inside vLLM 0.26's real scheduler, on CPU.

The scheduler, KV-cache manager, block pool (stock or Proxima's) and vLLM's MultiConnector
are vLLM's own code. The worker side is the connector's real worker code applying the ops
to a KvMemory whose driver is the CPU stand-in (tests/memory/fake_driver.py): everything
but the CUDA calls. After each step's ops, every block of every scheduled request must lie
in a granule the worker has mapped -- the property that keeps a GPU from faulting.

Policies: ``off`` (the channel only, the pool unchanged), ``fixed`` (the pool places by
granule, all mapped; forced cycles), ``auto`` (grow and shrink; fake clock).
"""

from __future__ import annotations

import json
import logging
from collections import deque

import pytest

from proxima.vllm import elastic_v1, vllm_v1
from proxima.vllm.elastic_connector import (ElasticMetadata, ElasticWorkerMetadata,
                                               ProximaElasticConnector)
from proxima.memory.channel import MAPPED
from proxima.memory.kv import KvMemory
from proxima.memory.ops import Op
from proxima.replay.driver_v1 import _runner_output, build_scheduler
from tests.memory.fake_driver import FakeDriver
from tests.support import forced

if elastic_v1.unsupported_reason("scheduler"):
    pytest.skip(elastic_v1.unsupported_reason("scheduler"), allow_module_level=True)

PAGE = 16 * 2 * 64 * 2 * 2      # the tiny Llama's page: 16 tokens, 2 KV heads, K+V, bf16
GRANULE = (2 << 20) // PAGE     # 256 blocks


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    # the connector's worker side runs here on CPU (the stand-in driver): on a vLLM whose
    # worker side is not proven on a GPU (0.33) that is under the override
    monkeypatch.setenv("PROXIMA_ALLOW_UNPROVEN_ELASTIC", "1")
    yield
    elastic_v1.deactivate()


def elastic_config(**extra):
    """The connector at 2 MiB a layer (the tiny Llama's granule of 256 blocks) unless a test
    says otherwise: these tests are about the connector's mechanics, not the grain."""
    from vllm.config import KVTransferConfig

    extra.setdefault("policy", "off")
    extra.setdefault("granule_bytes", 2 << 20)
    return KVTransferConfig(**elastic_v1.connector_config(extra))


def specs(n=48, seed=3):
    """Mixed prompts; every third shares a 64-token prefix with the one before (cache hits)."""
    import random

    rng = random.Random(seed)
    out, prefix = [], []
    for i in range(n):
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(20, 400))]
        prompt = prefix + body if i % 3 == 2 else body
        prefix = body[:64]
        out.append((f"r{i}", prompt, rng.randrange(4, 60), i // 4))   # id, prompt, max, step
    return out


class Worker:
    """The connector's worker side on the CPU stand-in driver, plus the V2 runner's block
    tables, checked after every step's ops."""

    def __init__(self, scheduler, capacity=1 << 40, background=False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.conn = ProximaElasticConnector(scheduler.vllm_config, KVConnectorRole.WORKER,
                                            scheduler.kv_cache_config)
        num_blocks = scheduler.kv_cache_config.num_blocks
        self.driver = FakeDriver(capacity=capacity)
        ours = elastic_v1.find_connector(scheduler.connector)
        mapped = getattr(ours, "startup_granules", None)     # what the worker maps at start
        self.memory = KvMemory([PAGE * num_blocks] * 2, num_blocks, driver=self.driver,
                               mapped=mapped)
        self.conn._memory = self.memory
        if background:          # maps and unmaps on the worker's mapping thread
            from proxima.memory.background import BackgroundOps

            self.conn._background = BackgroundOps(self.memory)
        self.tables: dict[str, list[int]] = {}
        self.ops: list[Op] = []
        self.checked = 0

    def __call__(self, out):
        from vllm.v1.outputs import KVConnectorOutput

        meta = out.kv_connector_metadata
        assert isinstance(meta, ElasticMetadata)
        if meta.batch is not None:
            self.ops += meta.batch.ops
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for req in out.scheduled_new_reqs:
            self.tables[req.req_id] = list(req.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, new in zip(cached.req_ids, cached.new_block_ids):
            if new:
                self.tables[rid] += new[0]
        self.conn.bind_connector_metadata(meta)
        self.conn.start_load_kv(None)
        arena = self.memory.arena
        for rid in out.num_scheduled_tokens:        # what this step's forward touches
            for b in self.tables[rid]:
                assert arena.is_mapped(b // self.memory.granule_blocks), (rid, b)
                self.checked += 1
        report = self.conn.build_connector_worker_meta()
        self.conn.clear_connector_metadata()
        return KVConnectorOutput(kv_connector_worker_meta=report)


def drive(scheduler, workload, worker=None, depth=1, between=None):
    """Run ``workload`` to completion like vLLM's engine loop (``depth`` 2: a step is
    scheduled before the previous one's output is processed, as with async scheduling).
    Returns one record per step: what was scheduled and which blocks were handed out."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    pending = deque(sorted(workload, key=lambda s: s[3]))
    in_flight: deque = deque()
    log, step = [], 0
    requests = scheduler.requests
    while pending or scheduler.has_requests() or in_flight:
        while pending and (pending[0][3] <= step or not scheduler.has_requests()):
            rid, prompt, max_tokens, _ = pending.popleft()
            scheduler.add_request(Request(
                request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                arrival_time=0.0, block_hasher=hasher,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        if scheduler.has_requests():
            if between is not None:
                between(step)
            out = scheduler.schedule()
            sampling = {r for r in out.num_scheduled_tokens if not requests[r].is_prefill_chunk}
            kv_out = worker(out) if worker is not None else None
            in_flight.appendleft((out, sampling, kv_out))
            cached = out.scheduled_cached_reqs
            log.append((sorted(out.num_scheduled_tokens.items()),
                        [(r.req_id, r.block_ids) for r in out.scheduled_new_reqs],
                        list(zip(cached.req_ids, cached.new_block_ids)),
                        sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids)))
            step += 1
            if len(in_flight) < depth and scheduler.has_requests():
                continue
        out, sampling, kv_out = in_flight.pop()
        result = _runner_output(out, sampling, requests, {})
        result.kv_connector_output = kv_out
        scheduler.update_from_output(out, result)
    return log


def scheduler_for(proxima, num_blocks, depth, ktc=None, **kw):
    return build_scheduler(proxima=proxima, num_blocks=num_blocks, async_scheduling=depth == 2,
                           kv_transfer_config=ktc, **kw)


def run(proxima, num_blocks, depth, ktc=None, worker=False, capacity=1 << 40, between=None,
        **kw):
    scheduler = scheduler_for(proxima, num_blocks, depth, ktc, **kw)
    w = Worker(scheduler, capacity) if worker else None
    if proxima:
        vllm_v1.activate()
    try:
        log = drive(scheduler, specs(), w, depth,
                    between=(lambda step: between(scheduler, step)) if between else None)
    finally:
        vllm_v1.deactivate()
    return scheduler, w, log


# ----------------------------------------------------------------------------- scheduling

@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("proxima", [False, True], ids=["stock", "proxima"])
def test_the_connector_changes_no_scheduling_decision(proxima, depth):
    # 400 blocks for 48 requests of up to 460 tokens: preemptions and prefix-cache hits
    _, _, plain = run(proxima, 400, depth, max_num_batched_tokens=2048)
    scheduler, worker, elastic = run(proxima, 400, depth, elastic_config(), worker=True,
                                     max_num_batched_tokens=2048)
    assert isinstance(scheduler.connector, ProximaElasticConnector)
    assert not scheduler.defer_block_free          # kv_producer: frees are not deferred
    assert elastic == plain                        # every step, every block id
    assert worker.ops == [] and worker.checked > 0
    assert sum(len(step[3]) for step in plain) > 0      # the workload did preempt


def test_ops_from_the_pool_reach_the_worker_in_order():
    scheduler = scheduler_for(True, 1024, 1, elastic_config(policy="fixed"))
    worker = Worker(scheduler)
    conn = scheduler.connector
    channel = conn.channel

    def between(step):
        if step == 0:
            conn.queue.release([3])       # blocks 768..1023, all free before any request
            channel.unmap(3)
        if step == 2:
            assert not worker.memory.arena.is_mapped(3) and channel.state[3] != MAPPED
            channel.map(3)                # and back: mapped once the worker confirms it

    vllm_v1.activate()
    try:
        drive(scheduler, specs(12), worker, between=between)
    finally:
        vllm_v1.deactivate()
    assert worker.ops == [Op.unmap(3, 1), Op.map(3, 1)]
    assert worker.memory.arena.is_mapped(3) and channel.state[3] == MAPPED


def test_a_block_handed_out_from_an_unmapped_granule_stops_the_step():
    from proxima.memory.channel import ChannelError

    scheduler = scheduler_for(False, 1024, 1, elastic_config())
    # unmapped behind the pool's back: its blocks are still in vLLM's free queue
    scheduler.connector.channel.unmap(1, 3)
    with pytest.raises(ChannelError, match=r"was given block \d+, in granule [123], which "
                                           r"is not mapped"):
        drive(scheduler, specs(), Worker(scheduler))


# ----------------------------------------------------------------------------- forced cycles

@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_forced_cycles_unmap_and_remap_without_touching_an_unmapped_block(depth, tmp_path):
    stats = tmp_path / "elastic.json"
    ktc = elastic_config(policy="fixed", eviction="lru", stats_file=str(stats),
                         compactor=forced.cycles(every=3, hold=2, granules=3))
    # 64 granules of 256 blocks: enough stay free of live and cached blocks
    _, _, stock = run(False, 64 * GRANULE, depth)
    scheduler, worker, elastic = run(True, 64 * GRANULE, depth, ktc, worker=True)
    conn = scheduler.connector
    assert conn.step_hook.cycles >= 3
    unmaps = [op for op in worker.ops if op.kind == "unmap"]
    maps = [op for op in worker.ops if op.kind == "map"]
    # every released granule was mapped again, but those of a cycle still open at the end
    still_out = conn.channel.num_granules - conn.channel.count(MAPPED)
    assert unmaps and sum(op.count for op in unmaps) - sum(op.count for op in maps) == still_out
    assert worker.memory.stats["granules_unmapped"] > 0
    # safe cycles and strict LRU: the same requests ran the same steps with the same token
    # counts, preempted and finished as with stock vLLM's pool
    # (an open cycle keeps the engine stepping after the last request: empty steps)
    def busy(log):
        return [(s[0], s[3], s[4]) for s in log if s[0] or s[3] or s[4]]

    assert busy(elastic) == busy(stock)
    conn.queue.check()
    conn.shutdown()
    written = json.loads(stats.read_text())
    assert written["forced_cycles"] == conn.step_hook.cycles and written["map_failures"] == 0
    assert written["granule_blocks"] == GRANULE and written["reported_mapped"] is not None


def test_a_map_the_gpu_cannot_back_is_retried_and_no_block_of_it_is_handed_out():
    ktc = elastic_config(policy="fixed", initial_granules=6,
                         compactor=forced.cycles(every=2, hold=1, granules=2, safe=False))
    scheduler = scheduler_for(True, 8 * GRANULE, 1, ktc)
    worker = Worker(scheduler)
    conn = scheduler.connector
    assert conn.startup_granules == 6 and worker.memory.mapped_granules == 6

    def between(step):
        # until step 12 another process takes whatever memory the engine gives back
        worker.driver.capacity = worker.driver.used if step < 12 else 1 << 40

    vllm_v1.activate()
    try:
        drive(scheduler, specs(), worker, between=between)
    finally:
        vllm_v1.deactivate()
    assert conn.channel.stats["map_failures"] >= 1     # while memory was short
    assert conn.step_hook.cycles >= 1                   # and completed once it was back
    assert worker.checked > 0
    conn.queue.check()


def test_warmup_and_initial_size_decide_what_is_mapped_at_start_up():
    # 8 granules of 256 blocks; vLLM's warm-up writes ids 1..1024 (max_num_seqs requests of
    # one block each): granules 0-4 are mapped at start-up, 2-4 released before any request
    scheduler = scheduler_for(True, 8 * GRANULE, 1,
                              elastic_config(policy="fixed", initial_granules=2))
    conn = scheduler.connector
    pool = scheduler.kv_cache_manager.block_pool
    assert elastic_v1.warmup_blocks(scheduler.vllm_config, scheduler.kv_cache_config) == 1024
    assert conn.startup_granules == 5
    assert pool.get_num_free_blocks() == 2 * GRANULE - 1      # minus the null block
    assert conn.channel.count(MAPPED) == 2
    batch = conn.channel.build()
    assert batch.ops == (Op.unmap(2, 3),)                     # 5..7 were never mapped


def test_the_warm_up_tokens_per_request_are_0_26_s_or_0_33_s_by_the_config():
    """0.26: a prefill of decode_query_len + 1 tokens and one decode step; 0.33 (its
    VllmConfig has num_lookahead_tokens): 3 decode steps, 5 with speculative decoding, and
    the lookahead slots, at most max_model_len (tests/contract checks vLLM's code)."""
    from types import SimpleNamespace

    from proxima.vllm.vllm_v1_compat import warmup_request_tokens

    class Config033:
        num_lookahead_tokens = property(lambda self: self.lookahead)

        def __init__(self, lookahead, max_len=8192):
            self.lookahead = lookahead
            self.model_config = SimpleNamespace(max_model_len=max_len)

    assert warmup_request_tokens(SimpleNamespace(), 1) == 3          # 0.26 (or a stand-in)
    assert warmup_request_tokens(SimpleNamespace(), 4) == 9
    assert warmup_request_tokens(Config033(0), 1) == 2 + 3           # 0.33
    assert warmup_request_tokens(Config033(3), 4) == 5 + 5 * 4 + 3   # speculative decoding
    assert warmup_request_tokens(Config033(3, max_len=16), 4) == 16


def test_an_engine_started_above_its_minimum_steps_without_a_request_until_it_gives_back():
    """``initial_granules`` above the minimum and no request: the connector keeps the
    engine stepping (``Scheduler.has_requests``) until its policy has looked at that memory,
    which it then gives back after the release delay, as any excess; then the engine rests."""
    scheduler = scheduler_for(True, 8 * GRANULE, 1, elastic_config(
        policy="auto", initial_granules=5, release_delay_s=1.0, idle_sleep_s=0.0))
    conn = scheduler.connector
    now = [0.0]
    conn.clock = lambda: now[0]
    assert conn.startup_granules == 5 and not conn.channel.pending   # no op waiting
    assert scheduler.has_requests()          # no request, yet the engine must step
    worker = Worker(scheduler)

    def between(step):
        now[0] = step * 0.1

    vllm_v1.activate()
    try:
        log = drive(scheduler, [], worker, between=between)
    finally:
        vllm_v1.deactivate()
    assert conn.channel.count(MAPPED) == 1 and worker.memory.mapped_granules == 1
    assert 10 <= len(log) <= 14              # the delay (10 steps), the unmap confirmed
    assert not scheduler.has_requests()      # at its minimum: the engine rests


@pytest.mark.parametrize("room, kept", [(None, 9), (7, 6), (5, 1)],
                         ids=["room", "crowded", "short"])
def test_the_start_up_grow_keeps_twice_the_warm_up_where_the_gpu_has_room(room, kept):
    """No initial size: warm-up maps granules 0-4 (ids 1..1024) and the engine grows to
    twice that (9 granules, ids up to 2048) at its first step, before any request -- but
    only into what the driver says is free, less ``gpu_free_low`` (5%) of the GPU: with
    room for 7 granules it keeps 6 (no failed map, nothing beyond the room); on a GPU full
    after warm-up it keeps its minimum, as before. What it keeps above the minimum goes
    back after the release delay (1 s: 10 steps) when no request comes."""
    G = 2 * PAGE * GRANULE                    # bytes of one granule, both regions
    scheduler = scheduler_for(True, 16 * GRANULE, 1, elastic_config(
        policy="auto", release_delay_s=1.0, idle_sleep_s=0.0))
    conn = scheduler.connector
    assert conn.startup_granules == 5 and conn.policy.startup_granules == 9
    now = [0.0]
    conn.clock = lambda: now[0]
    worker = Worker(scheduler, capacity=(1 << 40) if room is None else room * G)
    conn.shared.gpu_memory = worker.driver.mem_info     # what NVML says of the GPU
    assert scheduler.has_requests()                     # it steps from start-up
    seen = []

    def between(step):
        now[0] = step * 0.1 if step is not None else now[0]
        seen.append((conn.channel.count(MAPPED), worker.memory.mapped_granules,
                     worker.driver.used))

    vllm_v1.activate()
    try:
        drive(scheduler, [], worker, between=between)
    finally:
        vllm_v1.deactivate()
    between(None)                                       # and where it rests
    assert seen[0][:2] == (5, 5)                        # warm-up's granules, kept
    assert seen[1][:2] == (kept, kept)                  # after the first step
    assert len(seen) == (2 if kept == 1 else 13)        # then the delay, the release
    assert max(used for *_, used in seen) <= worker.driver.capacity
    assert conn.channel.stats["map_failures"] == 0 and conn.policy.stats.failed_grows == 0
    assert conn.channel.count(MAPPED) == worker.memory.mapped_granules == 1   # given back
    assert not scheduler.has_requests()
    conn.queue.check()


def test_a_policy_other_than_off_needs_proxima_s_pool():
    from proxima.errors import UserError

    with pytest.raises(UserError, match="needs Proxima's block pool"):
        scheduler_for(False, 4 * GRANULE, 1, elastic_config(policy="fixed"))


# ----------------------------------------------------------------------------- configuration

def test_with_elastic_connector_composes_with_other_connectors():
    from vllm.config import KVTransferConfig

    alone = elastic_v1.with_elastic_connector(None)
    assert alone.kv_connector == elastic_v1.CONNECTOR and alone.kv_role == "kv_producer"
    assert elastic_v1.with_elastic_connector(alone) is alone
    theirs = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": "/tmp/x"})
    multi = elastic_v1.with_elastic_connector(theirs)
    assert multi.kv_connector == "MultiConnector" and multi.kv_role == "kv_both"
    assert multi.engine_id == theirs.engine_id
    children = multi.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == [elastic_v1.CONNECTOR, "ExampleConnector"]
    assert "engine_id" not in children[1] and children[1]["kv_connector_extra_config"] == {
        "shared_storage_path": "/tmp/x"}
    assert elastic_v1.with_elastic_connector(multi) is multi
    other_multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                   kv_connector_extra_config={"connectors": [children[1]]})
    again = elastic_v1.with_elastic_connector(other_multi)
    assert [c["kv_connector"] for c in again.kv_connector_extra_config["connectors"]] == [
        elastic_v1.CONNECTOR, "ExampleConnector"]
    assert elastic_v1.with_elastic_connector(
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}).kv_connector == \
        "MultiConnector"


def test_composed_in_vllms_multiconnector_the_ops_still_travel(tmp_path):
    from vllm.config import KVTransferConfig

    theirs = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    ktc = elastic_v1.with_elastic_connector(theirs)
    ktc.kv_connector_extra_config["connectors"][0]["kv_connector_extra_config"] = {
        "policy": "fixed", "initial_granules": 2}
    scheduler = scheduler_for(True, 4 * GRANULE, 1, ktc)
    ours = scheduler.connector._connectors[0]
    assert isinstance(ours, ProximaElasticConnector)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 2 * GRANULE - 1
    meta = scheduler.schedule().kv_connector_metadata
    assert meta.metadata[0].batch.ops == (Op.unmap(2, 2),)


def test_activate_routes_engine_args_through_the_connector():
    from vllm.engine.arg_utils import EngineArgs

    elastic_v1.activate()
    args = EngineArgs(model="proxima/models/tiny-llama", skip_tokenizer_init=True)
    try:
        args.create_engine_config()
    except Exception:     # a CPU-only machine has no device platform: the rest cannot run
        pass
    assert args.kv_transfer_config.kv_connector == elastic_v1.CONNECTOR
    elastic_v1.deactivate()
    args = EngineArgs(model="proxima/models/tiny-llama", skip_tokenizer_init=True)
    try:
        args.create_engine_config()
    except Exception:
        pass
    assert args.kv_transfer_config is None


def test_native_offloading_flag_is_refused_with_the_way_out():
    from vllm.engine.arg_utils import EngineArgs

    from proxima.vllm.activation import ActivationError

    elastic_v1.activate()
    args = EngineArgs(model="proxima/models/tiny-llama", skip_tokenizer_init=True,
                      kv_offloading_size=4.0)
    with pytest.raises(ActivationError, match="--kv-offloading-size.*--kv-transfer-config"):
        args.create_engine_config()


@pytest.mark.parametrize("extra, message", [
    ({"granule_bytes": 0}, "granule_bytes: 0 is below 1"),
    ({"initial_granules": 0}, r"initial_granules: 0 is out of range: .* \(granule 0 holds"),
    ({"granule": 1}, "unknown option"),
    ({"policy": "elastic"}, "policy must be auto or fixed or off"),
    ({"min_bytes": "lots"}, "min_bytes: 'lots' is not a size"),
    ({"min_bytes": "4GiB", "max_bytes": "1GiB"}, "max_bytes .* is below min_bytes"),
    ({"eviction": "fifo"}, "eviction policy 'fifo'"),
    ({"compactor": forced.cycles(), "policy": "off"}, "needs the pool to place by granule"),
    ({"compactor": "nocolon"}, "compactor must be 'module:factory'"),
    ({"compactor": {"every": 3}}, "compactor must be 'module:factory'"),
    ({"headroom": -1}, "headroom: -1 is out of range: give a share of the live blocks"),
    ({"headroom": "NaN"}, "headroom: 'NaN' is not finite"),
    ({"max_bytes": "1e400GiB"}, "max_bytes: '1e400GiB' is above the bound of 1024TiB"),
    ({"cache_hold_s": -5}, "cache_hold_s: -5 is out of range"),
    ({"gpu_free_low": 1.5}, "gpu_free_low: 1.5 is out of range: give a share of the GPU's memory"),
    ({"ledger": "yes"}, "ledger must be true or false"),
    ({"ledger_dir": ""}, "ledger_dir must be a directory or null"),
])
def test_bad_options_are_one_clear_error(extra, message):
    from proxima.errors import UserError

    with pytest.raises(UserError, match=message):
        elastic_v1.ElasticOptions.from_extra(extra)


@pytest.mark.parametrize("hook, message", [
    (forced.cycles(every=0), "compactor 'tests.support.forced:ForcedCycler': every must be a "
                             "positive integer, got 0"),
    ({"factory": forced.FACTORY, "often": 1}, "unexpected keyword argument 'often'"),
    ("tests.support.forced:nothing", "cannot be loaded"),
])
def test_a_hook_that_cannot_be_built_is_one_clear_error(hook, message):
    from proxima.errors import UserError

    with pytest.raises(UserError, match=message):
        scheduler_for(True, 8 * GRANULE, 1, elastic_config(policy="fixed", compactor=hook))


def test_the_workers_report_must_agree_with_the_predicted_granule():
    from proxima.memory.channel import ChannelError
    from proxima.memory.ops import Report

    from vllm.v1.outputs import KVConnectorOutput

    scheduler = scheduler_for(False, 2 * GRANULE, 1, elastic_config())
    with pytest.raises(ChannelError, match="assumed 256"):
        scheduler.connector.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=ElasticWorkerMetadata(Report((), 2, 32))))


# ----------------------------------------------------------------------------- the switch

def test_elastic_needs_the_allocator_and_is_one_clear_error(monkeypatch):
    from proxima.vllm.plugin import register

    monkeypatch.setenv(elastic_v1.ENV, "1")
    monkeypatch.delenv("PROXIMA_ALLOCATOR", raising=False)
    with pytest.raises(SystemExit, match="PROXIMA_ELASTIC=1 needs PROXIMA_ALLOCATOR=1"):
        register()
    monkeypatch.setenv(elastic_v1.ENV, "yes")
    with pytest.raises(SystemExit, match="PROXIMA_ELASTIC must be 1"):
        register()
    monkeypatch.setenv(elastic_v1.ENV, "1")
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    register()
    assert elastic_v1.is_active() and vllm_v1.is_active()
    monkeypatch.setenv(elastic_v1.ENV, "0")
    elastic_v1.deactivate()
    vllm_v1.deactivate()
    register()
    assert not elastic_v1.is_active()


# ----------------------------------------------------------------------------- the policy

def auto_run(num_granules, depth=1, capacity_after=None, background=False, worker_class=None,
             **extra):
    """The auto policy on ``num_granules`` granules over specs(), the clock 0.1 s a step;
    from the second step on the GPU can back ``capacity_after`` bytes (None: plenty);
    ``worker_class``: the worker's stand-in (default :class:`Worker`). Started at its
    minimum (``initial_granules`` 1, not the default: warm-up's granules and the start-up
    grow to twice them) so that the load makes it grow."""
    extra = dict(policy="auto", release_delay_s=1.0, idle_sleep_s=0.0,
                 **{"initial_granules": 1, **extra})
    scheduler = scheduler_for(True, num_granules * GRANULE, depth, elastic_config(**extra))
    conn = scheduler.connector
    now = [0.0]
    conn.clock = lambda: now[0]
    worker = (worker_class or Worker)(scheduler, background=background)
    mapped = []

    def between(step):
        now[0] = step * 0.1
        if step == 1 and capacity_after is not None:
            worker.driver.capacity = capacity_after
        mapped.append(conn.channel.count(MAPPED))

    vllm_v1.activate()
    try:
        log = drive(scheduler, specs(), worker, depth, between=between)
    finally:
        vllm_v1.deactivate()
    return scheduler, conn, worker, log, mapped


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_auto_policy_grows_with_the_load_and_gives_memory_back_after_the_delay(depth):
    scheduler, conn, worker, log, mapped = auto_run(32, depth)
    finished = {r for step in log for r in step[4]}
    assert len(finished) == 48                          # no request lost
    stats = conn.policy.stats
    assert stats.grows >= 1 and stats.shrinks >= 1 and stats.failed_grows == 0
    assert max(mapped) >= 3                             # grew with the load (from 1)...
    assert conn.channel.count(MAPPED) == 1              # ...and fell back to granule 0
    assert worker.memory.mapped_granules == 1           # on the worker too
    assert stats.bytes_returned == stats.granules_released * conn.bytes_per_granule
    conn.queue.check()


@pytest.mark.parametrize("num_blocks, grain", [(128 * GRANULE, 32 << 20),
                                               (32 * GRANULE, 8 << 20),
                                               (4 * GRANULE, 2 << 20)])
def test_without_a_grain_the_pool_gets_the_largest_that_leaves_it_8_granules(num_blocks, grain):
    """No ``granule_bytes``: the scheduler side (from vLLM's KV cache config) and the worker
    side (from the same config) both take the largest of 32, 16, 8, 4, 2 MiB a layer that leaves
    the pool at least 8 granules, else 2 MiB (a map costs per physical allocation:
    docs/results/map-rate-h100/NOTES.md)."""
    scheduler = scheduler_for(True, num_blocks, 1, elastic_config(granule_bytes=None))
    vllm_v1.activate()
    try:
        conn = elastic_v1.find_connector(scheduler.connector)
        assert conn.channel.granule_blocks == grain // PAGE
        # the worker's KvMemory takes its grain from the same function (elastic_v1._vmm_memory)
        assert elastic_v1.grain_of(conn.options, scheduler.kv_cache_config) == grain
        assert num_blocks // conn.channel.granule_blocks >= 8 or grain == 2 << 20
    finally:
        conn.shutdown()


def across_processes(obj):
    """``obj`` as another process receives it from vLLM's ``mp`` executor: its message
    queues pickle what they carry (the SchedulerOutput one way, the runner's output back),
    so the copy shares no object with the sender."""
    import pickle

    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class ProcessWorker(Worker):
    """The worker as vLLM's ``mp`` executor runs it, in a process of its own: each step's
    output reaches it as a copy and its answer goes back as one (:func:`across_processes`)."""

    def __call__(self, out):
        return across_processes(super().__call__(across_processes(out)))


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_a_worker_in_a_process_of_its_own_sees_the_same_ops_and_the_schedule_is_the_same(depth):
    """``distributed_executor_backend="mp"`` on one GPU: the connector's worker side gets
    copies of the metadata, not the scheduler's objects. Every grow and shrink still reaches
    it, and every decision is the one made with the worker in the engine core's process."""
    here = auto_run(32, depth)
    apart = auto_run(32, depth, worker_class=ProcessWorker)
    assert apart[3] == here[3]                               # every step's schedule
    assert apart[4] == here[4]                               # mapped granules, step by step
    assert apart[2].ops == here[2].ops and apart[2].ops       # the same ops reached it
    assert apart[2].checked == here[2].checked > 0           # every block read was mapped
    assert apart[1].policy.stats.as_dict() == here[1].policy.stats.as_dict()
    assert apart[1].policy.stats.shrinks >= 1
    assert apart[2].memory.mapped_granules == apart[1].channel.count(MAPPED) == 1
    apart[1].queue.check()


class SlowDriver(FakeDriver):
    """Each page takes a while to create: a background map spans several steps."""

    def create(self, size):
        import time

        time.sleep(0.002)
        return super().create(size)


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_maps_in_the_background_land_steps_later_and_no_step_reads_an_unmapped_block(depth):
    """The worker's mapping thread (proxima.memory.background): the forward does not wait
    for a grow; its blocks are handed out only once the worker reported the map done."""
    from proxima.memory import background

    confirmed_late = []
    original_poll = background.BackgroundOps.poll

    def poll(self):
        busy = self.busy
        done = original_poll(self)
        confirmed_late.append(busy)          # a step ran while a map was still going
        return done

    background.BackgroundOps.poll = poll
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("tests.vllm.test_elastic_connector.FakeDriver", SlowDriver)
            scheduler, conn, worker, log, mapped = auto_run(32, depth, background=True)
    finally:
        background.BackgroundOps.poll = original_poll
    finished = {r for step in log for r in step[4]}
    assert len(finished) == 48                              # no request lost
    assert any(confirmed_late)                              # maps outlived their step
    stats = conn.policy.stats
    assert stats.grows >= 1 and stats.shrinks >= 1 and stats.failed_grows == 0
    assert worker.checked > 0                               # every block read was mapped
    assert worker.conn._background.drain(5)
    # the worker holds exactly what the scheduler counts as mapped
    assert worker.memory.mapped_granules == conn.channel.count(MAPPED)
    log_ = worker.driver.log
    unmaps = [i for i, e in enumerate(log_) if e[0] == "unmap"]
    assert unmaps and all(any(log_[j][0] == "sync" for j in range(max(0, i - 40), i))
                          for i in unmaps[:1])               # the thread waited first
    worker.conn.shutdown()
    conn.queue.check()


def test_the_stats_file_follows_every_step_with_the_policys_recent_events(monkeypatch, tmp_path):
    # written when due on any step, not only on steps whose ops the workers report (a
    # stall with a map in flight must show in the file), with the last grows and shrinks
    from proxima.vllm import elastic_connector
    from proxima.ioutil import flush_live_files

    monkeypatch.setattr(elastic_connector, "STATS_EVERY_S", 0.0)
    writes = []
    original = ProximaElasticConnector.write_stats

    def counted(self, wait=False):
        writes.append(self.steps)
        return original(self, wait)

    monkeypatch.setattr(ProximaElasticConnector, "write_stats", counted)
    stats = tmp_path / "elastic.json"
    scheduler, conn, worker, log, mapped = auto_run(32, stats_file=str(stats))
    assert len(set(writes)) >= conn.steps - 1                 # every step wrote
    flush_live_files()                          # (a thread writes the periodic ones)
    written = json.loads(stats.read_text())
    kinds = [e[1] for e in written["events"]]
    assert "grow" in kinds and "shrink" in kinds
    assert written["events"] == [list(e) for e in conn.policy.stats.events[-20:]]
    # how long steps take as the scheduler sees them (from each step with tokens to the
    # next: an empty step's wait for work is not a step), and its own share of them
    assert conn.steps == len(log)
    busy = [bool(step[0]) for step in log]
    assert not all(busy)                         # the run ends in empty steps
    assert written["step_ms"]["n"] == min(256, sum(busy[:-1]))
    assert 0 <= written["connector_ms"]["p50"] <= written["connector_ms"]["max"]


def test_when_the_gpu_has_no_memory_the_engine_serves_at_its_size_and_says_so_once(
        proxima_log):
    # after start-up the GPU can back 2 granules only (another process took the rest)
    scheduler, conn, worker, log, mapped = auto_run(32, capacity_after=2 * 2 * PAGE * GRANULE)
    finished = {r for step in log for r in step[4]}
    assert len(finished) == 48                          # slower, but nothing lost
    assert conn.policy.stats.failed_grows >= 1
    assert max(mapped) <= 2
    warnings = [r for r in proxima_log
                if r.levelno >= logging.WARNING and "cannot give" in r.getMessage()]
    assert len(warnings) == 1 and "serving at the current size" in warnings[0].getMessage()
    assert worker.checked > 0                           # and no unmapped block was read
    conn.queue.check()


def test_control_sets_the_limits_at_run_time_and_refuses_bad_input():
    scheduler = scheduler_for(True, 16 * GRANULE, 1, elastic_config(
        policy="auto", release_delay_s=0.0, initial_granules=1))   # started at its minimum
    conn = scheduler.connector
    per = conn.bytes_per_granule
    status = conn.control({})
    assert status["pool_bytes"] == 16 * per and status["mapped_bytes"] == per
    status = conn.control({"min_bytes": 4 * per})
    assert status["min_bytes"] == 4 * per and status["mapping_granules"] == 3   # grows now
    assert conn.control({"max_bytes": per})["error"].startswith("max_bytes")
    assert "unknown field" in conn.control({"size": 1})["error"]
    assert "not a size" in conn.control({"max_bytes": "big"})["error"]
    status = conn.control({"max_bytes": "8GiB", "min_bytes": 0})
    assert status["max_bytes"] == min(16 * per, (8 << 30) // per * per)
    fixed = scheduler_for(True, 4 * GRANULE, 1, elastic_config(policy="fixed")).connector
    assert "fixed" in fixed.control({"min_bytes": 0})["error"]


def test_asleep_the_ledger_record_stops_counting_the_weights_and_awake_counts_them_again(
        tmp_path, monkeypatch):
    """POST /proxima/sleep and /proxima/wake_up tell the engine core (``proxima_kv``'s
    ``asleep_bytes``): the other engines then see the weights' memory as free, and a wake
    claims it back before vLLM maps the weights again."""
    from proxima.memory.ledger import Ledger, ledger_path, live_records

    scheduler = scheduler_for(True, 16 * GRANULE, 1, elastic_config(
        policy="auto", release_delay_s=0.0, initial_granules=1))
    conn = scheduler.connector
    path = ledger_path("sleep", tmp_path)
    conn.shared.ledger = Ledger(path, nonkv=10 << 30)
    conn.control({})
    conn.shared.post()
    assert [r.nonkv for r in live_records(path)] == [10 << 30]
    status = conn.control({"asleep_bytes": 8 << 30})
    assert "error" not in status and status["mapped_bytes"] == conn.bytes_per_granule
    assert [r.nonkv for r in live_records(path)] == [2 << 30]     # activations, graphs stay
    conn.control({"asleep_bytes": 0})
    assert [r.nonkv for r in live_records(path)] == [10 << 30]
    conn.control({"asleep_bytes": 20 << 30})                      # never below 0
    assert [r.nonkv for r in live_records(path)] == [0]
    for bad in (-1, "8GiB", True, None):
        assert "asleep_bytes must be a number of bytes" in conn.control({"asleep_bytes": bad})["error"]
    # around vLLM's sleep the connector asks for no idle step (vLLM's pause completes only
    # once the engine has no work, and its has_requests counts this)
    monkeypatch.setattr(conn.shared, "wants_step", lambda: True)   # another engine's demand
    assert conn.has_pending_push_work()
    conn.control({"sleeping": True})
    assert not conn.has_pending_push_work()
    conn.control({"sleeping": False})
    assert conn.has_pending_push_work()
    assert "sleeping must be true or false" in conn.control({"sleeping": 1})["error"]
    assert "unknown field" in conn.control({"asleep_bytes": 0, "size": 1})["error"]


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_a_sleep_mode_engine_is_refused_unless_proxima_serve_set_it_up(sleep_mode):
    """vLLM's --enable-sleep-mode beside elastic KV only with the ``sleep_mode`` option
    (proxima serve --sleep-mode: the KV given back first, the wake coordinated)."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from proxima.errors import UserError

    options = {"policy": "auto", "idle_release_s": 5, **({"sleep_mode": True} if sleep_mode
                                                         else {})}
    scheduler = scheduler_for(True, 4 * GRANULE, 1, elastic_config(**options))
    config = copy.copy(scheduler.vllm_config)
    config.model_config = copy.copy(config.model_config)
    config.model_config.enable_sleep_mode = True
    make = lambda: ProximaElasticConnector(config, KVConnectorRole.WORKER,  # noqa: E731
                                           scheduler.kv_cache_config)
    if sleep_mode:
        assert make().options.sleep_mode is True
    else:
        with pytest.raises(UserError, match="sleep mode is not supported with elastic KV "
                                            "memory on its own.*--sleep-after"):
            make()


def test_elastic_options_come_from_the_environment_and_a_bad_one_stops_the_plugin(monkeypatch):
    from proxima.vllm.plugin import register

    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    monkeypatch.setenv(elastic_v1.ENV, "1")
    monkeypatch.setenv("PROXIMA_ELASTIC_OPTIONS", "min_bytes=2GiB,release_delay_s=3,eviction=lru")
    register()
    try:
        extra = _connector_extra()
        assert extra == {"min_bytes": "2GiB", "release_delay_s": 3, "eviction": "lru"}
        from vllm.v1.engine.core import EngineCore

        assert hasattr(EngineCore, elastic_v1.UTILITY)        # the run-time control
    finally:
        elastic_v1.deactivate()
        vllm_v1.deactivate()
    from vllm.v1.engine.core import EngineCore

    assert not hasattr(EngineCore, elastic_v1.UTILITY)        # deactivate undoes it
    monkeypatch.setenv("PROXIMA_ELASTIC_OPTIONS", '{"min_bytes": "lots"}')
    with pytest.raises(SystemExit, match="min_bytes: 'lots' is not a size"):
        register()
    vllm_v1.deactivate()


def _connector_extra() -> dict:
    """The connector options of the engine config vLLM builds now (tiny-llama; on CPU the
    config stops at the device platform, after the connector is set)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model="proxima/models/tiny-llama", skip_tokenizer_init=True)
    try:
        args.create_engine_config()
    except Exception:     # no device platform here: the connector is set before that
        pass
    return args.kv_transfer_config.kv_connector_extra_config


def test_the_options_set_after_the_plugin_loaded_reach_the_connector(monkeypatch):
    """``proxima serve`` builds vLLM's parser (the plugin activates then) before it sizes the
    engine, and only then writes the sizing into PROXIMA_ELASTIC_OPTIONS: the engine config
    built after that carries what the variable says then, not what it said at activation
    (the three-model H100 run: every engine's ledger record said nonkv 0, its --kv-max
    unapplied)."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("PROXIMA_ELASTIC_OPTIONS", "stats_file=/tmp/s.json")
    elastic_v1.activate()
    sized = {"stats_file": "/tmp/s.json", "min_bytes": 1 << 29, "max_bytes": 3 << 30,
             "ledger_model": "big", "ledger_port": 8300, "ledger_nonkv_bytes": 19011032269}
    monkeypatch.setenv("PROXIMA_ELASTIC_OPTIONS", json.dumps(sized))
    extra = _connector_extra()
    assert extra == sized
    assert elastic_v1.ElasticOptions.from_extra(extra).ledger_nonkv_bytes == 19011032269
    monkeypatch.setenv("PROXIMA_ELASTIC_OPTIONS", '{"max_bytes": "lots"}')
    args = EngineArgs(model="proxima/models/tiny-llama", skip_tokenizer_init=True)
    from proxima.vllm.activation import ActivationError

    with pytest.raises(ActivationError, match="max_bytes: 'lots' is not a size"):
        args.create_engine_config()


def test_no_gpu_no_ledger():
    """On CPU the connector keeps no GPU ledger (the replay sets its stand-in's own)."""
    from proxima.vllm.elastic_control import open_gpu_ledger

    assert open_gpu_ledger(elastic_v1.ElasticOptions(), 1) == (None, None)


def test_an_engine_alone_keeps_its_warm_cache_between_bursts():
    """The replay's bursts (the real scheduler, connector and policy; a stand-in ledger with
    this engine alone and a GPU with room to spare): granules of cached blocks stay through
    the gaps between bursts (1,500 steps, 37.5 s of the policy's clock), so the later bursts
    hit the shared prefixes that the rule before the ledger (``cache_hold_s`` 0: they went
    after the 10 s release delay) evicted; empty granules are still given back, and the
    hold's end takes the engine back to its minimum."""
    from proxima.replay.driver_v1 import run_replay
    from proxima.replay.elastic import ElasticReplay
    from proxima.workloads import make_workload

    w = make_workload("bursts", requests=160)
    before, now = (run_replay(w, proxima=True, num_blocks=8000,
                              elastic=ElasticReplay(extra={"cache_hold_s": hold}))
                   for hold in (0.0, 60.0))
    assert now.completed == before.completed == 160
    assert now.prefix_hit_rate > before.prefix_hit_rate + 0.01, (now.prefix_hit_rate,
                                                                 before.prefix_hit_rate)
    e, b = now.details["elastic"], before.details["elastic"]
    assert e["evicted_cached"] < b["evicted_cached"]
    assert e["bytes_returned"] > 0 and e["mapped_granules"] == 1      # back at the minimum


def test_release_now_gives_an_idle_engines_kv_back_at_once_and_a_busy_one_keeps_it():
    """POST /proxima/sleep {"release": true} (the several-models endpoint's eviction):
    ``proxima_kv {"release_now": true}`` does the idle release now, not after its seconds."""
    scheduler = scheduler_for(True, 16 * GRANULE, 1, elastic_config(
        policy="auto", release_delay_s=0.0, initial_granules=4, idle_release_s=600.0,
        min_bytes="0"))
    conn = scheduler.connector
    per = conn.bytes_per_granule
    conn.control({"min_bytes": 4 * per})
    held = conn.channel.held()
    assert held >= 4
    status = conn.control({"release_now": True})
    assert "error" not in status
    assert conn.channel.held() < held and conn.policy.min_granules == 4   # its minimum kept
    assert "release_now must be true" in conn.control({"release_now": 1})["error"]
