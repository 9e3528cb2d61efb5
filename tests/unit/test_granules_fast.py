"""The granule index's fast paths decide exactly as the plain code they replaced.

``ReferenceIndex`` is :class:`GranuleIndex` with the plain versions of what was made fast
(every refile adds to and discards from the emptiness sets; the window is entered id by id,
each refiling its granule, also for ids just cached; ``_unlink`` refits the window after
every window id; window ids are found by membership and handed out by ``window_ids_in`` +
``cached_to_live``). A
hypothesis state machine drives both through the same transitions the way the elastic free queue does and compares
their whole state after each, down to the order in which the emptiness sets iterate
(``empty_with_free`` hands out the first member a set iterates, so that order is a
decision).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from proxima.allocator.granules import CLASSES, GranuleIndex


class ReferenceIndex(GranuleIndex):
    """The plain code (commit 9f879c3's; ``_append`` 25d59ed's), kept here as the oracle."""

    def take_window(self, g, n, end):
        ids = self.window_ids_in(g, n)
        if ids:
            self.cached_to_live(ids, end)
        return ids

    def _append(self, ids, cls):
        # append at the tail, then (if the class's boundary was at the tail) fit the window
        # id by id, then refile every touched granule
        nxt, prev, G = self._next, self._prev, self.granule_blocks
        tail = self.num_blocks + 2 * cls + 1
        last = prev[tail]
        touched = set()
        for i in ids:
            self._clock += 1
            self._seq[i] = self._clock
            self._stamp[i] = self.now
            self._cls[i] = cls
            prev[i] = last
            nxt[last] = i
            last = i
            self.cached[i // G] += 1
            touched.add(i // G)
        nxt[last] = tail
        prev[tail] = last
        self.num_cached += len(ids)
        if self._boundary[cls] == tail:
            self._boundary[cls] = ids[0]
            self._fit_window(cls)
        for g in touched:
            self._refile(g)

    def window_ids_in(self, g, n):
        # by membership, not from the per-granule lists the fast code keeps in order
        ids = sorted((i for i in self.ids_of(g) if self._in_win[i]), key=self._seq.__getitem__)
        return ids if len(ids) <= n else ids[:n]

    def _refile(self, g):
        live = self.live[g]
        mapped = self.mapped[g]
        if mapped and 0 < live < self.size[g] and (
                self.size[g] - live - self.cached[g] > 0 or self.win[g]):
            key = (self.end_of_granule[g], g)
        else:
            key = None
        old = self._key[g]
        if key != old:
            if old is not None:
                del self._cand[bisect_left(self._cand, old)]
            if key is not None:
                insort(self._cand, key)
            self._key[g] = key
        if mapped and live == 0:
            self._empty.add(g)
            cached = self.cached[g]
            if cached == 0:
                self._vacant.add(g)
                self._empty_free.discard(g)
            else:
                self._vacant.discard(g)
                if cached < self.size[g]:
                    self._empty_free.add(g)
                else:
                    self._empty_free.discard(g)
        else:
            self._empty.discard(g)
            self._vacant.discard(g)
            self._empty_free.discard(g)

    def _fit_window(self, c):
        threshold = self._threshold[c]
        cap = self.num_blocks if self.max_window is None else self.max_window
        stamp, prev, nxt = self._stamp, self._prev, self._next
        tail = self.num_blocks + 2 * c + 1
        b = self._boundary[c]
        while self._win_size[c] and (self._win_size[c] > cap or stamp[prev[b]] > threshold):
            b = prev[b]
            self._leave_window(b)
        while b != tail and self._win_size[c] < cap and stamp[b] <= threshold:
            g = b // self.granule_blocks
            self._in_win[b] = 1
            self._win_lists[c * self.num_granules + g].append(b)
            self.win[g] += 1
            self._win_size[self._cls[b]] += 1
            self._refile(g)
            b = nxt[b]
        self._boundary[c] = b

    def _unlink(self, ids):
        nxt, prev, G = self._next, self._prev, self.granule_blocks
        touched = set()
        count = 0
        for i in ids:
            c = self._cls[i]
            was_in = self._in_win[i]
            if was_in:
                self._leave_window(i)
            elif self._boundary[c] == i:
                self._boundary[c] = nxt[i]
            p, q = prev[i], nxt[i]
            nxt[p] = q
            prev[q] = p
            prev[i] = nxt[i] = -1
            if was_in:
                self._fit_window(c)
            g = i // G
            self.cached[g] -= 1
            touched.add(g)
            count += 1
        self.num_cached -= count
        for g in touched:
            self._refile(g)


def state(gi: GranuleIndex) -> dict:
    return {
        "counts": (gi.live, gi.cached, gi.win, bytes(gi.mapped), gi.num_cached,
                   # the running total against the oracle's sum of its granules
                   gi.num_live if type(gi) is GranuleIndex else sum(gi.live)),
        "ends": (gi.end, gi.end_of_granule),
        "list": (gi._next, gi._prev, gi._stamp, gi._seq, gi._clock, bytes(gi._cls)),
        "window": (bytes(gi._in_win), gi._win_lists, gi._win_size,
                   gi._boundary, gi._threshold),
        "candidates": (gi._cand, gi._key),
        # iteration order, not just membership: it is what empty_with_free returns
        "emptiness": (sorted(gi._empty), list(gi._vacant), list(gi._empty_free),
                      gi.empty_with_free()),
    }


class Twins(RuleBasedStateMachine):
    @initialize(granules=st.integers(2, 12), G=st.sampled_from([1, 2, 4, 8]),
                max_window=st.sampled_from([None, None, 0, 1, 3, 6]))
    def build(self, granules, G, max_window):
        n = granules * G
        self.G, self.n = G, n
        self.fast = GranuleIndex(n, G, (0,), max_window=max_window)
        self.ref = ReferenceIndex(n, G, (0,), max_window=max_window)
        self.live: dict[int, None] = {}         # ids handed out (insertion order)
        self.cached: dict[int, None] = {}
        self.free = set(range(1, n))
        self.unmapped: set[int] = set()
        self.now = 0

    def both(self, name, *args):
        out = [getattr(gi, name)(*args) for gi in (self.fast, self.ref)]
        assert out[0] == out[1], name
        return out[0]

    def pick(self, data, pool, most=6):
        """Some ids of ``pool`` (at least one: the owner never passes none)."""
        ids = sorted(pool)
        return data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1,
                                  max_size=most)) if ids else []

    @rule(data=st.data(), end=st.integers(0, 40))
    def hand_out_free(self, data, end):
        ids = self.pick(data, self.free)
        self.both("free_to_live", ids, end)
        self.free -= set(ids)
        self.live.update(dict.fromkeys(ids))

    @rule(data=st.data(), end=st.integers(0, 40))
    def hit(self, data, end):
        ids = self.pick(data, self.cached, 3)
        self.both("cached_to_live", ids, end)
        for i in ids:
            del self.cached[i]
            self.live[i] = None

    @rule(data=st.data(), n=st.integers(1, 5), end=st.integers(0, 40))
    def take_window(self, data, n, end):
        gi = self.fast       # mostly a granule with window ids and live ones (the fast path)
        likely = [g for g, w in enumerate(gi.win) if w and gi.live[g]] or \
            [g for g, w in enumerate(gi.win) if w]
        g = data.draw(st.sampled_from(likely) if likely and data.draw(st.booleans())
                      else st.integers(0, self.n // self.G - 1))
        ids = self.both("take_window", g, n, end)
        for i in ids:
            del self.cached[i]
            self.live[i] = None

    @rule(data=st.data(), cls=st.integers(0, CLASSES - 1), to_cache=st.booleans())
    def give_back(self, data, cls, to_cache):
        ids = self.pick(data, self.live, 8)
        if not ids:
            return
        if to_cache:
            self.both("live_to_cached", ids, cls)
            self.cached.update(dict.fromkeys(ids))
        else:
            self.both("live_to_free", ids)
            self.free |= set(ids)
        for i in ids:
            del self.live[i]

    @rule(data=st.data())
    def drop_cached(self, data):
        ids = self.pick(data, self.cached, 4)
        self.both("cached_to_free", ids)
        for i in ids:
            del self.cached[i]
        self.free |= set(ids)

    @rule(data=st.data(), end=st.integers(0, 60))
    def set_end(self, data, end):
        self.both("set_end", self.pick(data, self.live, 4), end)

    @rule(h0=st.sampled_from([None, 0, 0, 1, 2, 5]), h1=st.sampled_from([None, 0, 0, 1, 3]),
          dt=st.integers(0, 3))
    def tick(self, h0, h1, dt):
        self.now += dt
        self.both("tick", self.now, (h0, h1))

    @precondition(lambda self: self.n // self.G > 1)
    @rule(data=st.data())
    def unmap_or_map(self, data):
        G = self.G
        g = data.draw(st.integers(1, self.n // G - 1))
        span = set(range(g * G, (g + 1) * G))
        if g in self.unmapped:
            self.both("map", g)
            self.unmapped.discard(g)
            self.free |= span
        elif span <= self.free:
            self.both("unmap", g)
            self.unmapped.add(g)
            self.free -= span

    @rule(data=st.data(), end=st.integers(0, 40))
    def place(self, data, end):
        self.both("place", end)
        self.both("oldest_cached", data.draw(st.integers(0, 5)))

    @invariant()
    def same_state(self):
        if hasattr(self, "fast"):
            assert state(self.fast) == state(self.ref)
            self.fast.check(live_ids=list(self.live), cached_order=None)


Twins.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
test_fast_paths_decide_as_the_plain_code = Twins.TestCase


@pytest.mark.parametrize("G", [2, 4])
def test_takes_that_fill_or_keep_a_granule_refile_as_the_plain_code(G):
    """Every shape of granule 1 a take can meet (live, window and free ids; an end below,
    at and above its T; one id or more): the state after the take is the plain code's. A take
    skips its refile when it would change nothing, and not when the granule fills up or its
    T grows."""
    cases = 0
    for live in range(1, G):
        for cached in range(1, G - live + 1):
            for n in range(1, cached + 2):
                for end in (3, 5, 7):
                    twins = []
                    for cls in (GranuleIndex, ReferenceIndex):
                        gi = cls(3 * G, G, (0,))
                        ids = list(range(G, G + live + cached))
                        gi.free_to_live(ids, 5)
                        gi.live_to_cached(ids[live:])
                        gi.tick(1, (0, 0))
                        got = gi.take_window(1, n, end)
                        twins.append((got, state(gi)))
                    assert twins[0] == twins[1], (live, cached, n, end)
                    cases += 1
    assert cases
