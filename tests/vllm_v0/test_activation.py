"""Activation of Proxima on vLLM 0.6.x (V0): the flag, the version check, the log line,
the entry point, and that the block manager is a faithful copy of vLLM's."""

from __future__ import annotations

import pytest

from tests.vllm_v0.helpers import card_stack_or_skip, make_manager

card_stack_or_skip()

import vllm  # noqa: E402
import vllm.core.block_manager as block_manager  # noqa: E402
from vllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from vllm.core.scheduler import Scheduler  # noqa: E402

from proxima.vllm.activation import ActivationError  # noqa: E402

STOCK = block_manager.SelfAttnBlockSpaceManager


def build_scheduler(num_blocks: int = 128, block_size: int = 16) -> Scheduler:
    """What LLMEngine does once the GPU has been profiled."""
    cache = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, swap_space=0,
                        cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks, cache.num_cpu_blocks = num_blocks, 16
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=2048)
    return Scheduler(sched, cache, lora_config=None)


def test_tested_version_is_the_pinned_one():
    from proxima.vllm import activation

    entry = activation.tested(vllm.__version__)
    assert entry is not None and entry.engine == "v0"


@pytest.mark.parametrize("value", [None, "", "0"])
def test_flag_off_is_stock(clean_activation, monkeypatch, value):
    from proxima.vllm.plugin import register

    if value is not None:
        monkeypatch.setenv("PROXIMA_ALLOCATOR", value)
    register()
    assert not clean_activation.is_active()
    assert block_manager.SelfAttnBlockSpaceManager is STOCK
    assert type(build_scheduler().block_manager) is STOCK


def test_flag_on_installs_and_logs_once_per_scheduler(clean_activation, monkeypatch,
                                                      proxima_log):
    from proxima.vllm.plugin import register

    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    register()
    register()                                          # plugins load several times
    clean_activation.activate()                         # and activate() is idempotent
    assert clean_activation.is_active()
    scheduler = build_scheduler(num_blocks=321, block_size=32)
    assert type(scheduler.block_manager) is clean_activation.ProximaBlockSpaceManager
    lines = [r.getMessage() for r in proxima_log if "Using Proxima" in r.getMessage()]
    assert lines == ["Using Proxima contiguous allocator: 321 GPU blocks, block size 32 "
                     f"(vLLM {vllm.__version__}, V0 block manager, prefix caching on)"]
    clean_activation.deactivate()
    assert not clean_activation.is_active()
    assert block_manager.SelfAttnBlockSpaceManager is STOCK
    assert type(build_scheduler().block_manager) is STOCK


@pytest.mark.parametrize("value", ["true", "2", "yes", "on"])
def test_other_flag_values_are_an_error(clean_activation, monkeypatch, value):
    from proxima.vllm.plugin import register

    monkeypatch.setenv("PROXIMA_ALLOCATOR", value)
    with pytest.raises(SystemExit, match="PROXIMA_ALLOCATOR must be 1"):
        register()
    assert block_manager.SelfAttnBlockSpaceManager is STOCK


def test_untested_version_is_refused(clean_activation, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.6.2")
    with pytest.raises(ActivationError, match=r"vLLM 0\.6\.2 .*0\.6\.3\.post1"):
        clean_activation.activate()
    with pytest.raises(ActivationError, match=r"vLLM 0\.6\.2"):
        with clean_activation.block_manager_class(True):     # the replay's way in
            pass
    assert block_manager.SelfAttnBlockSpaceManager is STOCK


def test_untested_version_allowed_with_a_warning(clean_activation, monkeypatch, proxima_log):
    from proxima.vllm import activation

    monkeypatch.setenv("PROXIMA_ALLOW_UNTESTED_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.6.2")
    monkeypatch.setattr(activation, "_warned", set())
    clean_activation.activate()
    assert block_manager.SelfAttnBlockSpaceManager is clean_activation.ProximaBlockSpaceManager
    warnings = [r.getMessage() for r in proxima_log if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "vLLM 0.6.2" in warnings[0]
    assert "PROXIMA_ALLOW_UNTESTED_VLLM=1" in warnings[0]


def test_a_v1_vllm_is_refused_by_the_v0_adapter(clean_activation, monkeypatch):
    monkeypatch.setenv("PROXIMA_ALLOW_UNTESTED_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.26.0")
    with pytest.raises(ActivationError, match="runs the V1 engine"):
        clean_activation.activate()
    assert not clean_activation.is_active()


def test_entry_point_activates_through_vllms_plugin_loader(clean_activation, monkeypatch):
    """vLLM 0.6.3 loads `vllm.general_plugins` in EngineArgs and in the engine process."""
    from importlib.metadata import entry_points
    if not [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "proxima"]:
        pytest.skip("proxima is not installed with its entry point (pip install -e .)")
    pytest.importorskip("proxima.vllm.plugin")
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    assert block_manager.SelfAttnBlockSpaceManager is STOCK      # flag unset: nothing
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "1")
    load_general_plugins()
    assert type(build_scheduler().block_manager) is clean_activation.ProximaBlockSpaceManager


def test_a_refusal_stops_vllm_06_although_its_loader_swallows_exceptions(clean_activation,
                                                                          monkeypatch):
    """vLLM 0.6.3's load_general_plugins logs and swallows any Exception a plugin raises;
    Proxima's refusal is a SystemExit, so a bad flag stops vLLM instead of silently
    leaving stock vLLM running."""
    from importlib.metadata import entry_points
    if not [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "proxima"]:
        pytest.skip("proxima is not installed with its entry point (pip install -e .)")
    from vllm.plugins import load_general_plugins
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "bogus")
    with pytest.raises(SystemExit, match="PROXIMA_ALLOCATOR must be 1"):
        load_general_plugins()
    assert block_manager.SelfAttnBlockSpaceManager is STOCK


@pytest.mark.parametrize("caching", [True, False])
def test_manager_has_every_attribute_of_vllms(caching):
    """ProximaBlockSpaceManager re-implements vLLM 0.6.3.post1's __init__ (to build its
    own allocator): every attribute vLLM's sets must be there, with equal plain values."""
    stock = make_manager(False, 100, enable_caching=caching)
    ours = make_manager(True, 100, enable_caching=caching)
    assert set(vars(stock)) <= set(vars(ours))
    for name, value in vars(stock).items():
        if isinstance(value, (int, float, bool, str, type(None), dict)):
            assert vars(ours)[name] == value, name


def test_sliding_window_matches_stock():
    """With a sliding window (none of the managers above has one) every plain attribute is
    stock's, the window's block count included: 100 // 16 + 1 blocks, plus one."""
    stock = STOCK(block_size=16, num_gpu_blocks=64, num_cpu_blocks=8, sliding_window=100)
    from proxima.vllm.vllm_v0 import ProximaBlockSpaceManager
    ours = ProximaBlockSpaceManager(block_size=16, num_gpu_blocks=64, num_cpu_blocks=8,
                                    sliding_window=100)
    assert ours.max_block_sliding_window == stock.max_block_sliding_window == 8
    for name, value in vars(stock).items():
        if isinstance(value, (int, float, bool, str, type(None), dict)):
            assert vars(ours)[name] == value, name


def test_status_file(clean_activation, monkeypatch, tmp_path):
    import json
    path = tmp_path / "status.json"
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(path))
    make_manager(True, 100)
    status = json.loads(path.read_text())
    assert status["active"] and status["engine"] == "vllm-v0"
    assert status["num_blocks"] == 100 and status["allocator"]["num_free"] == 100
    # the pool's invariants are checked when it is created (proxima serve's self-check reads it)
    assert status["invariants_ok"] is True and "invariants_error" not in status


def test_status_carries_a_live_invariant_verdict(clean_activation, monkeypatch, tmp_path):
    import json

    from proxima.allocator.free_runs import ALLOCATED, FREE
    from proxima.vllm import status as status_mod

    path = tmp_path / "status.json"
    monkeypatch.setenv("PROXIMA_STATS_FILE", str(path))
    monkeypatch.setattr(status_mod, "INVARIANTS_INTERVAL_S", 0.0)
    manager = make_manager(True, 100)
    buddy = manager.gpu_allocator.buddy
    free_id = next(i for i in range(100) if buddy._state[i] == FREE)
    buddy._state[free_id] = ALLOCATED          # broken behind the allocator's back
    manager._maybe_write_status(force=True)
    status = json.loads(path.read_text())
    assert status["invariants_ok"] is False and "num_free" in status["invariants_error"]
