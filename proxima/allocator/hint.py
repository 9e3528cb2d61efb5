"""Where the caller would like its next ids: a hint ``(after, room, spread, end)``, passed
explicitly.

A hint is what a block pool knows about the request it serves and the allocator does not:
its last id, how many ids it may still need, whether the pool has room for everyone, and
when the request is expected to finish. The allocator functions take it as an argument
(:meth:`~proxima.allocator.runs.RunAllocator.allocate`); the engine's free queue, which
vLLM calls as ``popleft_n(n)`` with no room for another argument, holds the one hint set
for its next pops (``queue.hint``) and passes it on.

Its value is a tuple of the four fields in that order: :class:`AllocationHint` (fields by
name, defaults) or a plain tuple, which readers take alike (they unpack it). The scheduler's
hot path builds plain ones (``queue.hint = (...)``, :func:`continued`): a plain tuple
comes from the interpreter's free list, an ``AllocationHint`` is a new object of a tuple
subclass, ~0.25 us more on the CPU VM, which a queue that built two per allocation paid
on every allocation (``docs/results/allocator-bench-*/NOTES.md``).
"""

from __future__ import annotations

from typing import NamedTuple


class AllocationHint(NamedTuple):
    """Placement wishes for one allocation; every field is a preference, never a
    reservation. Immutable; the same hint as the plain tuple of its fields (module doc).

    Attributes:
        after: None or the caller's last id (an allocated id): the new ids continue its
            run when the ids right after it are free (growth in place).
        room: None or the ids the caller expects to need in all from here (values below
            ``n`` count as ``n``): a new run is placed where that many stay free behind
            its start, and claims the ids past it.
        spread: the pool has room for every request's ``room`` twice over: share free
            space out (split the largest slack) rather than pack. Read only with ``room``.
        end: the step the request is expected to finish at (elastic placement groups ids
            that end together).
    """

    after: int | None = None
    room: int | None = None
    spread: bool = False
    end: int = 0


def continued(hint: tuple, last: int, n: int) -> tuple:
    """The hint for the next ids of the same allocation, after ``n`` ids ending at ``last``
    were handed out (vLLM takes a copy-on-write block, then the new blocks: one run):
    ``after`` moves to ``last`` and ``room`` loses ``n`` (never below 0), as a plain tuple.
    A hint with neither ``after`` nor ``room`` is returned unchanged."""
    after, room, spread, end = hint
    if after is None and room is None:
        return hint
    return (last, None if room is None else (room - n if room > n else 0), spread, end)

