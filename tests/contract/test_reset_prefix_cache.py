"""vLLM's prefix-cache reset on Proxima's pools, side by side with stock's (issue 37).

vLLM resets the prefix cache through ``BlockPool.reset_prefix_cache()``: the
``/reset_prefix_cache`` endpoint and ``LLM.reset_prefix_cache()``, every
``sleep(level >= 1)`` (``EngineCore.pause_scheduler(clear_cache=True)``) and, from vLLM
0.33, ``LLM.release_kv_cache_memory()`` and ``/release_kv_cache_memory``. Stock returns
True whenever no block but the null one is in use (a fresh engine, prefix caching off and a
second reset included) and False while a request holds blocks. Proxima's pool raised
``AllocationError: cannot free []`` in the first three cases: it gave the buddy allocator
its cached blocks back even when there were none.

Each test runs the same steps on vLLM's own objects, once with stock's pool and once with
Proxima's (no stand-ins, except the GPU executor below the engine core, which cannot run
here), and compares what vLLM sees. Runs on every stack: the V1 tests on 0.26 and 0.33,
the V0 check on the card stack (vLLM 0.6.3, which has no prefix-cache reset at all).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the contract is checked against an installed vLLM")

from proxima.vllm import activation  # noqa: E402

VERSION = vllm.__version__
ENGINE = activation.engine_for(VERSION)
v1 = pytest.mark.skipif(ENGINE != "v1", reason=f"vLLM {VERSION} runs the V0 engine")
v0 = pytest.mark.skipif(ENGINE != "v0", reason=f"vLLM {VERSION} runs the V1 engine")
BLOCK = 16


@pytest.fixture
def proxima_v1(monkeypatch):
    monkeypatch.setenv(activation.ALLOW_UNTESTED_ENV, "1")
    from proxima.vllm import vllm_v1

    vllm_v1.deactivate()
    vllm_v1.activate()
    yield vllm_v1
    vllm_v1.deactivate()


def cleared(pool) -> bool:
    """What a successful reset leaves: no hash in the map, none on any block."""
    return (not pool.cached_block_hash_to_block
            and all(block.block_hash is None for block in pool.blocks))


def all_free_in_the_buddy(pool) -> None:
    """Proxima's pool after a reset: every block but the null one in the buddy tier (the
    LRU tier holds only blocks with a hash), the allocator's invariants intact, and the
    whole pool can be handed out and given back."""
    queue = pool.free_block_queue
    queue.buddy.check()
    assert queue.num_evictable == 0
    assert queue.buddy.num_free == pool.num_gpu_blocks - 1 == pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(pool.num_gpu_blocks - 1)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    queue.buddy.check()


# ------------------------------------------------------------- the pool, on its own

@v1
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
def test_a_fresh_pool_resets_and_resets_again_as_stocks_does(proxima_v1, enable_caching):
    from vllm.v1.core.block_pool import BlockPool

    args = dict(num_gpu_blocks=16, enable_caching=enable_caching, hash_block_size=BLOCK)
    stock, ours = BlockPool(**args), proxima_v1.ProximaBlockPool(**args)
    for attempt in ("first", "second", "third"):
        assert stock.reset_prefix_cache() is True, attempt
        assert ours.reset_prefix_cache() is True, attempt    # raised AllocationError
        assert cleared(ours) and ours.get_num_free_blocks() == stock.get_num_free_blocks()
    all_free_in_the_buddy(ours)


@v1
def test_a_pool_refuses_a_reset_while_a_block_is_in_use_as_stocks_does(proxima_v1):
    from vllm.v1.core.block_pool import BlockPool

    args = dict(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK)
    stock, ours = BlockPool(**args), proxima_v1.ProximaBlockPool(**args)
    held = [stock.get_new_blocks(3), ours.get_new_blocks(3)]
    assert stock.reset_prefix_cache() is False
    assert ours.reset_prefix_cache() is False
    assert ours.get_num_free_blocks() == stock.get_num_free_blocks() == 12
    for pool, blocks in zip((stock, ours), held):
        pool.free_blocks(blocks)
        assert pool.reset_prefix_cache() is True
    all_free_in_the_buddy(ours)


@v1
@pytest.mark.parametrize("enable_caching", [True, False], ids=["caching", "no-caching"])
def test_an_elastic_pool_resets_fresh_and_again(proxima_v1, enable_caching):
    """The granule-aware queue (elastic mode) shares the V1 pool's reset; half its granules
    unmapped, as after a release of memory."""
    pool = proxima_v1.ProximaBlockPool(num_gpu_blocks=64, enable_caching=enable_caching,
                                       hash_block_size=BLOCK)
    queue = pool.proxima_use_granules(8, mapped=4)
    for _ in range(2):
        assert pool.reset_prefix_cache() is True            # raised AllocationError
        assert cleared(pool) and queue.num_evictable == 0
        assert pool.get_num_free_blocks() == 31 and queue.held_blocks() == 32
        queue.check()
    held = pool.get_new_blocks(5)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True
    queue.check()


# ------------------------------------- through the scheduler and KV-cache manager

def requests(n: int, prompt: int, max_tokens: int, tag: str = ""):
    """``n`` requests sharing their first block (so they hit each other's cache), with
    block hashes, as vLLM's engine makes them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=[7] * BLOCK
                    + list(range(100 * i, 100 * i + prompt - BLOCK)), pooling_params=None,
                    arrival_time=0.0, block_hasher=hasher,
                    sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i in range(n)]


def step(scheduler) -> None:
    """One scheduler step with a stand-in model: one token per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=[]))


def run_to_completion(scheduler, batch) -> None:
    for request in batch:
        scheduler.add_request(request)
    for _ in range(200):
        if not scheduler.has_requests():
            return
        step(scheduler)
    raise AssertionError("the requests did not finish in 200 steps")


def schedulers(**kwargs):
    """Stock's scheduler and Proxima's, built alike (vLLM's classes, Proxima's pool in the
    second only)."""
    from proxima.replay.driver_v1 import build_scheduler

    stock = build_scheduler(proxima=False, num_blocks=64, **kwargs)
    ours = build_scheduler(proxima=True, num_blocks=64, **kwargs)
    assert type(ours.kv_cache_manager.block_pool).__name__ == "ProximaBlockPool"
    assert type(stock.kv_cache_manager.block_pool).__name__ == "BlockPool"
    return stock, ours


def seen(scheduler) -> tuple:
    """What vLLM sees of the pool: free blocks, cached hashes, blocks carrying one."""
    pool = scheduler.kv_cache_manager.block_pool
    return (pool.get_num_free_blocks(), len(pool.cached_block_hash_to_block),
            sum(block.block_hash is not None for block in pool.blocks))


@v1
@pytest.mark.parametrize("enable_prefix_caching", [True, False],
                         ids=["caching", "no-caching"])
def test_the_kv_cache_manager_resets_fresh_after_a_run_and_again_as_stocks_does(
        proxima_v1, enable_prefix_caching):
    pair = schedulers(enable_prefix_caching=enable_prefix_caching)
    for s in pair:
        assert s.kv_cache_manager.reset_prefix_cache() is True      # fresh
        run_to_completion(s, requests(3, prompt=40, max_tokens=8))
    stock, ours = pair
    assert seen(ours) == seen(stock)
    assert (seen(stock)[1] > 0) == enable_prefix_caching        # blocks cached and freed
    for attempt in ("after the run", "again"):
        for s in pair:
            assert s.kv_cache_manager.reset_prefix_cache() is True, attempt
            assert cleared(s.kv_cache_manager.block_pool)
        assert seen(ours) == seen(stock) == (63, 0, 0)
    all_free_in_the_buddy(ours.kv_cache_manager.block_pool)
    for s in pair:                       # nothing is served from the dropped cache
        batch = requests(3, prompt=40, max_tokens=8)         # the first run's prompts
        assert [s.kv_cache_manager.get_computed_blocks(r)[1] for r in batch] == [0, 0, 0]
        run_to_completion(s, batch)
    assert seen(ours) == seen(stock)


@v1
def test_the_scheduler_refuses_a_reset_while_requests_run_unless_told_to_preempt(
        proxima_v1):
    pair = schedulers()
    for s in pair:
        run_to_completion(s, requests(2, prompt=40, max_tokens=8))
        for request in requests(2, prompt=40, max_tokens=8, tag="running-"):
            s.add_request(request)
        step(s)                          # both prefilled: they hold blocks
    before = [seen(s) for s in pair]
    assert before[0] == before[1] and before[0][0] < 63
    for s in pair:
        assert s.reset_prefix_cache() is False
    assert [seen(s) for s in pair] == before                # nothing dropped
    # What EngineCore._reset_caches asks (sleep, release_kv_cache_memory): preempt, reset.
    for s in pair:
        assert s.reset_prefix_cache(reset_running_requests=True,
                                    reset_connector=True) is True
        assert not s.running and len(s.waiting) == 2
    assert [seen(s) for s in pair] == [(63, 0, 0)] * 2
    all_free_in_the_buddy(pair[1].kv_cache_manager.block_pool)
    for s in pair:
        run_to_completion(s, [])         # the preempted requests are recomputed
    assert seen(pair[1]) == seen(pair[0])


# ------------------------------------------------- through the engine core's own methods

class GpuSide:
    """The model executor below EngineCore (GPU workers; none can run here): records what
    the engine core asks of it. Everything above it is vLLM's own code and objects."""

    is_sleeping = False

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, *args))


def engine_core(scheduler):
    """vLLM's EngineCore around a real scheduler, without its GPU executor's start-up."""
    from vllm.v1.engine.core import EngineCore

    core = EngineCore.__new__(EngineCore)
    core.scheduler = scheduler
    core.model_executor = GpuSide()
    core.batch_queue = None
    core.mm_receiver_cache = None
    return core


def engine_call(what: str, call) -> None:
    """``call()``; an AttributeError (the engine core reads more than this test builds, a
    vLLM change) fails naming the method, not deep in a traceback."""
    try:
        call()
    except AttributeError as exc:
        pytest.fail(f"vLLM {VERSION} changed vllm.v1.engine.core.EngineCore.{what}: it "
                    f"reads {exc.name!r}, which this test does not build", pytrace=False)


@v1
@pytest.mark.parametrize("enable_prefix_caching", [True, False],
                         ids=["caching", "no-caching"])
@pytest.mark.parametrize("history", ["fresh", "after-a-run"])
def test_engine_sleep_level_1_resets_as_stocks_does(proxima_v1, enable_prefix_caching,
                                                    history):
    """``LLM.sleep(level=1)``: the engine core pauses the scheduler with clear_cache, which
    resets the prefix cache (on a fresh engine or with caching off, Proxima's pool raised
    there), then sleeps the executor."""
    from vllm.v1.engine.core import EngineCore

    pair = schedulers(enable_prefix_caching=enable_prefix_caching)
    for s in pair:
        if history == "after-a-run":
            run_to_completion(s, requests(3, prompt=40, max_tokens=8))
        core = engine_core(s)
        for _ in range(2):                      # asleep, awake, asleep again
            engine_call("sleep", lambda: EngineCore.sleep(core, level=1))
            assert ("sleep", 1) in core.model_executor.calls
            assert cleared(s.kv_cache_manager.block_pool)
            EngineCore.resume_scheduler(core)
    assert seen(pair[1]) == seen(pair[0]) == (63, 0, 0)
    all_free_in_the_buddy(pair[1].kv_cache_manager.block_pool)


@v1
@pytest.mark.parametrize("enable_prefix_caching", [True, False],
                         ids=["caching", "no-caching"])
@pytest.mark.parametrize("history", ["fresh", "after-a-run", "requests-aborted"])
def test_release_kv_cache_memory_resets_as_stocks_does(proxima_v1, enable_prefix_caching,
                                                       history):
    """vLLM 0.33's ``LLM.release_kv_cache_memory()`` (and ``/release_kv_cache_memory``):
    after ``sleep(level=0)`` the engine core resets every cache, then discards the KV
    memory. With Proxima it raised AllocationError on a fresh engine, with caching off,
    and when called twice."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, "release_kv_cache_memory"):
        pytest.skip(f"vLLM {VERSION} has no EngineCore.release_kv_cache_memory")
    pair = schedulers(enable_prefix_caching=enable_prefix_caching)
    for s in pair:
        if history != "fresh":
            run_to_completion(s, requests(3, prompt=40, max_tokens=8))
        if history == "requests-aborted":
            for request in requests(2, prompt=40, max_tokens=8, tag="aborted-"):
                s.add_request(request)
            step(s)                             # running: sleep(0) aborts them
        core = engine_core(s)
        engine_call("sleep", lambda: EngineCore.sleep(core, level=0))
        if history == "requests-aborted":
            step(s)             # the engine's next step hands the aborted ids to the workers
        for _ in range(2):
            engine_call("release_kv_cache_memory",
                        lambda: EngineCore.release_kv_cache_memory(core))
            assert cleared(s.kv_cache_manager.block_pool)
        assert core.model_executor.calls.count(("discard", ("kv_cache",))) == 2
    assert seen(pair[1]) == seen(pair[0]) == (63, 0, 0)
    all_free_in_the_buddy(pair[1].kv_cache_manager.block_pool)


# ---------------------------------------------------------------------------- V0

@v0
def test_v0_has_no_prefix_cache_reset_for_proxima_to_follow():
    """vLLM 0.6's V0 engine frees cached blocks only by eviction, one id at a time (every
    free Proxima's V0 allocators make names at least one id). A V0 vLLM with a
    prefix-cache reset would free the evictor's blocks in bulk through Proxima's
    allocators, which nothing has checked: this names it."""
    root = Path(vllm.__file__).parent
    found = sorted(str(path.relative_to(root.parent)) for path in root.rglob("*.py")
                   if re.search(r"def reset_prefix_cache\b",
                                path.read_text(errors="replace")))
    if found:
        pytest.fail(f"vLLM {VERSION} changed its V0 engine: reset_prefix_cache is defined in "
                    f"{', '.join(found)}; Proxima's V0 allocators (proxima/vllm/"
                    f"vllm_v0_allocators.py)"
                    f" were never checked against a reset (a fresh pool, caching off, a "
                    f"second reset, blocks in use: tests/contract/test_reset_prefix_cache.py"
                    f" does it for V1)", pytrace=False)


def test_a_v0_prefix_cache_reset_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "vllm"
    (fake / "core" / "block").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core" / "block" / "prefix_caching_block.py").write_text(
        "class PrefixCachingBlockAllocator:\n    def reset_prefix_cache(self) -> bool:\n"
        "        return True\n")
    monkeypatch.setattr(vllm, "__file__", str(fake / "__init__.py"))
    with pytest.raises(pytest.fail.Exception) as info:
        test_v0_has_no_prefix_cache_reset_for_proxima_to_follow()
    assert "vllm/core/block/prefix_caching_block.py" in str(info.value)
    assert str(info.value).startswith(f"vLLM {VERSION} changed its V0 engine")
