"""GPU and host memory around vLLM's sleep, set up while a model that sleeps starts
(proxima/vllm/sleep_memory.py): one host tensor of each ``weights`` allocation's size, all
held at once as vLLM's sleep holds them, then freed into torch's cache; and torch's GPU
cache kept across the sleep. The allocators here are stand-ins (CuMemAllocator needs CUDA),
with vLLM's own AllocationData; the pinning's effect on the first sleep is checked on a GPU
(tests/gpu/test_serve_multi_gpu.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from proxima.vllm import sleep_memory

AllocationData = pytest.importorskip("vllm.device_allocator").AllocationData


class Pool:
    """What sleep_memory reads of vLLM's allocator: pointer -> AllocationData."""

    def __init__(self, *allocations: tuple[str, int]):
        self.pointer_to_data = {0x1000 * (i + 1): AllocationData(
            handle=(0, size, 0x1000 * (i + 1), i), tag=tag)
            for i, (tag, size) in enumerate(allocations)}


class HostTensor:
    pass


def test_one_host_tensor_per_weights_allocation_all_held_at_once_then_freed():
    pool = Pool(("weights", 3 << 20), ("kv_cache", 64 << 20), ("weights", 5 << 20),
                ("weights", 3 << 20))
    made: list[tuple[int, weakref.ref]] = []
    alive_at_most = 0

    def empty(size: int):
        nonlocal alive_at_most
        tensor = HostTensor()
        made.append((size, weakref.ref(tensor)))
        alive_at_most = max(alive_at_most, sum(r() is not None for _, r in made))
        return tensor

    seconds = sleep_memory.pin_sizes(sleep_memory.weights_sizes(pool), empty)
    gc.collect()
    assert [size for size, _ in made] == [3 << 20, 5 << 20, 3 << 20]   # weights only
    assert seconds >= 0
    assert alive_at_most == 3                   # held together, as the sleep holds them
    assert all(ref() is None for _, ref in made)   # and given back to the cache


def test_nothing_is_pinned_or_wrapped_where_vllms_sleep_allocator_is_absent():
    """Without CUDA vLLM has no sleep-mode allocator: pin_for_sleep and
    keep_cache_across_sleep raise (the connector logs it: vLLM's sleep as it is) and take
    no host memory."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_serve_multi_gpu.py checks the pinning")
    for set_up in (sleep_memory.pin_for_sleep, sleep_memory.keep_cache_across_sleep):
        with pytest.raises(RuntimeError, match="[Ss]leep mode allocator is not available"):
            set_up()


@pytest.mark.parametrize("allocations", [(("kv_cache", 1 << 20),), ()])
def test_no_weights_no_sizes(allocations):
    assert sleep_memory.weights_sizes(Pool(*allocations)) == []   # no weights: nothing to copy


def test_the_sizes_are_the_ones_vllms_sleep_copies():
    pool = Pool(("weights", 7), ("weights", 9), ("other", 11))
    assert sleep_memory.weights_sizes(pool) == [7, 9]


def test_vllms_sleep_empties_torchs_cache_as_keep_cache_across_sleep_expects():
    """The vLLM difference keep_cache_across_sleep answers: CuMemAllocator's sleep ends by
    emptying torch's GPU cache (looked up on torch.cuda, or on 0.33 torch.accelerator, at
    call time)."""
    import ast
    import importlib.util
    from pathlib import Path

    # its module loads libcuda, so it is read, not imported
    tree = ast.parse(Path(importlib.util.find_spec("vllm.device_allocator.cumem").origin)
                     .read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CuMemAllocator")
    sleep = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sleep")
    body = ast.unparse(sleep)
    assert "torch.cuda.empty_cache()" in body or "torch.accelerator.empty_cache()" in body


class SleepingAllocator:
    """What keep_cache_across_sleep wraps of vLLM's CuMemAllocator (which needs CUDA): a
    sleep that ends as vLLM's does, with torch.cuda.empty_cache()."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def sleep(self, offload_tags=None):
        import torch

        torch.cuda.empty_cache()
        if self.fail:
            raise RuntimeError("the copy failed")
        return offload_tags


def test_the_sleep_keeps_torchs_gpu_cache_and_nothing_else_does(monkeypatch):
    torch = pytest.importorskip("torch")
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    sleep = sleep_memory.keeping_cache(SleepingAllocator().sleep)
    assert sleep(offload_tags=("weights",)) == ("weights",)
    assert emptied == []                        # the sleep left the cache as it was
    torch.cuda.empty_cache()
    assert emptied == [1]                       # and empty_cache is torch's again after it
    assert sleep_memory.keeping_cache(sleep) is sleep     # wrapped once


def test_the_accelerator_spelling_is_kept_too(monkeypatch):
    torch = pytest.importorskip("torch")
    if not hasattr(getattr(torch, "accelerator", None), "empty_cache"):
        pytest.skip("this torch has no torch.accelerator.empty_cache")
    emptied = []
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: emptied.append(1))

    class Allocator033:                         # vLLM 0.33's sleep ends so
        def sleep(self, offload_tags=None):
            torch.accelerator.empty_cache()

    sleep_memory.keeping_cache(Allocator033().sleep)()
    assert emptied == []
    torch.accelerator.empty_cache()
    assert emptied == [1]


def test_a_failed_sleep_gives_empty_cache_back(monkeypatch):
    torch = pytest.importorskip("torch")
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    sleep = sleep_memory.keeping_cache(SleepingAllocator(fail=True).sleep)
    with pytest.raises(RuntimeError, match="the copy failed"):
        sleep(offload_tags=("weights",))
    torch.cuda.empty_cache()
    assert emptied == [1]
