"""Every bad argument to every public method of RunAllocator: an AllocationError that
names the value, and nothing changed (every internal structure identical, check() passes).

The pools are random (hypothesis builds each by a random history of allocations, frees
and takes, claims included); the bad values cover wrong types (floats, bools, strings,
None, numpy ints when numpy is importable), negatives, ids outside the pool, and ids in
the wrong state.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from proxima.allocator import AllocationError, AllocationHint, RunAllocator
from proxima.allocator.free_runs import ALLOCATED, FREE, RESERVED

try:
    import numpy as np
except ImportError:          # numpy ints are then simply not among the bad values
    np = None

NUMPY_INTS = [np.int64(3), np.int32(1), np.bool_(True)] if np is not None else []
NOT_INTS = [2.5, 3.0, True, False, "8", None, b"1", [1], (2,), *NUMPY_INTS]

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def snapshot(a: RunAllocator) -> tuple:
    """Everything the allocator holds, as plain values."""
    return (a.num_blocks, a.max_order, a.num_free, a._num_runs, bytes(a._state),
            list(a._run_end), list(a._run_start), list(a._claim),
            [sorted(s) for s in a._free_area], [sorted(s) for s in a._claimed_area],
            a.reserved)


@st.composite
def pools(draw):
    """A pool after a random history; returns (pool, held runs)."""
    n = draw(st.integers(2, 120))
    reserved = {0} if draw(st.booleans()) else set()
    a = RunAllocator(n, reserved=reserved)
    held: list[list[int]] = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["alloc", "grow", "free", "take"]))
        if kind == "alloc" and a.num_free:
            k = draw(st.integers(1, a.num_free))
            room = draw(st.one_of(st.none(), st.integers(0, 40)))
            held.append(a.allocate(k, AllocationHint(room=room, spread=draw(st.booleans()))))
        elif kind == "grow" and held and a.num_free:
            run = draw(st.sampled_from(held))
            run += a.allocate(1, AllocationHint(after=run[-1], room=draw(st.integers(0, 20))))
        elif kind == "free" and held:
            a.free(held.pop(draw(st.integers(0, len(held) - 1))))
        elif kind == "take" and a.num_free:
            free_id = draw(st.sampled_from([i for i in range(n) if a.is_free(i)]))
            a.take(free_id)
            held.append([free_id])
    a.check()
    return a, held


def ids_in_state(a: RunAllocator, state: int) -> list[int]:
    return [i for i in range(a.num_blocks) if a._state[i] == state]


def refused(a: RunAllocator, call, named) -> None:
    """``call(a)`` raises AllocationError mentioning ``named`` and changes nothing."""
    before = snapshot(a)
    with pytest.raises(AllocationError) as exc:
        call(a)
    assert repr(named) in str(exc.value) or str(named) in str(exc.value), \
        f"{exc.value} does not name {named!r}"
    assert snapshot(a) == before
    a.check()


def bad_id_for(a: RunAllocator, data, states) -> object:
    """A value that is not an id of the pool in one of ``states``."""
    wrong_state = [i for s in states for i in ids_in_state(a, s)]
    return data.draw(st.sampled_from(NOT_INTS + [-1, -a.num_blocks, a.num_blocks,
                                                 a.num_blocks + 7] + wrong_state))


# ------------------------------------------------------------------ allocate

@SETTINGS
@given(pool=pools(), data=st.data())
def test_allocate_refuses_a_bad_count(pool, data):
    a, _ = pool
    bad = data.draw(st.sampled_from(NOT_INTS + [-1, -100, a.num_free + 1, a.num_blocks + 5]))
    if isinstance(bad, int) and not isinstance(bad, bool) and 0 <= bad <= a.num_free:
        return
    refused(a, lambda p: p.allocate(bad), bad)


@SETTINGS
@given(pool=pools(), data=st.data())
def test_allocate_refuses_a_bad_after(pool, data):
    a, _ = pool
    bad = bad_id_for(a, data, (FREE, RESERVED))
    if bad is None:                               # None is the default: a valid after
        return
    n = data.draw(st.integers(0, max(0, a.num_free)))
    refused(a, lambda p: p.allocate(n, AllocationHint(after=bad)), bad)


@SETTINGS
@given(pool=pools(), data=st.data())
def test_allocate_refuses_a_bad_room_or_spread(pool, data):
    a, held = pool
    after = data.draw(st.sampled_from([None] + [run[-1] for run in held]))
    n = data.draw(st.integers(0, a.num_free))
    if data.draw(st.booleans()):
        bad = data.draw(st.sampled_from([v for v in NOT_INTS if v is not None] + [-1, -7]))
        refused(a, lambda p: p.allocate(n, AllocationHint(after=after, room=bad)), bad)
    else:
        bad = data.draw(st.sampled_from([0, 1, "yes", None, 2.0, *NUMPY_INTS]))
        refused(a, lambda p: p.allocate(n, AllocationHint(after=after, room=4, spread=bad)),
                bad)


@SETTINGS
@given(pool=pools(), data=st.data())
def test_allocate_refuses_a_hint_that_is_not_a_hint(pool, data):
    # a hint is an AllocationHint or the plain tuple (after, room, spread, end)
    a, held = pool
    n = data.draw(st.integers(0, a.num_free))
    bad = data.draw(st.sampled_from([v for v in NOT_INTS if v is not None]
                                    + [(None, 4, False), (None, 4, False, 0, 1),
                                       [None, 4, False, 0], {"room": 4}]))
    refused(a, lambda p: p.allocate(n, bad), bad)


# ------------------------------------------------------------------ free, take, queries

@SETTINGS
@given(pool=pools(), data=st.data())
def test_free_refuses_any_bad_id_in_the_list(pool, data):
    a, held = pool
    good = data.draw(st.sampled_from(held)) if held else []
    bad = bad_id_for(a, data, (FREE, RESERVED))
    ids = list(good)
    ids.insert(data.draw(st.integers(0, len(ids))), bad)
    refused(a, lambda p: p.free(ids), bad)


@SETTINGS
@given(pool=pools(), data=st.data())
def test_free_refuses_an_id_listed_twice(pool, data):
    a, held = pool
    if not held:
        return
    good = data.draw(st.sampled_from(held))
    twice = data.draw(st.sampled_from(good))
    ids = data.draw(st.permutations(good + [twice]))
    refused(a, lambda p: p.free(ids), twice)


@pytest.mark.parametrize("ids", [5, None, 2.5, object()])
def test_free_refuses_what_is_not_a_collection_of_ids(ids):
    a = RunAllocator(16)
    a.allocate(8)
    refused(a, lambda p: p.free(ids), ids)


def test_free_refuses_mixed_types_that_do_not_sort():
    a = RunAllocator(16)
    ids = a.allocate(4) + ["x"]
    refused(a, lambda p: p.free(ids), "x")
    refused(a, lambda p: p.free(iter(ids)), "give block ids")


@pytest.mark.parametrize("ids", [[], (), range(3, 3), set()])
def test_free_refuses_an_empty_collection(ids):
    """Freeing nothing is the caller's mistake (it lost its ids, or should have checked),
    named as such; callers with possibly nothing to give back (the pool's prefix-cache
    reset with no cached block) check first."""
    a = RunAllocator(16, reserved={0})
    a.allocate(8)
    refused(a, lambda p: p.free(ids), "no ids given")
    used_up = iter(a.allocate(2))
    a.free(used_up)
    refused(a, lambda p: p.free(used_up), "no ids given")    # the same iterator again


@SETTINGS
@given(pool=pools(), data=st.data())
def test_take_refuses_what_is_not_a_free_id(pool, data):
    a, _ = pool
    bad = bad_id_for(a, data, (ALLOCATED, RESERVED))
    refused(a, lambda p: p.take(bad), bad)


@SETTINGS
@given(pool=pools(), data=st.data())
def test_queries_refuse_what_is_not_an_id(pool, data):
    a, _ = pool
    bad = data.draw(st.sampled_from([v for v in NOT_INTS]))
    refused(a, lambda p: p.is_free(bad), bad)
    refused(a, lambda p: list(p.free_ids_from(bad)), bad)
    refused(a, lambda p: list(p.free_ids_from(-1)), -1)


def test_is_free_is_false_outside_the_pool():
    a = RunAllocator(8)
    assert not a.is_free(-1) and not a.is_free(8) and a.is_free(7)


# ------------------------------------------------------------------ construction

@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None, *NUMPY_INTS])
def test_bad_pool_size_is_a_clear_error(bad):
    with pytest.raises(AllocationError, match="num_blocks must be an integer >= 1") as exc:
        RunAllocator(bad)
    assert repr(bad) in str(exc.value)


@pytest.mark.parametrize("reserved, named", [
    ([8], "8"), ([-1], "-1"), ([2.5], "2.5"), (["a"], "'a'"), (5, "5"), ([[1]], "[[1]]"),
    *([([np.int64(2)], repr(np.int64(2)))] if np is not None else []),
])
def test_bad_reserved_ids_are_a_clear_error(reserved, named):
    with pytest.raises(AllocationError, match="reserved") as exc:
        RunAllocator(8, reserved=reserved)
    assert named in str(exc.value)


# ------------------------------------------------------------------ good arguments still work

@SETTINGS
@given(pool=pools(), data=st.data())
def test_valid_edge_arguments_are_accepted(pool, data):
    """The boundaries of the valid ranges: n == 0 and n == num_free, room == 0, spread
    either way, after == each held run's last id."""
    a, held = pool
    after = data.draw(st.sampled_from([None] + [run[-1] for run in held]))
    assert a.allocate(0, AllocationHint(after=after, room=0, spread=True)) == []
    n = a.num_free
    ids = a.allocate(n, AllocationHint(after=after, room=0, spread=data.draw(st.booleans())))
    assert len(set(ids)) == n and a.num_free == 0
    a.check()
