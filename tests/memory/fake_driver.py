"""A CPU stand-in for the CUDA driver's virtual memory calls (the real driver needs a GPU).

It enforces the rules the driver enforces and that the arena's bookkeeping must respect:
mappings lie inside a reservation, aligned to the granularity, never overlap, are unmapped
whole; physical memory is limited (``capacity`` bytes, then CUDA_ERROR_OUT_OF_MEMORY);
access and zero-fill need mapped memory; addresses are freed only when nothing is mapped.
``log`` records the calls in order (to check, for example, synchronise-before-unmap).
"""

from __future__ import annotations

from proxima.memory.errors import CannotGrow, VmmError

MiB = 1 << 20


def _invalid(call: str, detail: str) -> VmmError:
    return VmmError(call, 1, "CUDA_ERROR_INVALID_VALUE", detail)


class FakeDriver:
    def __init__(self, capacity: int = 1 << 40, granularity: int = 2 * MiB) -> None:
        self.capacity = capacity
        self.gran = granularity
        self.used = 0
        self.reservations: dict[int, int] = {}      # base -> size
        self.handles: dict[int, int] = {}           # handle -> size (live allocations)
        self.mappings: dict[int, tuple[int, int]] = {}   # ptr -> (size, handle)
        self.accessible: set[int] = set()           # mapped ptrs with access set
        self.log: list[tuple] = []
        self._next_va = 1 << 44
        self._next_handle = 1

    # the CudaDriver interface
    def use_device(self) -> None:
        pass

    def granularity(self) -> int:
        return self.gran

    def reserve(self, size: int, alignment: int) -> int:
        if size <= 0 or size % self.gran:
            raise _invalid("cuMemAddressReserve", f"size {size}")
        base = self._next_va
        self._next_va += size + self.gran          # a gap between reservations
        self.reservations[base] = size
        self.log.append(("reserve", base, size))
        return base

    def free_addresses(self, ptr: int, size: int) -> None:
        if self.reservations.get(ptr) != size:
            raise _invalid("cuMemAddressFree", f"{ptr:#x}+{size} is not a reservation")
        if any(ptr <= p < ptr + size for p in self.mappings):
            raise _invalid("cuMemAddressFree", "memory is still mapped in the range")
        del self.reservations[ptr]
        self.log.append(("free", ptr, size))

    def create(self, size: int) -> int:
        if size <= 0 or size % self.gran:
            raise _invalid("cuMemCreate", f"size {size}")
        if self.used + size > self.capacity:
            raise CannotGrow("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        self.used += size
        self.log.append(("create", handle, size))
        return handle

    def release(self, handle: int) -> None:
        if handle not in self.handles:
            raise _invalid("cuMemRelease", f"unknown handle {handle}")
        if any(h == handle for _, h in self.mappings.values()):
            raise _invalid("cuMemRelease", "handle still mapped (this fake frees eagerly)")
        self.used -= self.handles.pop(handle)
        self.log.append(("release", handle))

    def map(self, ptr: int, size: int, handle: int) -> None:
        if self.handles.get(handle) != size:
            raise _invalid("cuMemMap", "size differs from the allocation")
        if ptr % self.gran or not any(b <= ptr and ptr + size <= b + s
                                      for b, s in self.reservations.items()):
            raise _invalid("cuMemMap", f"{ptr:#x}+{size} not inside a reservation")
        for p, (s, _) in self.mappings.items():
            if p < ptr + size and ptr < p + s:
                raise _invalid("cuMemMap", f"{ptr:#x} overlaps a mapping at {p:#x}")
        self.mappings[ptr] = (size, handle)
        self.log.append(("map", ptr, size))

    def _covered(self, ptr: int, size: int, need_access: bool) -> bool:
        at = ptr
        while at < ptr + size:
            hit = self.mappings.get(at)
            if hit is None or (need_access and at not in self.accessible):
                return False
            at += hit[0]
        return at == ptr + size

    def set_access(self, ptr: int, size: int) -> None:
        if not self._covered(ptr, size, need_access=False):
            raise _invalid("cuMemSetAccess", "range not fully mapped")
        self.log.append(("access", ptr, size))
        at = ptr
        while at < ptr + size:
            self.accessible.add(at)
            at += self.mappings[at][0]

    def unmap(self, ptr: int, size: int) -> None:
        if not self._covered(ptr, size, need_access=False):
            raise _invalid("cuMemUnmap", "range is not whole mappings")
        at = ptr
        while at < ptr + size:
            s, _ = self.mappings.pop(at)
            self.accessible.discard(at)
            at += s
        self.log.append(("unmap", ptr, size))

    def zero(self, ptr: int, size: int, stream: int = 0) -> None:
        if not self._covered(ptr, size, need_access=True):
            raise VmmError("cuMemsetD8Async", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        self.log.append(("zero", ptr, size, stream))

    def synchronize(self) -> None:
        self.log.append(("sync",))

    def new_stream(self) -> int:
        self.streams = getattr(self, "streams", 0) + 1
        self.log.append(("stream", 1000 + self.streams))
        return 1000 + self.streams

    def stream_synchronize(self, stream: int) -> None:
        self.log.append(("stream_sync", stream))

    def destroy_stream(self, stream: int) -> None:
        self.log.append(("stream_destroy", stream))

    def mem_info(self) -> tuple[int, int]:
        return self.capacity - self.used, self.capacity

    # test helpers
    def mapped_bytes(self) -> int:
        return sum(s for s, _ in self.mappings.values())
