"""Behaviour of proxima.allocator.RunAllocator, one rule per test."""

import subprocess
import sys

import pytest

from proxima.allocator import AllocationError, AllocationHint, RunAllocator
from proxima.allocator.hint import continued
from tests.unit.reference import free_runs, held_blocks, maximal_aligned_chunks


def take_all_but(a: RunAllocator, keep_free: set[int]) -> list[int]:
    """Allocate every free id outside ``keep_free`` (ids chosen one by one)."""
    taken = []
    all_free = [i for i in range(a.num_blocks) if a.is_free(i)]
    for i in all_free:
        if i not in keep_free:
            a.take(i)
            taken.append(i)
    a.check()
    return taken


@pytest.mark.parametrize("n", [1, 2, 3, 5, 12, 100, 1000, 4097])
def test_new_pool_is_all_free_in_maximal_aligned_chunks(n):
    a = RunAllocator(n)
    a.check()
    assert a.num_free == n
    assert a.largest_free_run == n
    assert a.num_free_runs == 1
    assert a.fragmentation == 0.0
    assert held_blocks(a) == maximal_aligned_chunks(n)
    assert sum(a.free_blocks_by_order()) == bin(n).count("1")


def test_reserved_ids_are_never_handed_out():
    a = RunAllocator(10, reserved=[0, 5])
    a.check()
    assert a.num_free == 8
    assert a.largest_free_run == 4          # 1..4 and 6..9
    ids = a.allocate(8)
    assert sorted(ids) == [1, 2, 3, 4, 6, 7, 8, 9]
    with pytest.raises(AllocationError, match="cannot allocate 1 blocks: only 0 of 10"):
        a.allocate(1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_pool_size_is_a_clear_error(bad):
    with pytest.raises(AllocationError, match="num_blocks must be an integer >= 1"):
        RunAllocator(bad)


def test_reserved_id_outside_the_pool_is_a_clear_error():
    with pytest.raises(AllocationError, match="reserved id 8 is outside the pool 0..7"):
        RunAllocator(8, reserved=[8])


def test_allocate_zero_returns_nothing_and_negative_is_an_error():
    a = RunAllocator(8)
    assert a.allocate(0) == []
    with pytest.raises(AllocationError, match="n must be an integer >= 0"):
        a.allocate(-1)
    assert a.num_free == 8


def test_allocate_more_than_free_names_both_numbers_and_changes_nothing():
    a = RunAllocator(16)
    a.allocate(10)
    with pytest.raises(AllocationError, match="cannot allocate 7 blocks: only 6 of 16 are free"):
        a.allocate(7)
    assert a.num_free == 6
    a.check()


def test_a_fresh_allocation_is_one_contiguous_run():
    a = RunAllocator(1000, reserved=[0])
    ids = a.allocate(37)
    assert ids == list(range(ids[0], ids[0] + 37))


def test_grows_in_place_when_the_next_ids_are_free():
    a = RunAllocator(1000, reserved=[0])
    ids = a.allocate(5)
    for step in range(20):
        more = a.allocate(1, AllocationHint(after=ids[-1]))
        assert more == [ids[-1] + 1]
        ids += more
    chunk = a.allocate(7, AllocationHint(after=ids[-1]))
    assert chunk == list(range(ids[-1] + 1, ids[-1] + 8))
    a.check()


def test_does_not_grow_in_place_when_an_id_is_taken():
    a = RunAllocator(64)
    ids = a.allocate(4)
    a.take(ids[-1] + 3)                      # blocks the third id after the run
    more = a.allocate(3, AllocationHint(after=ids[-1]))
    assert more != list(range(ids[-1] + 1, ids[-1] + 4))
    assert not set(more) & set(ids) and ids[-1] + 3 not in more
    a.check()


def test_best_fit_uses_the_smallest_free_run_that_fits():
    a = RunAllocator(64)
    keep = set(range(2, 5)) | set(range(10, 15)) | set(range(30, 40))   # runs of 3, 5, 10
    take_all_but(a, keep)
    assert sorted(e - s for s, e in free_runs(keep)) == [3, 5, 10]
    ids = a.allocate(4)
    assert set(ids) <= set(range(10, 15))
    ids = a.allocate(3)
    assert set(ids) == {2, 3, 4}
    a.check()


def test_room_prefers_a_run_where_the_request_can_grow():
    a = RunAllocator(64)
    keep = set(range(2, 5)) | set(range(30, 40))                      # runs of 3 and 10
    take_all_but(a, keep)
    ids = a.allocate(2, AllocationHint(room=8))
    assert set(ids) <= set(range(30, 40))
    more = a.allocate(6, AllocationHint(after=ids[-1]))
    assert more == list(range(ids[-1] + 1, ids[-1] + 7))


def test_new_runs_are_spread_so_that_each_can_grow():
    a = RunAllocator(4096, reserved=[0])
    runs = [a.allocate(2, AllocationHint(room=16)) for _ in range(32)]
    for ids in runs:                         # every request can grow to its room in place
        grown = a.allocate(14, AllocationHint(after=ids[-1]))
        assert grown == list(range(ids[-1] + 1, ids[-1] + 15))
    a.check()


def test_combines_runs_largest_first_only_when_no_single_run_fits():
    a = RunAllocator(64)
    keep = set(range(2, 5)) | set(range(10, 15)) | set(range(30, 40))
    take_all_but(a, keep)
    ids = a.allocate(13)                     # the 10-run whole, then best fit for 3
    assert ids == list(range(30, 40)) + [2, 3, 4]
    ids2 = a.allocate(5)                     # what is left: the 5-run
    assert ids2 == list(range(10, 15))
    assert a.num_free == 0 and a.largest_free_run == 0
    a.check()


def test_never_refuses_while_enough_ids_are_free():
    a = RunAllocator(101, reserved=[0, 50])
    held = [a.allocate(1) for _ in range(99)]
    a.free([h[0] for h in held[::2]])        # every other id: maximal fragmentation
    n = a.num_free
    ids = a.allocate(n)
    assert len(set(ids)) == n and a.num_free == 0
    a.check()


def test_free_merges_back_into_maximal_aligned_chunks():
    a = RunAllocator(100, reserved=[0])
    parts = [a.allocate(k) for k in (3, 17, 1, 40, 9)]
    for part in (parts[1], parts[3], parts[0], parts[4], parts[2]):
        a.free(part)
        a.check()
    assert held_blocks(a) == maximal_aligned_chunks(100, reserved=[0])
    assert a.largest_free_run == 99 and a.num_free_runs == 1


@pytest.mark.parametrize("bad_ids, message", [
    ([5], "cannot free id 5: it is not allocated"),
    ([0], "cannot free id 0: it is reserved"),
    ([64], "cannot free id 64: the pool's ids are 0..63"),
    ([-1], "cannot free id -1: the pool's ids are 0..63"),
])
def test_bad_free_is_a_clear_error_and_changes_nothing(bad_ids, message):
    a = RunAllocator(64, reserved=[0])
    ids = a.allocate(3)
    before = (a.num_free, a.largest_free_run, held_blocks(a))
    with pytest.raises(AllocationError, match=message):
        a.free(ids + bad_ids if bad_ids != [5] or 5 not in ids else bad_ids)
    assert (a.num_free, a.largest_free_run, held_blocks(a)) == before
    a.check()


def test_double_free_and_duplicate_ids_are_errors_that_change_nothing():
    a = RunAllocator(64)
    ids = a.allocate(4)
    with pytest.raises(AllocationError, match="listed twice"):
        a.free(ids + [ids[1]])
    assert a.num_free == 60
    a.free(ids)
    with pytest.raises(AllocationError, match="not allocated"):
        a.free(ids)
    assert a.num_free == 64
    a.check()


def test_free_accepts_ids_in_any_order():
    a = RunAllocator(64)
    ids = a.allocate(10)
    a.free(list(reversed(ids)))
    assert a.num_free == 64 and a.num_free_runs == 1
    a.check()


def test_take_claims_one_specific_free_id():
    a = RunAllocator(32)
    a.take(17)
    assert not a.is_free(17) and a.num_free == 31 and a.largest_free_run == 17
    with pytest.raises(AllocationError, match="cannot take id 17: it is not free"):
        a.take(17)
    a.check()


def test_stats_are_consistent():
    a = RunAllocator(64)
    keep = set(range(2, 5)) | set(range(10, 15)) | set(range(30, 40))
    take_all_but(a, keep)
    s = a.stats()
    assert s["num_free"] == 18
    assert s["largest_free_run"] == 10
    assert s["num_free_runs"] == 3
    assert s["fragmentation"] == pytest.approx(1 - 10 / 18)
    assert s["free_runs_by_order"][:4] == [0, 1, 1, 1]      # 3 -> order 1, 5 -> 2, 10 -> 3
    assert sum((1 << k) * c for k, c in enumerate(a.free_blocks_by_order())) == 18


def test_a_million_blocks_build_and_import_neither_torch_nor_vllm():
    """(How fast it builds is a benchmark's business, not a test's: ~0.1 s on the CI VM.)"""
    code = ("import sys\n"
            "from proxima.allocator import RunAllocator\n"
            "a = RunAllocator(1_000_000, reserved=[0])\n"
            "a.check()\n"
            "print(a.num_free, a.largest_free_run, 'torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["999999", "999999", "False", "False"]


def test_spread_shares_free_space_so_runs_can_outgrow_their_room():
    a = RunAllocator(4096, reserved=[0])
    runs = [a.allocate(4, AllocationHint(room=8, spread=True)) for _ in range(16)]
    for ids in runs:                         # each can grow 8x its stated room in place
        grown = a.allocate(60, AllocationHint(after=ids[-1]))
        assert grown == list(range(ids[-1] + 1, ids[-1] + 61))
    a.check()


def test_packing_keeps_the_rest_of_the_pool_whole():
    a = RunAllocator(4096, reserved=[0])
    runs = [a.allocate(4, AllocationHint(room=8, spread=False)) for _ in range(16)]
    assert a.largest_free_run >= 4096 - 1 - 16 * 8     # runs sit back to back by room
    for ids in runs:                         # and each still grows to its stated room
        assert a.allocate(4, AllocationHint(after=ids[-1])) == list(range(ids[-1] + 1, ids[-1] + 5))
    a.check()


def test_allocate_all_hands_out_every_free_id_ascending():
    a = RunAllocator(50, reserved=[0])
    keep = a.allocate(7)
    a.take(30)
    ids = a.allocate_all()
    assert ids == sorted(set(range(1, 50)) - set(keep) - {30})
    assert a.num_free == 0 and a.largest_free_run == 0 and a.num_free_runs == 0
    a.free(ids)
    a.check()


def test_count_runs_counts_the_pieces_of_a_block_table():
    from proxima.allocator import count_runs

    assert count_runs([]) == 0
    assert count_runs([7]) == 1
    assert count_runs([4, 5, 6, 9]) == 2
    assert count_runs([9, 8, 7]) == 3          # descending ids are not a run


# ------------------------------------------------------------------ claims: a lifetime

def test_a_claim_is_set_by_a_new_run_with_room_and_read_by_the_next_placement():
    a = RunAllocator(64)
    first = a.allocate(4, AllocationHint(room=10))
    assert first == [0, 1, 2, 3]
    assert a.claims() == {4: 10}                 # the free run [4, 64) is claimed to 10
    second = a.allocate(4, AllocationHint(room=4))
    assert second == [10, 11, 12, 13]            # packed right after the claim
    assert a.claims() == {4: 10}
    a.check()


def test_a_claim_stays_while_its_owner_grows_and_ends_when_the_run_is_used_up():
    a = RunAllocator(64)
    run = a.allocate(4, AllocationHint(room=10))
    a.allocate(4, AllocationHint(room=4))        # [10, 14): the claimed run is [4, 10)
    run += a.allocate(3, AllocationHint(after=run[-1]))
    assert a.claims() == {7: 10}
    run += a.allocate(3, AllocationHint(after=run[-1]))  # [4, 10) used up: the claim is gone
    assert run == list(range(10)) and a.claims() == {}
    a.check()


def test_freeing_the_owner_ends_its_claim_and_a_take_keeps_it_on_the_left():
    a = RunAllocator(64)
    run = a.allocate(4, AllocationHint(room=12))
    a.take(8)                                    # cuts the claimed run [4, 64)
    assert a.claims() == {4: 8}                  # left part [4, 8) keeps it; [9, 64) none
    a.free(run)
    assert a.claims() == {}                      # merged run [0, 8) starts claim-free
    a.check()


def test_with_the_same_free_ids_the_claims_explain_a_different_placement():
    """Claims are state beyond the free set, listed by claims() and checked by check()."""
    a, b = RunAllocator(64), RunAllocator(64)
    a.allocate(4, AllocationHint(room=20))
    b.allocate(4)
    assert [i for i in range(64) if a.is_free(i)] == [i for i in range(64) if b.is_free(i)]
    assert a.claims() == {4: 20} and b.claims() == {}
    assert a.allocate(8, AllocationHint(room=8)) == list(range(20, 28))
    assert b.allocate(8, AllocationHint(room=8)) == list(range(4, 12))


# ------------------------------------------------------------------ frees, views

def test_a_reversed_table_is_one_range_and_merges_whole():
    a = RunAllocator(1000, reserved=[0])
    ids = a.allocate(300, AllocationHint(room=300))
    a.free(ids[::-1])                            # vLLM's order: tail first
    assert a.num_free_runs == 1 and a.largest_free_run == 999
    a.check()


def test_free_ids_from_and_the_buddy_view():
    a = RunAllocator(20, reserved=[0])
    a.allocate(5)                                # ids 1..5
    a.take(9)
    assert list(a.free_ids_from(7)) == [7, 8] + list(range(10, 20))
    assert list(a.free_ids_from(0)) == [6, 7, 8] + list(range(10, 20))
    assert list(a.free_blocks()) == [(6, 1), (8, 0), (10, 1), (12, 2), (16, 2)]
    assert a.free_blocks_by_order() == [1, 2, 2, 0, 0]
    assert a.free_runs() == [(6, 9), (10, 20)]


def test_a_hint_continues_after_the_ids_handed_out():
    hint = AllocationHint(after=4, room=10, spread=True, end=7)
    assert continued(hint, 9, 5) == AllocationHint(after=9, room=5, spread=True, end=7)
    assert AllocationHint(*continued(hint, 20, 12)).room == 0   # room never goes below 0
    assert continued(AllocationHint(room=3), 2, 3) == AllocationHint(after=2, room=0)
    plain = AllocationHint(end=5)                            # no run to continue
    assert continued(plain, 9, 1) is plain
    assert continued((4, 10, True, 7), 9, 5) == (9, 5, True, 7)       # the plain form
    assert type(continued(hint, 9, 5)) is tuple


def test_a_plain_tuple_is_the_same_hint_as_an_allocation_hint():
    """The hot path's form (a plain tuple, the queue's continuation) places every id
    where the named form does, over a mix of new runs with room, growth and frees."""
    named, plain = RunAllocator(300, reserved=[0]), RunAllocator(300, reserved=[0])
    assert (3, 8, True, 2) == AllocationHint(3, 8, True, 2)
    held = []
    for i in range(60):
        if held and i % 3 == 0:
            ids = held.pop(i % len(held))
            named.free(ids)
            plain.free(ids)
            continue
        if held and i % 2:
            run = held[i % len(held)]
            fields = (run[-1], 6, i % 4 == 1, i)
        else:
            run, fields = None, (None, 2 + i % 9, i % 4 == 0, i)
        n = 1 + i % 3
        got = named.allocate(n, AllocationHint(*fields))
        assert plain.allocate(n, tuple(fields)) == got
        if run is None:
            held.append(got)
        else:
            run += got
    assert named.free_runs() == plain.free_runs()
