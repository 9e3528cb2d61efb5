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
