"""A torch tensor over GPU memory torch did not allocate (a reserved VMM range).

The lightest path that needs nothing beyond torch: an object exposing the
``__cuda_array_interface__`` (version 2: no stream, so torch adds no synchronisation), given
to ``torch.as_tensor``. torch wraps the pointer with ``from_blob`` (no copy; it keeps the
object alive and never frees the memory), which is also what CuPy's ``UnownedMemory`` +
``torch.as_tensor`` does underneath, minus CuPy. The tensor's ``data_ptr()`` is the
reserved address itself, so kernels and CUDA graphs see addresses that never move.
"""

from __future__ import annotations


class _DeviceBuffer:
    """Describes ``nbytes`` bytes at ``ptr`` as a 1-D uint8 CUDA array."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "strides": None, "version": 2,
        }


def device_bytes(ptr: int, nbytes: int, device: int = 0):
    """``torch.uint8`` tensor of ``nbytes`` at device address ``ptr`` (not copied, not
    owned: the memory must outlive the tensor)."""
    import torch

    tensor = torch.as_tensor(_DeviceBuffer(ptr, nbytes), device=torch.device("cuda", device))
    if tensor.data_ptr() != ptr or tensor.numel() != nbytes:   # a copy would be a silent bug
        raise RuntimeError(f"torch did not view the memory in place (got {tensor.data_ptr():#x}"
                           f" for {ptr:#x})")
    return tensor
