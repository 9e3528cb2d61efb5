"""Maps and unmaps on the worker's mapping thread (proxima.memory.background), on the CPU
stand-in driver: ops land in order, a batch is reported only once its memory is mapped
and zero-filled, unmaps wait for the device, moves stay on the caller's thread."""

import threading

import pytest

from proxima.memory.background import BackgroundOps
from proxima.memory.kv import KvMemory
from proxima.memory.ops import Op
from tests.memory.fake_driver import MiB, FakeDriver


class GatedDriver(FakeDriver):
    """Creating memory waits until the test opens the gate: a map still in progress."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.threads = set()

    def create(self, size):
        self.threads.add(threading.current_thread().name)
        assert self.gate.wait(5)
        return super().create(size)


def memory(driver, mapped=2):
    # 8 granules of 32 blocks over two regions of 2 MiB a granule
    return KvMemory([8 * 2 * MiB] * 2, 256, granule_bytes=2 * MiB, driver=driver,
                    mapped=mapped)


def test_a_map_is_reported_only_after_its_memory_is_mapped_and_zero_filled():
    driver = GatedDriver()
    mem = memory(driver)
    driver.threads.clear()                          # the start-up maps ran here
    bg = BackgroundOps(mem)
    driver.gate.clear()
    bg.submit(7, (Op.map(2, 3),), stream=5)
    assert bg.busy and bg.poll() == []              # the caller did not wait
    assert not mem.arena.is_mapped(2)
    driver.gate.set()
    assert bg.drain(5)
    assert bg.poll() == [(7, ())] and bg.poll() == []
    assert all(mem.arena.is_mapped(g) for g in (2, 3, 4)) and mem.mapped_granules == 5
    assert driver.threads == {"proxima-kv-mapper"}
    log = driver.log
    zeros = [e for e in log if e[0] == "zero"]
    stream = zeros[-1][3]
    assert stream not in (0, 5)                     # the thread's own stream, not the forward's
    assert log.index(("stream_sync", stream)) > log.index(zeros[-1])
    # one access grant per region for the run of three granules, not one per page
    assert [e[2] for e in log if e[0] == "access"][-2:] == [3 * 2 * MiB] * 2
    bg.close()


def test_batches_land_in_order_and_moves_run_at_once_on_the_callers_stream():
    driver = GatedDriver()
    mem = memory(driver, mapped=8)
    bg = BackgroundOps(mem)
    moved = []
    driver.gate.clear()
    bg.submit(1, (Op.unmap(6, 2),))
    bg.submit(2, (Op.map(6, 1),))
    bg.submit(3, (Op.move(10, 40, 4),), mover=lambda *a: moved.append(
        (threading.current_thread().name, a)))
    assert moved == [("MainThread", (10, 40, 4))]     # not behind the queued maps
    assert bg.poll() == [(3, ())]                      # a batch of moves only: done now
    driver.gate.set()
    assert bg.drain(5)
    assert bg.poll() == [(1, ()), (2, ())]
    assert mem.arena.is_mapped(6) and not mem.arena.is_mapped(7)
    log = driver.log
    first_unmap = next(i for i, e in enumerate(log) if e[0] == "unmap")
    assert ("sync",) in log[:first_unmap]              # waited for the device first
    bg.close()


def test_a_map_the_gpu_cannot_back_is_reported_failed_and_a_driver_error_is_raised_later():
    driver = FakeDriver(capacity=3 * 2 * 2 * MiB)      # the pool's first three granules
    mem = memory(driver)
    bg = BackgroundOps(mem)
    bg.submit(0, (Op.map(2, 3),))
    assert bg.drain(5)
    assert bg.poll() == [(0, ((3, 2),))]               # granule 2 mapped, 3-4 could not be
    assert mem.mapped_granules == 3

    def broken(ptr, size, handle):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    driver.map = broken
    driver.capacity = 1 << 40
    bg.submit(1, (Op.map(5, 1),))
    bg.drain(5)
    with pytest.raises(RuntimeError, match="mapping KV memory in the background failed: "
                                           "CUDA_ERROR_ILLEGAL_ADDRESS"):
        bg.poll()
    bg.close()


class CountedDriver(FakeDriver):
    """Creates memory for the first ``allowed`` pages, then waits for the gate."""

    def __init__(self, allowed, **kw):
        super().__init__(**kw)
        self.allowed = allowed
        self.gate = threading.Event()

    def create(self, size):
        if self.allowed <= 0:
            assert self.gate.wait(5)
        self.allowed -= 1
        return super().create(size)


def test_a_steps_lead_maps_are_mapped_first_and_waited_for_alone():
    """The scheduler handed out blocks of granule 2 while its map was in flight (issue 33:
    admit against maps in flight): the step waits for that lead op only, not for the
    rest of the batch, which the thread maps afterwards."""
    driver = CountedDriver(allowed=10**6)
    mem = memory(driver)
    bg = BackgroundOps(mem)
    driver.allowed = 2                  # granule 2 of both regions, then the gate
    bg.submit(4, (Op.map(2, 1), Op.map(3, 3)), lead=1)
    assert bg.wait_lead(4, timeout=5)
    assert mem.arena.is_mapped(2) and not mem.arena.is_mapped(3)
    assert bg.busy and bg.poll() == []          # the batch is reported only when done
    driver.gate.set()
    assert bg.drain(5)
    assert bg.poll() == [(4, ())]
    assert all(mem.arena.is_mapped(g) for g in (2, 3, 4, 5))
    bg.close()
