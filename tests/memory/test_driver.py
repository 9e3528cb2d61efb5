"""The ctypes binding's C layouts, and a clear error where there is no driver."""

import ctypes
import ctypes.util

import pytest

from proxima.memory import driver
from proxima.memory.errors import CannotGrow, VmmError, VmmUnavailable


def test_structs_match_the_cuda_headers():
    # CUmemAllocationProp: type, handle types, location{type,id}, void*, allocFlags[8]
    assert ctypes.sizeof(driver._AllocationProp) == 32
    assert driver._AllocationProp.win32HandleMetaData.offset == 16
    assert driver._AllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(driver._AccessDesc) == 12          # location{type,id}, flags


def test_out_of_memory_is_its_own_catchable_error():
    err = CannotGrow("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY", "2097152 bytes")
    assert isinstance(err, VmmError) and err.code == 2
    assert str(err) == "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2): 2097152 bytes"


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None,
                    reason="a CUDA driver is installed here")
def test_without_a_driver_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(driver, "_lib", None)
    with pytest.raises(VmmUnavailable, match="libcuda.so.1.*needs an NVIDIA GPU"):
        driver.CudaDriver(0)
