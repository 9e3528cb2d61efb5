"""Proxima's allocator core: pure Python, imports neither torch nor vllm."""

from proxima.allocator.errors import AllocationError, InvariantError
from proxima.allocator.runs import RunAllocator, count_runs

__all__ = ["AllocationError", "InvariantError", "RunAllocator", "count_runs"]
