"""Proxima's allocator core: pure Python, imports neither torch nor vllm."""

from proxima.allocator.errors import AllocationError, InvariantError
from proxima.allocator.hint import AllocationHint
from proxima.allocator.runs import RunAllocator, count_runs

__all__ = ["AllocationError", "AllocationHint", "InvariantError", "RunAllocator", "count_runs"]
