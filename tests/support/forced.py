"""Test-only policies: forced map/unmap cycles and forced KV compaction.

They exist to exercise the machinery (the channel, the workers' maps and unmaps, the
compactor's moves) harder than any real policy would, and to prove that doing so changes
no scheduling decision and no token. The product does not carry them; they plug in
through what the product already offers:

* :class:`ForcedCycler` through the elastic connector's ``compactor`` hook (a
  ``module:factory``, here with keyword arguments)::

      {"policy": "fixed", "eviction": "lru", "compactor": forced.cycles(every=4)}

  The hook is loaded in whichever process runs the scheduler (vLLM's engine core), so this
  module must be importable there: the repository root on ``sys.path`` (the tests run from
  it; the proof drivers insert it).
* forced compaction (``every:K``: empty one granule every K steps) with :func:`set_mode`,
  on a :class:`~proxima.vllm.compaction_v1.Compactor` of this process (tests, and the
  GPU proof with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import weakref

from proxima.memory.arena import runs
from proxima.memory.channel import MAPPED, UNMAPPED

FACTORY = "tests.support.forced:ForcedCycler"


def cycles(every: int = 4, hold: int = 2, granules: int = 8, safe: bool = True) -> dict:
    """The elastic option ``compactor`` that runs :class:`ForcedCycler` in the engine."""
    return {"factory": FACTORY, "every": every, "hold": hold, "granules": granules,
            "safe": safe}


class ForcedCycler:
    """A test policy: every ``every`` steps release up to ``granules`` granules that hold
    neither live nor cached blocks, map them back ``hold`` steps later, and count a cycle
    once the maps are confirmed (a map the GPU cannot back is asked again).

    ``safe``: release only while the free blocks left in mapped memory cover what the held
    requests may still need (``forecast``) plus the step reserve, so that no allocation ever
    evicts a cached block stock would have kept and no admission changes: the schedule,
    and so greedy output, stay identical to stock's (the GPU identity proof relies on it).

    The elastic connector calls :meth:`tick` at every step boundary, after its policy,
    keeps the engine stepping while :meth:`pending`, and adds :meth:`stats` to its status.
    """

    def __init__(self, queue, channel, every: int = 4, hold: int = 2, granules: int = 4,
                 safe: bool = True) -> None:
        if queue is None:
            raise ValueError("forced cycles need the pool to place by granule: use policy "
                             "fixed or auto, not off")
        for name, value in (("every", every), ("hold", hold), ("granules", granules)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(safe, bool):
            raise ValueError(f"safe must be true or false, got {safe!r}")
        self.queue, self.channel = queue, channel
        self.every, self.hold, self.granules, self.safe = every, hold, granules, safe
        self.forecast = None
        self.margin = 0
        self.cycles = 0
        self.out: list[int] = []
        self._since = 0
        self._mapping = False

    def pending(self) -> bool:
        return bool(self.out)

    def stats(self) -> dict:
        return {"forced_cycles": self.cycles}

    def _candidates(self) -> list[int]:
        q = self.queue
        free_only = sorted((g for g, cached in q.releasable()
                            if not cached and self.channel.state[g] == MAPPED), reverse=True)
        if not self.safe:
            return free_only[:self.granules]
        spare = q.buddy.num_free - (self.forecast() if self.forecast else 0) - self.margin
        out = []
        for g in free_only:
            size = len(q.granules.ids_of(g))
            if len(out) == self.granules or spare < size:
                break
            out.append(g)
            spare -= size
        return out

    def tick(self, step: int, reserve: int = 0, forecast=None) -> bool:
        """Advance at a step boundary (``reserve``: blocks the next steps may allocate;
        ``forecast``: ``() -> blocks`` the held requests may still need); True when a
        cycle completed now."""
        self.margin, self.forecast = reserve, forecast
        state = self.channel.state
        if not self.out:
            idle = not self.queue.live_blocks() and not (self.forecast and self.forecast())
            if step % self.every == 0 and not idle:     # an idle engine sleeps: no cycle
                self.out = self._candidates()
                if self.out:
                    self.queue.release(self.out)
                    for run in runs(sorted(self.out)):
                        self.channel.unmap(run.start, len(run))
                    self._since, self._mapping = step, False
            return False
        if not self._mapping:
            if step - self._since >= self.hold:
                for run in runs(sorted(self.out)):
                    self.channel.map(run.start, len(run))
                self._mapping = True
            return False
        if any(state[g] != MAPPED for g in self.out):
            retry = [g for g in self.out if state[g] == UNMAPPED]
            for run in runs(retry):          # the GPU had no memory: ask again
                self.channel.map(run.start, len(run))
            return False
        self.out, self.cycles = [], self.cycles + 1
        return True


# ----------------------------------------------------------------------------- compaction

_auto: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def set_mode(compactor, mode: str) -> None:
    """Switch ``compactor`` between steps: ``"off"`` (elastic mode without compaction),
    ``"auto"`` (the product's policy) or ``"every:K"`` (forced: every K steps, empty the
    most occupied granule that can be emptied -- its cached blocks too when there is room
    -- and place every allocation; a test of the machinery, not a policy)."""
    interval, gate = _auto.setdefault(compactor, (compactor.interval, compactor.pack_gate))
    compactor.__dict__.pop("plan_step", None)             # the product's own policy again
    compactor.interval, compactor.pack_gate = interval, gate
    if mode == "off":
        compactor.set_enabled(False)
        return
    compactor.set_enabled(True)
    if mode == "auto":
        return
    kind, _, k = mode.partition(":")
    if kind != "every" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"mode must be off, auto or every:K (K >= 1), got {mode!r}")
    compactor.interval = int(k)
    compactor.pack_gate = None          # placement on every allocation, whatever the policy
    compactor.plan_step = lambda: compactor.apply(forced_plan(compactor))


def forced_plan(compactor):
    """Empty the most occupied granule that can be emptied, within what is left of the
    step's budget (its cached blocks too when there is room, else its live blocks only)."""
    from proxima.allocator.planner import plan_evacuate
    from proxima.allocator.plans import Plan

    view = compactor.view()
    budget = compactor.budget_left()
    live = view.live_per_granule()
    order = sorted(range(view.num_granules), key=lambda g: (-live[g], g))
    for g in order:
        if not live[g]:
            break
        for cached_too in (True, False):
            plan, _ = plan_evacuate(view, [g], budget, cached_too=cached_too,
                                    max_phases=compactor.max_phases)
            if plan:
                return plan
    return Plan()
