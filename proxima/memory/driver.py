"""The CUDA driver's virtual memory management API, through ctypes on ``libcuda.so.1``.

Why ctypes and not cuda-python (``cuda.bindings.driver``): the dozen calls and two structs
needed here are stable C ABI since CUDA 10.2, so ctypes costs no dependency, no import
time, and the same code runs on every stack Proxima supports (vLLM 0.26 on CUDA 13, the
card stack on CUDA 12.1) while cuda-python's module layout changed between its 12.x and
13.x releases. Nothing is loaded until the first call, so importing this module needs no
GPU.

Contexts: vLLM's sleep-mode allocator notes that its ctypes / cuda-python attempts "failed
because of cuda context mismatch". The virtual memory calls act on the calling thread's
current context; :meth:`CudaDriver.use_device` makes the device's *primary* context
current when none is -- the same context the CUDA runtime (and so torch) uses -- so
addresses mapped here are valid in torch's kernels and CUDA graphs.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, Structure, byref, c_char_p, c_int, c_size_t, c_ubyte, c_uint
from ctypes import c_ulonglong, c_ushort, c_void_p

from proxima.memory.errors import CannotGrow, VmmError, VmmUnavailable

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_STREAM_NON_BLOCKING = 1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102

_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
          3: "CUDA_ERROR_NOT_INITIALIZED", 100: "CUDA_ERROR_NO_DEVICE",
          101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
          700: "CUDA_ERROR_ILLEGAL_ADDRESS", 801: "CUDA_ERROR_NOT_SUPPORTED"}


class _Location(Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(Structure):
    _fields_ = [("compressionType", c_ubyte), ("gpuDirectRDMACapable", c_ubyte),
                ("usage", c_ushort), ("reserved", c_ubyte * 4)]


class _AllocationProp(Structure):          # CUmemAllocationProp
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", _Location),
                ("win32HandleMetaData", c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(Structure):              # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", c_int)]


_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDeviceGetAttribute": (POINTER(c_int), c_int, c_int),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuCtxSynchronize": (),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuMemGetAllocationGranularity": (POINTER(c_size_t), POINTER(_AllocationProp), c_int),
    "cuMemAddressReserve": (POINTER(c_ulonglong), c_size_t, c_size_t, c_ulonglong,
                            c_ulonglong),
    "cuMemAddressFree": (c_ulonglong, c_size_t),
    "cuMemCreate": (POINTER(c_ulonglong), c_size_t, POINTER(_AllocationProp), c_ulonglong),
    "cuMemRelease": (c_ulonglong,),
    "cuMemMap": (c_ulonglong, c_size_t, c_size_t, c_ulonglong, c_ulonglong),
    "cuMemUnmap": (c_ulonglong, c_size_t),
    "cuMemSetAccess": (c_ulonglong, c_size_t, POINTER(_AccessDesc), c_size_t),
    "cuMemsetD8Async": (c_ulonglong, c_ubyte, c_size_t, c_void_p),
    "cuMemGetInfo_v2": (POINTER(c_size_t), POINTER(c_size_t)),
    "cuStreamCreate": (POINTER(c_void_p), c_uint),
    "cuStreamSynchronize": (c_void_p,),
    "cuStreamDestroy_v2": (c_void_p,),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
}

_lib = None
_lib_lock = threading.Lock()


def _load():
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise VmmUnavailable(
                    f"cannot load the CUDA driver (libcuda.so.1: {exc}); elastic KV memory "
                    "needs an NVIDIA GPU and its driver") from None
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = list(args), c_int
            _lib = lib
    return _lib


def _error_name(lib, code: int) -> str:
    out = c_char_p()
    if lib.cuGetErrorName(code, byref(out)) == CUDA_SUCCESS and out.value:
        return out.value.decode()
    return _NAMES.get(code, "CUDA_ERROR_UNKNOWN")


class CudaDriver:
    """The virtual memory calls on one device, each raising on failure.

    ``CUDA_ERROR_OUT_OF_MEMORY`` raises :class:`CannotGrow`; every other error code raises
    :class:`VmmError`. Sizes are bytes, addresses ints.
    """

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._lib = _load()
        self._check("cuInit", self._lib.cuInit(0))
        dev = c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(byref(dev), device))
        self._dev = dev.value
        supported = c_int()
        self._check("cuDeviceGetAttribute", self._lib.cuDeviceGetAttribute(
            byref(supported), CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            self._dev))
        if not supported.value:
            raise VmmUnavailable(f"GPU {device} does not support CUDA virtual memory "
                                 "management; elastic KV memory cannot be used on it")
        self._prop = _AllocationProp()
        self._prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
        self._prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self._dev
        self._access = _AccessDesc()
        self._access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = self._dev
        self._access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def _check(self, call: str, code: int, detail: str = "") -> None:
        if code == CUDA_SUCCESS:
            return
        name = _error_name(self._lib, code)
        cls = CannotGrow if code == CUDA_ERROR_OUT_OF_MEMORY else VmmError
        raise cls(call, code, name, detail)

    def use_device(self) -> None:
        """Make a context current on this thread: keep torch's if there is one, else the
        device's primary context (the one the CUDA runtime uses)."""
        ctx = c_void_p()
        self._check("cuCtxGetCurrent", self._lib.cuCtxGetCurrent(byref(ctx)))
        if ctx.value:
            return
        self._check("cuDevicePrimaryCtxRetain",
                    self._lib.cuDevicePrimaryCtxRetain(byref(ctx), self._dev))
        self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(ctx))

    def granularity(self) -> int:
        """Smallest physical allocation (and mapping alignment) on this device, bytes."""
        out = c_size_t()
        self._check("cuMemGetAllocationGranularity", self._lib.cuMemGetAllocationGranularity(
            byref(out), byref(self._prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        return out.value

    def reserve(self, size: int, alignment: int) -> int:
        ptr = c_ulonglong()
        self._check("cuMemAddressReserve",
                    self._lib.cuMemAddressReserve(byref(ptr), size, alignment, 0, 0),
                    f"reserving {size} bytes of virtual addresses")
        return ptr.value

    def free_addresses(self, ptr: int, size: int) -> None:
        self._check("cuMemAddressFree", self._lib.cuMemAddressFree(ptr, size))

    def create(self, size: int) -> int:
        handle = c_ulonglong()
        self._check("cuMemCreate", self._lib.cuMemCreate(byref(handle), size,
                                                         byref(self._prop), 0),
                    f"{size} bytes of GPU {self.device} memory")
        return handle.value

    def release(self, handle: int) -> None:
        self._check("cuMemRelease", self._lib.cuMemRelease(handle))

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._check("cuMemMap", self._lib.cuMemMap(ptr, size, 0, handle, 0))

    def set_access(self, ptr: int, size: int) -> None:
        self._check("cuMemSetAccess",
                    self._lib.cuMemSetAccess(ptr, size, byref(self._access), 1))

    def unmap(self, ptr: int, size: int) -> None:
        self._check("cuMemUnmap", self._lib.cuMemUnmap(ptr, size))

    def zero(self, ptr: int, size: int, stream: int = 0) -> None:
        """Fill with zeros, asynchronously on ``stream`` (0: the legacy default stream)."""
        self._check("cuMemsetD8Async",
                    self._lib.cuMemsetD8Async(ptr, 0, size, c_void_p(stream or None)))

    def new_stream(self) -> int:
        """A stream that does not synchronise with the legacy default stream (for work
        off the forward's path, such as zero-filling memory mapped in the background)."""
        stream = c_void_p()
        self._check("cuStreamCreate", self._lib.cuStreamCreate(byref(stream),
                                                               CU_STREAM_NON_BLOCKING))
        return stream.value

    def stream_synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._lib.cuStreamSynchronize(c_void_p(stream)))

    def destroy_stream(self, stream: int) -> None:
        self._check("cuStreamDestroy", self._lib.cuStreamDestroy_v2(c_void_p(stream)))

    def synchronize(self) -> None:
        """Wait for all work on the current context (every stream) to finish."""
        self._check("cuCtxSynchronize", self._lib.cuCtxSynchronize())

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver sees them now."""
        free, total = c_size_t(), c_size_t()
        self._check("cuMemGetInfo", self._lib.cuMemGetInfo_v2(byref(free), byref(total)))
        return free.value, total.value
