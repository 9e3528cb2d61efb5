"""KV compaction inside vLLM 0.26's real scheduler, on CPU, against a model of the KV cache.

The scheduler, KV-cache manager, block pool and prefix cache are vLLM's own code; the pool
is Proxima's, compaction runs in the elastic connector's scheduler side as in an engine.
The worker is a model of vLLM's V2 runner: per-request block tables updated from the
scheduler output (new requests: full ids; running ones: appended ids), compaction's work
applied with the real worker code (:func:`proxima.vllm.compaction_worker.apply_on_worker`:
the block mover on CPU tensors, then the table writes), and a "forward" that writes every
scheduled token's KV slot with a value that depends only on the token and its position,
after checking that every slot the request already computed reads back what was written
there -- through its current table. A prefix-cache hit reads slots another request wrote,
so a cached block whose content was not moved with its hash fails the check too.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from proxima.vllm import compaction_v1, compaction_worker, elastic_v1, vllm_v1
from proxima.vllm.compaction_options import CompactionOptions, scratch_first
from proxima.vllm.compaction_worker import apply_on_worker
from proxima.vllm.elastic_connector import ElasticMetadata
from proxima.replay.driver_v1 import _runner_output, build_scheduler
from proxima.replay.elastic import ReplayWorker
from tests.support import forced
from tests.vllm.test_elastic_connector import across_processes

if elastic_v1.unsupported_reason("scheduler"):
    pytest.skip(elastic_v1.unsupported_reason("scheduler"), allow_module_level=True)

torch = pytest.importorskip("torch")

BLOCK = 16


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv("PROXIMA_COMPACTION", raising=False)
    monkeypatch.setenv("PROXIMA_ALLOW_UNPROVEN_ELASTIC", "1")   # the worker side, on CPU
    yield
    elastic_v1.deactivate()
    vllm_v1.deactivate()


PAGE = 16 * 2 * 64 * 2 * 2      # the tiny Llama's page of one layer: 8 KiB
GRANULE = 16                    # granule_bytes below: 16 blocks, so a small pool has many


def ktc(policy="fixed", elastic=None, **compaction):
    """The connector's config: granule-aware placement over the whole pool (``fixed``) by
    default, with strict LRU eviction -- with the eviction window (the default, ``auto``)
    the pool may evict another old cached block when compaction has moved blocks between
    granules, so a hit can change; in strict LRU order nothing compaction does can change
    a decision, which is what the identity tests check. ``auto`` grows and shrinks
    (``elastic``: more of its options), granules of cached blocks with the release delay
    (``cache_hold_s`` 0: these engines run on the real clock and must go idle)."""
    from vllm.config import KVTransferConfig

    extra = {"granule_bytes": GRANULE * PAGE, "policy": policy, "eviction": "lru",
             "cache_hold_s": 0.0, **(elastic or {})}
    if compaction:
        extra["compaction"] = compaction
    return KVTransferConfig(**elastic_v1.connector_config(extra))


def specs(n=40, seed=5, shared=True):
    """Mixed prompts; every third shares a 48-token prefix with the one before (hits)."""
    import random

    rng = random.Random(seed)
    out, prefix = [], []
    for i in range(n):
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(20, 300))]
        prompt = prefix + body if shared and i % 3 == 2 else body
        prefix = body[:48]
        out.append((f"r{i}", prompt, rng.randrange(4, 80), i // 3))
    return out


def content(token: int, pos: int) -> float:
    return float(token * 100_000 + pos + 1)


def _tables_say_kernel_blocks() -> bool:
    import inspect

    from vllm.v1.worker.gpu.block_table import BlockTables

    return "blocks_per_kv_block" in inspect.getsource(BlockTables.__init__)


class ModelRunner:
    """vLLM's V2 runner as far as block ids go (see the module doc); its BlockTables shaped
    as the installed release's: 0.26's says blocks_per_kv_block, 0.33's has none."""

    def __init__(self, scheduler, total_blocks: int, max_reqs: int = 128) -> None:
        self.kv_cache_config = scheduler.kv_cache_config
        self.kv_caches = [torch.zeros(total_blocks, BLOCK, dtype=torch.float64)
                          for _ in range(2)]
        self.block_tables = SimpleNamespace(
            block_tables=[SimpleNamespace(gpu=torch.zeros(max_reqs, 1024, dtype=torch.int32))])
        if _tables_say_kernel_blocks():
            self.block_tables.blocks_per_kv_block = [1]
        self.req_states = SimpleNamespace(req_id_to_index={})
        self.num_blocks: dict[str, int] = {}
        self.free_rows = deque(range(max_reqs))
        self.requests = scheduler.requests
        self.checked = 0
        self.moves = 0
        self.unmapped = 0

    def table(self, rid) -> list[int]:
        row = self.req_states.req_id_to_index[rid]
        return self.block_tables.block_tables[0].gpu[row, :self.num_blocks[rid]].tolist()

    def _write(self, rid, start, ids):
        row = self.req_states.req_id_to_index[rid]
        t = self.block_tables.block_tables[0].gpu
        t[row, start:start + len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.num_blocks[rid] = start + len(ids)

    def execute(self, out) -> None:
        index = self.req_states.req_id_to_index
        for rid in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            if rid in index:
                self.free_rows.append(index.pop(rid))
                self.num_blocks.pop(rid)
        computed = {}
        for req in out.scheduled_new_reqs:
            if req.req_id in index:
                self.free_rows.append(index.pop(req.req_id))
            index[req.req_id] = self.free_rows.popleft()
            self._write(req.req_id, 0, list(req.block_ids[0]))
            computed[req.req_id] = req.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, nc, new in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids):
            if rid in cached.resumed_req_ids:
                # On CPU vLLM picks its V1 runner, which sends a resumed request as a cached
                # one with all its ids (the V2 runner sends it as a new one: the same here)
                if rid not in index:
                    index[rid] = self.free_rows.popleft()
                self._write(rid, 0, list(new[0]))
            elif new:
                self._write(rid, self.num_blocks[rid], list(new[0]))
            computed[rid] = nc
        meta = out.kv_connector_metadata
        assert isinstance(meta, ElasticMetadata)
        if meta.compaction is not None:             # what the hook does after vLLM's own
            apply_on_worker(self, meta.compaction)
            self.moves += meta.compaction.blocks
        from proxima.memory.ops import UNMAP

        for op in (meta.batch.ops if meta.batch is not None else ()):
            if op.code == UNMAP:                    # then the connector's ops: memory given
                lo = op.first * GRANULE             # back reads as garbage from now on
                for layer in self.kv_caches:
                    layer[lo:lo + op.count * GRANULE] = float("nan")
                self.unmapped += op.count
        kv = self.kv_caches
        for rid, ns in out.num_scheduled_tokens.items():
            tokens = self.requests[rid].all_token_ids
            table = self.table(rid)
            nc = computed[rid]
            for p in range(nc):                     # what the forward reads
                blk, slot = table[p // BLOCK], p % BLOCK
                want = content(tokens[p], p)
                for layer in kv:
                    assert layer[blk, slot].item() == want, (rid, p, blk)
                self.checked += 1
            for p in range(nc, nc + ns):            # what it writes
                tok = tokens[p] if p < len(tokens) else 5
                blk, slot = table[p // BLOCK], p % BLOCK
                for layer in kv:
                    layer[blk, slot] = content(tok, p)


def drive(scheduler, workload, runner, depth=1, worker=None):
    """vLLM's engine loop (``depth`` 2: async scheduling's batch queue); returns what the
    scheduler decided each step (block ids aside) and the prefix-cache counts."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    pending = deque(sorted(workload, key=lambda s: s[3]))
    in_flight: deque = deque()
    log, step, hits = [], 0, [0, 0]
    requests = scheduler.requests
    while pending or scheduler.has_requests() or in_flight:
        assert step < 20_000, "the engine never went idle"
        while pending and (pending[0][3] <= step or not scheduler.has_requests()):
            rid, prompt, max_tokens, _ = pending.popleft()
            scheduler.add_request(Request(
                request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                arrival_time=0.0, block_hasher=hasher,
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        if scheduler.has_requests():
            out = scheduler.schedule()
            sampling = {r for r in out.num_scheduled_tokens if not requests[r].is_prefill_chunk}
            if runner is not None:
                runner.execute(out)
            scheduler.kv_cache_manager.block_pool.free_block_queue.check()   # every step
            in_flight.appendleft((out, sampling))
            log.append((sorted(out.num_scheduled_tokens.items()),
                        sorted(out.preempted_req_ids or ()), sorted(out.finished_req_ids)))
            step += 1
            if len(in_flight) < depth and scheduler.has_requests():
                continue
        out, sampling = in_flight.pop()
        runner_output = _runner_output(out, sampling, requests, {})
        if worker is not None:          # the workers' answer: the connector's ops confirmed
            from vllm.v1.outputs import KVConnectorOutput

            runner_output.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=worker(out.kv_connector_metadata))
        for outputs in scheduler.update_from_output(out, runner_output).values():
            stats = outputs.scheduler_stats
            if stats is not None:
                hits[0] += stats.prefix_cache_stats.hits
                hits[1] += stats.prefix_cache_stats.queries
    return log, tuple(hits)


def drive_elastic(scheduler, workload, runner, conn):
    """:func:`drive` with the elastic policy's maps confirmed by the replay's worker."""
    vllm_v1.activate()
    try:
        return drive(scheduler, workload, runner, 1, worker=ReplayWorker(conn.channel, None))
    finally:
        vllm_v1.deactivate()


class ProcessModelRunner(ModelRunner):
    """The runner as vLLM's ``mp`` executor runs it, in a process of its own: each step's
    output (its compaction work included) reaches it as a copy, as vLLM's message queue
    sends it (:func:`tests.vllm.test_elastic_connector.across_processes`)."""

    def execute(self, out) -> None:
        super().execute(across_processes(out))


def run(num_blocks, depth=1, workload=None, runner_class=None, **compaction):
    """``mode``: ``"1"`` (the policy) or ``"every:K"`` (the tests' forced compaction)."""
    forced_mode = None
    if str(compaction.get("mode", "")).startswith("every:"):
        forced_mode, compaction["mode"] = compaction["mode"], "1"
    scheduler = build_scheduler(proxima=True, num_blocks=num_blocks,
                                async_scheduling=depth == 2, kv_transfer_config=ktc(**compaction),
                                max_num_batched_tokens=2048)
    compactor = scheduler.connector.compactor
    if forced_mode is not None:
        forced.set_mode(compactor, forced_mode)
    total = num_blocks
    if compactor is not None:
        total = scratch_first(num_blocks, GRANULE) + compactor.scratch_blocks
    runner = (runner_class or ModelRunner)(scheduler, total)
    vllm_v1.activate()
    try:
        log = drive(scheduler, workload or specs(), runner, depth)
    finally:
        vllm_v1.deactivate()
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_block_queue.buddy.check()
    assert pool.get_num_free_blocks() == num_blocks - 1          # nothing leaked
    return scheduler, runner, log


# ----------------------------------------------------------------------------- identity

@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["every:1", "every:3", "1"])
def test_compaction_changes_no_decision_and_every_slot_reads_what_was_written(mode, depth):
    # 300 blocks for 40 requests of up to 380 tokens: preemptions and prefix-cache hits
    _, plain_runner, plain = run(300, depth)
    scheduler, runner, compacted = run(300, depth, mode=mode)
    stats = scheduler.connector.compactor.stats()
    assert compacted == plain                   # admissions, tokens, preemptions, finishes
    assert runner.checked == plain_runner.checked > 10_000
    assert stats["relocations"] > 0 and runner.moves > 0
    assert sum(len(s[1]) for s in plain[0]) > 0  # the workload did preempt
    assert plain[1][0] > 0                       # and hit the prefix cache


def test_compaction_work_reaches_a_worker_in_a_process_of_its_own_whole():
    # distributed_executor_backend="mp" on one GPU: the moves and table changes travel as
    # a copy; every slot still reads what was written, and nothing is decided otherwise
    _, here, log_here = run(300, 2, mode="every:3")
    _, apart, log_apart = run(300, 2, runner_class=ProcessModelRunner, mode="every:3")
    assert log_apart == log_here
    assert apart.moves == here.moves > 0
    assert apart.checked == here.checked > 10_000


@pytest.mark.parametrize("mode", ["every:1", "1"])
def test_compaction_moves_live_shared_and_cached_blocks(mode):
    scheduler, runner, _ = run(300, 1, mode=mode)
    c = scheduler.connector.compactor.counters
    assert c["live_moved"] > 0 and c["cached_moved"] > 0
    if mode == "1":
        assert c["scratch_used"] > 0 and c["steered"] > 0 and c["live_displaced"] > 0
    else:
        assert c["shared_moved"] > 0     # a prefix block held by two requests


# ----------------------------------------------------------------------------- elastic

def test_evacuate_lets_a_granule_that_holds_live_blocks_be_unmapped():
    """The elastic policy's hook: before a shrink, the policy asks the compactor to empty
    a granule that requests still use, then releases it in the same step (the workers copy
    in update_requests, before start_load_kv unmaps)."""
    # 800 blocks: room elsewhere for what the granule holds
    scheduler = build_scheduler(proxima=True, num_blocks=800, kv_transfer_config=ktc(mode="1"),
                                max_num_batched_tokens=2048)
    conn = scheduler.connector
    compactor = conn.compactor
    released: list[tuple[int, int]] = []

    class EvacuateThenRelease:           # stands in for the elastic policy's shrink
        def pending(self):
            return False

        def stats(self):
            return {}

        def tick(self, step, reserve, forecast):
            if released or step < 10:
                return False
            view = compactor.view()
            live = view.live_per_granule()
            used = [g for g in range(1, view.num_granules - 1) if live[g]]
            if not used:
                return False
            g = min(used, key=lambda g: (live[g], g))
            if compactor.evacuate([g]) and g in dict(conn.queue.releasable()):
                conn.queue.release([g])
                conn.channel.unmap(g, 1)
                released.append((g, live[g]))
            return False

    conn.step_hook = EvacuateThenRelease()
    runner = ModelRunner(scheduler, scratch_first(800, GRANULE)
                         + compactor.scratch_blocks)
    seen_after = []
    real_execute = runner.execute

    def execute(out):
        real_execute(out)
        if released:
            g = released[0][0]
            seen_after.append(any(b // GRANULE == g for rid in runner.req_states.req_id_to_index
                                  for b in runner.table(rid)))

    runner.execute = execute
    vllm_v1.activate()
    try:      # the workers' reports (an unmap is pending until the workers say it is done)
        drive(scheduler, specs(), runner, 1, worker=ReplayWorker(conn.channel, None))
    finally:
        vllm_v1.deactivate()
    assert released and released[0][1] > 0          # it held live blocks when asked
    assert seen_after and not any(seen_after)       # and none of it was read afterwards
    assert compactor.counters["evacuations_done"] == 1
    assert runner.unmapped >= 1


def test_the_elastic_policy_asks_compaction_to_empty_granules_before_a_shrink():
    """Policy auto: when a shrink finds too few granules without live blocks (here: the
    maximum is lowered mid-run), the controller asks the compactor (Compactor.empty_granules) to empty
    some, and releases them in the same step;
    every slot still reads what was written (given-back memory reads as NaN)."""
    elastic = {"min_bytes": 4 * GRANULE * PAGE, "release_delay_s": 0.0, "headroom": 0.0}
    scheduler = build_scheduler(proxima=True, num_blocks=800,
                                kv_transfer_config=ktc("auto", elastic, mode="1"),
                                max_num_batched_tokens=2048)
    conn = scheduler.connector
    compactor = conn.compactor
    runner = ModelRunner(scheduler, scratch_first(800, GRANULE)
                         + compactor.scratch_blocks)

    real_execute, steps = runner.execute, [0]

    def execute(out):                    # mid-run, an operator lowers the maximum (POST
        real_execute(out)                # /proxima/kv): more than the empty granules must go
        steps[0] += 1
        if steps[0] == 25:
            assert "error" not in conn.control({"max_bytes": 8 * GRANULE * PAGE})

    runner.execute = execute
    drive_elastic(scheduler, specs(60), runner, conn)
    assert conn.policy.stats.compactor_calls > 0
    assert compactor.counters["evacuations_done"] > 0
    assert runner.unmapped > 0 and runner.checked > 10_000


def test_auto_mode_plans_no_pack_while_nothing_could_be_given_back(monkeypatch):
    """Policy auto on a pool the load keeps full (preemptions): packing and placing for
    release gain nothing then (no granule could be released), so the compactor does not
    even plan them -- plan_pack runs only on steps where the policy could shrink, placement
    is skipped on the others; the moves come from the steps with room, and every slot still
    reads what was written."""
    calls = []
    real_pack = compaction_v1.plan_pack

    def plan_pack(view, budget, **kw):
        calls.append(conn.policy.could_shrink())
        return real_pack(view, budget, **kw)

    monkeypatch.setattr(compaction_v1, "plan_pack", plan_pack)
    scheduler = build_scheduler(proxima=True, num_blocks=320,
                                kv_transfer_config=ktc("auto", {"release_delay_s": 0.0}, mode="1"),
                                max_num_batched_tokens=2048)
    conn = scheduler.connector
    compactor = conn.compactor
    assert compactor.pack_gate == conn.policy.could_shrink
    runner = ModelRunner(scheduler, scratch_first(320, GRANULE)
                         + compactor.scratch_blocks)
    full = []
    real_execute = runner.execute

    def execute(out):
        full.append(not conn.policy.could_shrink())
        real_execute(out)

    runner.execute = execute
    drive_elastic(scheduler, specs(80), runner, conn)
    c = compactor.counters
    assert sum(full) > 0.5 * len(full)              # the pool was full most of the run
    assert c["pack_skipped"] >= sum(full) - 1        # and then no pack was planned
    assert all(calls)                                # plans only where it could release
    assert compactor.placements.get("skipped_full", 0) > 0
    assert runner.checked > 10_000 and runner.moves > 0


# ----------------------------------------------------------------------------- settings

@pytest.mark.parametrize("extra, message", [
    ({"mode": "sometimes"}, "mode must be 1 .on. or 0 .off."),
    ({"mode": "every:2"}, "mode must be 1 .on. or 0 .off."),     # forced: tests/support only
    ({"mode": "1", "budget_mib": 0}, "budget_mib must be an integer >= 1"),
    ({"mode": "1", "scratch_granules": -1}, "scratch_granules must be an integer >= 0"),
    ({"mode": "1", "budget": 3}, "unknown option"),
    ({"mode": "1", "defrag": 1}, "unknown option"),
])
def test_bad_compaction_options_are_one_clear_error(extra, message):
    from proxima.errors import UserError

    with pytest.raises(UserError, match=message):
        CompactionOptions.resolve(extra)


def test_the_mode_comes_from_the_environment_unless_the_options_say(monkeypatch):
    from proxima.vllm.activation import ActivationError, CompactionMode

    assert CompactionOptions.resolve(None) is None
    monkeypatch.setenv("PROXIMA_COMPACTION", "1")
    assert CompactionOptions.resolve(None).mode == CompactionMode("auto")
    assert CompactionOptions.resolve({"mode": "0"}) is None
    monkeypatch.setenv("PROXIMA_COMPACTION", "often")
    with pytest.raises(ActivationError, match=r"PROXIMA_COMPACTION must be 1 \(KV compaction.*got 'often'"):
        CompactionOptions.resolve(None)


def test_compaction_needs_elastic_mode_and_is_one_clear_error(monkeypatch):
    from proxima.vllm.plugin import register

    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    monkeypatch.delenv("PROXIMA_ELASTIC", raising=False)
    monkeypatch.setenv("PROXIMA_COMPACTION", "1")
    with pytest.raises(SystemExit, match="PROXIMA_COMPACTION needs PROXIMA_ELASTIC=1"):
        register()


def test_compaction_refuses_another_connector_beside_it(tmp_path):
    from vllm.config import KVTransferConfig

    from proxima.errors import UserError

    theirs = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    multi = elastic_v1.with_elastic_connector(theirs)
    multi.kv_connector_extra_config["connectors"][0]["kv_connector_extra_config"] = {
        "compaction": {"mode": "1"}}
    with pytest.raises(UserError, match="another KV connector is configured"):
        build_scheduler(proxima=True, num_blocks=512, kv_transfer_config=multi)


def test_the_worker_hook_wraps_and_unwraps_update_requests():
    calls = []

    class Runner:
        def update_requests(self, scheduler_output):
            calls.append("vllm")

    compaction_worker.install_worker_hook(Runner)
    compaction_worker.install_worker_hook(Runner)        # idempotent
    try:
        seen = []
        real = compaction_worker.apply_on_worker
        compaction_worker.apply_on_worker = lambda runner, work: seen.append(work)
        Runner().update_requests(SimpleNamespace(kv_connector_metadata=ElasticMetadata()))
        Runner().update_requests(SimpleNamespace(
            kv_connector_metadata=ElasticMetadata(compaction="work")))
        assert calls == ["vllm", "vllm"] and seen == ["work"]
    finally:
        compaction_worker.apply_on_worker = real
        compaction_worker.uninstall_worker_hook()
    assert "__wrapped__" not in Runner.update_requests.__dict__

