"""The simplest possible model of the pool: a set of free ids. Tests compare against it."""


def free_runs(free: set[int]) -> list[tuple[int, int]]:
    """Maximal ranges [start, end) of consecutive ids in ``free``, ascending."""
    runs = []
    for i in sorted(free):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def canonical_blocks(free: set[int], num_blocks: int) -> set[tuple[int, int]]:
    """(head, order) of the maximal aligned power-of-two ranges made only of free ids
    inside the pool: what a buddy system with eager merging must hold."""
    blocks = set()
    for start, end in free_runs(free):
        pos = start
        while pos < end:
            order = 0
            while (pos % (1 << (order + 1)) == 0 and pos + (1 << (order + 1)) <= end
                   and pos + (1 << (order + 1)) <= num_blocks):
                order += 1
            blocks.add((pos, order))
            pos += 1 << order
    return blocks


def maximal_aligned_chunks(num_blocks: int, reserved=()) -> set[tuple[int, int]]:
    """The pool split into maximal aligned chunks around the reserved ids."""
    return canonical_blocks(set(range(num_blocks)) - set(reserved), num_blocks)


def held_blocks(a) -> set[tuple[int, int]]:
    """The allocator's buddy view, as a set."""
    return set(a.free_blocks())


def run_containing(free: set[int], i: int) -> tuple[int, int]:
    """The maximal run [start, end) of ``free`` that holds ``i``."""
    start = i
    while start - 1 in free:
        start -= 1
    end = i + 1
    while end in free:
        end += 1
    return start, end


class ClaimModel:
    """The claims as the allocator's module doc defines them, kept beside a set of free
    ids: ``{end of a free run: claimed up to}``. Each method takes the free set *before*
    the operation and the ids it touched."""

    def __init__(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.by_end: dict[int, int] = {}

    def allocated(self, free: set[int], ids: list[int], grew: bool, want: int) -> None:
        free = set(free)
        pieces = free_runs(set(ids))          # ascending ranges of the handed-out ids
        # A gather takes whole runs first, then places the rest (want == its size).
        if len(pieces) > 1:
            want = 0
        for s, t in pieces:
            rs, re = run_containing(free, s)
            kept = self.by_end.pop(re, 0)
            if grew:
                if t < re:
                    self.by_end[re] = kept      # the run is eaten from the front
                continue
            if rs < s and kept:
                self.by_end[s] = kept
            if t < re and want > t - s:
                self.by_end[re] = min(s + want, self.n)
            free -= set(range(s, t))

    def taken(self, free: set[int], i: int) -> None:
        rs, re = run_containing(free, i)
        kept = self.by_end.pop(re, 0)
        if rs < i and kept:
            self.by_end[i] = kept

    def freed(self, free: set[int], ids) -> None:
        free = set(free)
        for s, e in free_runs(set(ids)):
            kept = self.by_end.pop(s, 0) if s - 1 in free else 0
            end = e
            if e in free:
                end = run_containing(free, e)[1]
                self.by_end.pop(end, None)
            free |= set(range(s, e))
            if kept:
                self.by_end[end] = kept

    def cleared(self) -> None:
        self.by_end.clear()

    def expected(self, free: set[int]) -> dict[int, int]:
        """What ``RunAllocator.claims()`` must say."""
        out = {}
        for end, claim in self.by_end.items():
            start = run_containing(free, end - 1)[0]
            if claim > start:
                out[start] = min(claim, end)
        return out
