"""Two engines' policies sharing one ledger file and one simulated GPU of fixed size, on
CPU: the idle engine keeps its warm cache while nobody asks, and gives it back within a
step or two of the other's unmet demand appearing in the ledger."""

import dataclasses

from proxima.memory.channel import MAPPED, ElasticChannel
from proxima.memory.ledger import Ledger
from proxima.memory.ops import MAP, UNMAP, Report
from proxima.memory.policy import GrowShrinkPolicy, PolicyOptions
from proxima.memory.sharing import SharedPolicyStep
from tests.memory.test_policy import B, G, Pool

STEP_S = 0.05


class Gpu:
    """One GPU of ``capacity`` granules shared by the engines' channels: a map beyond it
    fails (the memory is held by the other engine), as the driver would refuse it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[int, set] = {}

    def free_total(self):
        used = sum(len(s) for s in self.held.values())
        return (self.capacity - used) * B, self.capacity * B

    def deliver(self, ch: ElasticChannel):
        mine = self.held.setdefault(id(ch), {g for g in range(ch.num_granules)
                                             if ch.state[g] == MAPPED})
        batch = ch.build()
        if batch is None:
            return
        failed = []
        for op in batch.ops:
            span = range(op.first, op.first + op.count)
            if op.code == UNMAP:
                mine.difference_update(span)
            elif op.code == MAP:
                for g in span:
                    if sum(len(s) for s in self.held.values()) >= self.capacity:
                        failed.append((g, op.first + op.count - g))
                        break
                    mine.add(g)
        ch.on_report(Report(((batch.seq, tuple(failed)),), len(mine), G))


class Engine:
    def __init__(self, name, ledger_file, gpu, now, mapped, **options):
        self.ch = ElasticChannel(32 * G, G)
        self.pool = Pool(self.ch, mapped)
        self.demand = [0]
        opts = dict(release_delay_s=1.0, cache_hold_s=60.0, retry_s=5.0)
        opts.update(options)
        self.policy = GrowShrinkPolicy(self.pool, self.ch, B, PolicyOptions(**opts),
                                       clock=lambda: now[0], forecast=lambda: self.demand[0])
        self.gpu = gpu
        gpu.deliver(self.ch)
        self.shared = SharedPolicyStep(self.policy, Ledger(ledger_file, name=name),
                                       gpu_memory=gpu.free_total)

    def step(self):
        self.shared.step()
        self.gpu.deliver(self.ch)

    @property
    def mapped(self):
        return self.ch.count(MAPPED)


def run(engines, now, steps):
    for _ in range(steps):
        now[0] += STEP_S
        for e in engines:
            e.step()


def test_the_idle_engine_keeps_its_cache_until_the_other_asks_then_gives_it_at_once(tmp_path):
    now = [0.0]
    gpu = Gpu(capacity=20)
    path = tmp_path / "proxima-ledger-0.json"
    a = Engine("a", path, gpu, now, mapped=16)
    for g in range(1, 12):                     # a's warm prefix cache: granules 1-11
        a.pool.cached[g] = G
    b = Engine("b", path, gpu, now, mapped=2)
    run([a, b], now, 100)                      # 5 s: five release delays, nobody asks
    assert a.mapped == 12                      # its empty granules went back...
    assert a.policy.stats.evicted_cached == 0  # ...its cache stayed
    assert a.shared.ledger.read().others_unmet_bytes == 0

    b.demand[0] = 40                           # a burst on b: 10 granules more wanted
    steps_to_yield = steps_to_served = None
    for i in range(1, 60):
        run([a, b], now, 1)
        if steps_to_yield is None and a.policy.stats.yields:
            steps_to_yield = i
        if steps_to_served is None and b.mapped * G - b.pool.live_blocks() >= 40:
            steps_to_served = i
    assert b.policy.stats.failed_grows > 0     # the GPU was full: b asked through the ledger
    # b's failed grow is reported at its first step, posted at its second; a reads it at
    # its next step
    assert steps_to_yield is not None and steps_to_yield <= 3
    # b saw a's memory go down in the ledger and mapped at once, not retry_s (100 steps) on
    assert steps_to_served is not None and steps_to_served <= steps_to_yield + 2
    assert a.policy.stats.evicted_cached > 0   # the cache went because b needed it
    assert b.mapped * G - b.pool.live_blocks() >= 40    # b got what it wanted
    assert b.policy.unmet_bytes == 0 and a.shared.ledger.read().others_unmet_bytes == 0
    assert a.mapped + b.mapped <= gpu.capacity


def test_a_killed_engines_demand_is_not_served(tmp_path):
    """A record with unmet demand whose process is gone asks for nothing."""
    import json
    import subprocess
    import sys

    path = tmp_path / "proxima-ledger-0.json"
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; from proxima.memory.ledger import Ledger; "
                              f"Ledger({str(path)!r}).post(0, 0, {8 * B}); print('ok', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ok"
    now = [0.0]
    a = Engine("a", path, Gpu(capacity=64), now, mapped=16)
    for g in range(1, 12):
        a.pool.cached[g] = G
    run([a], now, 1)                   # a, above its minimum, reads the ledger at its first step
    assert a.policy.stats.yields == 1              # a live engine's demand is served
    child.kill()
    child.wait(timeout=60)
    assert json.loads(path.read_text())["engines"]  # its record is still in the file...
    before = a.policy.stats.evicted_cached
    run([a], now, 10)
    assert a.policy.stats.evicted_cached == before  # ...and asks for nothing
    assert a.policy.stats.yields == 1


def sized_engine(name, path, gpu, now, nonkv, mapped, **options):
    """An engine of 32 one-granule blocks whose ledger record says its non-KV memory
    (``nonkv`` granules), as proxima serve's sizing gives it: the ledger bounds its
    maximum at run time."""
    e = Engine.__new__(Engine)
    e.ch = ElasticChannel(32 * G, G)
    e.pool = Pool(e.ch, mapped)
    e.demand = [0]
    e.policy = GrowShrinkPolicy(e.pool, e.ch, B, PolicyOptions(
        release_delay_s=1.0, cache_hold_s=60.0, retry_s=5.0, **options),
        clock=lambda: now[0], forecast=lambda: e.demand[0])
    e.gpu = gpu
    gpu.deliver(e.ch)
    e.shared = SharedPolicyStep(e.policy, Ledger(path, name=name, nonkv=nonkv * B),
                                gpu_memory=gpu.free_total)
    return e


def test_an_engine_started_first_makes_room_for_one_started_later(tmp_path):
    """Engines whose records say their non-KV memory (proxima serve's sizing): the first,
    alone, may grow to the whole GPU; once a second registers, the first's maximum is the
    GPU less both engines' non-KV memory and the second's minimum, and what it held above
    that without live blocks goes back."""
    now = [0.0]
    gpu = Gpu(capacity=32)
    path = tmp_path / "proxima-ledger-0.json"

    def engine(name, nonkv, mapped, **options):
        return sized_engine(name, path, gpu, now, nonkv, mapped, **options)

    a = engine("a", nonkv=4, mapped=1)
    a.demand[0] = 26 * G                         # a burst: a grows to what the GPU leaves it
    run([a], now, 20)
    assert a.policy.room_bytes == (32 - 4) * B and a.mapped == 27
    a.demand[0] = 0                              # idle, but its cache is warm
    for g in range(1, 27):
        a.pool.cached[g] = G
    b = engine("b", nonkv=6, mapped=1, min_bytes=4 * B)
    run([a, b], now, 40)                          # 2 s: the bound, then a release delay
    assert a.policy.room_bytes == (32 - 4 - 6 - 4) * B
    assert a.policy.max_granules == 18 and a.mapped <= 18
    assert a.mapped + 4 + b.mapped + 6 <= gpu.capacity    # b keeps its minimum and weights
    assert b.policy.room_bytes == (32 - 6 - 4 - 1) * B    # a's minimum: the null granule


def serve(engines, now, steps, log=None):
    """The engine loop as vLLM 0.26 runs it: an engine steps only while it has requests
    (here: a demand) or its connector says it must (``has_pending_push_work``, which asks
    :meth:`SharedPolicyStep.wants_step`)."""
    for _ in range(steps):
        now[0] += STEP_S
        for e in engines:
            if e.demand[0] or e.pool.live_blocks() or e.shared.wants_step():
                e.step()
                if log is not None:
                    log.append(e)


def test_an_engine_that_never_had_a_request_gives_its_initial_memory_to_the_others_demand(
        tmp_path):
    now = [0.0]
    gpu = Gpu(capacity=20)
    path = tmp_path / "proxima-ledger-0.json"
    a = Engine("a", path, gpu, now, mapped=1)
    b = Engine("b", path, gpu, now, mapped=16)   # started with 16 granules, no request yet
    assert not a.shared.wants_step()             # at its minimum: nothing to decide, no step
    assert b.shared.wants_step()                 # above it: steps before any request
    a.demand[0] = 40                             # a's first burst: 10 granules more wanted
    steps = []
    served = None
    for i in range(1, 40):
        serve([a, b], now, 1, steps)
        if served is None and a.mapped * G - a.pool.live_blocks() >= 40:
            served = i
    assert b in steps and b.policy.stats.yields >= 1   # b stepped, read a's demand, gave
    assert a.policy.stats.failed_grows > 0             # the GPU was full: a asked the ledger
    assert served is not None and served <= 6          # within a few steps, not a delay
    assert b.policy.stats.evicted_cached == 0          # it held no cache: nothing lost
    assert a.mapped + b.mapped <= gpu.capacity


def test_an_unstepped_engine_keeps_its_initial_memory_until_its_first_step_decides(tmp_path):
    """Pending until the first step only: that step starts the release delay as for any
    excess, so an engine nobody asks keeps its initial memory for the delay."""
    now = [0.0]
    gpu = Gpu(capacity=20)
    b = Engine("b", tmp_path / "proxima-ledger-0.json", gpu, now, mapped=8)
    serve([b], now, 1)
    assert b.mapped == 8 and b.shared.wants_step()     # the delay (1 s) runs
    serve([b], now, 30)                                # 1.5 s
    assert b.mapped == 1 and not b.shared.wants_step()  # empty granules went; idle now


def test_an_idle_engine_above_its_minimum_watches_the_ledger_and_gives_when_asked(tmp_path):
    """An idle engine whose policy has nothing pending (what it maps is wanted: here a
    reserve, as the connector's reserve of the last steps' allocations) still maps more
    than its minimum: it reads the ledger at most every ``watch_every_s`` and steps while
    another engine posts unmet demand; once its reserve is down it gives."""
    now = [0.0]
    gpu = Gpu(capacity=12)
    path = tmp_path / "proxima-ledger-0.json"
    a = Engine("a", path, gpu, now, mapped=2)
    b = Engine("b", path, gpu, now, mapped=9, reserve_blocks=8 * G)
    serve([a, b], now, 40)                       # 2 s: b settles at its reserve
    assert b.mapped == 9 and not b.policy.pending
    assert not b.shared.wants_step()             # nobody asks: b does not step

    a.demand[0] = 40                             # a wants 10 granules more; 1 is free
    seen = None
    for i in range(1, 40):
        serve([a, b], now, 1)
        if seen is None and b.shared.watching:
            seen = i
    assert a.shared.ledger.read().others_unmet_bytes == 0 or a.policy.unmet_bytes > 0
    assert seen is not None and seen * STEP_S <= b.shared.watch_every_s + 2 * STEP_S
    assert b.shared.wants_step() and b.shared.others_unmet_bytes > 0   # b steps, sees it
    # a reserve b keeps whatever the others want (its reserve_blocks option): no watch
    b.shared.keep_blocks, b.shared.watching = 8 * G, False
    assert not b.shared.wants_step()
    b.shared.keep_blocks = 0
    # the reserve gone (the connector's falls once the last busy steps leave its window)
    b.policy.options = dataclasses.replace(b.policy.options, reserve_blocks=0)
    serve([a, b], now, 12)             # the ledger's next read (0.5 s: 10 steps), then a step
    assert b.policy.stats.yields >= 1 and b.mapped < 9
    assert a.mapped > 2 and a.mapped + b.mapped <= gpu.capacity


class SlowUnmapGpu(Gpu):
    """As :class:`Gpu`, but a worker unmaps in the background, as on a GPU with vLLM's mp
    executor: a batch of unmaps frees its memory, and is reported done, one step later."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.later: dict[int, tuple] = {}

    def deliver(self, ch: ElasticChannel):
        mine = self.held.setdefault(id(ch), {g for g in range(ch.num_granules)
                                             if ch.state[g] == MAPPED})
        due = self.later.pop(id(ch), None)
        if due is not None:                       # last step's unmaps: done now
            seq, span = due
            mine.difference_update(span)
            ch.on_report(Report(((seq, ()),), len(mine), G))
        batch = ch.build()
        if batch is not None and all(op.code == UNMAP for op in batch.ops):
            self.later[id(ch)] = (batch.seq, {g for op in batch.ops
                                              for g in range(op.first, op.first + op.count)})
            return
        ch._queue[:0] = batch.ops if batch is not None else ()   # as built: maps at once
        if batch is not None:
            ch._next_seq -= 1
            ch._waiting.pop(batch.seq, None)
            ch.stats["batches"] -= 1
            ch.stats["ops"] -= len(batch.ops)
        super().deliver(ch)


def test_the_ledger_shows_memory_given_back_only_once_the_workers_have_unmapped_it(tmp_path):
    """An idle engine yields to another's demand; its workers unmap a step later. Its ledger
    record keeps those granules until the workers report the unmap done, so the waiting
    engine's early retry (it retries when the others' memory drops) finds the memory free:
    no failed map after the yield, and no retry_s backoff (5 s, 100 steps) before it is
    served. Posting the drop when the release was only decided sent the retry ahead of the
    unmap: it failed and backed off."""
    now = [0.0]
    gpu = SlowUnmapGpu(capacity=20)
    path = tmp_path / "proxima-ledger-0.json"
    a = Engine("a", path, gpu, now, mapped=16)
    for g in range(1, 12):
        a.pool.cached[g] = G
    b = Engine("b", path, gpu, now, mapped=2)
    run([a, b], now, 100)
    assert a.mapped == 12 and a.ch.held() == 12

    b.demand[0] = 40
    yielded = served = failed_at_yield = None
    for i in range(1, 60):
        failed_before = b.policy.stats.failed_grows
        run([a, b], now, 1)          # a step of a, then of b
        if yielded is None and a.policy.stats.yields:
            yielded, failed_at_yield = i, failed_before
            # decided, not yet unmapped: the record still counts the granules
            assert b.shared.ledger.read().others_mapped_bytes == a.ch.held() * B > a.mapped * B
        if served is None and b.mapped * G - b.pool.live_blocks() >= 40:
            served = i
    assert yielded is not None and failed_at_yield >= 1
    assert b.policy.stats.failed_grows == failed_at_yield    # no map failed after the yield
    assert served is not None and served <= yielded + 4
    assert a.ch.held() == a.mapped and a.mapped + b.mapped <= gpu.capacity


def test_a_short_engine_retries_when_the_driver_says_memory_is_free_not_after_its_backoff(
        tmp_path):
    """Memory held by a process that is not in the ledger (or given back before the waiting
    engine first read the ledger after its failure: H100, 2026-12-05, the second burst's
    engine retried only after its 2 s backoff): the driver's free memory is what says so.
    While the GPU has no granule free beyond what a map keeps free, no retry (no churn);
    once it has, the grow is tried within the driver's polling interval, not retry_s."""
    now = [0.0]
    gpu = Gpu(capacity=20)
    gpu.held[-1] = set(range(100, 114))          # another process: 14 granules
    b = Engine("b", tmp_path / "proxima-ledger-0.json", gpu, now, mapped=2,
               retry_s=5.0, retry_max_s=30.0)
    run([b], now, 20)
    b.demand[0] = 10 * G
    run([b], now, 10)
    assert b.policy.stats.short and b.mapped == 6        # 20 - 14: a partial map, kept
    fails = b.policy.stats.failed_grow_attempts
    run([b], now, 40)                                    # 2 s: still full, backoff 5 s+
    assert b.policy.stats.failed_grow_attempts == fails  # no retry while nothing is free
    del gpu.held[-1]                                     # the other process ends
    for i in range(1, 100):
        run([b], now, 1)
        if not b.policy.stats.short:
            break
    assert not b.policy.stats.short and b.mapped == 11    # 6 + the 5 that had failed
    assert i * STEP_S <= b.shared.gpu_every_s + 2 * STEP_S   # not the 5-10 s backoff


def test_an_engine_started_beside_another_grows_into_what_that_one_gives_up_when_it_sleeps(
        tmp_path):
    """H100, s32: of two models behind one endpoint, the one sized second kept the room its
    sizing saw (the first's weights and minimum kept) as a fixed maximum, and stayed there
    while the first slept. With the pool as its fixed maximum (serve's sizing since
    f90c3ff) the ledger's run-time bound is the only one: it grows once the first's record
    stops counting its weights, and only then."""
    path = tmp_path / "proxima-ledger-0.json"

    def pair(max_granules=None):
        now = [0.0]
        gpu = Gpu(capacity=32)

        first = sized_engine("first", path, gpu, now, nonkv=6, mapped=1)
        second = sized_engine("second", path, gpu, now, nonkv=6, mapped=1, **(
            {"max_bytes": max_granules * B} if max_granules else {}))
        second.demand[0] = 30 * G                # a burst that wants more than there is
        run([first, second], now, 40)
        beside = second.mapped
        first.shared.ledger.nonkv = 1 * B       # first sleeps: its weights leave the GPU
        first.shared.ledger.repost()
        run([first, second], now, 40)
        first.shared.ledger.close()
        second.shared.ledger.close()
        return beside, second.mapped

    room = 32 - 6 - (6 + 1)                      # beside first's weights and null granule
    assert pair() == (room, room + 5)
    assert pair(max_granules=room) == (room, room)   # the start-up room as a fixed maximum
