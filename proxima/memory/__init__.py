"""GPU memory that can be given back and taken again: CUDA virtual memory management.

Rooms inside: :mod:`~proxima.memory.driver` (the driver calls, ctypes), :mod:`~.arena`
(a reserved range mapped by units), :mod:`~.tensor` (torch views over it), :mod:`~.layout`
(which bytes a block id owns; the granule in block ids), :mod:`~.kv` (a KV cache mapped by
granules), :mod:`~.ops` and :mod:`~.channel` (the scheduler -> worker commands and the
scheduler's view of what is mapped), :mod:`~.policy` (when to grow and shrink: min / max
bytes, headroom, release delay). Importing any of them needs no GPU: the driver is loaded
and torch imported on first use; ``layout``, ``ops``, ``channel`` and ``policy`` are pure
Python.

Why not vLLM's sleep-mode allocator (``vllm/device_allocator/cumem.py``)? It is the same
driver API, but built for another job: a torch ``CUDAPluggableAllocator`` (a C extension
and a process-wide singleton) that backs *whole allocations* and releases or restores all
allocations of a tag at once (``sleep``/``wake_up``). Elastic KV needs the opposite grain:
one allocation that stays put (so attention kernels and captured CUDA graphs keep their
pointers) while 2 MiB pieces of it, chosen by block id, come and go at step boundaries,
with "the GPU has no memory now" as an ordinary answer instead of an exception deep in a
torch allocation. Reusing cumem would also tie Proxima to vLLM's compiled extension and to
torch's MemPool (and would collide with sleep mode, which owns that singleton). What we
learnt from it: drain the device before unmapping (its free callback synchronises for the
same reason), and create/map/set-access/unmap/release is the whole life of a page.
From kvcached (ovg-project/kvcached), which maps KV pages on demand: it maps a page when an
allocation first needs one and unmaps a page when its last block is freed, keeping a small
reserve of mapped free pages; its commands reach the workers through its own IPC, while
here they ride vLLM's step (:mod:`proxima.vllm.elastic_connector`) and growth is
confirmed before blocks are handed out.
"""

__all__ = ["CannotGrow", "VmmError", "VmmUnavailable"]

from proxima.memory.errors import CannotGrow, VmmError, VmmUnavailable
