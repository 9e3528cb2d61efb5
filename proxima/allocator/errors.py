"""The allocator core's two errors (standard library only)."""


class AllocationError(ValueError):
    """A request the allocator refuses: a bad argument (named in the message) or more ids
    than are free. Nothing has changed when it is raised."""


class InvariantError(RuntimeError):
    """A ``check()`` (:class:`~proxima.allocator.runs.RunAllocator`,
    :class:`~proxima.allocator.granules.GranuleIndex`) found the structures inconsistent."""
