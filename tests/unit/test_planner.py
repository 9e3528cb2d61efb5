"""The migration planner (proxima.allocator.planner) against an independent model.

The model is a pool of labelled contents: a LIVE block holds ("live", its id at the start)
and belongs to one or two requests' tables (a shared prefix block), a CACHED block holds
("cached", its hash). A plan's relocations are applied one by one to the model, its phases
are applied as the block mover applies batches (every copy reads what the batch found),
and afterwards: every table entry holds the content it held before, every hash still maps
to its content, the free/cached/live counts are those of the start, nothing pinned or
FIXED was touched, the scratch ids are empty, the budget and the phase cap hold.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxima.allocator.placement import plan_placement
from proxima.allocator.planner import plan_evacuate, plan_pack
from proxima.allocator.plans import (CACHED, FIXED, FREE, LIVE, Plan, PlanError, PoolView,
                                     check_plan, schedule_phases)


# ----------------------------------------------------------------------------- the model

class Model:
    def __init__(self, kinds, tables, scratch):
        self.kinds = list(kinds)
        self.content = {i: (("live", i) if k == LIVE else ("cached", f"h{i}"))
                        for i, k in enumerate(kinds) if k in (LIVE, CACHED)}
        self.tables = {r: list(t) for r, t in tables.items()}
        self.scratch = set(scratch)

    def snapshot(self):
        """What each table position and each hash must hold."""
        return ({r: [self.content[b] for b in t] for r, t in self.tables.items()},
                {v[1]: v for v in self.content.values() if v[0] == "cached"})

    def apply(self, plan: Plan, pinned):
        """Sequentially; returns the ids where each original content ended."""
        where = {i: i for i in self.content}
        for a, b in plan.relocations:
            assert a not in pinned and b not in pinned
            assert self.kinds[a] in (LIVE, CACHED), (a, self.kinds[a])
            assert self.kinds[b] == FREE or (b in self.scratch and self.kinds[b] == FIXED)
            self.content[b] = self.content.pop(a)
            self.kinds[b], self.kinds[a] = self.kinds[a], (FIXED if a in self.scratch
                                                           else FREE)
        return self.content

    def phases_result(self, kinds0, plan: Plan):
        """The phases applied as batches to the starting contents."""
        state = {i: (("live", i) if k == LIVE else ("cached", f"h{i}"))
                 for i, k in enumerate(kinds0) if k in (LIVE, CACHED)}
        for phase in plan.phases:
            dsts, srcs = set(), set()
            copies = []
            for s, d, n in phase:
                for j in range(n):
                    assert d + j not in dsts, "a block written twice in one phase"
                    dsts.add(d + j)
                    srcs.add(s + j)
                    copies.append((s + j, d + j))
            assert not dsts & srcs, "a phase's destination is also its source"
            found = {d: state.get(s) for s, d in copies}
            state.update(found)
        return state


@st.composite
def pools(draw, max_blocks=120):
    n = draw(st.integers(2, max_blocks))
    g = draw(st.sampled_from([1, 2, 4, 8, 16]))
    weights = draw(st.sampled_from([(3, 3, 4, 0), (0, 5, 5, 0), (1, 2, 6, 1), (6, 1, 2, 0)]))
    kinds = draw(st.lists(st.sampled_from(
        [k for k, w in zip((FREE, CACHED, LIVE, FIXED), weights) for _ in range(w)]),
        min_size=n, max_size=n))
    live = [i for i, k in enumerate(kinds) if k == LIVE]
    # split the live ids into request tables, in a drawn order; a few shared (prefix)
    order = draw(st.permutations(live))
    tables, i, r = {}, 0, 0
    while i < len(order):
        size = draw(st.integers(1, 12))
        tables[f"q{r}"] = list(order[i:i + size])
        i += size
        r += 1
    pinned = draw(st.sets(st.integers(0, n - 1), max_size=n // 8))
    extra = draw(st.integers(0, 3))                 # scratch ids past the pool
    kinds = kinds + [FIXED] * extra
    scratch = list(range(n, n + extra))
    return kinds, g, tables, pinned, scratch


def verify(kinds, g, tables, pinned, scratch, plan, budget=None, max_phases=None):
    view = PoolView(kinds, g, pinned, scratch=scratch)
    check_plan(view, plan, budget)                          # the module's own check
    model = Model(kinds, tables, scratch)
    before_tables, before_hashes = model.snapshot()
    model.apply(plan, pinned)
    moved = plan.final_positions()
    model.tables = {r: [moved.get(b, b) for b in t] for r, t in model.tables.items()}
    after_tables, after_hashes = model.snapshot()
    assert after_tables == before_tables          # each owner's table points at its content
    assert after_hashes == before_hashes          # every hash still maps to its content
    assert sorted(model.kinds) == sorted(kinds)   # free / cached / live counts unchanged
    for x in scratch:
        assert model.kinds[x] == FIXED            # scratch left empty
    for i, k in enumerate(kinds):
        if k == FIXED and i not in scratch or i in pinned:
            assert model.kinds[i] == k and model.content.get(i) == (
                None if k in (FREE, FIXED) else (("live", i) if k == LIVE else ("cached", f"h{i}")))
    phased = model.phases_result(kinds, plan)
    for i, label in model.content.items():
        assert phased.get(i) == label             # the phases give the sequential result
    if budget is not None:
        assert plan.blocks_moved <= budget
    if max_phases is not None:
        assert len(plan.phases) <= max_phases
    return view, model


SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- goals

@SETTINGS
@given(pools(), st.integers(0, 60), st.sampled_from([None, 1, 3, 8]))
def test_pack_keeps_every_content_and_never_dirties_a_granule(pool, budget, max_phases):
    kinds, g, tables, pinned, scratch = pool
    plan = plan_pack(PoolView(kinds, g, pinned, scratch=scratch), budget,
                     max_phases=max_phases)
    view, model = verify(kinds, g, tables, pinned, scratch, plan, budget, max_phases)
    after = PoolView(model.kinds, g, pinned, scratch=scratch)
    assert after.reclaimable_fraction() >= view.reclaimable_fraction()
    if plan:
        assert after.reclaimable_fraction() > view.reclaimable_fraction()


@SETTINGS
@given(pools(), st.data(), st.integers(0, 60), st.booleans(),
       st.sampled_from([None, 2, 8]))
def test_evacuate_empties_what_it_says(pool, data, budget, cached_too, max_phases):
    kinds, g, tables, pinned, scratch = pool
    view = PoolView(kinds, g, pinned, scratch=scratch)
    granules = data.draw(st.lists(st.integers(0, view.num_granules - 1), max_size=3))
    plan, clear = plan_evacuate(view, granules, budget, cached_too=cached_too,
                                max_phases=max_phases)
    _, model = verify(kinds, g, tables, pinned, scratch, plan, budget, max_phases)
    if clear:
        gone = (LIVE, CACHED) if cached_too else (LIVE,)
        for gr in granules:
            assert all(model.kinds[i] not in gone for i in view.granule_range(gr))


@SETTINGS
@given(pools(), st.data())
def test_placement_targets_are_usable(pool, data):
    kinds, g, tables, pinned, scratch = pool
    kinds = list(kinds)
    n = len(kinds) - len(scratch)
    free = [i for i in range(1, n) if kinds[i] in (FREE, CACHED) and i not in pinned]
    if not free:
        return
    k = data.draw(st.integers(1, min(6, len(free))))
    ids = data.draw(st.lists(st.sampled_from(free), min_size=k, max_size=k, unique=True))
    for x in ids:                                 # handed out: the caller marks them LIVE
        kinds[x] = LIVE
    prev = data.draw(st.one_of(st.none(), st.integers(0, n - 1)))
    lone = {t[0] for t in tables.values() if len(t) == 1}
    movable = {b for t in tables.values() for b in t}
    view = PoolView(kinds, g, pinned, scratch=scratch)
    where = plan_placement(view, ids, prev, k + data.draw(st.integers(0, 20)), lone=lone,
                           movable=movable, claim_blocks=4)
    if where.targets is None:
        return
    assert len(where.targets) == k == len(set(where.targets))
    for x in where.targets:
        assert x in ids or (x not in pinned and x < n and (
            kinds[x] in (FREE, CACHED) or x in lone or x in movable))
    if where.reason in ("continued", "window", "window_displacing"):
        assert where.targets == list(range(where.targets[0], where.targets[0] + k))
    if where.reason == "continued":
        assert where.targets[0] == prev + 1


# ----------------------------------------------------------------------------- examples

def test_a_pool_without_free_blocks_packs_through_the_scratch_id():
    # granule 0: null + 3 live; granule 1: 1 live + 3 cached; no FREE block anywhere
    kinds = [FIXED, LIVE, LIVE, CACHED, LIVE, CACHED, CACHED, CACHED]
    view = PoolView(kinds, 4, scratch=[0])
    plan = plan_pack(view, 10)
    verify(kinds, 4, {"a": [1, 2], "b": [4]}, set(), [0], plan, 10)
    assert plan.blocks_moved == 3          # cached 3 -> scratch, live 4 -> 3, scratch -> 4
    assert (4, 3) in plan.relocations and any(d == 0 for _, d in plan.relocations)
    assert PoolView(kinds, 4).reclaimable_fraction() == 0.0
    without = plan_pack(PoolView(kinds, 4), 10)
    assert not without                      # no spare at all: nothing can move


def test_parallel_exchanges_use_distinct_scratch_ids():
    # granule 0: four live, three cached; granule 1: three live, five cached; no FREE block
    kinds = [FIXED, LIVE, LIVE, LIVE, LIVE, CACHED, CACHED, CACHED,
             LIVE, LIVE, LIVE, CACHED, CACHED, CACHED, CACHED, CACHED] + [FIXED] * 4
    scratch = [16, 17, 18, 19]
    plan = plan_pack(PoolView(kinds, 8, scratch=scratch), 20, max_phases=3)
    verify(kinds, 8, {"a": [1, 2, 3, 4], "b": [8, 9, 10]}, set(), scratch, plan, 20, 3)
    # cached 5, 6, 7 -> three scratch ids; live 8, 9, 10 -> 5, 6, 7; scratch -> 8, 9, 10
    assert len(plan.phases) == 3 and plan.blocks_moved == 9
    assert plan.phases[1] == [(8, 5, 3)]                   # the live blocks: one run


def test_schedule_phases_orders_a_chain_and_merges_runs():
    # content 2 -> 3 must wait for 3 -> 4; 10, 11 -> 20, 21 is one run
    phases = schedule_phases([(3, 4), (2, 3), (10, 20), (11, 21)])
    assert phases == [[(3, 4, 1), (10, 20, 2)], [(2, 3, 1)]]


@pytest.mark.parametrize("plan, message", [
    (Plan([(1, 2)], [[(1, 2, 1)]]), "the destination is live"),
    (Plan([(3, 1)], [[(3, 1, 1)]]), "the source is free"),
    (Plan([(1, 3)], [[(1, 3, 1)], [(1, 3, 1)]]), "different number of blocks"),
    (Plan([(1, 3)], []), "after the phases block 3 holds"),
    (Plan([(5, 3)], [[(5, 3, 1)]]), "block 5 is pinned"),
    (Plan([(1, 9)], [[(1, 9, 1)]]), "outside the pool"),
])
def test_check_plan_names_what_is_wrong(plan, message):
    view = PoolView([FIXED, LIVE, LIVE, FREE, CACHED, LIVE], 2, pinned={5})
    with pytest.raises(PlanError, match=message):
        check_plan(view, plan)


def test_check_plan_refuses_a_phase_that_reads_what_it_writes():
    view = PoolView([FIXED, LIVE, FREE, FREE], 4)
    plan = Plan([(1, 2), (2, 3)], [[(1, 2, 2)]])       # 2 is source and destination
    with pytest.raises(PlanError, match="both a source and a destination"):
        check_plan(view, plan)


@pytest.mark.parametrize("args, message", [
    (([FREE, 9], 2), "block kind 9"),
    (([FREE, FREE], 0), "granule_blocks must be an integer >= 1"),
    (([FREE, FREE], 2, [5]), "pinned id 5 is outside"),
    (([FREE, FREE], 2, (), [1]), "scratch id 1 must be a FIXED"),
])
def test_bad_views_are_refused(args, message):
    with pytest.raises(PlanError, match=message):
        PoolView(*args)


def test_budget_zero_moves_nothing_and_a_bad_budget_is_refused():
    kinds = [FIXED, LIVE, FREE, FREE, FREE, FREE, FREE, FREE]
    assert not plan_pack(PoolView(kinds, 4), 0)
    with pytest.raises(PlanError, match="budget must be an integer >= 0"):
        plan_pack(PoolView(kinds, 4), -1)
