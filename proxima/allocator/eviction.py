"""How far eviction may depart from LRU so that live blocks stay packed, and the learnt
reuse horizon that bounds it.

:class:`EvictionPolicy` is the user's setting (``lru``, ``auto``, ``age:N``, ...);
:class:`ReuseHorizon` learns, per class of cached block, the ages at which cached blocks
are hit again. The granule index (:mod:`proxima.allocator.granules`) takes the resulting
horizons at every tick and puts the cached ids older than them in its eviction window.
Pure Python, standard library only.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionPolicy:
    """How far eviction may depart from LRU so that live blocks stay packed.

    A cached block may be evicted out of LRU order (taken for a new block while free ids
    remain elsewhere) only once it is older than the *reuse horizon*: ``horizon`` steps,
    or, with ``horizon=None`` ("auto"), the ``quantile`` of the ages at which cached
    blocks were hit again (:class:`ReuseHorizon`), so that about ``1 - quantile`` of the
    reuse stock would see is put at risk. ``max_window`` bounds the departure by count
    too: only the ``max_window`` least recently used cached blocks (None: no bound by
    count; 0: strict LRU -- cached blocks are evicted only when no free id is left,
    oldest first, exactly as stock vLLM).
    """

    horizon: int | None = None
    quantile: float = 0.99
    max_window: int | None = None
    min_horizon: int = 0

    def __post_init__(self) -> None:
        if self.horizon is not None and (type(self.horizon) is not int or self.horizon < 0):
            raise ValueError(f"eviction horizon must be None (auto) or an integer >= 0 "
                             f"steps, got {self.horizon!r}")
        if not isinstance(self.quantile, (int, float)) or not 0.5 <= self.quantile <= 1.0:
            raise ValueError(f"eviction quantile must lie in [0.5, 1], got {self.quantile!r}")
        if self.max_window is not None and (type(self.max_window) is not int
                                            or self.max_window < 0):
            raise ValueError(f"max_window must be None or an integer >= 0, got "
                             f"{self.max_window!r}")
        if type(self.min_horizon) is not int or self.min_horizon < 0:
            raise ValueError(f"min_horizon must be an integer >= 0, got {self.min_horizon!r}")

    @property
    def strict(self) -> bool:
        return self.max_window == 0

    @classmethod
    def parse(cls, text: str) -> "EvictionPolicy":
        """``lru`` (strict), ``auto`` (the default: learnt horizon), ``auto:Q`` (learnt,
        quantile Q), ``age:N`` (fixed horizon of N steps), ``window:W`` (the W oldest,
        any age). ValueError naming the value otherwise."""
        value = str(text).strip().lower()
        kind, colon, arg = value.partition(":")
        try:
            if kind in ("lru", "strict") and not colon:
                return cls(max_window=0)
            if kind == "auto" and (arg or not colon):      # "auto:" names no quantile
                return cls(quantile=float(arg)) if arg else cls()
            if kind == "age" and arg:
                return cls(horizon=int(arg))
            if kind == "window" and arg:
                return cls(horizon=0, max_window=int(arg))
        except ValueError as exc:
            if "eviction" in str(exc) or "max_window" in str(exc):
                raise ValueError(f"eviction policy {text!r}: {exc}") from None
        raise ValueError(f"eviction policy {text!r}: give lru, auto, auto:Q (0.5 <= Q <= 1), "
                         f"age:N (steps) or window:W (blocks)")

    def __str__(self) -> str:
        if self.strict:
            return "lru"
        if self.horizon is None:
            base = "auto" if self.quantile == 0.99 else f"auto:{self.quantile:g}"
        elif self.horizon == 0 and self.max_window is not None:
            return f"window:{self.max_window}"
        else:
            base = f"age:{self.horizon}"
        return base if self.max_window is None else f"{base},max_window={self.max_window}"


class ReuseHorizon:
    """The reuse horizon of an ``auto`` :class:`EvictionPolicy`, in steps.

    Reuse ages are the steps between a block being cached and being hit again; a lookup
    that misses a block evicted early (a *ghost*: it would have been a hit had it been
    kept) counts as a reuse at the age it has then. The horizon is ``margin`` times the
    ``quantile`` of the last ``samples`` reuse ages, plus one. Ages are censored (a block
    not hit *yet* may be hit later), so until the pool has been watched for ``warmup``
    steps the horizon is at least the time watched: nothing is evicted early before there
    was time to see it reused. With no reuse seen after that, the horizon is
    ``min_horizon``: nothing cached is worth keeping out of LRU order. A pool that went
    idle starts a new period (:meth:`restart`): the warm-up applies again, since the reuse
    of one burst says little about the next one's (a burst over twice the contexts comes
    back to each twice as late).
    """

    def __init__(self, quantile: float = 0.99, samples: int = 4096, min_horizon: int = 0,
                 ghosts: int = 65536, warmup: int = 256, margin: float = 1.25) -> None:
        self.quantile = quantile
        self.min_horizon = min_horizon
        self.warmup = warmup
        self.margin = margin
        self._ages: deque[int] = deque(maxlen=samples)
        self._ghosts: OrderedDict = OrderedDict()           # key -> step it was cached at
        self._max_ghosts = ghosts
        self._sorted: list[int] | None = []
        self._since: int | None = None                       # first step anything was cached
        self.hits = 0
        self.ghost_hits = 0

    def watching(self, step: int) -> None:
        """Something was cached at ``step`` (the first call starts the warm-up)."""
        if self._since is None:
            self._since = step

    def restart(self, step: int) -> None:
        """A new busy period starts at ``step`` (the pool was idle: no live block): the
        reuse seen before need not be this load's, so the warm-up floor applies again from
        here (the ages seen stay samples). Before anything was cached it changes nothing:
        the first warm-up starts with the first cached block (:meth:`watching`)."""
        if self._since is not None:
            self._since = step

    def on_hit(self, age: int) -> None:
        self._ages.append(age)
        self._sorted = None
        self.hits += 1

    def on_early_eviction(self, key, cached_at: int) -> None:
        """A block holding ``key`` (its prefix-cache hash) was evicted out of LRU order."""
        ghosts = self._ghosts
        ghosts[key] = cached_at
        ghosts.move_to_end(key)
        if len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def on_miss(self, key, now: int) -> bool:
        """A lookup missed ``key``; True (and counted as a reuse) when it was a ghost."""
        cached_at = self._ghosts.pop(key, None)
        if cached_at is None:
            return False
        self.ghost_hits += 1
        self.on_hit(now - cached_at)
        return True

    def horizon(self, now: int) -> int:
        watched = 0 if self._since is None else now - self._since
        floor = min(watched, self.warmup) if watched < self.warmup else 0
        if not self._ages:
            return max(self.min_horizon, floor)
        if self._sorted is None:
            self._sorted = sorted(self._ages)
        ages = self._sorted
        k = min(len(ages) - 1, max(0, math.ceil(self.quantile * len(ages)) - 1))
        return max(self.min_horizon, floor, int(self.margin * ages[k]) + 1)
