"""The one patch registry (proxima.vllm.patches) on vLLM's real classes: every patch
set Proxima has, applied and undone, leaves each attribute it touched the identical object
it was before (or absent again), and nothing else of those classes changed."""

from __future__ import annotations

import pytest

from proxima.vllm import activation, compaction_worker, elastic_v1, observe_v1, patches, vllm_v1


def _targets():
    """Every module and class a patch set may touch (the snapshot is taken of these)."""
    import vllm.engine.arg_utils as arg_utils
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.sched.scheduler as scheduler
    import vllm.v1.core.single_type_kv_cache_manager as managers
    import vllm.v1.engine.core as core
    import vllm.v1.worker.gpu.attn_utils as attn_utils
    import vllm.v1.worker.gpu.model_runner as model_runner

    base = managers.SingleTypeKVCacheManager
    subclasses, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        subclasses.append(cls)
        todo += cls.__subclasses__()
    return [coordinator, attn_utils, scheduler.Scheduler, kv_cache_manager.KVCacheManager,
            base, *subclasses, arg_utils.EngineArgs, core.EngineCore,
            model_runner.GPUModelRunner]


def _apply_every_set(observe: bool) -> None:
    if observe:
        observe_v1.activate()
        return
    vllm_v1.activate()
    if elastic_v1.unsupported_reason() is None:         # vLLM 0.26: the elastic hooks too
        elastic_v1.activate()
        elastic_v1.install_allocation_hook(elastic_v1.ElasticOptions())
    compaction_worker.install_worker_hook()


def _undo_every_set() -> None:
    compaction_worker.uninstall_worker_hook()
    elastic_v1.deactivate()
    vllm_v1.deactivate()
    observe_v1.deactivate()


@pytest.mark.parametrize("observe", [False, True], ids=["proxima", "observer"])
def test_deactivate_restores_every_patched_attribute_to_the_identical_object(observe):
    targets = _targets()
    before = {id(t): dict(vars(t)) for t in targets}
    assert patches.applied() == []
    try:
        _apply_every_set(observe)
        done = patches.applied()
        touched = {(id(a.patch.target), a.patch.attribute) for a in done}
        assert len(touched) == len(done)             # no attribute patched twice
        wanted = ({"new_step_starts", "free"} if observe else
                  {"BlockPool", "add_request", "free", "new_step_starts", "allocate_new_blocks",
                   "update_requests"})
        assert wanted <= {a.patch.attribute for a in done}
        for a in done:
            target, name = a.patch.target, a.patch.attribute
            assert id(target) in before, f"{target!r} is not in the test's list of targets"
            assert a.original is before[id(target)].get(name, patches.ABSENT)
            assert patches.own(target, name) is a.patch.replacement is not a.original
    finally:
        _undo_every_set()
    assert patches.applied() == []
    for a in done:
        target, name = a.patch.target, a.patch.attribute
        assert patches.own(target, name) is before[id(target)].get(name, patches.ABSENT), (
            f"{getattr(target, '__name__', target)}.{name} is not the object it was")
    for t in targets:
        if isinstance(t, type):                      # a class: not one attribute more or less
            assert vars(t).keys() == before[id(t)].keys(), t


def test_the_utility_method_vllm_lacks_is_removed_again():
    from vllm.v1.engine.core import EngineCore

    if elastic_v1.unsupported_reason() is not None:
        pytest.skip("elastic KV runs on vLLM 0.26 only")
    assert not hasattr(EngineCore, elastic_v1.UTILITY)
    elastic_v1.activate()
    try:
        assert EngineCore.__dict__[elastic_v1.UTILITY] is elastic_v1.engine_core_proxima_kv
    finally:
        elastic_v1.deactivate()
    assert not hasattr(EngineCore, elastic_v1.UTILITY)


def test_the_version_gate_refuses_before_anything_is_built(monkeypatch):
    import vllm

    built = []
    monkeypatch.setattr(vllm, "__version__", "0.27.1")
    monkeypatch.delenv(activation.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(activation.ActivationError, match="not a version Proxima was tested"):
        patches.apply(patches.PatchSet("probe", "v1", lambda: built.append(1) or []))
    with pytest.raises(activation.ActivationError, match="runs the V1 engine"):
        patches.apply(patches.PatchSet("probe", "v0", lambda: built.append(1) or []))
    assert built == [] and not patches.is_applied("probe")


def test_swapped_puts_back_the_identical_object_or_none():
    class Owner:
        kept = object()

    class Child(Owner):
        pass

    kept = Owner.kept
    with patches.swapped(Owner, "kept", 1):
        assert Owner.kept == 1
    assert Owner.kept is kept
    with patches.swapped(Child, "kept", 2):            # inherited: absent from Child itself
        assert Child.kept == 2
    assert "kept" not in vars(Child) and Child.kept is kept
