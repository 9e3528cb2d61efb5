"""What a batch of block moves means, and its validation (pure Python, no torch).

A batch is a list of runs ``(src[i], dst[i], n[i])``: run ``i`` moves the ``n[i]`` blocks
``src[i] .. src[i] + n[i] - 1`` to ``dst[i] .. dst[i] + n[i] - 1``. After the batch has been
applied, for every run ``i`` and every ``0 <= k < n[i]``, block ``dst[i] + k`` of every
layer (K and V, every head and token slot) holds what block ``src[i] + k`` held before the
call. No other block is written, and the source blocks keep their content (a move is a
copy; the caller frees or reuses the sources afterwards).

A batch is valid when

1. ``src``, ``dst`` and ``n`` have the same length, every entry is an int (``bool`` is
   not), and every ``n[i] >= 1``;
2. every block of every run lies in ``[0, num_blocks)``;
3. no block is the destination of two moves (two writers of one block);
4. no destination block is a source block of the same batch.

Rule 4 makes the result independent of the order the copies run in, which is what lets
one kernel launch do them all at once. A permutation (block ``a`` to ``b`` and ``b`` to
``a``, or a run shifted onto itself) is not one batch: the planner breaks it into phases
whose destinations are disjoint from their sources, with one spare block per cycle.
A source may repeat (one block copied to several destinations).

:func:`expand_moves` checks all four rules and raises :class:`MoveError` naming the first
offending run, before anything is copied.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = ["MoveError", "expand_moves", "runs_of"]


class MoveError(ValueError):
    """An invalid batch of block moves (nothing was copied). The message names the run."""


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise MoveError(f"{what} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise MoveError(f"{what} must be an int, got {value!r} ({type(value).__name__})") from None


def _as_list(values, name: str) -> list:
    if isinstance(values, (str, bytes)):
        raise MoveError(f"{name} must be a sequence of block ids, got {values!r}")
    if hasattr(values, "tolist"):          # numpy arrays, torch tensors
        values = values.tolist()
    try:
        return list(values)
    except TypeError:
        raise MoveError(f"{name} must be a sequence of ints, got {values!r}") from None


def expand_moves(src: Sequence[int], dst: Sequence[int], n: Sequence[int] | None,
                 num_blocks: int) -> tuple[list[int], list[int]]:
    """Check a batch (module docstring) and return it block by block.

    ``n=None`` means one block per entry (``src`` and ``dst`` are then per-block lists).
    Returns ``(src_blocks, dst_blocks)``, equal-length lists with one entry per moved
    block, in run order. Raises :class:`MoveError` for an invalid batch.
    """
    src_l = _as_list(src, "src")
    dst_l = _as_list(dst, "dst")
    n_l = [1] * len(src_l) if n is None else _as_list(n, "n")
    if not len(src_l) == len(dst_l) == len(n_l):
        raise MoveError(f"src, dst and n must have the same length, got {len(src_l)}, "
                        f"{len(dst_l)} and {len(n_l)}")
    src_blocks: list[int] = []
    dst_blocks: list[int] = []
    writer: dict[int, int] = {}          # destination block -> the run that writes it
    for i, (s, d, k) in enumerate(zip(src_l, dst_l, n_l)):
        s = _as_int(s, f"src[{i}]")
        d = _as_int(d, f"dst[{i}]")
        k = _as_int(k, f"n[{i}]")
        run = f"move {i} (src {s}, dst {d}, n {k})"
        if k < 1:
            raise MoveError(f"{run}: n must be >= 1")
        for start in (s, d):
            if start < 0 or start + k > num_blocks:
                raise MoveError(f"{run}: blocks {start}..{start + k - 1} are outside the "
                                f"cache's {num_blocks} blocks (valid ids: 0..{num_blocks - 1})")
        for b in range(d, d + k):
            if b in writer:
                raise MoveError(f"{run}: destination block {b} is also written by move "
                                f"{writer[b]}; each block may be written once per batch")
            writer[b] = i
        src_blocks.extend(range(s, s + k))
        dst_blocks.extend(range(d, d + k))
    for b in src_blocks:
        if b in writer:
            i = writer[b]
            raise MoveError(f"move {i} (src {src_l[i]}, dst {dst_l[i]}, n {n_l[i]}): destination "
                            f"block {b} is also a source of this batch; split the batch into "
                            f"phases whose destinations are disjoint from their sources")
    return src_blocks, dst_blocks


def runs_of(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge a block-by-block batch into runs ``(src, dst, n)`` where both sides continue.

    ``runs_of(*expand_moves(s, d, n, N))`` gives the fewest runs describing the same moves
    (adjacent runs that continue each other merge).
    """
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]
