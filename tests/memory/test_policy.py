"""proxima.memory.policy: the grow/shrink decisions, with a fake clock and a model pool.

The pool here is a small model of the elastic free queue (live / free / cached blocks per
granule); the real queue in vLLM's scheduler is exercised in
tests/vllm/test_elastic_connector.py. Maps are confirmed (or failed) through the real
channel, as the workers' reports would.
"""

import pytest

from proxima.memory.channel import MAPPED, MAPPING, UNMAPPED, ElasticChannel
from proxima.memory.ops import Report
from proxima.memory.policy import GrowShrinkPolicy, PolicyOptions
from proxima.memory.policy_options import format_bytes

G = 4          # blocks per granule
B = 1 << 20    # bytes per granule


class Pool:
    """Per granule: live and cached blocks; free = G - live - cached when mapped."""

    def __init__(self, channel: ElasticChannel, mapped: int):
        self.ch = channel
        self.live = [0] * channel.num_granules
        self.cached = [0] * channel.num_granules
        self.live[0] = 1                                   # the null block
        self.ch.state[mapped:] = bytes([UNMAPPED]) * (channel.num_granules - mapped)
        self.released = []

    @property
    def num_free_blocks(self):
        return sum(G - self.live[g] for g in range(self.ch.num_granules)
                   if self.ch.state[g] == MAPPED)

    def live_blocks(self):
        return sum(self.live) - 1

    def hot_cached_blocks(self):
        return 0

    def releasable(self):             # cheapest first, as the real queue: fewest cached
        return sorted(((g, self.cached[g]) for g in range(1, self.ch.num_granules)
                       if self.ch.state[g] == MAPPED and not self.live[g]),
                      key=lambda gc: (gc[1], -gc[0]))

    def num_releasable(self):
        return len(self.releasable())

    def release(self, granules):
        self.released += list(granules)
        evicted = sum(self.cached[g] for g in granules)
        for g in granules:
            self.cached[g] = 0
        return evicted


def setup(num_granules=16, mapped=1, **options):
    ch = ElasticChannel(num_granules * G, G)
    pool = Pool(ch, mapped)
    now = [0.0]
    demand = [0]
    policy = GrowShrinkPolicy(pool, ch, B, PolicyOptions(**options), clock=lambda: now[0],
                              forecast=lambda: demand[0])
    return ch, pool, policy, now, demand


def confirm(ch, failed=()):
    """The workers' answer to what was sent: maps confirmed, except ``failed`` granules."""
    batch = ch.build()
    if batch is None:
        return
    bad = tuple((g, 1) for g in failed)
    ch.on_report(Report(((batch.seq, bad),), ch.count(MAPPED), G))


def test_grows_at_once_when_the_held_requests_need_more_than_is_free():
    ch, pool, policy, now, demand = setup()
    demand[0] = 10                         # 10 blocks may still be needed, 3 are free
    policy.step()
    assert ch.count(MAPPING) == 2 and policy.stats.grows == 1          # 3 + 2 * 4 >= 10
    policy.step()
    assert policy.stats.grows == 1                  # maps in flight count: not asked twice
    confirm(ch)
    assert ch.count(MAPPED) == 3


def test_never_grows_above_the_maximum_nor_shrinks_below_the_minimum():
    ch, pool, policy, now, demand = setup(max_bytes=4 * B, min_bytes=2 * B, release_delay_s=0)
    demand[0] = 1000
    policy.step()
    confirm(ch)
    assert ch.count(MAPPED) == 4
    policy.step()
    assert ch.count(MAPPING) == 0
    demand[0] = 0
    policy.step()
    confirm(ch)
    assert ch.count(MAPPED) == 2                    # the minimum


def test_shrinks_only_after_the_excess_lasted_the_delay():
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=10.0)
    policy.step()
    assert policy.pending and ch.count(MAPPED) == 6
    now[0] = 9.9
    policy.step()
    assert ch.count(MAPPED) == 6 and 0 < policy.due_in() < 0.2
    now[0] = 10.0
    policy.step()
    assert ch.count(MAPPED) == 1 and sorted(pool.released) == [1, 2, 3, 4, 5]
    assert policy.stats.bytes_returned == 5 * B and not policy.pending


def test_a_short_dip_in_load_does_not_release_memory():
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=10.0)
    policy.step()
    now[0] = 5.0
    demand[0] = 20                                   # load is back before the delay
    policy.step()
    now[0] = 12.0
    demand[0] = 0
    policy.step()                                    # the delay starts again from here
    assert ch.count(MAPPED) == 6


def test_granules_holding_live_blocks_are_never_released():
    # cache_hold_s 0: granules of cached blocks go with the release delay (the rule before
    # the ledger)
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=0.0, cache_hold_s=0.0)
    pool.live[3] = 2
    pool.cached[4] = 3
    policy.step()
    assert 3 not in pool.released and ch.state[3] == MAPPED
    assert policy.stats.evicted_cached == 3          # granule 4's cached blocks went with it


def test_a_failed_grow_is_said_once_retried_after_the_pause_and_serving_goes_on():
    ch, pool, policy, now, demand = setup(retry_s=2.0)
    demand[0] = 6
    policy.step()
    confirm(ch, failed=[1])                          # another process holds the memory
    assert policy.stats.failed_grows == 1 and policy.stats.short
    assert ch.state[1] == UNMAPPED
    now[0] = 1.0
    policy.step()
    assert ch.count(MAPPING) == 0                    # not before retry_s
    now[0] = 2.5
    policy.step()
    assert ch.count(MAPPING) == 1
    confirm(ch)
    assert not policy.stats.short and ch.count(MAPPED) == 2


def test_a_short_gpu_keeps_what_a_partial_map_got_and_is_asked_less_and_less_often():
    """Issue 33 item 4: the map that ran out of memory half-way keeps the granules it got;
    then, every map failing, the tries come 1, 2, 4, 8, 8, ... s apart (not every
    ``retry_s``): 17 in two minutes, not 120. A map that succeeds starts the pauses over."""
    ch, pool, policy, now, demand = setup(num_granules=64, retry_s=1.0, retry_max_s=8.0)
    demand[0] = 40                                   # 10 granules wanted
    policy.step()
    asked = ch.count(MAPPING)
    confirm(ch, failed=range(6, 1 + asked))          # granules 1-5 mapped, the rest not
    assert ch.count(MAPPED) == 6 and ch.count(MAPPING) == 0
    assert policy.stats.failed_grow_attempts == 1 and policy.stats.short
    tries = []
    for tick in range(1, 1201):                      # two minutes, a step every 0.1 s
        now[0] = tick / 10
        policy.step()
        if ch.count(MAPPING):
            tries.append(now[0])
            confirm(ch, failed=[g for g in range(ch.num_granules) if ch.state[g] == MAPPING])
    gaps = [round(b - a, 1) for a, b in zip([0.0] + tries, tries)]
    assert gaps[:6] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert len(tries) == 17 and policy.stats.failed_grow_attempts == 1 + len(tries)
    assert ch.count(MAPPED) == 6                     # nothing given back meanwhile
    now[0] += 8.0
    policy.step()
    confirm(ch)                                      # the memory came back
    assert not policy.stats.short and ch.count(MAPPED) > 6
    demand[0] += 200
    policy.step()
    confirm(ch, failed=[g for g in range(ch.num_granules) if ch.state[g] == MAPPING])
    now[0] += 1.0                                    # the first pause again: 1 s
    policy.step()
    assert ch.count(MAPPING) > 0


def test_with_the_drivers_free_memory_a_grow_asks_no_more_and_retries_when_more_is_free():
    ch, pool, policy, now, demand = setup(num_granules=32, retry_s=1.0)
    free = [2 * B + B // 2]                           # two granules and a half
    policy.free_bytes = lambda: free[0]
    demand[0] = 40
    policy.step()
    assert ch.count(MAPPING) == 2                    # not the 10 wanted
    confirm(ch)
    free[0] = B - 1                                  # less than a granule: nothing asked
    for tick in range(1, 50):
        now[0] = tick
        policy.step()
        assert ch.count(MAPPING) == 0
    assert policy.stats.failed_grow_attempts == 0
    free[0] = 3 * B                                  # the driver says 3, another takes them
    policy.step()
    confirm(ch, failed=[g for g in range(ch.num_granules) if ch.state[g] == MAPPING])
    assert policy.stats.failed_grow_attempts == 1
    now[0] += 0.5
    policy.step()
    assert ch.count(MAPPING) == 0                    # no more free than at the failure
    free[0] = 4 * B                                  # more is free: tried before the pause
    policy.step()
    assert ch.count(MAPPING) == 4


def test_limits_change_at_run_time():
    ch, pool, policy, now, demand = setup(release_delay_s=0.0)
    policy.set_limits(min_bytes=5 * B)
    policy.step()
    confirm(ch)
    assert ch.count(MAPPED) == 5
    demand[0] = 100                                  # busy: only the new maximum shrinks it
    policy.set_limits(min_bytes=0, max_bytes=2 * B)
    policy.step()
    assert ch.count(MAPPED) == 2
    with pytest.raises(ValueError, match="above the pool"):
        policy.set_limits(min_bytes=100 * B)
    policy.set_limits(clear_max=True)
    assert policy.max_granules == ch.num_granules


def test_the_compactor_is_asked_when_too_few_granules_are_empty():
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=0.0)
    for g in range(1, 6):
        pool.live[g] = 1                             # every granule pinned by one block
    wanted = policy.step(moves=True)                 # the shrink stops short, releasing nothing
    assert wanted > 0 and pool.released == [] and ch.count(MAPPED) == 6
    for g in (4, 5):                                 # the caller moves two granules' blocks away
        pool.live[g] = 0
    pool.live[1] += 2
    policy.finish_shrink()                           # and the policy releases them, this step
    assert sorted(pool.released) == [4, 5]
    assert policy.stats.compactor_calls == 1


def test_without_moves_a_short_shrink_releases_what_it_finds():
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=0.0)
    for g in range(1, 5):
        pool.live[g] = 1                             # only granule 5 is empty
    assert policy.step() == 0
    assert pool.released == [5] and policy.stats.compactor_calls == 0


def test_a_shortfall_left_unanswered_is_released_at_the_next_step():
    ch, pool, policy, now, demand = setup(mapped=6, release_delay_s=0.0)
    for g in range(1, 5):
        pool.live[g] = 1
    assert policy.step(moves=True) > 0 and pool.released == []
    policy.step()
    assert pool.released[:1] == [5]


def test_format_bytes():
    assert format_bytes(3 << 30) == "3.00 GiB" and format_bytes(12) == "12 B"


def test_bad_options_name_the_value():
    with pytest.raises(ValueError, match="max_bytes must be None or an integer >= min_bytes"):
        PolicyOptions(min_bytes=10, max_bytes=5)
    with pytest.raises(ValueError, match="headroom: -0.1 is out of range"):
        PolicyOptions(headroom=-0.1)
    with pytest.raises(ValueError, match="release_delay_s: nan is not finite"):
        PolicyOptions(release_delay_s=float("nan"))
    with pytest.raises(ValueError, match="band must be a number, got '0.1'"):
        PolicyOptions(band="0.1")


def test_a_band_keeps_a_steady_load_from_growing_and_shrinking_granule_by_granule():
    """Demand that wobbles by a few blocks every second: without a band (0) every rise
    is a grow and every lasting dip a shrink; with the default band (5% of what is
    mapped, at least a granule) a grow maps a band more and a busy shrink keeps one."""
    counts = {}
    for band in (0.0, 0.25):
        ch, pool, policy, now, demand = setup(num_granules=64, release_delay_s=2.0,
                                              band=band)
        for t in range(120):
            now[0] = float(t)
            demand[0] = 80 + (t * 7) % 13 + (20 if (t // 10) % 2 else 0)
            policy.step()
            confirm(ch)
            # never short: what is wanted is free (or being mapped) after every step
            assert pool.num_free_blocks + ch.count(MAPPING) * G >= demand[0]
        counts[band] = (policy.stats.grows, policy.stats.shrinks)
    assert counts[0.25][0] < counts[0.0][0] and counts[0.25][1] < counts[0.0][1]
    assert counts[0.0][0] >= 5                         # the wobble did churn without it


def test_a_busy_shrink_keeps_a_band_and_an_idle_one_goes_to_the_minimum():
    ch, pool, policy, now, demand = setup(num_granules=64, mapped=40, release_delay_s=0.0,
                                          band=0.1)
    demand[0] = 8                                       # busy: 8 blocks wanted, 2 granules
    policy.step()
    # 40 mapped, band 4: (159 free - 8 wanted) // 4 = 37 spare granules, 4 of them kept
    assert ch.count(MAPPED) == 40 - 33
    demand[0] = 0
    pool.live[0] = 1
    policy.step()                                       # idle: down to the minimum
    assert ch.count(MAPPED) == 1


# ------------------------------------------------------------------ the release rule (issue 33)
def warm_idle(**options):
    """An idle engine at 8 granules: 1-3 hold cached blocks, 4-7 are empty."""
    ch, pool, policy, now, demand = setup(mapped=8, release_delay_s=10.0, **options)
    for g in (1, 2, 3):
        pool.cached[g] = G
    return ch, pool, policy, now, demand


def test_an_idle_engine_returns_empty_granules_and_keeps_its_warm_cache_until_the_hold():
    ch, pool, policy, now, demand = warm_idle(cache_hold_s=60.0)
    policy.step()
    now[0] = 10.0
    policy.step()
    assert sorted(pool.released) == [4, 5, 6, 7]             # memory is still returned
    assert policy.stats.evicted_cached == 0 and policy.pending
    assert policy.due_in() == pytest.approx(10.0)           # no spin: next look in a delay
    for t in (20.0, 30.0, 40.0, 50.0, 59.0):
        now[0] = t
        policy.step()
    assert ch.count(MAPPED) == 4 and policy.stats.evicted_cached == 0
    now[0] = 60.0                                           # nobody asked for the hold
    policy.step()
    assert ch.count(MAPPED) == 1 and policy.stats.evicted_cached == 3 * G
    assert not policy.pending


def test_another_engines_demand_takes_the_cache_at_once_as_much_as_it_asks():
    ch, pool, policy, now, demand = warm_idle(cache_hold_s=60.0)
    policy.step()
    now[0] = 1.0                                            # well within the delay
    policy.step(others_unmet_bytes=2 * B)
    assert len(pool.released) == 2 and sorted(pool.released) == [6, 7]   # empties first
    policy.step(others_unmet_bytes=5 * B)
    assert sorted(pool.released) == [1, 2, 3, 4, 5, 6, 7]
    assert policy.stats.evicted_cached == 3 * G and policy.stats.yields == 2


def test_a_short_gpu_takes_the_cache_after_the_delay():
    ch, pool, policy, now, demand = warm_idle(cache_hold_s=60.0, gpu_free_low=0.1)
    gpu = dict(gpu_free_bytes=50 * B, gpu_total_bytes=100 * B)
    policy.step(**gpu)
    now[0] = 10.0
    policy.step(**gpu)                                      # plenty free: cache kept
    assert ch.count(MAPPED) == 4
    now[0] = 20.0
    policy.step(gpu_free_bytes=9 * B, gpu_total_bytes=100 * B)   # short: others may wait
    assert ch.count(MAPPED) == 1 and policy.stats.evicted_cached == 3 * G


def test_a_failed_grow_is_unmet_demand_until_a_map_succeeds():
    ch, pool, policy, now, demand = setup(retry_s=1.0)
    demand[0] = 10
    policy.step()
    assert policy.unmet_bytes == 0
    confirm(ch, failed=[1, 2])
    assert policy.unmet_bytes == 2 * B
    policy.step()
    assert policy.unmet_bytes == 2 * B                      # still wanted, still short
    now[0] = 1.0
    policy.step()                                           # the retry: maps in flight...
    assert ch.count(MAPPING) == 2 and policy.unmet_bytes == 2 * B   # ...are not had yet
    confirm(ch)
    policy.step()
    assert policy.unmet_bytes == 0


# ------------------------------------------------------------------ idle models step aside
def test_an_idle_engine_gives_back_all_its_kv_after_idle_release_and_regrows_on_a_request():
    ch, pool, policy, now, demand = setup(mapped=8, min_bytes=4 * B, release_delay_s=10.0,
                                          cache_hold_s=60.0, idle_release_s=30.0)
    for g in (1, 2, 3):
        pool.cached[g] = G                                  # a warm cache, nobody asking
    policy.step()
    now[0] = 10.0
    policy.step()                                           # the empty granules above the min
    assert ch.count(MAPPED) == 4 and policy.stats.evicted_cached == 0
    assert policy.pending and policy.due_in() == pytest.approx(20.0)   # the idle release
    now[0] = 29.0
    policy.step()
    assert ch.count(MAPPED) == 4                            # not idle long enough yet
    now[0] = 30.0
    policy.step()                                           # idle 30 s: the minimum goes too
    assert ch.count(MAPPED) == 1 and policy.stats.evicted_cached == 3 * G
    assert not policy.pending                               # nothing left: it may stop
    demand[0] = 2                                           # the next request
    policy.step()
    confirm(ch)
    assert ch.count(MAPPED) >= 4                            # the minimum is back at once


def test_an_idle_engine_told_to_release_now_gives_back_all_its_kv_at_its_next_step():
    ch, pool, policy, now, demand = setup(mapped=8, min_bytes=4 * B, release_delay_s=10.0,
                                          cache_hold_s=60.0, idle_release_s=600.0)
    pool.cached[1] = G                                      # a warm cache goes too
    policy.step()
    demand[0] = 1
    assert policy.release_idle_now() is False               # busy: nothing changes
    policy.step()
    assert ch.count(MAPPED) >= 4
    demand[0] = 0
    now[0] = 1.0
    assert policy.release_idle_now() is True                # idle 1 s of its 600
    policy.step()
    assert ch.count(MAPPED) == 1 and policy.stats.evicted_cached == G
    demand[0] = 2                                           # the next request
    policy.step()
    confirm(ch)
    assert ch.count(MAPPED) >= 4                            # the minimum is back at once
    _, _, plain, _, _ = setup(mapped=8, min_bytes=4 * B)
    assert plain.release_idle_now() is False                # no idle release: refused


def test_without_idle_release_an_idle_engine_keeps_its_minimum():
    ch, pool, policy, now, demand = setup(mapped=8, min_bytes=4 * B, release_delay_s=10.0,
                                          cache_hold_s=10.0)
    for t in (0.0, 10.0, 100.0, 1000.0):
        now[0] = t
        policy.step()
    assert ch.count(MAPPED) == 4 and not policy.pending


def test_a_request_restarts_the_idle_clock():
    ch, pool, policy, now, demand = setup(mapped=4, min_bytes=4 * B, idle_release_s=30.0)
    policy.step()
    now[0] = 20.0
    demand[0] = 1
    policy.step()                                           # busy at 20 s
    demand[0] = 0
    now[0] = 40.0
    policy.step()                                           # idle since 40 s, not 0 s
    assert ch.count(MAPPED) == 4
    now[0] = 70.0
    policy.step()
    assert ch.count(MAPPED) == 1


def test_idle_release_is_checked_like_every_option():
    with pytest.raises(ValueError, match="idle_release_s"):
        PolicyOptions(idle_release_s=-1)
    with pytest.raises(ValueError, match="idle_release_s"):
        PolicyOptions(idle_release_s=True)


def startup_setup(mapped, target, **options):
    ch = ElasticChannel(16 * G, G)
    pool = Pool(ch, mapped)
    now = [0.0]
    policy = GrowShrinkPolicy(pool, ch, B, PolicyOptions(release_delay_s=1.0, **options),
                              clock=lambda: now[0], startup_granules=target)
    return ch, policy, now


@pytest.mark.parametrize("free, grown", [(None, 5), (100 * B, 5), (4 * B, 3), (3 * B, 2),
                                         (int(5.5 * B), 4)])
def test_the_start_up_grow_asks_no_more_than_the_gpu_has_free_less_its_low_mark(free, grown):
    """Warm-up's 3 granules kept, a start-up size of 8: the first step grows by 5, or by
    what the driver says is free less gpu_free_low (5%) of the GPU's 20 granules (one)."""
    ch, policy, _ = startup_setup(3, 8)
    assert policy.pending and policy.unstepped          # the engine steps from start-up
    policy.step(gpu_free_bytes=free, gpu_total_bytes=None if free is None else 20 * B)
    assert ch.count(MAPPING) == grown and policy.stats.grows == 1
    assert not policy.unstepped
    policy.step()                                       # a later step: no start-up grow
    assert ch.count(MAPPING) == grown and policy.stats.grows == 1


def test_on_a_gpu_short_at_start_up_the_engine_keeps_its_minimum():
    """Free below gpu_free_low of the GPU after warm-up: no start-up grow, and warm-up's
    granules above the minimum go at once (as they went at start-up before the grow)."""
    ch, policy, _ = startup_setup(3, 8, min_bytes=2 * B)
    policy.step(gpu_free_bytes=B // 2, gpu_total_bytes=20 * B)
    assert ch.count(MAPPED) == 2 and ch.count(MAPPING) == 0
    assert policy.stats.granules_released == 1 and policy.stats.grows == 0


def test_without_a_start_up_size_the_first_step_neither_grows_nor_releases_at_once():
    ch, policy, _ = startup_setup(3, 0)
    policy.step(gpu_free_bytes=0, gpu_total_bytes=20 * B)
    assert ch.count(MAPPED) == 3 and ch.count(MAPPING) == 0 and policy.stats.grows == 0


def test_the_start_up_grow_keeps_an_idle_engine_stepping_until_it_goes_back():
    """Warm-up within the minimum (1 granule), a start-up size of 3: the grow is excess
    the step it is confirmed, and the engine keeps stepping (pending) while it maps and
    through the release delay, then rests at its minimum."""
    ch, policy, now = startup_setup(1, 3)
    assert policy.pending                               # a start-up grow to come
    policy.step()
    assert ch.count(MAPPING) == 2
    now[0] = 0.1
    policy.step()                                       # still in flight
    assert policy.pending
    confirm(ch)
    assert policy.pending                               # not looked at since
    for t in range(2, 40):
        now[0] = t / 10
        policy.step()
        confirm(ch)
        if not policy.pending:
            break
    assert ch.count(MAPPED) == 1 and 1.0 <= now[0] <= 1.5
