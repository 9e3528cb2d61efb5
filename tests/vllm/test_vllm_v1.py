"""Proxima inside vLLM 0.26's real V1 scheduler, KV-cache manager and block pool, on CPU."""

import pytest

from proxima.vllm import activation, vllm_v1
from proxima.allocator import count_runs
from proxima.replay.driver_v1 import build_scheduler, run_replay
from proxima.workloads import RequestSpec, Workload, make_workload


def one_request(rid, prompt, max_tokens, arrival=0, follows=None):
    return RequestSpec(rid, list(prompt), max_tokens, arrival, follows=follows)


def add_requests(scheduler, n: int, prompt_len: int, max_tokens: int) -> None:
    """``n`` requests with distinct prompts, straight into a scheduler (with block hashes,
    as prefix caching needs)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    for i in range(n):
        scheduler.add_request(Request(
            request_id=str(i), prompt_token_ids=list(range(3 + i, 3 + i + prompt_len)),
            pooling_params=None, arrival_time=0.0, block_hasher=hasher,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def step(scheduler, scheduled=None) -> list[str]:
    """One scheduler step with a stand-in model: one token for every scheduled request
    (prefill chunks included, which is harmless for these tests). Returns the ids.
    ``scheduled()`` is called between scheduling and the model's output."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    if scheduled is not None:
        scheduled()
    ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=[]))
    return ids


# ------------------------------------------------------------------ activation

def test_plugin_does_nothing_unless_enabled(monkeypatch):
    import vllm.v1.core.kv_cache_coordinator as coordinator
    from vllm.v1.core.block_pool import BlockPool

    from proxima.vllm.plugin import register

    monkeypatch.delenv(activation.ENV, raising=False)
    register()
    assert coordinator.BlockPool is BlockPool and not vllm_v1.is_active()
    monkeypatch.setenv(activation.ENV, "1")
    register()
    assert coordinator.BlockPool is not BlockPool and vllm_v1.is_active()
    vllm_v1.deactivate()
    assert coordinator.BlockPool is BlockPool


def test_a_bad_value_stops_vllms_plugin_loading(monkeypatch):
    import vllm.plugins

    monkeypatch.setenv(activation.ENV, "yes")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    with pytest.raises(SystemExit, match="PROXIMA_ALLOCATOR must be 1 .* got 'yes'"):
        vllm.plugins.load_general_plugins()
    assert not vllm_v1.is_active()


def test_plugin_entry_point_is_registered_with_vllm():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("proxima") == "proxima.vllm.plugin:register"


def test_untested_vllm_is_refused_unless_allowed(monkeypatch, proxima_log):
    import vllm

    from proxima.vllm.plugin import register

    monkeypatch.setenv(activation.ENV, "1")
    monkeypatch.delenv(activation.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    monkeypatch.setattr(activation, "_warned", set())
    with pytest.raises(SystemExit, match="proxima: vLLM 0.27.1 with torch .* is not a "
                                         "version Proxima was tested with"):
        register()
    with pytest.raises(activation.ActivationError, match="PROXIMA_ALLOW_UNTESTED_VLLM=1"):
        vllm_v1.activate()                  # the adapter asks the same policy
    assert not vllm_v1.is_active()
    monkeypatch.setenv(activation.ALLOW_UNTESTED_ENV, "yes")     # not 1: an error, not a no
    with pytest.raises(SystemExit, match="PROXIMA_ALLOW_UNTESTED_VLLM must be 1 .* got 'yes'"):
        register()
    assert not vllm_v1.is_active()
    monkeypatch.setenv(activation.ALLOW_UNTESTED_ENV, "1")
    register()
    assert vllm_v1.is_active()
    assert any("0.27.1" in r.getMessage() and "trying it anyway" in r.getMessage()
               for r in proxima_log)


def test_the_v0_vllm_series_is_refused_by_the_v1_adapter(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.6.3.post1")
    monkeypatch.setenv(activation.ALLOW_UNTESTED_ENV, "1")
    with pytest.raises(activation.ActivationError, match="runs the V0 engine"):
        vllm_v1.activate()
    assert not vllm_v1.is_active()


def test_a_bad_stats_file_stops_the_plugin_before_anything_is_patched(monkeypatch, tmp_path):
    from proxima.vllm.plugin import register

    monkeypatch.setenv(activation.ENV, "1")
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(tmp_path / "missing" / "status.json"))
    with pytest.raises(SystemExit, match="PROXIMA_STATS_FILE must be .* does not exist"):
        register()
    assert not vllm_v1.is_active()


def test_the_engine_logs_the_activation_line_once(proxima_log):
    import vllm

    build_scheduler(proxima=True, num_blocks=500)
    build_scheduler(proxima=False, num_blocks=500)
    lines = [r.getMessage() for r in proxima_log]
    assert lines == ["Using Proxima contiguous allocator: 500 blocks of 16 tokens "
                     f"(vLLM {vllm.__version__}, V1 engine)"]


def test_stock_when_off_proxima_when_on():
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    stock = build_scheduler(proxima=False, num_blocks=300)
    prox = build_scheduler(proxima=True, num_blocks=300)
    assert type(stock.kv_cache_manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    assert type(prox.kv_cache_manager.block_pool.free_block_queue) is vllm_v1.ProximaFreeQueue
    for s in (stock, prox):
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 299   # null block


# ------------------------------------------------------------------ growth and semantics

def test_prefill_chunks_and_decode_grow_one_run():
    # 1,500 prompt tokens in chunks of 256, then 400 decode steps: 119 blocks, one run.
    w = Workload("one", [one_request("r", range(3, 1503), 400)])
    out = run_replay(w, proxima=True, num_blocks=2000, max_num_batched_tokens=256, max_num_seqs=64)
    assert out.completed == 1 and out.runs_per_request_histogram == {1: 1}
    stock = run_replay(w, proxima=False, num_blocks=2000, max_num_batched_tokens=256, max_num_seqs=64)
    assert stock.steps == out.steps


def test_prefix_cache_hit_reuses_the_cached_blocks():
    prompt = list(range(100, 420))                    # 20 full blocks
    w = Workload("hit", [one_request("a", prompt, 8),
                         one_request("b", prompt + [7] * 40, 8, arrival=3, follows="a")])
    for proxima in (False, True):
        out = run_replay(w, proxima=proxima, num_blocks=400)
        assert out.details["prefix_hit_rate_new_requests"] == pytest.approx(320 / (320 + 360))


def test_eviction_takes_the_least_recently_used_cached_blocks_like_stock():
    # Four prompts finish one after the other; a fifth needs more than the truly free
    # blocks, so cached blocks are evicted; then the four prompts come back. The hits
    # that remain show which blocks were evicted: they must match stock's exactly.
    prompts = [list(range(1000 * k + 3, 1000 * k + 3 + 160)) for k in range(4)]
    reqs = []
    prev = None
    for k, p in enumerate(prompts):
        reqs.append(one_request(f"p{k}", p, 1, follows=prev))
        prev = f"p{k}"
    reqs.append(one_request("big", range(20000, 20000 + 400), 1, follows=prev))
    prev = "big"
    for k, p in enumerate(prompts):
        reqs.append(one_request(f"again{k}", p + [9] * 16, 1, follows=prev))
        prev = f"again{k}"
    w = Workload("lru", reqs)
    stock = run_replay(w, proxima=False, num_blocks=64)
    prox = run_replay(w, proxima=True, num_blocks=64)
    assert 0 < stock.prefix_hit_rate < 1
    assert prox.prefix_hit_rate == stock.prefix_hit_rate


def test_cached_blocks_are_evicted_only_when_no_free_block_is_left():
    s = build_scheduler(proxima=True, num_blocks=100)
    pool = s.kv_cache_manager.block_pool
    queue = pool.free_block_queue
    blocks = pool.get_new_blocks(10)
    for i, b in enumerate(blocks):       # give them hashes as cache_full_blocks would
        pool._insert_block_hash((b"h%d" % i) + b"\0" * 4, b, num_tokens=16 * (i + 1))
    pool.free_blocks(reversed(blocks))
    assert queue.num_evictable == 10 and pool.get_num_free_blocks() == 99
    new = pool.get_new_blocks(89)        # exactly the truly free ones: nothing evicted
    assert not {b.block_id for b in new} & {b.block_id for b in blocks}
    assert all(b.block_hash is not None for b in blocks)
    two = pool.get_new_blocks(2)         # now the two least recently used go
    assert {b.block_id for b in two} == {blocks[-1].block_id, blocks[-2].block_id}
    assert all(b.block_hash is None for b in two)


def test_reset_prefix_cache_returns_every_block_to_the_buddy():
    s = build_scheduler(proxima=True, num_blocks=64)
    pool = s.kv_cache_manager.block_pool
    blocks = pool.get_new_blocks(8)
    for i, b in enumerate(blocks):
        pool._insert_block_hash((b"x%d" % i) + b"\0" * 4, b, num_tokens=16)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.free_block_queue.num_evictable == 0
    assert pool.free_block_queue.buddy.num_free == 63 == pool.get_num_free_blocks()
    assert pool.free_block_queue.buddy.largest_free_run == 63


# ------------------------------------------------------------------ what vLLM 0.33 added
# (proxima/vllm/vllm_v1_compat.py lists the differences; these run where vLLM has them)

def _has_block_pool_feature(name: str) -> bool:
    import inspect

    from vllm.v1.core.block_pool import BlockPool

    return hasattr(BlockPool, name) or name in inspect.signature(BlockPool.__init__).parameters


def test_block_pool_arguments_added_by_vllm_reach_stocks_constructor():
    if not _has_block_pool_feature("num_hash_lookahead_tokens"):
        pytest.skip("this vLLM's BlockPool takes no num_hash_lookahead_tokens= (added in 0.33)")
    vllm_v1.activate()
    pool = vllm_v1.ProximaBlockPool(num_gpu_blocks=50, enable_caching=True, hash_block_size=16,
                                    num_hash_lookahead_tokens=4, medium="CPU")
    assert (pool.num_hash_lookahead_tokens, pool.medium) == (4, "CPU")
    assert type(pool.free_block_queue) is vllm_v1.ProximaFreeQueue
    assert pool.get_num_free_blocks() == 49 and all(b.pool is pool for b in pool.blocks)


def test_unpinned_blocks_are_handed_out_last_and_watched_like_stock():
    """vLLM 0.33's ``unpin_blocks`` (HiSparse): released blocks stay readable until reused,
    count as free, and are the last to be handed out; ``on_reuse`` fires when they are."""
    if not _has_block_pool_feature("unpin_blocks"):
        pytest.skip("this vLLM's BlockPool has no unpin_blocks (added in 0.33)")
    from vllm.v1.core.block_pool import BlockPool

    vllm_v1.activate()
    seen = {}
    for cls in (BlockPool, vllm_v1.ProximaBlockPool):
        pool = cls(num_gpu_blocks=40, enable_caching=True, hash_block_size=16)
        held = pool.get_new_blocks(10)
        reused = seen[cls] = []
        pool.unpin_blocks(held[:4], on_reuse=lambda b, reused=reused: reused.append(b.block_id))
        assert pool.get_num_free_blocks() == 39 - 6
        pool.free_blocks(held[4:])
        first = pool.get_new_blocks(35)              # every block that was not unpinned
        assert reused == [] and not {b.block_id for b in first} & {b.block_id for b in held[:4]}
        two = pool.get_new_blocks(2)                 # the two released first
        assert sorted(b.block_id for b in two) == sorted(reused) == sorted(
            b.block_id for b in held[:2])
        assert pool.get_num_free_blocks() == 2
    assert sorted(seen[BlockPool]) == sorted(seen[vllm_v1.ProximaBlockPool])


def test_abort_mid_run_leaves_no_block_behind():
    from vllm.v1.request import RequestStatus

    s = build_scheduler(proxima=True, num_blocks=300)
    add_requests(s, 6, prompt_len=200, max_tokens=50)
    for _ in range(5):
        step(s)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() < 299
    s.finish_requests([str(i) for i in range(6)], RequestStatus.FINISHED_ABORTED)
    assert pool.get_num_free_blocks() == 299
    pool.free_block_queue.buddy.check()


def test_preemption_leaves_no_block_behind_and_matches_stock_capacity():
    w = make_workload("pressure", 60, seed=1)
    stock = run_replay(w, proxima=False, num_blocks=300)
    prox = run_replay(w, proxima=True, num_blocks=300)
    assert stock.preemptions > 0                    # the pool really is too small
    for key in ("completed", "steps", "peak_running", "preemptions"):
        assert getattr(prox, key) == getattr(stock, key), key
    assert prox.blocks_leaked == 0 == stock.blocks_leaked


def test_hybrid_model_with_sliding_window_and_full_attention_groups():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    groups = [
        KVCacheGroupSpec(["layer.0"], SlidingWindowSpec(block_size=16, num_kv_heads=2,
                                                        head_size=64, dtype=torch.bfloat16,
                                                        sliding_window=128)),
        KVCacheGroupSpec(["layer.1"], FullAttentionSpec(block_size=16, num_kv_heads=2,
                                                        head_size=64, dtype=torch.bfloat16)),
    ]
    finals = {}
    for proxima in (False, True):
        s = build_scheduler(proxima=proxima, num_blocks=2000, kv_cache_groups=groups)
        if proxima:
            vllm_v1.activate()
        add_requests(s, 8, prompt_len=300, max_tokens=120)
        steps = 0
        full_manager = s.kv_cache_manager.coordinator.single_type_managers[1]
        tables = {}
        while s.has_requests():
            for rid in step(s):
                blocks = full_manager.req_to_blocks.get(rid)
                if blocks:                       # (a request that just finished is freed)
                    tables[rid] = [b.block_id for b in blocks]
            steps += 1
        vllm_v1.deactivate()
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 1999
        finals[proxima] = (steps, tables)
    assert finals[True][0] == finals[False][0]
    assert len(finals[True][1]) == 8
    assert all(count_runs(t) == 1 for t in finals[True][1].values())   # per-group contiguity


# ------------------------------------------------------------------ short replays

@pytest.mark.parametrize("name, n, blocks, contiguous", [
    ("chat", 100, 55735, True),
    ("sharegpt", 300, 55735, True),
    ("multiturn", 120, 55735, True),
    ("pressure", 150, 1920, False),
])
def test_replay_parity_and_contiguity(name, n, blocks, contiguous):
    w = make_workload(name, n, seed=0)
    stock = run_replay(w, proxima=False, num_blocks=blocks)
    prox = run_replay(w, proxima=True, num_blocks=blocks)
    assert prox.completed == stock.completed == n
    assert prox.preemptions <= stock.preemptions
    assert prox.prefix_hit_rate >= stock.prefix_hit_rate - 0.005
    assert prox.blocks_leaked == 0 == stock.blocks_leaked
    assert stock.blocks_per_run < 5                    # stock scatters
    assert prox.blocks_per_run > stock.blocks_per_run
    if contiguous:
        assert prox.single_run_fraction >= 0.95


# ------------------------------------------------------------------ observing stock

def block_tables(scheduler) -> dict[str, list[int]]:
    return {rid: [b.block_id for b in blocks]
            for m in scheduler.kv_cache_manager.coordinator.single_type_managers
            for rid, blocks in m.req_to_blocks.items()}


def runs_of(ids: list[int]) -> int:
    return sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)


def test_observer_measures_stock_without_changing_its_allocation(monkeypatch, tmp_path):
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    from proxima.vllm import observe_v1
    from proxima.vllm.plugin import register
    from proxima.vllm.status import read_status
    from proxima.ioutil import flush_live_files

    # Build the unobserved scheduler first, then switch the observer on, as vLLM's
    # engine core would (the plugin runs before the engine is built).
    plain = build_scheduler(proxima=False, num_blocks=400)
    status = tmp_path / "status.json"
    monkeypatch.delenv(activation.ENV, raising=False)
    monkeypatch.setenv(activation.OBSERVE_ENV, "1")
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(status))
    monkeypatch.setattr(observe_v1, "STATUS_INTERVAL_S", 0.0)     # a snapshot every step
    register()
    assert observe_v1.is_active() and not vllm_v1.is_active()
    observed = build_scheduler(proxima=False, num_blocks=400)
    assert type(observed.kv_cache_manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    for s in (plain, observed):
        add_requests(s, 12, prompt_len=70, max_tokens=60)
    seen_scattered = False
    for _ in range(40):
        assert step(observed) == step(plain)
        tables = block_tables(observed)
        assert tables == block_tables(plain)          # the very same ids, step by step
        observed.kv_cache_manager.new_step_starts()   # what the next schedule() calls first
        flush_live_files()                              # (periodic snapshots: a thread)
        snap = read_status(status)
        assert snap["active"] is False and snap["observer"] is True
        assert snap["num_blocks"] == 400 and snap["num_free_blocks"] == \
            observed.kv_cache_manager.block_pool.get_num_free_blocks()
        expected = sorted(len(ids) / runs_of(ids) for ids in tables.values() if ids)
        assert sorted(snap["running_blocks_per_run"]) == pytest.approx(expected)
        seen_scattered |= any(runs_of(ids) > 1 for ids in tables.values())
    assert seen_scattered, "stock never scattered a request here: the check proves nothing"
    # Every request's whole KV at completion, then a snapshot as the pool empties.
    finals = {}

    def record():
        finals.update({rid: ids for rid, ids in block_tables(observed).items() if ids})

    while step(observed, scheduled=record):
        pass
    snap = read_status(status)
    assert not any(block_tables(observed).values())
    expected = [len(ids) / runs_of(ids) for ids in finals.values()]
    assert snap["finished_blocks_per_run"]["count"] == 12
    assert snap["finished_blocks_per_run"]["mean"] == pytest.approx(sum(expected) / 12)
    observe_v1.deactivate()
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    assert not hasattr(KVCacheManager.new_step_starts, "__wrapped__")


def test_observer_is_off_with_proxima_on_and_refuses_bad_values(monkeypatch, tmp_path):
    from proxima.vllm import observe_v1
    from proxima.vllm.plugin import register

    monkeypatch.setenv("PROXIMA_STATS_FILE", str(tmp_path / "s.json"))
    monkeypatch.setenv(activation.OBSERVE_ENV, "yes")
    with pytest.raises(SystemExit, match="PROXIMA_OBSERVE must be 1 .* got 'yes'"):
        register()
    monkeypatch.setenv(activation.OBSERVE_ENV, "1")
    monkeypatch.setenv(activation.ENV, "1")
    register()
    assert vllm_v1.is_active() and not observe_v1.is_active()


def test_finished_tally_proxima_against_observed_stock(monkeypatch, tmp_path):
    """The same 12 requests through stock (observed) and Proxima: both status files count
    every finished request, and Proxima's requests end in far fewer runs."""
    from proxima.vllm import observe_v1
    from proxima.vllm.status import read_status

    means = {}
    for proxima in (False, True):
        status = tmp_path / f"{proxima}.json"
        monkeypatch.setenv("PROXIMA_STATS_FILE", str(status))
        # as in an engine: switched on before the scheduler is built, on while it runs
        (vllm_v1 if proxima else observe_v1).activate()
        s = build_scheduler(proxima=proxima, num_blocks=400)
        add_requests(s, 12, prompt_len=70, max_tokens=60)
        while step(s):
            pass
        (vllm_v1 if proxima else observe_v1).deactivate()
        tally = read_status(status)["finished_blocks_per_run"]
        assert tally["count"] == 12, tally
        means[proxima] = tally["mean"]
    # 9 blocks per request: Proxima keeps each in one run, stock interleaves decode growth
    assert means[True] == pytest.approx(9.0)
    assert means[False] < 3.0


def test_invariants_are_rechecked_on_the_live_pool(monkeypatch, tmp_path):
    from proxima.allocator.free_runs import ALLOCATED, FREE
    from proxima.vllm import status as status_mod
    from proxima.ioutil import flush_live_files

    path = tmp_path / "status.json"
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(path))
    monkeypatch.setattr(vllm_v1, "STATUS_INTERVAL_S", 0.0)
    monkeypatch.setattr(status_mod, "INVARIANTS_INTERVAL_S", 0.0)
    vllm_v1.activate()
    s = build_scheduler(proxima=True, num_blocks=300)
    first = status_mod.read_status(path)
    assert first["invariants_ok"] is True
    add_requests(s, 6, prompt_len=100, max_tokens=20)
    for _ in range(5):
        step(s)
    flush_live_files()                  # the periodic snapshots are written by a thread
    later = status_mod.read_status(path)
    assert later["invariants_ok"] is True
    assert later["invariants_checked_at"] > first["invariants_checked_at"]
    # break the live pool behind the allocator's back: the next snapshot says so
    pool = s.kv_cache_manager.block_pool
    buddy = pool.free_block_queue.buddy
    free_id = next(i for i in range(1, 300) if buddy._state[i] == FREE)
    buddy._state[free_id] = ALLOCATED
    pool.publish_status(now=True)
    broken = status_mod.read_status(path)
    assert broken["invariants_ok"] is False and "num_free" in broken["invariants_error"]
