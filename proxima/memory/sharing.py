"""One engine's policy step with the GPU's other engines in view: the ledger read, the
policy stepped with what it says, this engine's record written.

:class:`SharedPolicyStep` is what the scheduler-side connector (and the CPU replay's
stand-in, and the tests' two engines on one simulated GPU) calls at each step boundary in
place of :meth:`GrowShrinkPolicy.step`. The policy stays pure -- it gets the others'
unmet demand and the driver's free memory as arguments -- and the ledger stays a file;
this is the glue between them. Pure Python. A shrink short of releasable granules is
handed back to the caller (``step(moves=True)`` returns the shortfall), which empties
granules and then calls :meth:`SharedPolicyStep.finish_shrink`.

An engine whose grow failed reads the ledger too, and tries again at once when the others'
mapped memory went down (one gave some back) instead of after ``retry_s``.

An engine whose ledger record says what it holds besides KV (``nonkv``: ``proxima serve``'s
sizing sets it) bounds its maximum, every ``gpu_every_s``, by what the others leave: the
GPU's memory less its own non-KV memory less every other engine's non-KV memory and minimum
(:attr:`GrowShrinkPolicy.room_bytes`). So an engine started first, whose maximum was the
whole GPU, stops growing into what an engine started later must always keep, and gives back
what it holds above that bound without live blocks (as for a lowered maximum).

An engine steps only while it has requests or says it must (vLLM 0.26's
``Scheduler.has_requests`` asks the connector's ``has_pending_push_work``, which asks
:meth:`SharedPolicyStep.wants_step`): its policy has something pending (a release waiting
for its delay, or memory mapped at start-up above the minimum before the first step), or
it maps more than its minimum while the ledger -- read at most every ``watch_every_s`` --
shows another engine's unmet demand. So an idle engine sees the others' demand without a
request of its own (issue 33, item 3). What an idle engine whose policy has nothing pending
maps above its minimum is at most what its policy wants free (``reserve_blocks``, and the
connector's reserve of its last steps' allocations, which falls as it steps): its first
step looks at everything else. Limit: vLLM's engine loop asks once, when the engine would
go idle, and then waits for a request; so the watch keeps an engine stepping when the
demand is there as it goes idle, and does not wake one already waiting.

Cost: the ledger is read and the driver asked only while the policy has memory in excess
(:attr:`GrowShrinkPolicy.pending`: only then can it give anything), watches as above, or
waits for memory,
the driver at most every ``gpu_every_s``; the record is written only when it changes (a grow, a shrink, a
change of unmet demand).
"""

from __future__ import annotations

from typing import Callable

from proxima.memory.channel import MAPPED
from proxima.memory.ledger import Ledger
from proxima.memory.policy import GrowShrinkPolicy


class SharedPolicyStep:
    """Args:
        policy: this engine's policy.
        ledger: this GPU's ledger (None: no other engine is seen; the policy then sees no
            demand but its own).
        gpu_memory: ``fn() -> (free bytes, total bytes)`` of the GPU, the driver's figures
            (None: not known).
        gpu_every_s: at most how often ``gpu_memory`` is asked (policy clock).
        watch_every_s: at most how often an idle engine with nothing pending reads the
            ledger for the others' unmet demand (:meth:`wants_step`; policy clock).
        keep_blocks: the reserve this engine keeps free whatever the others want (its
            ``reserve_blocks`` option): no watch for memory it would not give.
    """

    def __init__(self, policy: GrowShrinkPolicy, ledger: Ledger | None = None,
                 gpu_memory: Callable[[], tuple[int, int]] | None = None,
                 gpu_every_s: float = 0.5, watch_every_s: float = 0.5,
                 keep_blocks: int = 0) -> None:
        self.policy = policy
        self.ledger = ledger
        self.gpu_memory = gpu_memory
        self.gpu_every_s = gpu_every_s
        self.others_unmet_bytes = 0
        self._others_mapped: int | None = None    # the others' mapped bytes while short
        self._gpu: tuple[int, int] | None = None
        self._gpu_at: float | None = None
        self.nonkv = getattr(ledger, "nonkv", 0) if ledger is not None else 0
        self._room_at: float | None = None
        self.watch_every_s = watch_every_s
        self.keep_blocks = keep_blocks
        self.watching = False              # another engine's demand seen by wants_step
        self._watch_at: float | None = None
        self.post()

    def wants_step(self) -> bool:
        """Whether this engine must step without requests: its policy has something
        pending, or it maps more than its minimum and ``keep_blocks`` and the ledger (read
        at most every ``watch_every_s``) shows another engine's unmet demand."""
        p = self.policy
        if p.pending:
            return True
        keep = -(-self.keep_blocks // p.channel.granule_blocks)
        if self.ledger is None or p.channel.count(MAPPED) <= p.min_granules + keep:
            self.watching = False
            return False
        now = p.clock()
        if self._watch_at is None or now - self._watch_at >= self.watch_every_s:
            self._watch_at = now
            view = self._read()
            self.watching = view is not None and view.others_unmet_bytes > 0
        return self.watching

    def idle_pause(self, most: float) -> float:
        """How long an idle engine's empty step may sleep: ``most``, less when a release
        is due sooner."""
        due = self.policy.due_in()
        return most if due is None else min(most, due)

    def _gpu_figures(self) -> tuple[int | None, int | None]:
        if self.gpu_memory is None:
            return None, None
        now = self.policy.clock()
        if self._gpu_at is None or now - self._gpu_at >= self.gpu_every_s:
            try:
                self._gpu = self.gpu_memory()
            except Exception:          # a driver that cannot answer: not known this time
                self._gpu = None
            self._gpu_at = now
        return self._gpu if self._gpu is not None else (None, None)

    def _read(self):
        try:
            return self.ledger.read()
        except OSError:
            return None

    def _bound(self) -> None:
        """:attr:`GrowShrinkPolicy.room_bytes` from the ledger and the GPU's size, every
        ``gpu_every_s`` (only for an engine whose record says its non-KV memory)."""
        now = self.policy.clock()
        if self._room_at is not None and now - self._room_at < self.gpu_every_s:
            return
        self._room_at = now
        _, total = self._gpu_figures()
        view = self._read()
        if total is None or view is None:
            return
        claims = sum(r.nonkv + r.min for r in view.others)
        self.policy.room_bytes = max(0, total - self.nonkv - claims)

    def step(self, moves: bool = False) -> int:
        """The policy's step with the ledger's view; returns its shortfall (``moves``: see
        :meth:`GrowShrinkPolicy.step`): then the caller empties granules and calls
        :meth:`finish_shrink`, and this engine's record is written there."""
        policy = self.policy
        if self.nonkv and self.ledger is not None and self.gpu_memory is not None:
            self._bound()
        others, free, total = 0, None, None
        if policy.pending or self.watching:   # memory to give: is someone waiting for it?
            if self.ledger is not None:
                view = self._read()
                others = view.others_unmet_bytes if view is not None else 0
            free, total = self._gpu_figures()
        elif policy.stats.short:
            # waiting for memory: when another engine gave some back, or the driver says a
            # granule is free beyond what a map keeps free, try now rather than after
            # retry_s (the engine that gave may record its unmap before this engine first
            # reads the ledger after its failure: the driver's figure does not miss it)
            if self.ledger is not None:
                view = self._read()
                if view is not None:
                    mapped = view.others_mapped_bytes
                    if self._others_mapped is not None and mapped < self._others_mapped:
                        policy.retry_now()
                    self._others_mapped = mapped
            gpu_free, gpu_total = self._gpu_figures()
            if gpu_free is not None and gpu_total and (
                    gpu_free - int(policy.options.gpu_free_low * gpu_total)
                    >= policy.bytes_per_granule):
                policy.retry_now()
        if not policy.stats.short:
            self._others_mapped = None
        self.watching = self.watching and others > 0
        self.others_unmet_bytes = others
        short = policy.step(others_unmet_bytes=others, gpu_free_bytes=free,
                            gpu_total_bytes=total, moves=moves)
        if not short:
            self.post()
        return short

    def finish_shrink(self) -> None:
        """The policy releases what its shrink found short of, once the caller's moves are
        done (:meth:`GrowShrinkPolicy.finish_shrink`); then this engine's record."""
        self.policy.finish_shrink()
        self.post()

    def post(self) -> None:
        """This engine's record: mapped (and mapping) bytes, minimum, unmet demand."""
        if self.ledger is None:
            return
        p, ch = self.policy, self.policy.channel
        B = p.bytes_per_granule
        try:
            self.ledger.post(ch.held() * B,
                             p.min_granules * B, p.unmet_bytes, maximum=p.max_granules * B)
        except OSError:
            pass                       # a full or vanished /dev/shm: the engine serves on

    def close(self) -> None:
        if self.ledger is not None:
            try:
                self.ledger.close()
            except OSError:
                pass
