"""proxima.allocator.granules (the per-granule index) and .eviction (the eviction policy, the
reuse horizon).

Pure Python. The index is driven through its transitions the way its owner (the elastic
free queue) drives it; the stateful test in tests/vllm/test_elastic_pool.py drives it
through the queue against a reference model.
"""

import pytest

from proxima.allocator import InvariantError
from proxima.allocator.eviction import EvictionPolicy, ReuseHorizon
from proxima.allocator.granules import FINISHED, FOREVER, PREEMPTED, GranuleIndex


def index(num_blocks=64, G=8, **kw) -> GranuleIndex:
    return GranuleIndex(num_blocks, G, reserved=(0,), **kw)


def test_counts_and_emptiness_follow_the_transitions():
    gi = index()
    assert gi.num_granules == 8 and gi.live[0] == 1 and gi.end_of_granule[0] == FOREVER
    assert [g for g, _ in gi.empty_granules()] == list(range(1, 8))
    gi.free_to_live([8, 9, 10], end=50)
    assert gi.live[1] == 3 and gi.end_of_granule[1] == 50 and gi.free_count(1) == 5
    gi.live_to_cached([9, 10])
    assert gi.cached[1] == 2 and gi.live[1] == 1 and list(gi.cached_ids()) == [9, 10]
    gi.live_to_free([8])
    assert gi.end_of_granule[1] == -1 and 1 in dict(gi.empty_granules())
    assert dict(gi.empty_granules())[1] == 2           # two cached blocks in it
    gi.cached_to_live([10], end=7)
    assert list(gi.cached_ids()) == [9] and gi.end_of_granule[1] == 7
    gi.check(live_ids=[10], cached_order=[9])


def test_place_picks_the_granule_whose_life_covers_the_block_best():
    gi = index()
    gi.free_to_live([8], end=100)         # granule 1 ends at 100
    gi.free_to_live([16], end=40)         # granule 2 at 40
    gi.free_to_live([24], end=10)         # granule 3 at 10
    assert gi.place(30) == 2              # smallest end >= 30: no granule's life grows
    assert gi.place(41) == 1
    assert gi.place(5) == 3
    # nothing outlives 200 but granule 0 (the null block never leaves): no cost there
    assert gi.place(200) == 0
    full = GranuleIndex(16, 8, reserved=(0,))
    full.free_to_live(range(1, 8), end=5)
    full.free_to_live([8], end=3)
    assert full.place(9) == 1             # granule 0 is full: the latest other granule


def test_the_window_holds_cached_blocks_older_than_the_horizon_per_class():
    gi = index()
    gi.free_to_live(range(8, 16), end=99)
    gi.tick(0, (5, 20))
    gi.live_to_cached([8, 9], FINISHED)
    gi.live_to_cached([10], PREEMPTED)
    gi.tick(3, (5, 20))
    gi.live_to_cached([11], FINISHED)
    gi.tick(5, (5, 20))
    assert [i for i in range(8, 16) if gi.in_window(i)] == [8, 9]     # cached at 0 <= 5-5
    gi.tick(8, (5, 20))
    assert [i for i in range(8, 16) if gi.in_window(i)] == [8, 9, 11]
    gi.tick(20, (5, 20))
    assert gi.in_window(10)                                            # preempted: 20 steps
    gi.tick(21, (None, None))                                          # strict: none
    assert gi.window_size == 0
    gi.check()
    assert gi.oldest_cached(10) == [8, 9, 10, 11]                      # LRU order overall


def test_max_window_bounds_the_departure_by_count():
    gi = index(max_window=2)
    gi.free_to_live(range(8, 14), end=9)
    gi.live_to_cached(list(range(8, 14)))
    gi.tick(10, (0, 0))
    assert gi.window_size == 2 and gi.window_ids_in(1, 5) == [8, 9]
    gi.cached_to_live([8], end=3)                       # leaves: the next one enters
    assert gi.window_ids_in(1, 5) == [9, 10]
    gi.check()


def test_unmap_and_map_and_their_refusals():
    gi = index()
    gi.free_to_live([40], end=1)
    with pytest.raises(ValueError, match="granule 5 cannot be unmapped"):
        gi.unmap(5)
    gi.unmap(6)
    assert not gi.mapped[6] and gi.free_count(6) == 0 and 6 not in dict(gi.empty_granules())
    with pytest.raises(ValueError, match="already mapped"):
        gi.map(5)
    gi.map(6)
    gi.check(live_ids=[40])


def test_check_finds_corruption():
    gi = index()
    gi.free_to_live([8], end=4)
    gi.live[1] += 1
    with pytest.raises(InvariantError, match="granule 1"):
        gi.check(live_ids=[8])
    gi = index()
    gi.free_to_live([8, 9], end=4)
    gi.live_to_cached([8, 9])
    gi.cached[1] = 0
    with pytest.raises(InvariantError, match="cached ids counted"):
        gi.check()
    gi = index()
    gi.free_to_live([8, 9], end=4)
    gi.num_live += 1                   # the running total the policy reads every step
    with pytest.raises(InvariantError, match="num_live is 4, the granules hold 3"):
        gi.check()


@pytest.mark.parametrize("text, expected", [
    ("lru", EvictionPolicy(max_window=0)), ("auto", EvictionPolicy()),
    ("auto:0.95", EvictionPolicy(quantile=0.95)), ("age:40", EvictionPolicy(horizon=40)),
    ("window:64", EvictionPolicy(horizon=0, max_window=64)), (" LRU ", EvictionPolicy(max_window=0)),
])
def test_eviction_policy_parses_and_prints_back(text, expected):
    policy = EvictionPolicy.parse(text)
    assert policy == expected and EvictionPolicy.parse(str(policy)) == policy


@pytest.mark.parametrize("text", ["fifo", "age:", "age:-1", "auto:2", "window:x", "lru:3", ""])
def test_bad_eviction_policies_are_one_clear_error(text):
    with pytest.raises(ValueError, match=f"eviction policy {text!r}"):
        EvictionPolicy.parse(text)


def test_reuse_horizon_warms_up_then_follows_the_ages_and_the_ghosts():
    r = ReuseHorizon(quantile=0.9, warmup=100, margin=1.0)
    assert r.horizon(0) == 0                      # nothing cached yet
    r.watching(10)
    assert r.horizon(40) == 30                    # watched 30 steps, nothing seen: wait
    assert r.horizon(110) == 0                    # watched long enough, no reuse at all
    for age in range(1, 11):
        r.on_hit(age)
    assert r.horizon(200) == 10                   # 0.9 quantile of 1..10 is 9, plus one
    r.on_early_eviction("k", cached_at=100)
    assert r.on_miss("other", 300) is False
    assert r.on_miss("k", 300) is True and r.ghost_hits == 1   # evicted early, wanted later
    assert r.horizon(300) == 11                   # the ghost's age (200) entered the sample
    r2 = ReuseHorizon(quantile=0.99, margin=1.25, warmup=0)
    r2.on_hit(40)
    assert r2.horizon(0) == 51


def test_a_restart_waits_out_a_new_warm_up_before_the_learnt_horizon_applies_again():
    r = ReuseHorizon(quantile=0.9, warmup=100, margin=1.0)
    r.restart(5)                                  # nothing cached yet: no period to restart
    r.watching(10)
    assert r.horizon(40) == 30
    for age in range(1, 11):
        r.on_hit(age)
    assert r.horizon(200) == 10                   # learnt: the first period's reuse
    r.restart(300)                                # idle, then a new load from step 300
    assert r.horizon(340) == 40                   # what was cached since 300 is kept
    assert r.horizon(399) == 99
    assert r.horizon(400) == 10                   # warmed up: the samples decide again
    assert r.hits == 10


def test_move_carries_each_content_with_its_state_through_a_permutation():
    """KV compaction's moves (GranuleIndex.move): live ids keep their ends, cached ids
    their place in the LRU order, class, age and window; a cycle among contents works."""
    gi = index()
    gi.free_to_live([8, 9, 10, 11, 12], end=50)
    gi.tick(0, (2, 2))
    gi.live_to_cached([9, 10], FINISHED)
    gi.live_to_cached([11], PREEMPTED)
    gi.tick(4, (2, 2))                       # 9, 10, 11 old enough: in the window
    gi.free_to_live([16], end=70)
    gi.live_to_cached([16], FINISHED)        # younger: outside the window
    before = list(gi.cached_ids())
    assert before == [9, 10, 11, 16] and gi.in_window(9) and not gi.in_window(16)
    # live 8 -> free 40; cached 9 -> cached 10's id, 10 -> live 12's id, 12 -> 9 (a cycle);
    # cached 16 -> free 17
    gi.move({8: 40, 9: 10, 10: 12, 12: 9, 16: 17})
    assert list(gi.cached_ids()) == [10, 12, 11, 17]
    assert gi.in_window(10) and gi.in_window(12) and not gi.in_window(9)
    assert not gi.in_window(17) and gi.class_of(11) == PREEMPTED
    assert gi.end[40] == 50 and gi.end[9] == 50 and gi.end[8] == -1
    assert gi.live[1] == 1 and gi.live[5] == 1 and gi.cached[1] == 3 and gi.cached[2] == 1
    gi.check(live_ids=[9, 40], cached_order=[10, 12, 11, 17])
    gi.tick(5, (2, 2))                       # the window still follows the moved ids
    gi.check(live_ids=[9, 40], cached_order=[10, 12, 11, 17])
    gi.cached_to_live([12], end=60)
    gi.check(live_ids=[9, 12, 40], cached_order=[10, 11, 17])


def test_move_refuses_a_destination_that_holds_a_content():
    gi = index()
    gi.free_to_live([8, 9], end=5)
    with pytest.raises(ValueError, match="destination 9 is not free"):
        gi.move({8: 9})
    with pytest.raises(ValueError, match="id 20 holds no content"):
        gi.move({20: 21})
    gi.check(live_ids=[8, 9])
