"""The scheduler's view of mapped granules, against a worker applying the ops for real
bookkeeping (KvMemory on the CPU stand-in driver, with memory that can run out)."""

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from proxima.memory.channel import (MAPPED, MAPPING, UNMAPPED, WHOLE, ChannelError,
                                    ElasticChannel)
from proxima.memory.kv import KvMemory
from proxima.memory.ops import Op, Report
from tests.memory.fake_driver import MiB, FakeDriver

PAGE = 64 * 1024      # 32 blocks a granule


def test_unmap_takes_effect_at_once_and_travels_with_the_next_step():
    ch = ElasticChannel(num_blocks=320, granule_blocks=32, workers=2)
    assert ch.num_granules == 10 and ch.count(MAPPED) == 10 and not ch.pending
    ch.unmap(3, 2)
    assert not ch.allocatable(96) and not ch.allocatable(159) and ch.allocatable(160)
    assert ch.pending
    batch = ch.build()
    assert batch.seq == 0 and batch.ops == (Op.unmap(3, 2),)
    assert ch.build() is None
    # pending until every worker said it unmapped (in the background: a later step), so
    # that an idle engine keeps stepping and the workers' mapped count is heard
    ch.on_report(Report(((0, ()),), mapped_granules=8, granule_blocks=32))
    assert ch.pending
    ch.on_report(Report(((0, ()),), mapped_granules=8, granule_blocks=32))
    assert not ch.pending and ch.reported_mapped == 8


def test_a_map_is_usable_only_once_confirmed():
    ch = ElasticChannel(320, 32)
    seen = []
    ch.listeners.append(lambda run, ok: seen.append((run, ok)))
    ch.unmap(1, 4)
    first = ch.build()
    ch.map(2, 2)
    assert ch.state[2] == MAPPING and not ch.allocatable(64)
    batch = ch.build()
    assert ch.pending                          # waiting for the confirmation
    ch.on_report(Report(((first.seq, ()), (batch.seq, ())), mapped_granules=8,
                        granule_blocks=32))
    assert ch.allocatable(64) and ch.allocatable(127) and not ch.allocatable(32)
    assert seen == [(range(2, 4), True)] and not ch.pending
    assert ch.reported_mapped == 8


def test_a_failed_map_goes_back_to_unmapped_and_is_reconciled():
    ch = ElasticChannel(320, 32)
    seen = []
    ch.listeners.append(lambda run, ok: seen.append((run, ok)))
    ch.unmap(1, 5)
    ch.build()
    ch.map(1, 5)
    batch = ch.build()
    ch.on_report(Report(((batch.seq, ((4, 2),)),), 8, 32))    # granules 4, 5 failed
    assert [ch.state[g] for g in range(1, 6)] == [MAPPED] * 3 + [UNMAPPED] * 2
    assert seen == [(range(1, 4), True), (range(4, 6), False)]
    assert ch.build().ops == (Op.unmap(4, 2),)    # workers that did map give it back
    assert ch.stats["map_failures"] == 2


def test_with_two_workers_a_map_waits_for_both_reports_and_keeps_either_failure():
    """Workers that map in the background report the same batch in different steps."""
    ch = ElasticChannel(320, 32, workers=2)
    ch.unmap(1, 4)
    ch.build()
    ch.map(1, 2)
    first = ch.build()
    ch.map(3, 2)
    second = ch.build()
    ch.on_report(Report(((first.seq, ()), (second.seq, ((4, 1),))), 9, 32))   # worker 0
    assert ch.state[1] == MAPPING and ch.state[3] == MAPPING and ch.pending
    ch.on_report(Report(((first.seq, ()),), 8, 32))                          # worker 1
    assert ch.allocatable(32) and ch.allocatable(95) and ch.state[3] == MAPPING
    ch.on_report(Report(((second.seq, ()),), 9, 32))
    assert ch.state[3] == MAPPED and ch.state[4] == UNMAPPED      # worker 0 failed granule 4
    assert ch.build().ops == (Op.unmap(4, 1),)
    with pytest.raises(ValueError, match="0 workers"):
        ElasticChannel(320, 32, workers=0)


def test_requests_that_contradict_the_state_are_refused():
    ch = ElasticChannel(320, 32)
    with pytest.raises(ChannelError, match="granule 2 is mapped, not unmapped"):
        ch.map(2, 1)
    with pytest.raises(ValueError, match="null block"):
        ch.unmap(0, 1)
    ch.unmap(5, 1)
    with pytest.raises(ChannelError, match="is unmapped"):
        ch.unmap(4, 2)
    with pytest.raises(ChannelError, match="block 160 is in an unmapped granule"):
        ch.move(150, 10, 11)
    ch.move(10, 200, 8)
    assert ch.build().ops[-1] == Op.move(10, 200, 8)
    with pytest.raises(ChannelError, match="assumed 32"):
        ch.on_report(Report((), 10, 16))


class ChannelAgainstWorker(RuleBasedStateMachine):
    """Random unmaps, maps, memory taken and given back by another process, steps whose
    reports arrive ``lag`` steps late (async scheduling): whatever the scheduler may hand
    out is backed on the worker, and once nothing is pending both agree exactly."""

    @initialize(lag=st.integers(0, 2), granules=st.integers(2, 12))
    def setup(self, lag, granules):
        self.driver = FakeDriver()
        self.worker = KvMemory([PAGE * 32 * granules] * 2, 32 * granules, driver=self.driver)
        self.ch = ElasticChannel(32 * granules, self.worker.granule_blocks)
        self.lag = lag
        self.reports = deque()

    def _pick(self, data, state):
        runs = [range(max(r.start, 1), r.stop) for r in self.ch.ranges(state)]  # never 0
        runs = [r for r in runs if len(r)]
        if not runs:
            return None
        run = data.draw(st.sampled_from(runs))
        first = data.draw(st.integers(run.start, run.stop - 1))
        return first, data.draw(st.integers(1, run.stop - first))

    @rule(data=st.data())
    def unmap(self, data):
        picked = self._pick(data, MAPPED)
        if picked:
            self.ch.unmap(*picked)

    @rule(data=st.data())
    def map(self, data):
        picked = self._pick(data, UNMAPPED)
        if picked:
            self.ch.map(*picked)

    @rule(free_granules=st.integers(0, 6))
    def other_process(self, free_granules):
        """Another process leaves this much memory free (it grabs or frees the rest)."""
        self.driver.capacity = self.driver.used + free_granules * self.worker.bytes_per_granule

    @rule()
    def step(self):
        batch = self.ch.build()
        if batch is not None:
            failed = self.worker.apply(batch.ops)
            self.reports.append(Report(((batch.seq, tuple(failed)),),
                                       self.worker.mapped_granules, self.worker.granule_blocks))
        while len(self.reports) > self.lag:
            self.ch.on_report(self.reports.popleft())

    @invariant()
    def allocatable_means_backed(self):
        for g in range(self.ch.num_granules):
            if self.ch.state[g] == MAPPED:
                assert self.worker.arena.is_mapped(g), g
        assert self.worker.arena.is_mapped(0)

    @invariant()
    def agree_when_quiet(self):
        if not self.ch.pending and not self.reports:
            assert [self.worker.arena.is_mapped(g) for g in range(self.ch.num_granules)] == \
                   [s == MAPPED for s in self.ch.state]
        assert self.driver.used == self.worker.mapped_granules * self.worker.bytes_per_granule


ChannelAgainstWorker.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                   deadline=None)
TestChannelAgainstWorker = ChannelAgainstWorker.TestCase


def test_an_admitted_map_is_allocatable_at_once_goes_first_and_is_waited_for():
    """Issue 33: the scheduler admits against granules whose map is in flight. Their ops
    lead the step's batch (the workers map them first) and the wait point names them;
    the rest of the grow is confirmed first, as any map."""
    ch = ElasticChannel(320, 32)
    seen = []
    ch.listeners.append(lambda run, ok: seen.append((run, ok, set(ch.admitted))))
    ch.unmap(1, 9)
    ch.build()
    ch.map(1, 6)
    ch.admit([4, 5])
    assert ch.allocatable(4 * 32) and ch.allocatable(6 * 32 - 1)
    assert not ch.allocatable(1 * 32) and not ch.allocatable(6 * 32)
    batch = ch.build()
    assert batch.ops == (Op.map(4, 2), Op.map(1, 3), Op.map(6, 1))
    assert ch.wait_point == (batch.seq, 1)
    with pytest.raises(ChannelError, match="in flight"):
        ch.unmap(4, 1)                       # never released before the map is confirmed
    ch.on_report(Report(((batch.seq, ()),), 7, 32))
    assert [ch.state[g] for g in range(1, 7)] == [MAPPED] * 6
    assert ch.admitted == set() and ch.wait_point is None
    assert [(r, ok) for r, ok, _ in seen] == [(range(4, 6), True), (range(1, 4), True),
                                              (range(6, 7), True)]
    assert seen[0][2] == {4, 5}              # listeners can tell what was admitted


def test_a_map_sent_earlier_is_admitted_whole_and_a_failed_admitted_map_is_an_error():
    ch = ElasticChannel(320, 32)
    ch.unmap(1, 4)
    ch.build()
    ch.map(1, 2)
    sent = ch.build()
    assert ch.in_flight() == [(sent.seq, [1, 2])]
    ch.admit([1])                            # sent already: the workers finish that batch
    assert ch.wait_point == (sent.seq, WHOLE) and ch.in_flight() == [(sent.seq, [2])]
    with pytest.raises(ChannelError, match="unmapped"):
        ch.admit([3])
    ch.map(3, 2)
    ch.admit([3])
    batch = ch.build()
    assert ch.wait_point == (batch.seq, 1)         # its lead op, after the whole earlier batch
    with pytest.raises(ChannelError, match="already handed out"):
        ch.on_report(Report(((sent.seq, ()), (batch.seq, ((3, 1),))), 5, 32))
