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

    pinned, seconds = sleep_pin.pin_for_sleep(pool, pin=True, empty=empty)
    gc.collect()
    assert [size for size, _ in made] == [3 << 20, 5 << 20, 3 << 20]   # weights only
    assert pinned == 11 << 20 and seconds >= 0
    assert alive_at_most == 3                   # held together, as the sleep holds them
    assert all(ref() is None for _, ref in made)   # and given back to the cache


@pytest.mark.parametrize("pin, allocations", [
    (False, (("weights", 1 << 20),)),          # no pinned memory here (vLLM's PIN_MEMORY)
    (True, (("kv_cache", 1 << 20),)),          # no weights in the pool: nothing to copy
    (True, ()),
])
def test_nothing_is_taken_where_a_sleep_would_not_pin(pin, allocations):
    def empty(size: int):
        raise AssertionError("no host memory should be taken")

    assert sleep_pin.pin_for_sleep(Pool(*allocations), pin=pin, empty=empty) == (0, 0.0)


def test_the_sizes_are_the_ones_vllms_sleep_copies():
    pool = Pool(("weights", 7), ("weights", 9), ("other", 11))
    assert sleep_pin.weights_sizes(pool) == [7, 9]
