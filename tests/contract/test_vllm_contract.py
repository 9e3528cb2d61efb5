"""The contract between Proxima's engine adapters and vLLM's internals, in one place.

Runs against whatever vLLM is installed, tested or not (the tested stack, the card stack,
a candidate release: ``PROXIMA_STACK=... ./dev test tests/contract``), and checks the
section of the adapter that vLLM's engine generation selects
(:func:`proxima.vllm.activation.engine_for`). Every check fails with one message naming
the vLLM symbol that changed and what Proxima needs of it, so moving to a new vLLM starts
from a list, not from a traceback deep in the scheduler.

V1 adapter (proxima/vllm/vllm_v1.py) and the stock observer (observe_v1.py) rely on:
  vllm.v1.core.kv_cache_coordinator.BlockPool      the name activation replaces
  vllm.v1.core.block_pool.BlockPool                __init__ (passed through), the attributes
                                                   it sets, reset_prefix_cache()
  vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue  its method set, which ProximaFreeQueue
                                                   implements, and every use vLLM makes of
                                                   a pool's free_block_queue
  vllm.v1.core.kv_cache_utils.KVCacheBlock         block_id, is_null, the free-list links
  vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager
                                                   allocate_new_blocks' positional signature
                                                   and, on the releases of the wrapper's fast
                                                   path, its nothing-to-do answer;
                                                   req_to_blocks, block_size, block_pool,
                                                   _partial_hit_reqs; every manager class
                                                   vLLM registers exists at activation
  vllm.v1.core.sched.scheduler.Scheduler.add_request, AsyncScheduler inheriting it
  vllm.v1.core.kv_cache_manager.KVCacheManager.free / new_step_starts, .coordinator
Elastic KV's and compaction's worker side (elastic_v1, compaction_worker; what differs between
0.26 and 0.33 is proxima/vllm/vllm_v1_compat.py):
  vllm.v1.worker.gpu.attn_utils._allocate_kv_cache (0.26) / allocate_kv_cache (0.33)
                                                   the function replaced, with its arguments,
                                                   called by that name from init_kv_cache
  vllm.v1.worker.gpu.model_runner.GPUModelRunner.update_requests, called by execute_model
                                                   before block_tables.apply_staged_writes
  KVConnectorBase_V1's methods ProximaElasticConnector overrides, with their signatures
V0 adapter (proxima/vllm/vllm_v0.py, vllm_v0_allocators.py):
  vllm.core.block_manager.SelfAttnBlockSpaceManager
  (the name activation replaces) and the signatures of every vLLM method it overrides.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the contract is checked against an installed vLLM")

from proxima.vllm import activation  # noqa: E402

VERSION = vllm.__version__
ENGINE = activation.engine_for(VERSION)
v1 = pytest.mark.skipif(ENGINE != "v1", reason=f"vLLM {VERSION} runs the V0 engine")
v0 = pytest.mark.skipif(ENGINE != "v0", reason=f"vLLM {VERSION} runs the V1 engine")

#: FreeKVCacheBlockQueue's public methods in vLLM 0.26, all of which ProximaFreeQueue has
FREE_QUEUE_METHODS = {"popleft", "popleft_n", "remove", "append", "append_n", "prepend_n",
                      "get_all_free_blocks", "iter_blocks_after"}
ALLOCATE_NEW_BLOCKS = ["self", "request_id", "num_tokens", "num_tokens_main_model"]


def broken(symbol: str, what: str) -> None:
    pytest.fail(f"vLLM {VERSION} changed {symbol}: {what}", pytrace=False)


def symbol(path: str):
    """The object at dotted ``path`` (module prefix imported), or a failure naming it."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, name in enumerate(parts[i:], start=i):
            if not hasattr(obj, name):
                broken(".".join(parts[:j + 1]), "it is gone")
            obj = getattr(obj, name)
        return obj
    broken(path, "its module is gone")


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def keeps_signature(ours, theirs) -> bool:
    """``ours`` accepts whatever vLLM passes to ``theirs``: its parameters begin with
    theirs, or it passes ``*args, **kwargs`` through."""
    kinds = {p.kind for p in inspect.signature(ours).parameters.values()}
    if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return True
    mine, base = params(ours), params(theirs)
    return mine[:len(base)] == base


def check_overrides(cls, owner: str) -> None:
    """Every vLLM method ``cls`` overrides keeps vLLM's signature."""
    for name, ours in vars(cls).items():
        if not inspect.isfunction(ours):
            continue
        for base in cls.__mro__[1:]:
            theirs = vars(base).get(name)
            if theirs is None:
                continue
            if inspect.isfunction(theirs) and base.__module__.startswith("vllm"):
                if not keeps_signature(ours, theirs):
                    broken(f"{base.__module__}.{base.__qualname__}.{name}",
                           f"its parameters are {params(theirs)}; {owner}'s override takes "
                           f"{params(ours)}")
            break


@pytest.fixture
def untested_allowed(monkeypatch):
    """Activation asks the version policy: let it through on a candidate release."""
    monkeypatch.setenv(activation.ALLOW_UNTESTED_ENV, "1")


# ------------------------------------------------------------------------------ V1

@pytest.fixture
def proxima_v1(untested_allowed):
    from proxima.vllm import vllm_v1

    vllm_v1.deactivate()
    vllm_v1.activate()
    yield vllm_v1
    vllm_v1.deactivate()


@v1
def test_the_coordinator_builds_its_pool_through_the_name_activation_replaces():
    coordinator = symbol("vllm.v1.core.kv_cache_coordinator")
    stock = symbol("vllm.v1.core.block_pool.BlockPool")
    if symbol("vllm.v1.core.kv_cache_coordinator.BlockPool") is not stock:
        broken("vllm.v1.core.kv_cache_coordinator.BlockPool", "it is not "
               "vllm.v1.core.block_pool.BlockPool, which ProximaBlockPool subclasses")
    if not re.search(r"\bBlockPool\(", inspect.getsource(coordinator)):
        broken("vllm.v1.core.kv_cache_coordinator", "it no longer builds its pool as "
               "BlockPool(...), the module attribute Proxima's activation replaces")


@v1
def test_block_pool_init_sets_what_proxima_reads():
    BlockPool = symbol("vllm.v1.core.block_pool.BlockPool")
    where = "vllm.v1.core.block_pool.BlockPool.__init__"
    try:
        pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    except TypeError as exc:
        broken(where, f"it takes {params(BlockPool.__init__)} ({exc}); ProximaBlockPool "
                      f"passes them through, this test builds one by these names")
    for name in ("blocks", "null_block", "free_block_queue", "num_gpu_blocks",
                 "hash_block_size"):
        if not hasattr(pool, name):
            broken(where, f"it no longer sets self.{name}, which ProximaBlockPool reads")
    if [b.block_id for b in pool.blocks] != list(range(8)) or not pool.null_block.is_null:
        broken(where, "self.blocks is no longer every block by id, or self.null_block is "
                      "not vLLM's null block")
    if type(pool.free_block_queue) is not symbol(
            "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue"):
        broken(where, "self.free_block_queue is no longer a FreeKVCacheBlockQueue")
    if pool.get_num_free_blocks() != pool.free_block_queue.num_free_blocks:
        broken("vllm.v1.core.block_pool.BlockPool.get_num_free_blocks",
               "it no longer reads free_block_queue.num_free_blocks")


@v1
def test_proxima_block_pool_keeps_block_pools_signatures(proxima_v1):
    check_overrides(proxima_v1.ProximaBlockPool, "ProximaBlockPool")
    if params(symbol("vllm.v1.core.block_pool.BlockPool.reset_prefix_cache")) != ["self"]:
        broken("vllm.v1.core.block_pool.BlockPool.reset_prefix_cache",
               "it takes arguments now; ProximaBlockPool overrides it")


@v1
def test_the_free_queue_method_set_is_the_one_proxima_implements():
    from proxima.vllm.vllm_v1 import ProximaFreeQueue

    stock = symbol("vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue")
    where = "vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue"
    methods = {n for n, v in vars(stock).items() if inspect.isfunction(v)
               and not n.startswith("_")}
    if methods != FREE_QUEUE_METHODS:
        broken(where, f"methods added: {sorted(methods - FREE_QUEUE_METHODS) or 'none'}, "
                      f"removed: {sorted(FREE_QUEUE_METHODS - methods) or 'none'} "
                      f"(ProximaFreeQueue implements {sorted(FREE_QUEUE_METHODS)})")
    for name in sorted(methods):
        ours = getattr(ProximaFreeQueue, name, None)
        if ours is None:
            broken(f"{where}.{name}", "ProximaFreeQueue has no such method")
        if params(ours) != params(getattr(stock, name)):
            broken(f"{where}.{name}", f"its parameters are {params(getattr(stock, name))}; "
                                      f"ProximaFreeQueue's are {params(ours)}")
    KVCacheBlock = symbol("vllm.v1.core.kv_cache_utils.KVCacheBlock")
    queue = stock([KVCacheBlock(i) for i in range(4)])
    if getattr(queue, "num_free_blocks", None) != 4:
        broken(f"{where}.num_free_blocks", "the attribute the scheduler reads is gone")


@v1
def test_vllm_touches_a_pools_free_queue_only_through_what_proxima_has():
    """Every attribute any vLLM module reads on a block pool's free_block_queue (directly,
    or through a local alias, as the simple CPU offload's cursor walk does)."""
    from proxima.vllm.vllm_v1 import ProximaFreeQueue

    ours = set(dir(ProximaFreeQueue)) | {"num_free_blocks"}
    root = Path(vllm.__file__).parent
    missing: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if "free_block_queue" not in text:
            continue
        names = set(re.findall(r"\bfree_block_queue\.(\w+)", text))
        for alias in re.findall(r"^\s*(\w+)\s*=\s*[\w.]*\bfree_block_queue\s*$", text, re.M):
            names |= set(re.findall(rf"\b{alias}\.(\w+)", text))
        for name in names - ours:
            missing.setdefault(name, set()).add(str(path.relative_to(root.parent)))
    if missing:
        broken("vllm's use of BlockPool.free_block_queue",
               "; ".join(f"{name} (in {', '.join(sorted(files))})"
                         for name, files in sorted(missing.items()))
               + " — not on ProximaFreeQueue")


@v1
def test_kv_cache_block_fields():
    block = symbol("vllm.v1.core.kv_cache_utils.KVCacheBlock")(3)
    for name in ("block_id", "is_null", "prev_free_block", "next_free_block", "block_hash"):
        if not hasattr(block, name):
            broken(f"vllm.v1.core.kv_cache_utils.KVCacheBlock.{name}", "the field is gone")
    if block.block_id != 3 or block.is_null or block.block_hash is not None:
        broken("vllm.v1.core.kv_cache_utils.KVCacheBlock", "a new block is no longer "
               "(block_id, is_null=False, block_hash=None)")


def _manager_classes():
    """The single-type manager classes vLLM builds, from its registry (0.26) or its map."""
    module = symbol("vllm.v1.core.single_type_kv_cache_manager")
    try:
        registry = importlib.import_module("vllm.v1.kv_cache_spec_registry")
    except ImportError:
        registry = None
    if registry is not None and hasattr(registry, "KVCacheSpecRegistry"):
        registry.KVCacheSpecRegistry._ensure_registered()
        return {m.manager_class for m in registry._REGISTRY_KVCACHESPEC_LIST.values()}
    if hasattr(module, "spec_manager_map"):
        return set(module.spec_manager_map.values())
    broken("vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry",
           "neither it nor single_type_kv_cache_manager.spec_manager_map lists the managers")


@v1
def test_allocate_new_blocks_keeps_its_positional_signature():
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")
    for cls in (base, *_manager_classes()):
        fn = vars(cls).get("allocate_new_blocks")
        if fn is not None and params(fn) != ALLOCATE_NEW_BLOCKS:
            broken(f"{cls.__module__}.{cls.__qualname__}.allocate_new_blocks",
                   f"its parameters are {params(fn)}, not {ALLOCATE_NEW_BLOCKS} (Proxima's "
                   f"wrapper passes them positionally)")


@v1
def test_allocate_new_blocks_does_nothing_for_a_request_holding_blocks_enough():
    """The fast path of Proxima's wrapper (vllm_v1.PLAIN_ALLOCATE_RELEASES) answers such a
    call itself with a new empty list: vLLM's base method must do just that (no block
    taken, no list or id record changed) on every release the path is enabled for."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from proxima.vllm import vllm_v1

    if VERSION not in vllm_v1.PLAIN_ALLOCATE_RELEASES:
        pytest.skip(f"the fast path is off on vLLM {VERSION} (not in PLAIN_ALLOCATE_RELEASES)")
    vllm_v1.deactivate()
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")
    stock = vars(base)["allocate_new_blocks"]
    manager_cls = symbol("vllm.v1.core.kv_cache_manager.KVCacheManager")
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    kv = manager_cls(config, max_model_len=4096, scheduler_block_size=32, hash_block_size=32,
                     enable_caching=False)
    request = Request(request_id="a", prompt_token_ids=list(range(100, 164)),
                      pooling_params=None, arrival_time=0.0,
                      sampling_params=SamplingParams(max_tokens=8))
    kv.allocate_slots(request, request.num_tokens)
    group = kv.coordinator.single_type_managers[0]
    table = list(group.req_to_blocks["a"])
    new_ids = list(getattr(group, "new_block_ids", []))
    free = kv.block_pool.get_num_free_blocks()
    where = f"{base.__module__}.{base.__qualname__}.allocate_new_blocks"
    for n in (1, 33, 64):
        got = stock(group, "a", n, n)
        if got != [] or group.req_to_blocks["a"] != table or \
                list(getattr(group, "new_block_ids", [])) != new_ids or \
                kv.block_pool.get_num_free_blocks() != free:
            broken(where, f"for a request holding {len(table)} blocks of 32 tokens and asking "
                   f"for {n} it returned {got!r} or changed the request's blocks, the new "
                   "block ids or the free count; Proxima's fast path returns [] and changes "
                   "nothing: take this release out of vllm_v1.PLAIN_ALLOCATE_RELEASES")


@v1
def test_every_manager_vllm_registers_exists_at_activation(proxima_v1):
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")
    for cls in sorted(_manager_classes(), key=lambda c: c.__qualname__):
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not issubclass(cls, base):
            broken(name, "it is not a SingleTypeKVCacheManager")
        if not hasattr(cls.allocate_new_blocks, "__wrapped__"):
            broken(f"{name}.allocate_new_blocks", "it was not wrapped at activation (the "
                   "class did not exist yet, or defines the method another way)")


@v1
def test_the_scheduler_and_manager_methods_activation_wraps():
    scheduler = symbol("vllm.v1.core.sched.scheduler.Scheduler")
    manager = symbol("vllm.v1.core.kv_cache_manager.KVCacheManager")
    expected = [(scheduler, "add_request", ["self", "request"]),
                (manager, "free", ["self", "request"]),
                (manager, "new_step_starts", ["self"])]
    for owner, name, args in expected:
        where = f"{owner.__module__}.{owner.__qualname__}.{name}"
        if name not in vars(owner):
            broken(where, "it is no longer defined on the class activation patches")
        if params(vars(owner)[name]) != args:
            broken(where, f"its parameters are {params(vars(owner)[name])}, not {args}")
    async_scheduler = symbol("vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    if "add_request" in vars(async_scheduler):
        broken("vllm.v1.core.sched.async_scheduler.AsyncScheduler.add_request",
               "it overrides Scheduler.add_request, so Proxima's growth hint misses it")


@v1
def test_a_live_scheduler_has_what_the_adapter_reads(proxima_v1):
    """Scheduler -> kv_cache_manager -> coordinator.single_type_managers -> block_pool, the
    request fields of the growth hint, and one new_step_starts per schedule()."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from proxima.replay.driver_v1 import build_scheduler

    s = build_scheduler(proxima=True, num_blocks=64, enable_prefix_caching=False)
    kv = s.kv_cache_manager
    pool = kv.block_pool
    if type(pool) is not proxima_v1.ProximaBlockPool:
        broken("vllm.v1.core.kv_cache_coordinator.BlockPool", "the scheduler's pool is not "
               "Proxima's although activation replaced the name")
    managers = kv.coordinator.single_type_managers
    for m in managers:
        for name, kind in (("req_to_blocks", dict), ("_partial_hit_reqs", dict),
                           ("block_size", int)):
            if not isinstance(getattr(m, name, None), kind):
                broken(f"{type(m).__qualname__}.{name}", f"it is not a {kind.__name__} any "
                       f"more; Proxima's allocate_new_blocks wrapper reads it")
        if m.block_pool is not pool:
            broken(f"{type(m).__qualname__}.block_pool", "it is not the coordinator's pool")
    request = Request(request_id="r", prompt_token_ids=list(range(3, 43)), pooling_params=None,
                      arrival_time=0.0, sampling_params=SamplingParams(max_tokens=20,
                                                                       ignore_eos=True))
    for name in ("request_id", "num_prompt_tokens", "max_tokens"):
        if not hasattr(request, name):
            broken(f"vllm.v1.request.Request.{name}", "Proxima's add_request wrapper reads it")
    s.add_request(request)
    if pool.proxima.expected_tokens != {"r": 60}:
        broken("vllm.v1.core.sched.scheduler.Scheduler.add_request",
               "Proxima's wrapper did not see the request (prompt 40 + max_tokens 20)")
    steps = 0
    while s.has_requests():
        out = s.schedule()
        steps += 1
        ids = list(out.num_scheduled_tokens)
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))
    if pool.proxima.steps != steps:
        broken("vllm.v1.core.kv_cache_manager.KVCacheManager.new_step_starts",
               f"called {pool.proxima.steps} times in {steps} scheduler steps, not once each")
    if pool.proxima.expected_tokens or pool.get_num_free_blocks() != 63:
        broken("vllm.v1.core.kv_cache_manager.KVCacheManager.free",
               "a finished request was not freed through it")
    pool.free_block_queue.buddy.check()


# ------------------------------------------------------------------------------ V0

@v0
def test_v0_block_manager_name_and_overrides(untested_allowed):
    from proxima.vllm import vllm_v0, vllm_v0_allocators as allocators

    symbol("vllm.core.block_manager.SelfAttnBlockSpaceManager")
    for cls in (allocators.ProximaNaiveBlockAllocator,
                allocators.ProximaPrefixCachingBlockAllocator,
                allocators.ProximaCpuGpuBlockAllocator, vllm_v0.ProximaBlockSpaceManager):
        check_overrides(cls, cls.__name__)
    stock_init = symbol("vllm.core.block_manager.SelfAttnBlockSpaceManager.__init__")
    if params(vllm_v0.ProximaBlockSpaceManager.__init__) != params(stock_init):
        broken("vllm.core.block_manager.SelfAttnBlockSpaceManager.__init__",
               f"its parameters are {params(stock_init)}; ProximaBlockSpaceManager "
               f"re-implements it with {params(vllm_v0.ProximaBlockSpaceManager.__init__)}")


@v0
def test_v0_scheduler_builds_the_manager_activation_installs(untested_allowed):
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.core.scheduler import Scheduler

    from proxima.vllm import vllm_v0

    vllm_v0.deactivate()
    vllm_v0.activate()
    try:
        cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9, swap_space=0,
                            cache_dtype="auto", enable_prefix_caching=True)
        cache.num_gpu_blocks, cache.num_cpu_blocks = 64, 8
        scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8,
                                              max_model_len=2048), cache, lora_config=None)
    finally:
        vllm_v0.deactivate()
    if type(scheduler.block_manager) is not vllm_v0.ProximaBlockSpaceManager:
        broken("vllm.core.scheduler.Scheduler.__init__", "it no longer builds its block "
               "manager from vllm.core.block_manager.SelfAttnBlockSpaceManager")


# ------------------------------------------------------- the checks fail when vLLM changes

def fails_naming(check, *fragments, **kwargs) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        check(**kwargs)
    message = str(info.value)
    assert message.startswith(f"vLLM {VERSION} changed "), message
    for fragment in fragments:
        assert fragment in message, message


@v1
def test_a_new_free_queue_method_is_named(monkeypatch):
    stock = symbol("vllm.v1.core.kv_cache_utils.FreeKVCacheBlockQueue")
    monkeypatch.setattr(stock, "peek", lambda self: None, raising=False)
    fails_naming(test_the_free_queue_method_set_is_the_one_proxima_implements,
                 "FreeKVCacheBlockQueue", "methods added: ['peek']")


@v1
def test_a_new_use_of_the_free_queue_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "offload.py").write_text("q = pool.free_block_queue\nq.peek_n(3)\n")
    monkeypatch.setattr(vllm, "__file__", str(fake / "__init__.py"))
    fails_naming(test_vllm_touches_a_pools_free_queue_only_through_what_proxima_has,
                 "peek_n (in vllm/offload.py)")


@v1
def test_a_changed_allocate_new_blocks_is_named(monkeypatch):
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")
    sub = sorted((c for c in _manager_classes() if c is not base),
                 key=lambda c: c.__qualname__)[0]
    monkeypatch.setattr(sub, "allocate_new_blocks",
                        lambda self, request_id, num_tokens, num_tokens_main_model, extra: [],
                        raising=False)
    fails_naming(test_allocate_new_blocks_keeps_its_positional_signature,
                 f"{sub.__qualname__}.allocate_new_blocks", "'extra'")


@v1
def test_a_changed_base_allocate_new_blocks_is_named(monkeypatch):
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")
    stock = vars(base)["allocate_new_blocks"]

    def answers_with_a_placeholder(self, request_id, num_tokens, num_tokens_main_model):
        return stock(self, request_id, num_tokens, num_tokens_main_model) or [None]

    monkeypatch.setattr(base, "allocate_new_blocks", answers_with_a_placeholder)
    fails_naming(test_allocate_new_blocks_does_nothing_for_a_request_holding_blocks_enough,
                 "SingleTypeKVCacheManager.allocate_new_blocks", "PLAIN_ALLOCATE_RELEASES")


@v1
def test_a_manager_defined_after_activation_is_named(proxima_v1, monkeypatch):
    base = symbol("vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager")

    class LateManager(base):
        def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
            return []

    known = _manager_classes()
    monkeypatch.setattr(sys.modules[__name__], "_manager_classes", lambda: known | {LateManager})
    fails_naming(test_every_manager_vllm_registers_exists_at_activation,
                 "LateManager.allocate_new_blocks", "not wrapped at activation",
                 proxima_v1=proxima_v1)


@v1
def test_an_async_scheduler_override_is_named(monkeypatch):
    async_scheduler = symbol("vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    monkeypatch.setattr(async_scheduler, "add_request", lambda self, request: None,
                        raising=False)
    fails_naming(test_the_scheduler_and_manager_methods_activation_wraps,
                 "AsyncScheduler.add_request")


@v1
def test_a_changed_reset_prefix_cache_is_named(proxima_v1, monkeypatch):
    BlockPool = symbol("vllm.v1.core.block_pool.BlockPool")
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", lambda self, keep=False: True)
    fails_naming(test_proxima_block_pool_keeps_block_pools_signatures,
                 "BlockPool.reset_prefix_cache", proxima_v1=proxima_v1)


@v0
def test_a_changed_v0_method_is_named(untested_allowed, monkeypatch):
    naive = symbol("vllm.core.block.naive_block.NaiveBlockAllocator")

    def allocate_mutable_block(self, prev_block, device=None, extra=None):
        return None

    monkeypatch.setattr(naive, "allocate_mutable_block", allocate_mutable_block)
    fails_naming(test_v0_block_manager_name_and_overrides,
                 "NaiveBlockAllocator.allocate_mutable_block", "'extra'",
                 untested_allowed=None)


# ------------------------------------------------------------------ V1: elastic worker side

#: the arguments of the KV allocation each release's hook takes (vllm_v1_compat.vmm_kv_allocation)
KV_ALLOCATION_PARAMS = {"_allocate_kv_cache": ["kv_cache_config", "shared_layers", "device"],
                        "allocate_kv_cache": ["kv_cache_config", "device", "layout",
                                              "kernel_block_sizes"]}


@v1
def test_the_kv_allocation_elastic_replaces_is_called_by_its_name():
    from proxima.vllm import vllm_v1_compat

    site = vllm_v1_compat.kv_allocation()
    if site is None:
        broken("vllm.v1.worker.gpu.attn_utils._allocate_kv_cache / allocate_kv_cache",
               "neither is there: elastic KV replaces the V2 runner's KV allocation")
    owner, name = site
    where = f"{owner.__name__}.{name}"
    if params(getattr(owner, name)) != KV_ALLOCATION_PARAMS[name]:
        broken(where, f"its parameters are {params(getattr(owner, name))}; Proxima's "
                      f"replacement takes {KV_ALLOCATION_PARAMS[name]}")
    caller = inspect.getsource(symbol(f"{owner.__name__}.init_kv_cache"))
    if f"{name}(" not in caller:
        broken(f"{owner.__name__}.init_kv_cache", f"it no longer calls {name} by that name, so "
                                                  "replacing the module's attribute has no effect")


@v1
def test_the_runner_updates_block_tables_before_it_applies_their_writes():
    execute = inspect.getsource(
        symbol("vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model"))
    update = execute.find("self.update_requests(")
    apply = execute.find("self.block_tables.apply_staged_writes(")
    if update < 0 or apply < update:
        broken("vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model",
               "KV compaction's hook wraps update_requests and needs it called before "
               "block_tables.apply_staged_writes and the forward")


@v1
def test_the_elastic_connector_keeps_the_connector_api_s_signatures():
    from proxima.vllm.elastic_connector import ProximaElasticConnector

    check_overrides(ProximaElasticConnector, "ProximaElasticConnector")


@v1
def test_the_warm_up_writes_the_blocks_elastic_kv_maps_at_start_up():
    """Elastic KV maps at start-up the block ids vLLM's warm-up writes, counted by
    ``elastic_v1.warmup_blocks`` from ``vllm_v1_compat.warmup_request_tokens``: each warm-up
    request's tokens as 0.26 (one decode step) or 0.33 (up to 3 or 5, and the drafter's
    lookahead slots) computes them. A warm-up writing more would write unmapped memory."""
    from vllm.config import VllmConfig

    source = inspect.getsource(symbol("vllm.v1.worker.gpu.warmup"))
    needed = ["prompt_len = decode_query_len + 1", "next_block_id = 1"]
    if hasattr(VllmConfig, "num_lookahead_tokens"):          # 0.33
        needed += ["num_decode_steps = 5 if num_spec_steps > 0 else 3",
                   "decode_len = prompt_len + num_decode_steps * decode_query_len",
                   "num_tokens = min(num_tokens + num_lookahead_tokens, max_model_len)"]
    else:
        needed += ["decode_len = prompt_len + decode_query_len"]
    missing = [line for line in needed if line not in source]
    if missing:
        broken("vllm.v1.worker.gpu.warmup.warmup_kernels",
               f"it no longer has {missing}: the block ids its requests write are not what "
               f"proxima.vllm.vllm_v1_compat.warmup_request_tokens counts")
