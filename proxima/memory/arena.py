"""A reserved GPU virtual address range whose physical memory comes and goes by *units*.

The range is split into regions (for a KV cache: one per layer tensor). Unit ``u`` is the
``u``-th slice of ``unit_bytes[r]`` bytes of every region ``r``; mapping or unmapping a
unit acts on all regions at once, so "unit u" can mean "block ids [u*G, (u+1)*G) of every
layer" (see :mod:`proxima.memory.kv`). Addresses never move: tensors, kernels and CUDA
graphs keep their pointers while units under them are unmapped and mapped again.

Mapping is all-or-nothing per unit: if the GPU runs out of memory half way through a unit's
regions, the regions already mapped for that unit are released again, the unit stays
unmapped, and :meth:`VmmArena.map` returns a :class:`GrowResult` saying where it stopped
(never raises for lack of memory). Both calls are idempotent: mapping a mapped unit or
unmapping an unmapped one does nothing, so a lost or repeated command is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from proxima.memory.errors import CannotGrow, VmmError


@dataclass(frozen=True)
class GrowResult:
    """What :meth:`VmmArena.map` did: ``mapped`` units newly backed by memory; ``failed``
    the units it could not back because the GPU had no memory (None when all were)."""

    mapped: int
    failed: range | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None


class VmmArena:
    """``num_units`` units over ``len(unit_bytes)`` regions of one reserved range.

    ``unit_bytes[r]`` must be a multiple of the device's allocation granularity (2 MiB on
    the H200). ``driver`` defaults to :class:`proxima.memory.driver.CudaDriver` on
    ``device``; anything with its methods will do. Newly mapped memory is zero-filled (on
    the stream passed to :meth:`map`) unless ``zero_on_map=False``.
    """

    def __init__(self, unit_bytes: Sequence[int], num_units: int, *, device: int = 0,
                 driver=None, zero_on_map: bool = True) -> None:
        if driver is None:
            from proxima.memory.driver import CudaDriver

            driver = CudaDriver(device)
        self.driver = driver
        self.device = device
        self.zero_on_map = zero_on_map
        driver.use_device()
        self.granularity = driver.granularity()
        if num_units < 1 or not unit_bytes:
            raise ValueError(f"an arena needs at least one unit and one region, got "
                             f"{num_units} units and {len(unit_bytes)} regions")
        for size in unit_bytes:
            if size <= 0 or size % self.granularity:
                raise ValueError(
                    f"unit size {size} bytes is not a positive multiple of the GPU's "
                    f"allocation granularity ({self.granularity} bytes)")
        self.unit_bytes = tuple(int(b) for b in unit_bytes)
        self.num_units = num_units
        self.region_bytes = tuple(b * num_units for b in self.unit_bytes)
        self.reserved_bytes = sum(self.region_bytes)
        self.base = driver.reserve(self.reserved_bytes, self.granularity)
        offsets, at = [], self.base
        for size in self.region_bytes:
            offsets.append(at)
            at += size
        self.region_base = tuple(offsets)
        self._handles: list[tuple[int, ...] | None] = [None] * num_units
        self._mapped = 0
        self._views: dict[tuple[int, int], object] = {}
        self._closed = False

    # ------------------------------------------------------------------ state
    @property
    def bytes_per_unit(self) -> int:
        return sum(self.unit_bytes)

    @property
    def mapped_units(self) -> int:
        return self._mapped

    @property
    def mapped_bytes(self) -> int:
        return self._mapped * self.bytes_per_unit

    def is_mapped(self, unit: int) -> bool:
        return self._handles[unit] is not None

    def mapped_ranges(self) -> list[range]:
        """The mapped units as maximal ranges, in order."""
        out, start = [], None
        for u, h in enumerate(self._handles + [None]):
            if h is not None and start is None:
                start = u
            elif h is None and start is not None:
                out.append(range(start, u))
                start = None
        return out

    def unit_address(self, region: int, unit: int) -> int:
        return self.region_base[region] + unit * self.unit_bytes[region]

    # ------------------------------------------------------------------ map / unmap
    def _check_range(self, start: int, stop: int) -> None:
        if self._closed:
            raise RuntimeError("this VMM arena was closed")
        if not 0 <= start <= stop <= self.num_units:
            raise IndexError(f"units [{start}, {stop}) outside the arena's "
                             f"{self.num_units} units")

    def map(self, start: int, stop: int, stream: int = 0) -> GrowResult:
        """Back units ``[start, stop)`` with fresh physical memory, in order.

        Stops at the first unit the GPU cannot back (``CUDA_ERROR_OUT_OF_MEMORY``) and says
        so in the result; the units before it stay mapped. Other driver errors raise.
        """
        self._check_range(start, stop)
        driver = self.driver
        driver.use_device()
        fresh: list[int] = []
        failed = None
        for u in range(start, stop):
            if self._handles[u] is not None:
                continue
            done: list[tuple[int, int, int]] = []
            try:
                for r, size in enumerate(self.unit_bytes):
                    ptr = self.unit_address(r, u)
                    handle = driver.create(size)
                    try:
                        driver.map(ptr, size, handle)
                    except BaseException:
                        driver.release(handle)
                        raise
                    done.append((ptr, size, handle))
            except CannotGrow:
                self._undo(done)
                failed = range(u, stop)
                break
            except BaseException:
                self._undo(done)
                self._grant(fresh)
                raise
            self._handles[u] = tuple(h for _, _, h in done)
            self._mapped += 1
            fresh.append(u)
        self._grant(fresh)
        if fresh and self.zero_on_map:
            for run in runs(fresh):
                for r, size in enumerate(self.unit_bytes):
                    driver.zero(self.unit_address(r, run.start), size * len(run), stream)
        return GrowResult(len(fresh), failed)

    def _grant(self, units: list[int]) -> None:
        """Give the device access to newly mapped units: one ``cuMemSetAccess`` per region
        and run of consecutive units, as PyTorch's expandable segments do (a range may
        span several allocations), instead of one per allocation: for a 32-layer pool that
        is 32 calls a grow, not 32 a granule. Where the driver refuses a range, per unit."""
        driver = self.driver
        for run in runs(units):
            for r, size in enumerate(self.unit_bytes):
                try:
                    driver.set_access(self.unit_address(r, run.start), size * len(run))
                except VmmError:
                    if len(run) == 1:
                        raise
                    for u in run:
                        driver.set_access(self.unit_address(r, u), size)

    def _undo(self, done) -> None:
        for ptr, size, handle in reversed(done):
            self.driver.unmap(ptr, size)
            self.driver.release(handle)

    def unmap(self, start: int, stop: int, *, sync: bool = True) -> int:
        """Give the physical memory of units ``[start, stop)`` back to the GPU.

        ``sync`` (default) first waits for all work on the device: a kernel still reading
        or writing an unmapped address would fault. Pass ``sync=False`` only when the
        caller has synchronised. Returns the number of units unmapped.
        """
        self._check_range(start, stop)
        todo = [u for u in range(start, stop) if self._handles[u] is not None]
        if not todo:
            return 0
        driver = self.driver
        driver.use_device()
        if sync:
            driver.synchronize()
        for u in todo:
            for r, handle in enumerate(self._handles[u]):
                driver.unmap(self.unit_address(r, u), self.unit_bytes[r])
                driver.release(handle)
            self._handles[u] = None
            self._mapped -= 1
        return len(todo)

    def close(self) -> None:
        """Unmap everything and give the addresses back (after a device synchronise).
        Tensor views taken from this arena must not be used afterwards."""
        if self._closed:
            return
        self.unmap(0, self.num_units)
        self._views.clear()
        self.driver.free_addresses(self.base, self.reserved_bytes)
        self._closed = True

    def __enter__(self) -> "VmmArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ torch views
    def region_tensor(self, region: int, nbytes: int | None = None):
        """A ``torch.uint8`` tensor over the first ``nbytes`` (default: all) of region
        ``region``, mapped or not, made once and cached. Unit 0 must be mapped when it is
        first asked for (torch asks the driver which device the first byte belongs to)."""
        nbytes = self.region_bytes[region] if nbytes is None else nbytes
        if not 0 < nbytes <= self.region_bytes[region]:
            raise ValueError(f"region {region} holds {self.region_bytes[region]} bytes, "
                             f"not {nbytes}")
        view = self._views.get((region, nbytes))
        if view is None:
            if not self.is_mapped(0):
                raise RuntimeError("map unit 0 before taking a tensor view of the arena")
            from proxima.memory.tensor import device_bytes

            view = device_bytes(self.region_base[region], nbytes, self.device)
            self._views[(region, nbytes)] = view
        return view

    def range_tensor(self):
        """A ``torch.uint8`` tensor over the whole reserved range (every region, mapped or
        not), made once and cached: for an engine that views all its layers in one
        allocation (vLLM 0.33). Unit 0 must be mapped, as for :meth:`region_tensor`."""
        view = self._views.get(("all", self.reserved_bytes))
        if view is None:
            if not self.is_mapped(0):
                raise RuntimeError("map unit 0 before taking a tensor view of the arena")
            from proxima.memory.tensor import device_bytes

            view = device_bytes(self.base, self.reserved_bytes, self.device)
            self._views[("all", self.reserved_bytes)] = view
        return view


def runs(indices) -> list[range]:
    """Sorted indices -> maximal ranges of consecutive ones."""
    out: list[range] = []
    for u in indices:
        if out and out[-1].stop == u:
            out[-1] = range(out[-1].start, u + 1)
        else:
            out.append(range(u, u + 1))
    return out
