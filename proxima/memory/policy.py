"""When elastic KV memory grows and shrinks: min / max bytes, headroom, release delay.

Pure Python (no torch, no vLLM), run by the scheduler side once per step boundary
(:meth:`GrowShrinkPolicy.step`), with an injectable clock (tests use a fake one). It reads
the pool through a small interface (:class:`PoolView`: what is live, free, releasable) and
acts through the pool (``release``) and the channel (:class:`~proxima.memory.channel.
ElasticChannel`: ``map`` / ``unmap``).

The rule, in blocks (a granule is ``G`` blocks, ``bytes_per_granule`` bytes):

* *wanted free* = ``max(reserve_blocks, headroom * live, forecast)``, where ``forecast``
  is what the requests the scheduler holds may still need (prompt + max_tokens, minus
  what they hold) and ``reserve_blocks`` what one step may allocate. *Free* counts the free
  and cached blocks of mapped granules -- what vLLM's scheduler admits against -- less,
  while the engine is busy, the cached blocks young enough to be hit again (younger than
  the pool's reuse horizon, :class:`proxima.allocator.eviction.ReuseHorizon`): a cache
  that is being reused keeps its memory.
* **Grow** at once when free (plus maps in flight) is below wanted: map enough granules
  to reach wanted plus a *band* (``band`` of the mapped granules, at least one), never
  above ``max_bytes``. A map is confirmed by the workers before its blocks are
  handed out; one the GPU cannot back (another process holds the memory) leaves the
  engine at its current size, keeping what the map got before it failed: said once in the
  log and in :attr:`stats` (``failed_grows``: granules; ``failed_grow_attempts``), never
  raised. No churn while the GPU is short: the next try waits ``retry_s``, doubled after
  each failure in a row up to ``retry_max_s``; with ``free_bytes`` (what the driver says
  is free for this engine to map) a grow asks for no more than that, none while it is
  less than a granule, and a failed one is tried again early once the driver says more is
  free than when it failed.
* **Shrink** when free has exceeded wanted by more than two bands for ``release_delay_s``
  (which granules may go: the release rule below),
  down to wanted plus one band (an idle engine: by a granule, down to wanted; the band keeps a steady load from growing and shrinking
  by a granule every second: each map or unmap is driver work on every worker; measured
  on the H200, 125 grows in a 60 s steady run without it): release granules without live
  blocks, those with the fewest cached blocks first (their
  cached blocks are evicted, as stock would evict them when reusing the memory: counted
  in ``evicted_cached``), never below ``min_bytes`` or wanted. A shrink that finds too
  few such granules, stepped with ``moves=True``, stops and returns the shortfall: the
  caller (:mod:`proxima.vllm.elastic_control`) may empty granules by moving blocks
  (issue 14's compaction), then :meth:`GrowShrinkPolicy.finish_shrink` releases what is
  free, in the same step. The policy calls nothing above it.

**The release rule** (issue 33, item 3). A granule without live blocks either holds no
cached block (*empty*: releasing it costs nothing) or holds cached blocks a later request
may hit (releasing evicts them: every prefix hit lost is prefill computed again). So:

* empty granules go after ``release_delay_s``, as before: memory is still returned;
* granules of cached blocks go only when someone needs the memory:
  - **another Proxima engine on this GPU asks** (the ledger, :mod:`proxima.memory.ledger`,
    shows its unmet demand: ``others_unmet_bytes``): at once, no delay -- that engine is
    serving at a size it did not choose -- and as many granules as it asks for (it
    re-posts what is still missing, so the next step gives more if one engine's excess
    was not enough);
  - **the GPU is short** (the driver's free memory below ``gpu_free_low`` of the GPU:
    ``gpu_free_bytes`` / ``gpu_total_bytes``): after ``release_delay_s``, as before --
    a process that is not Proxima cannot say what it wants, and low free memory is the
    one sign of it there is;
  - **the hold ends**: the excess has lasted ``cache_hold_s`` with nobody asking: the
    load is gone, the cache is presumed cold, and the engine goes back to its minimum
    (so an idle engine does not keep stepping, watching the ledger, for ever).

  Otherwise they stay: evicting a warm cache nobody wants the memory of is a pure loss
  (measured in the CPU replay: bursts 0.594 against stock's 0.604 prefix hits before).
  Why not a hold for ever: the engine would have to keep stepping to see later demand,
  and with ``cache_hold_s <= release_delay_s`` the rule is the one before the ledger.
  Kernel memory ballooning (and Prism's, behind kvcached) reclaims on the host's demand
  alone; here the demand is the engines' own, posted when a grow fails, so an idle
  engine gives exactly what a busy one misses, within a step.

An engine whose grow fails posts its unmet demand (:attr:`GrowShrinkPolicy.unmet_bytes`:
the granules the grow wanted, while the GPU is short of them; 0 once a map succeeds or
nothing more is wanted); the connector writes it to the ledger, the others read it at
their next step. The policy itself reads and writes nothing: its inputs are arguments of
:meth:`GrowShrinkPolicy.step`.

**An idle model steps aside** (``idle_release_s``, None: never): once the engine has held
no live block and no request for ``idle_release_s``, its minimum is 0 (granule 0, the null
block, only) and nothing is wanted free, so every other granule goes at once, cached ones
included; the next request makes it busy again and the minimum is back, grown at that
step. The engine keeps stepping (:attr:`pending`) until then.

**The start-up grow** (issue 33: the cold start). An engine started without an initial size
keeps what vLLM's warm-up mapped and grows, at its first step (before its first request:
:attr:`pending` keeps it stepping), to ``startup_granules`` -- twice what the warm-up
writes (:func:`proxima.vllm.elastic_v1.startup_target`): at its minimum its first steps
would admit against one granule while the load's first grow maps, a step or two behind
stock. That grow is an ordinary one (the maximum, ``free_bytes``, the backoff of a failed
map), and asks for no more than the driver's free memory, ``gpu_free_bytes``, less
``gpu_free_low`` of the GPU (below that the release rule counts the GPU short): an engine
started on a crowded GPU keeps what fits and no more; on a GPU short already (free below
``gpu_free_low``) it keeps its minimum, releasing the rest of warm-up's granules at once.
What it keeps above the minimum is excess as any, given to another engine that asks and
returned after ``release_delay_s`` when no load wants it.

``min_bytes`` and ``max_bytes`` can be changed at run time (:meth:`set_limits`); a new
minimum above the mapped size grows at the next step, a new maximum below it shrinks
(after the delay, like any shrink, but without waiting for excess).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

from proxima.memory.arena import runs
from proxima.memory.channel import MAPPED, MAPPING, UNMAPPED, ElasticChannel
from proxima.memory.policy_options import PolicyOptions, PolicyStats, PoolView

logger = logging.getLogger("vllm.proxima")


class GrowShrinkPolicy:
    """Decides at each step boundary whether granules are mapped or released.

    Args:
        pool: the pool (:class:`PoolView`).
        channel: the granule states and the ops to the workers.
        bytes_per_granule: memory of one granule (all layers).
        options: :class:`PolicyOptions`.
        clock: seconds, monotonic (tests pass a fake).
        forecast: ``fn() -> blocks`` the held requests may still need (None: 0).
        free_bytes: ``fn() -> bytes or None``, what the driver says this engine could map
            now (None: not known); grows are capped at it (an attribute: may be set later).
        startup_granules: granules to have mapped after the first step (the start-up grow,
            see the module; 0: none).
    """

    def __init__(self, pool: PoolView, channel: ElasticChannel, bytes_per_granule: int,
                 options: PolicyOptions = PolicyOptions(), *,
                 clock: Callable[[], float] = time.monotonic,
                 forecast: Callable[[], int] | None = None,
                 free_bytes: Callable[[], int | None] | None = None,
                 startup_granules: int = 0) -> None:
        if bytes_per_granule < 1:
            raise ValueError(f"bytes_per_granule must be >= 1, got {bytes_per_granule}")
        self.pool = pool
        self.channel = channel
        self.bytes_per_granule = bytes_per_granule
        self.options = options
        self.clock = clock
        self.forecast = forecast
        self.free_bytes = free_bytes
        self.stats = PolicyStats()
        self._fails = 0                      # failed grows in a row (the backoff's power)
        self._free_at_fail: int | None = None    # what the driver said when the last failed
        self._excess_since: float | None = None
        self._due_at: float | None = None     # when the waiting release may act next
        self._idle_since: float | None = None  # when the engine last became idle
        self._idle_wait = False               # an idle release is still to come
        self._shrinking: tuple | None = None  # a shrink waiting for moves (finish_shrink)
        self.unmet_bytes = 0                  # what a grow wants and the GPU cannot give
        #: what the GPU's other engines leave this one (bytes; None: not known), a bound on
        #: the maximum kept by :class:`proxima.memory.sharing.SharedPolicyStep`
        self.room_bytes: int | None = None
        self._retry_at = 0.0
        self._reported_short = False
        #: not stepped yet: memory mapped at start-up above the minimum (``initial_bytes``)
        #: keeps the engine stepping (:attr:`pending`) until its first step decides on it
        self._unstepped = True
        self.startup_granules = startup_granules
        #: a start-up grow issued: the engine keeps stepping until a step has looked at it
        #: as excess (it then goes after the release delay, as any)
        self._startup_grown = False
        channel.listeners.append(self._on_map)

    # ------------------------------------------------------------------ limits
    @property
    def min_granules(self) -> int:
        # granule 0 (the null block) always stays mapped
        return max(1, -(-self.options.min_bytes // self.bytes_per_granule))

    @property
    def max_granules(self) -> int:
        """The most granules mapped: ``max_bytes`` (None: the pool), and at most
        :attr:`room_bytes` (what the GPU's other engines leave, when known); never below
        the minimum."""
        ng = self.channel.num_granules
        if self.options.max_bytes is None and self.room_bytes is None:
            return ng
        cap = ng if self.options.max_bytes is None else \
            self.options.max_bytes // self.bytes_per_granule
        if self.room_bytes is not None:
            cap = min(cap, self.room_bytes // self.bytes_per_granule)
        return max(self.min_granules, min(ng, cap))

    def set_limits(self, min_bytes: int | None = None, max_bytes: int | None = None,
                   clear_max: bool = False) -> PolicyOptions:
        """New bounds (None: unchanged; ``clear_max``: no maximum but the pool's). Raises
        ValueError (naming the value) for a minimum above the maximum or beyond the pool."""
        lo = self.options.min_bytes if min_bytes is None else min_bytes
        hi = None if clear_max else (self.options.max_bytes if max_bytes is None else max_bytes)
        pool_bytes = self.channel.num_granules * self.bytes_per_granule
        if lo > pool_bytes:
            raise ValueError(f"min_bytes {lo} is above the pool's {pool_bytes} bytes "
                             f"(its maximum at start-up)")
        self.options = replace(self.options, min_bytes=lo, max_bytes=hi)
        self._excess_since = None
        return self.options

    def release_idle_now(self) -> bool:
        """Count the engine idle long enough now (``idle_release_s`` set, no live block
        and nothing held): its next step gives back every granule but the null block's, as
        the idle release would, without waiting for it (a model put to sleep to make room
        for another). False, and nothing changed, when it is busy or has no idle release."""
        if self.options.idle_release_s is None or self._busy():
            return False
        self._idle_since = float("-inf")
        return True

    # ------------------------------------------------------------------ the step
    def wanted_free(self) -> int:
        o = self.options
        live = self.pool.live_blocks()
        wanted = max(o.reserve_blocks, int(o.headroom * live + 0.5))
        if o.forecast and self.forecast is not None:
            wanted = max(wanted, self.forecast())
        return wanted

    def spare_blocks(self, busy: bool | None = None) -> int:
        """Free blocks of mapped memory not counting, while the engine is busy, the cached
        blocks young enough to be hit again (they earn their memory). Idle, every cached
        block counts as spare: the release delay is what protects them. ``busy``: the
        caller's :meth:`_busy` of this step (None: asked here)."""
        free = self.pool.num_free_blocks
        if self._busy() if busy is None else busy:
            free -= self.pool.hot_cached_blocks()
        return free

    def _busy(self) -> bool:
        """Live blocks, or requests held that will need blocks."""
        return bool(self.pool.live_blocks() or (self.forecast is not None and self.forecast()))

    def step(self, *, others_unmet_bytes: int = 0, gpu_free_bytes: int | None = None,
             gpu_total_bytes: int | None = None, moves: bool = False) -> int:
        """One step boundary: grow, or shrink after the delay, or nothing.

        ``others_unmet_bytes``: what the other Proxima engines on this GPU want and cannot
        map (the ledger's view, :mod:`proxima.memory.ledger`; 0: nobody waits).
        ``gpu_free_bytes`` / ``gpu_total_bytes``: the driver's figures for the GPU (None:
        not known, taken as not short). See the module's release rule.

        ``moves``: the caller can empty granules by moving blocks. Then a shrink that finds
        fewer releasable granules than it wants releases nothing yet and returns how many
        more it wants; the caller empties what it can and calls :meth:`finish_shrink` in
        this step. Returns 0 otherwise (the step is done)."""
        ch, G = self.channel, self.channel.granule_blocks
        now = self.clock()
        if self._shrinking is not None:       # a shortfall nobody answered: release now
            self.finish_shrink()
        mapped = ch.count(MAPPED)
        pending = ch.count(MAPPING)
        startup = self._startup_grow(mapped + pending, gpu_free_bytes, gpu_total_bytes)
        self._unstepped = False
        if startup < 0:       # a GPU short at start-up: warm-up's granules above the minimum
            found = [g for g in self._candidates(True) if g][:-startup]   # go now
            self._release(sorted(found), now)
            mapped, startup = ch.count(MAPPED), 0
        busy = self._busy()
        free = self.spare_blocks(busy)
        idle_out = self._idle_out(now, busy, mapped + pending)
        wanted = 0 if idle_out else self.wanted_free()
        floor = 1 if idle_out else self.min_granules
        cap = self.max_granules
        band = self.band_granules(mapped + pending)
        # grow: below wanted free memory (then by a band more), or below the minimum
        short_blocks = wanted - free - pending * G
        grow = max(-(-short_blocks // G) + band - 1 if short_blocks > 0 else 0,
                   floor - mapped - pending, startup)
        grow = min(grow, cap - mapped - pending)
        # unmet demand (for the ledger): while the GPU cannot back a grow, what is wanted
        # beyond what is mapped (maps in flight are not had yet)
        self.unmet_bytes = 0
        if self.stats.short:
            want = max(-(-(wanted - free) // G) + band - 1 if wanted > free else 0,
                       floor - mapped)
            self.unmet_bytes = max(0, min(want, cap - mapped)) * self.bytes_per_granule
        if grow > 0:
            self._excess_since = self._due_at = None
            free_now = self.free_bytes() if self.free_bytes is not None else None
            if free_now is not None:          # never ask for what the driver says is not there
                grow = min(grow, free_now // self.bytes_per_granule)
                if grow <= 0:
                    return 0
            freed = (free_now is not None and self._free_at_fail is not None
                     and free_now > self._free_at_fail)
            if now >= self._retry_at or freed:
                self._grow(grow, now)
                self._startup_grown = self._startup_grown or startup > 0
            return 0
        if not pending:             # the start-up grow is had: the rule below looks at it
            self._startup_grown = False
        # shrink: excess beyond wanted and two bands (or above the maximum) for the delay,
        # down to a band above wanted; an idle engine keeps no band
        keep = band if busy else 0
        spare = (free - wanted) // G
        excess = min(spare - keep, mapped - floor) if spare >= max(1, 2 * keep) else 0
        over = mapped + pending - cap
        if over > 0:
            excess = max(excess, over)
        if excess <= 0:
            self._excess_since = self._due_at = None
            return 0
        if self._excess_since is None:
            self._excess_since = now
        o, waited = self.options, now - self._excess_since
        if others_unmet_bytes > 0:
            # another engine waits for memory now: give what it asks (no delay), cached
            # blocks included, never below wanted or the minimum (excess says so)
            asked = -(-others_unmet_bytes // self.bytes_per_granule)
            count, cached_ok = min(excess, max(asked, over)), True
        elif idle_out:
            count, cached_ok = excess, True       # idle long enough: everything goes now
        elif waited < o.release_delay_s:
            self._due_at = self._excess_since + o.release_delay_s
            return 0
        elif self._due_at is not None and now < self._due_at:
            return 0           # cached granules held: look again when due (or when asked)
        else:
            short = (gpu_free_bytes is not None and gpu_total_bytes
                     and gpu_free_bytes < o.gpu_free_low * gpu_total_bytes)
            count = excess
            cached_ok = over > 0 or bool(short) or waited >= o.cache_hold_s
        self._shrinking = (count, excess, now, cached_ok, others_unmet_bytes > 0)
        found = self._candidates(cached_ok)
        if moves and len(found) < count:
            self.stats.compactor_calls += 1
            return count - len(found)
        self.finish_shrink(found)
        return 0

    def _startup_grow(self, mapped: int, gpu_free_bytes: int | None,
                      gpu_total_bytes: int | None) -> int:
        """Granules the start-up grow adds at the first step (0 after it, or without a
        start-up size): up to ``startup_granules``, within what the driver says is free
        less ``gpu_free_low`` of the GPU (when it says). The maximum and ``free_bytes`` cap
        it in :meth:`step`, as any grow. Negative: the GPU is short already (free below
        ``gpu_free_low``), the granules above the minimum to release now."""
        if not self._unstepped or not self.startup_granules:
            return 0
        want = self.startup_granules - mapped
        if gpu_free_bytes is not None and gpu_total_bytes:
            spare = gpu_free_bytes - int(self.options.gpu_free_low * gpu_total_bytes)
            if spare < 0:
                return min(0, self.min_granules - mapped)
            want = min(want, spare // self.bytes_per_granule)
        return max(0, want)

    def finish_shrink(self, found: list[int] | None = None) -> None:
        """Release what the step's shrink decided: up to its count of the granules
        releasable now (``found``: already looked up; None: looked up here, after the
        caller's moves), and keep the waiting release's state. Nothing when no shrink
        waits."""
        if self._shrinking is None:
            return
        count, excess, now, cached_ok, asked = self._shrinking
        self._shrinking = None
        if found is None:     # looked up again even when no granule was emptied: the
            found = self._candidates(cached_ok)     # moves may have filled a candidate
        done = self._release(sorted(found[:count]), now)
        if done and asked:
            self.stats.yields += 1
        o = self.options
        if done >= excess or (cached_ok and done < count):
            self._excess_since = self._due_at = None    # nothing left that could go
        else:          # cached granules kept: they go when asked, short, or after the hold
            # (looked at again after a release delay, to see whether the GPU is short)
            self._due_at = min(now + o.release_delay_s,
                               self._excess_since + max(o.cache_hold_s, o.release_delay_s))
            if done < count:
                self.stats.kept_cached += 1

    def _idle_out(self, now: float, busy: bool, mapped: int) -> bool:
        """Whether the idle release is on now: ``idle_release_s`` set and the engine idle
        that long. Records when it became idle, and whether a release is still to come
        (:attr:`pending` keeps the engine stepping for it)."""
        after = self.options.idle_release_s
        if busy or after is None:
            self._idle_since, self._idle_wait = None, False
            return False
        if self._idle_since is None:
            self._idle_since = now
        out = now - self._idle_since >= after
        self._idle_wait = not out and mapped > 1
        return out

    def retry_now(self) -> None:
        """Memory was freed (another engine gave some back): a grow waiting for
        ``retry_s`` after a failure is tried at the next step."""
        self._retry_at = 0.0

    def band_granules(self, mapped: int) -> int:
        """The hysteresis band in granules at ``mapped`` granules (at least 1)."""
        return max(1, int(self.options.band * mapped))

    def could_shrink(self) -> bool:
        """Whether a granule emptied now could be given back, now or once its cached
        blocks have cooled: the free and cached blocks of mapped memory beyond what is
        wanted free cover a granule, or more than the maximum is mapped. A pool the load
        keeps full (the scheduler admits while free and cached blocks last) never passes.
        KV compaction's auto mode packs only then. "Cover" is the shrink rule's: two
        bands of granules beyond wanted."""
        ch, G = self.channel, self.channel.granule_blocks
        mapped = ch.count(MAPPED)
        if mapped + ch.count(MAPPING) > self.max_granules:
            return True
        if mapped <= self.min_granules:
            return False
        spare = (self.pool.num_free_blocks - self.wanted_free()) // G
        return spare >= (2 * self.band_granules(mapped) if self._busy() else 1)

    @property
    def pending(self) -> bool:
        """A release is waiting for its delay, or an idle engine for its idle release, or
        the policy has not stepped yet while more than the minimum is mapped (an engine
        started above it, before its first request) or its start-up grow is to come or
        has not been looked at since: the engine must keep stepping to do it."""
        if self._excess_since is not None or self._idle_wait or self._startup_grown:
            return True
        if not self._unstepped:
            return False
        mapped = self.channel.count(MAPPED)
        return mapped > self.min_granules or mapped < self.startup_granules

    @property
    def unstepped(self) -> bool:
        """The policy has not stepped yet (its start-up decisions are still to come)."""
        return self._unstepped

    def due_in(self) -> float | None:
        """Seconds until the waiting release is due (None: none is waiting)."""
        dues = []
        if self._excess_since is not None:
            due = self._due_at
            dues.append(self._excess_since + self.options.release_delay_s if due is None
                        else due)
        if self._idle_wait:
            dues.append(self._idle_since + self.options.idle_release_s)
        return max(0.0, min(dues) - self.clock()) if dues else None

    # ------------------------------------------------------------------ actions
    def _grow(self, count: int, now: float) -> None:
        ch = self.channel
        todo = [g for g in range(ch.num_granules) if ch.state[g] == UNMAPPED][:count]
        for run in runs(todo):
            ch.map(run.start, len(run))
        if todo:
            self.stats.grows += 1
            self.stats.granules_grown += len(todo)
            self.stats.events.append((now, "grow", len(todo)))

    def _candidates(self, cached_ok: bool) -> list[int]:
        """Mapped granules without live blocks (``cached_ok`` False: without cached blocks
        either), cheapest first."""
        state = self.channel.state
        return [g for g, cached in self.pool.releasable()
                if state[g] == MAPPED and (cached_ok or not cached)]

    def _release(self, chosen: list[int], now: float) -> int:
        """Release ``chosen`` (sorted granule ids); returns how many went."""
        if not chosen:
            return 0
        evicted = self.pool.release(chosen)
        for run in runs(chosen):
            self.channel.unmap(run.start, len(run))
        s = self.stats
        s.shrinks += 1
        s.granules_released += len(chosen)
        s.bytes_returned += len(chosen) * self.bytes_per_granule
        s.evicted_cached += evicted
        s.events.append((now, "shrink", len(chosen)))
        if len(s.events) > 1000:
            del s.events[:500]
        return len(chosen)

    def _on_map(self, granules: range, ok: bool) -> None:
        s = self.stats
        if ok:
            self._fails = 0
            self._free_at_fail = None
            if s.short:
                logger.info("Proxima elastic KV: the GPU gives memory again (%d granules "
                            "mapped)", len(granules))
            s.short = False
            self._reported_short = False
            return
        s.failed_grows += len(granules)
        s.failed_grow_attempts += 1
        s.short = True
        self.unmet_bytes = max(self.unmet_bytes, len(granules) * self.bytes_per_granule)
        s.events.append((self.clock(), "fail", len(granules)))
        self._fails += 1
        o = self.options
        self._retry_at = self.clock() + min(max(o.retry_max_s, o.retry_s),
                                            o.retry_s * 2 ** min(self._fails - 1, 30))
        self._free_at_fail = self.free_bytes() if self.free_bytes is not None else None
        if not self._reported_short:
            self._reported_short = True
            logger.warning("Proxima elastic KV: the GPU cannot give %d more granules (%.0f MiB) "
                           "now (another process or engine holds the memory; the demand is "
                           "posted on the GPU's ledger, and engines of Proxima give back at "
                           "their next step); serving at the current size, retrying once the "
                           "driver shows memory freed, else after %.1f s, then less and less "
                           "often (at most every %.0f s)", len(granules),
                           len(granules) * self.bytes_per_granule / 2**20,
                           self.options.retry_s, max(self.options.retry_max_s,
                                                     self.options.retry_s))

    # ------------------------------------------------------------------ reporting
    def snapshot(self) -> dict:
        """Mapped / used / reclaimable bytes and the counters, for the status file."""
        ch, G, B = self.channel, self.channel.granule_blocks, self.bytes_per_granule
        live = self.pool.live_blocks()
        releasable = self.pool.num_releasable()
        return {
            "granule_blocks": G, "bytes_per_granule": B, "num_granules": ch.num_granules,
            "mapped_granules": ch.count(MAPPED), "mapping_granules": ch.count(MAPPING),
            "mapped_bytes": ch.count(MAPPED) * B,
            "used_bytes": live * B // G,
            "reclaimable_bytes": releasable * B,
            "free_blocks": self.pool.num_free_blocks, "wanted_free_blocks": self.wanted_free(),
            "min_bytes": self.min_granules * B, "max_bytes": self.max_granules * B,
            "pool_bytes": ch.num_granules * B,
            "release_pending": self.pending, **self.stats.as_dict(),
        }
