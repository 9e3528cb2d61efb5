"""What can go wrong when mapping GPU memory, as Python exceptions.

* :class:`CannotGrow` -- the GPU has no physical memory to give now
  (``CUDA_ERROR_OUT_OF_MEMORY``, typically because another process holds it). It is an
  expected outcome of asking for more KV memory, not a failure: callers keep serving at
  their current size and retry later. :meth:`proxima.memory.arena.VmmArena.map` turns it
  into a :class:`~proxima.memory.arena.GrowResult` instead of raising.
* :class:`VmmUnavailable` -- no driver, no device, or a device without virtual memory
  management: elastic KV memory cannot be switched on here.
* :class:`VmmError` -- any other driver error. These are bugs (a bad address, a double
  unmap) and are raised with the driver call, the CUDA error name and code.
"""

from __future__ import annotations

from proxima.errors import UserError


class VmmError(RuntimeError):
    """A CUDA driver call of the virtual memory API failed."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call, self.code, self.name = call, code, name
        msg = f"{call} failed: {name} ({code})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CannotGrow(VmmError):
    """The GPU cannot give more physical memory now (CUDA_ERROR_OUT_OF_MEMORY)."""


class VmmUnavailable(UserError, VmmError):
    """CUDA virtual memory management cannot be used in this process."""

    def __init__(self, detail: str) -> None:
        RuntimeError.__init__(self, detail)
        self.call, self.code, self.name = "", -1, "unavailable"
