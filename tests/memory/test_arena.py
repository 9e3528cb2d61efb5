"""VmmArena and KvMemory bookkeeping against a CPU stand-in for the driver (the real
driver needs a GPU: tests/gpu/test_memory_gpu.py runs the same paths on the H200)."""

import pytest

from proxima.memory.arena import VmmArena
from proxima.memory.errors import CannotGrow, VmmError
from proxima.memory.kv import KvMemory
from proxima.memory.ops import Op
from tests.memory.fake_driver import MiB, FakeDriver


def arena(units=8, unit_bytes=(2 * MiB, 4 * MiB), **kw):
    driver = FakeDriver(**kw)
    return VmmArena(list(unit_bytes), units, driver=driver), driver


def test_regions_are_laid_out_back_to_back_and_units_address_every_region():
    a, d = arena()
    assert a.reserved_bytes == 8 * 6 * MiB and d.reservations == {a.base: a.reserved_bytes}
    assert a.region_base == (a.base, a.base + 16 * MiB)
    assert a.unit_address(1, 3) == a.base + 16 * MiB + 3 * 4 * MiB
    assert a.mapped_units == 0 and d.mapped_bytes() == 0


def test_map_backs_every_region_of_each_unit_and_zero_fills_runs():
    a, d = arena()
    result = a.map(2, 5, stream=7)
    assert result.ok and result.mapped == 3 and a.mapped_units == 3
    assert d.mapped_bytes() == 3 * 6 * MiB == a.mapped_bytes
    assert a.mapped_ranges() == [range(2, 5)]
    zeros = [e for e in d.log if e[0] == "zero"]
    # one zero-fill per region over the whole run of fresh units, on the caller's stream
    assert zeros == [("zero", a.unit_address(0, 2), 3 * 2 * MiB, 7),
                     ("zero", a.unit_address(1, 2), 3 * 4 * MiB, 7)]


def test_map_and_unmap_are_idempotent():
    a, d = arena()
    a.map(0, 4)
    assert a.map(1, 3).mapped == 0 and d.mapped_bytes() == 4 * 6 * MiB
    assert a.unmap(2, 6) == 2 and a.unmap(2, 6) == 0
    assert a.mapped_ranges() == [range(0, 2)]


def test_unmap_synchronises_the_device_first_and_returns_the_memory():
    a, d = arena()
    a.map(0, 4)
    d.log.clear()
    a.unmap(1, 3)
    assert d.log[0] == ("sync",) and [e[0] for e in d.log[1:]] == ["unmap", "release"] * 4
    assert d.used == 2 * 6 * MiB
    d.log.clear()
    a.unmap(0, 1, sync=False)
    assert ("sync",) not in d.log


def test_out_of_memory_is_a_result_and_a_unit_is_all_or_nothing():
    # room for 2 units and the first region of a third: that third unit must roll back
    a, d = arena(capacity=2 * 6 * MiB + 2 * MiB)
    result = a.map(0, 5)
    assert not result.ok and result.mapped == 2 and result.failed == range(2, 5)
    assert a.mapped_ranges() == [range(0, 2)]
    assert d.used == 2 * 6 * MiB and d.mapped_bytes() == 2 * 6 * MiB   # nothing half-mapped
    a.unmap(1, 2)                       # memory comes back: growth succeeds again
    assert a.map(1, 2).ok and a.mapped_ranges() == [range(0, 2)]


def test_close_unmaps_everything_and_frees_the_addresses():
    a, d = arena()
    a.map(0, 8)
    a.close()
    assert d.reservations == {} and d.mappings == {} and d.used == 0
    a.close()                           # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        a.map(0, 1)


def test_unit_sizes_must_be_whole_granules_and_ranges_inside():
    with pytest.raises(ValueError, match="granularity"):
        VmmArena([3 * MiB], 4, driver=FakeDriver())
    a, _ = arena()
    with pytest.raises(IndexError):
        a.map(7, 9)


def test_kv_memory_granule_is_derived_from_the_page_size():
    # Llama-3.1-8B's page: 16 tokens x 8 KV heads x 2 x 128 x bf16 = 64 KiB -> 32 blocks
    page = 16 * 8 * 2 * 128 * 2
    mem = KvMemory([page * 1000] * 3, 1000, driver=FakeDriver())
    assert mem.granule_blocks == 32 and mem.num_granules == 32      # 1000 blocks -> 32
    assert mem.bytes_per_granule == 3 * 2 * MiB
    assert mem.mapped_granules == 32                                 # all, as stock would
    # a page that does not divide 2 MiB: the granule is the lcm, whole granules per region
    odd = KvMemory([24 * 1024 * 100], 100, driver=FakeDriver())
    assert odd.granule_blocks == 256 and odd.arena.unit_bytes == (256 * 24 * 1024,)


def test_kv_memory_applies_ops_in_order_and_reports_what_could_not_grow():
    page = 64 * 1024
    driver = FakeDriver(capacity=6 * 2 * 2 * MiB)        # 6 granules of 2 regions
    mem = KvMemory([page * 320] * 2, 320, driver=driver, mapped=4)
    assert mem.num_granules == 10 and mem.mapped_granules == 4
    failed = mem.apply([Op.unmap(2, 2), Op.map(4, 6)])
    assert failed == [(8, 2)]                            # 2 + 6 fit, granules 8, 9 do not
    assert mem.arena.mapped_ranges() == [range(0, 2), range(4, 8)]
    assert mem.stats["map_failures"] == 2 and mem.stats["granules_unmapped"] == 2
    with pytest.raises(ValueError, match="null block"):
        mem.apply([Op.unmap(0, 1)])


def test_a_map_leaves_the_memory_kept_free_for_the_forward_and_reports_the_rest():
    # H100, 2026-12-05: a grow took the GPU's last free bytes and the next forward's
    # activations failed with out-of-memory. A map now stops where keep_free_bytes would
    # no longer be free; what it did not map is reported as a failed grow.
    page, granule = 64 * 1024, 2 * 2 * MiB                  # 2 regions of 2 MiB a granule
    driver = FakeDriver(capacity=10 * granule)
    mem = KvMemory([page * 320] * 2, 320, driver=driver, mapped=2,
                   keep_free_bytes=3 * granule + 1)       # warm-up's 2 are not held to it
    assert mem.apply([Op.map(2, 8)]) == [(6, 4)]          # 10 - 2 - 3.x: room for 4
    assert mem.mapped_granules == 6 and mem.stats["map_failures"] == 4
    assert driver.mem_info()[0] >= 3 * granule + 1
    assert mem.apply([Op.map(6, 2)]) == [(6, 2)]          # no room: nothing mapped
    mem.apply([Op.unmap(4, 2)])
    # 4 mapped, room for 2 more: granule 3 (mapped) takes none, 4 and 5 fit, 6 does not
    assert mem.apply([Op.map(3, 4)]) == [(6, 1)]
    assert mem.arena.mapped_ranges() == [range(0, 6)]
    free = KvMemory([page * 320] * 2, 320, driver=FakeDriver(capacity=10 * granule),
                    mapped=2)                             # 0: until the driver refuses
    assert free.apply([Op.map(2, 8)]) == [] and free.mapped_granules == 10


def test_kv_memory_that_cannot_start_says_so():
    with pytest.raises(CannotGrow, match="initial KV cache"):
        KvMemory([64 * 1024 * 320], 320, driver=FakeDriver(capacity=4 * MiB))


def test_access_is_granted_per_run_and_per_page_where_the_driver_refuses_a_run():
    class OnePerAllocation(FakeDriver):
        def set_access(self, ptr, size):
            if ptr in self.mappings and self.mappings[ptr][0] != size:
                raise VmmError("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE")
            super().set_access(ptr, size)

    for driver, grants in ((FakeDriver(), 2), (OnePerAllocation(), 8)):
        arena = VmmArena([2 * MiB, 2 * MiB], 8, driver=driver)
        arena.map(1, 5)                              # 4 units x 2 regions
        assert sum(1 for e in driver.log if e[0] == "access") == grants
        assert all(p in driver.accessible for p in driver.mappings)
        arena.close()
