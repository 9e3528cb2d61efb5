"""Host memory for vLLM's sleep, pinned while a model that sleeps starts
(proxima/vllm/sleep_pin.py): one host tensor of each ``weights`` allocation's size, all
held at once as vLLM's sleep holds them, then freed into torch's cache. The allocator here
is a stand-in holding vLLM's own AllocationData (CuMemAllocator needs CUDA); the pinning's
effect on the first sleep is checked on a GPU (tests/gpu/test_serve_multi_gpu.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from proxima.vllm import sleep_pin

AllocationData = pytest.importorskip("vllm.device_allocator").AllocationData


class Pool:
    """What sleep_pin reads of vLLM's allocator: pointer -> AllocationData."""

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

    seconds = sleep_pin.pin_sizes(sleep_pin.weights_sizes(pool), empty)
    gc.collect()
    assert [size for size, _ in made] == [3 << 20, 5 << 20, 3 << 20]   # weights only
    assert seconds >= 0
    assert alive_at_most == 3                   # held together, as the sleep holds them
    assert all(ref() is None for _, ref in made)   # and given back to the cache


def test_nothing_is_pinned_where_vllms_sleep_allocator_is_absent():
    """Without CUDA vLLM has no sleep-mode allocator: pin_for_sleep raises (the connector
    logs it and the first sleep pins, as before) and takes no host memory."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/test_serve_multi_gpu.py checks the pinning")
    with pytest.raises(RuntimeError, match="[Ss]leep mode allocator is not available"):
        sleep_pin.pin_for_sleep()


@pytest.mark.parametrize("allocations", [(("kv_cache", 1 << 20),), ()])
def test_no_weights_no_sizes(allocations):
    assert sleep_pin.weights_sizes(Pool(*allocations)) == []   # no weights: nothing to copy


def test_the_sizes_are_the_ones_vllms_sleep_copies():
    pool = Pool(("weights", 7), ("weights", 9), ("other", 11))
    assert sleep_pin.weights_sizes(pool) == [7, 9]
