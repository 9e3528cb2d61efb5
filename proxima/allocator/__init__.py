"""Proxima's allocator core: pure Python, imports neither torch nor vllm."""

from proxima.allocator.buddy import AllocationError, BuddyAllocator, InvariantError, count_runs

__all__ = ["AllocationError", "BuddyAllocator", "InvariantError", "count_runs"]
