"""Hypothesis stateful test: RunAllocator against a set of free ids.

Random interleavings of allocate (with and without ``after``, ``room`` and ``spread``),
allocate_all, take, free of whole or partial allocations in any order, and bad frees,
over pools of odd sizes with reserved ids. After every step ``check()`` passes and the
allocator agrees with the reference on every observable: free ids, runs, the buddy view,
the claims (tests.unit.reference.ClaimModel, the module doc's lifetime), and frees come
back as exactly as many ranges as the freed ids form.
"""

import os

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proxima.allocator import AllocationError, AllocationHint, RunAllocator
from tests.unit.reference import (ClaimModel, canonical_blocks, free_runs, held_blocks,
                                  maximal_aligned_chunks)


class CountingAllocator(RunAllocator):
    """RunAllocator counting the ranges its frees give back (nothing else changes)."""

    __slots__ = ("ranges_given_back",)

    def _give_back_range(self, start, end):
        self.ranges_given_back += 1
        return super()._give_back_range(start, end)


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 300), reserve_null=st.booleans(),
                extra_reserved=st.lists(st.integers(0, 299), max_size=3))
    def build(self, num_blocks, reserve_null, extra_reserved):
        self.reserved = {r for r in extra_reserved if r < num_blocks}
        if reserve_null:
            self.reserved.add(0)
        self.n = num_blocks
        self.a = CountingAllocator(num_blocks, reserved=self.reserved)
        self.a.ranges_given_back = 0
        self.free = set(range(num_blocks)) - self.reserved
        self.owned: list[list[int]] = []          # allocations still held, in order
        self.claims = ClaimModel(num_blocks)

    # ---------------------------------------------------------------- rules
    @rule(data=st.data(), use_after=st.booleans(), room=st.one_of(st.none(), st.integers(0, 64)),
          spread=st.booleans())
    def allocate(self, data, use_after, room, spread):
        n = data.draw(st.integers(0, max(0, min(len(self.free) + 2, 80))), label="n")
        after = None
        if use_after and self.owned:
            after = data.draw(st.sampled_from(self.owned), label="grow")[-1]
        if n > len(self.free):
            try:
                self.a.allocate(n, AllocationHint(after=after, room=room, spread=spread))
            except AllocationError as exc:
                assert f"cannot allocate {n} blocks: only {len(self.free)}" in str(exc)
            else:
                raise AssertionError("allocate beyond num_free did not raise")
            return
        ids = self.a.allocate(n, AllocationHint(after=after, room=room, spread=spread))
        assert len(ids) == n and len(set(ids)) == n
        assert set(ids) <= self.free, "handed out an id that was not free"
        grew = after is not None and n > 0 and set(range(after + 1, after + 1 + n)) <= self.free
        if grew:
            assert ids == list(range(after + 1, after + 1 + n)), "did not grow in place"
        if n > 0 and any(e - s >= n for s, e in free_runs(self.free)):
            assert ids == list(range(ids[0], ids[0] + n)), "split although one run fits"
        if n:
            want = n if room is None or room <= n else room
            self.claims.allocated(self.free, ids, grew, want)
        self.free -= set(ids)
        if n:
            grown = next((o for o in self.owned if after is not None and o[-1] == after), None)
            if grown is not None:
                grown.extend(ids)
            else:
                self.owned.append(ids)

    @precondition(lambda self: self.free)
    @rule()
    def allocate_everything(self):
        ids = self.a.allocate_all()
        assert ids == sorted(self.free)
        self.claims.cleared()
        self.free = set()
        self.owned.append(ids)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_some(self, data):
        i = data.draw(st.integers(0, len(self.owned) - 1))
        ids = self.owned[i]
        k = data.draw(st.integers(1, len(ids)))
        part = data.draw(st.permutations(ids))[:k]          # any order, as callers free
        before = self.a.ranges_given_back
        self.a.free(part)
        assert self.a.ranges_given_back - before == len(free_runs(set(part))), \
            "freed as more ranges than the ids form"
        self.claims.freed(self.free, part)
        self.free |= set(part)
        rest = [x for x in ids if x not in set(part)]
        if rest:
            self.owned[i] = rest
        else:
            del self.owned[i]

    @precondition(lambda self: self.free)
    @rule(data=st.data())
    def take_one(self, data):
        i = data.draw(st.sampled_from(sorted(self.free)))
        self.a.take(i)
        self.claims.taken(self.free, i)
        self.free.discard(i)
        self.owned.append([i])

    @rule(data=st.data())
    def bad_free(self, data):
        candidates = sorted(self.free | self.reserved) + [-1, self.n]
        bad = data.draw(st.sampled_from(candidates))
        good = data.draw(st.sampled_from(self.owned)) if self.owned else []
        dup = bool(good) and data.draw(st.booleans())
        ids = list(good) + ([good[0]] if dup else [bad])
        before = (self.a.num_free, self.a.largest_free_run, held_blocks(self.a),
                  self.a.claims())
        try:
            self.a.free(data.draw(st.permutations(ids)))
        except AllocationError:
            pass
        else:
            raise AssertionError(f"bad free {ids} did not raise")
        assert (self.a.num_free, self.a.largest_free_run, held_blocks(self.a),
                self.a.claims()) == before

    @precondition(lambda self: self.owned)
    @rule()
    def free_everything(self):
        for ids in self.owned:
            self.claims.freed(self.free, ids)
            self.a.free(ids[::-1])
            self.free |= set(ids)
        self.owned = []
        assert self.free == set(range(self.n)) - self.reserved
        assert held_blocks(self.a) == maximal_aligned_chunks(self.n, self.reserved)
        assert self.a.claims() == {}

    # ---------------------------------------------------------------- invariants
    @invariant()
    def checks_and_agrees_with_reference(self):
        if not hasattr(self, "a"):
            return
        self.a.check()
        runs = free_runs(self.free)
        assert self.a.num_free == len(self.free)
        assert self.a.free_runs() == runs
        assert self.a.largest_free_run == max((e - s for s, e in runs), default=0)
        assert self.a.num_free_runs == len(runs)
        assert held_blocks(self.a) == canonical_blocks(self.free, self.n)
        assert all(self.a.is_free(i) == (i in self.free) for i in range(self.n))
        assert list(self.a.free_ids_from(0)) == sorted(self.free)
        assert self.a.claims() == self.claims.expected(self.free)


PoolMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PROXIMA_HYPOTHESIS_EXAMPLES", "300")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestPool = PoolMachine.TestCase
