"""Idle models sleep and wake on their next request: the several-models endpoint's side
(``--sleep-after SECONDS`` per model; the engine's side is :mod:`proxima.serve.engine_sleep`).

The router (:mod:`proxima.serve.router`) tells :class:`SleepWake` when each request for a
model begins and ends. A model with ``sleep_after`` whose engine is ready, with no request
in flight and none begun or ended for ``sleep_after`` seconds, is put to sleep: ``POST
/proxima/sleep`` on its engine (which waits for its KV to be given back by the idle
release, then moves the weights to host memory). A request for a sleeping model wakes it
first and is held meanwhile (the client sees a slower first token, not an error):

1. room: the weights' bytes (as the engine's sleep answered) must be free on the GPU; what
   is short is asked of the GPU's other engines through the ledger's unmet demand, as a
   starting engine does (:func:`proxima.serve.autosize.ask_others`), bounded;
2. ``POST /proxima/wake_up`` on the engine, bounded;
3. the held request (and every other that came meanwhile: one wake for them all) goes on.

A wake that fails or times out answers the held requests 503 in OpenAI's error shape with
``Retry-After``; the model stays listed and asleep, and its next request tries again. One
log line per sleep and per wake, with the seconds it took. An engine that restarts
starts awake.

For another engine's demand (``demand``: the GPU's ledger): a model that may sleep, has
been idle for ``DEMAND_IDLE_S`` (or its ``sleep_after``, if shorter), is put to sleep
before its ``sleep_after`` when another engine on the GPU posts unmet demand (it wants memory
the GPU cannot give: a busy model's KV, a wake's weights), its KV given back at once ("model
X sleeps for the GPU's other engines: Y GiB wanted"). One at a time, the least recently used
first. Its next request wakes it as usual. A model whose last wake came less than
``HELD_IDLE_S`` after its last request before that sleep (its requests come now and then, a
few seconds apart: that sleep was a mistake) must be idle ``HELD_IDLE_S`` to sleep for
demand, until a wake after a longer gap: it is not slept and woken over and over while
another is busy. A model woken for one burst and idle through the next one's (alternating
bursts) sleeps for it after ``DEMAND_IDLE_S``.

More models than fit at once (``capacity``: what the GPU has for the models, with each
backend's ``awake_bytes`` / ``asleep_bytes`` from :mod:`proxima.serve.residency`): before
a wake, and before an engine starts or restarts (:meth:`SleepWake.admit`, the supervisor's
``before_start``), the least recently used awake model that may sleep, is ready and has no
request in flight is put to sleep (its KV given back at once: ``{"release": true}``) while
the GPU has no room for the model beside the others ("model X sleeps to make room for Y").
A model with a request in flight is never put to sleep; with no such model left the wake
fails (503 with ``Retry-After``), and a start waits for one (at most the wake's bound, then
starts anyway: its own sizing decides). One wake or start makes room at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from proxima.serve import residency

log = logging.getLogger("proxima.serve")

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling-asleep", "asleep", "waking"
WAKE_TIMEOUT_S = 120.0          # room + wake, at most
# how long an engine's sleep may wait for its KV to be given back: short, since a request
# that comes meanwhile waits for the sleep before its wake (a refused sleep is retried)
SLEEP_TIMEOUT_S = 5.0
SLEEP_RETRY_S = 10.0            # after a sleep the engine refused (a request came, ...)
RETRY_AFTER_S = "10"
# idle this long, a sleeper may sleep for another's demand: about two wakes (0.4-0.9 s on an
# H100); each second longer is a second the busy engine runs short of memory. Decode-heavy
# bursts between two 8B engines on an H100: 1.420x a static split and 0.947 of one engine
# holding the GPU with 2 s, 1.313x and 0.877 with 10 s (docs/benchmarks.md)
DEMAND_IDLE_S = 2.0
# ... but this long for a model whose last sleep a request undid less than this long after
# its last one. Not a hold after every wake: alternating bursts on an H100 ran 9 % slower
# beside a model held awake 60 s after its wake (s40), and a 15 s burst of short requests
# went 10 s without the memory of a model held 10 s idle after its wake, 0.779 of static's
# on the same requests (docs/results/h100-2026-12-08-s41)
HELD_IDLE_S = 10.0


class WakeFailed(Exception):
    """A wake that did not happen; its message says why (one line)."""


RoomFn = Callable[[str, int, float], Awaitable[None]]
#: the GPU's engines' unmet demand: (the engine's port, bytes wanted) for each that wants
DemandFn = Callable[[], list[tuple[int, int]]]


class SleepWake:
    """The sleep/wake state machine of the router's models (those with ``sleep_after``)."""

    def __init__(self, router, *, make_room: RoomFn | None = None,
                 wake_timeout: float = WAKE_TIMEOUT_S, sleep_timeout: float = SLEEP_TIMEOUT_S,
                 retry_s: float = SLEEP_RETRY_S, tick_s: float | None = None,
                 capacity: int | None = None, demand: DemandFn | None = None,
                 demand_idle_s: float = DEMAND_IDLE_S, held_idle_s: float = HELD_IDLE_S):
        self.router = router
        self.make_room = make_room
        self.demand = demand
        self.demand_idle_s = demand_idle_s
        self.held_idle_s = held_idle_s
        self.capacity = capacity            # bytes the models may hold (None: not counted)
        self._room = asyncio.Lock()         # one wake or start makes room at a time
        self.wake_timeout = wake_timeout
        self.sleep_timeout = sleep_timeout
        self.retry_s = retry_s
        afters = [b.sleep_after for b in router.backends.values() if b.sleep_after]
        self.tick_s = tick_s if tick_s is not None else \
            min([1.0, *(a / 4 for a in afters)]) if afters else 1.0
        self._wakes: dict[str, asyncio.Task] = {}
        self._sleeps: dict[str, asyncio.Task] = {}
        self._loop: asyncio.Task | None = None
        self.refusals: dict[str, str] = {}          # why the last sleep did not happen
        now = time.monotonic()
        for backend in router.backends.values():
            backend.last_request = now

    @property
    def active(self) -> bool:
        return any(b.sleep_after for b in self.router.backends.values())

    # -- lifespan --------------------------------------------------------------------------
    def start(self) -> None:
        if self.active and self._loop is None:
            self._loop = asyncio.create_task(self._forever(), name="proxima-router-sleep")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self._wakes.values(), *self._sleeps.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests --------------------------------------------------------------------------
    def begin(self, backend) -> Callable[[], None]:
        """A request for ``backend`` goes to its engine now; returns its end (call once)."""
        backend.in_flight += 1
        backend.last_request = time.monotonic()
        done = False

        def end() -> None:
            nonlocal done
            if not done:
                done = True
                backend.in_flight -= 1
                backend.last_request = time.monotonic()
        return end

    async def awake(self, backend) -> str | None:
        """Wait until ``backend``'s model is awake (waking it if asleep): None, or why it
        could not be woken (one line)."""
        self._forget_restart(backend)
        now = time.monotonic()
        if backend.sleep_state in (ASLEEP, FALLING_ASLEEP):     # this request wakes it
            backend.held = now - backend.last_request < self.held_idle_s
        backend.last_request = now
        if not backend.sleep_after or backend.sleep_state == AWAKE:
            return None
        falling = self._sleeps.get(backend.name)
        if falling is not None:
            await asyncio.shield(falling)
            if backend.sleep_state == AWAKE:        # the engine refused the sleep
                return None
        task = self._wakes.get(backend.name)
        if task is None:
            task = self._wakes[backend.name] = asyncio.create_task(
                self._wake(backend), name=f"proxima-wake-{backend.name}")
            task.add_done_callback(lambda _t, n=backend.name: self._wakes.pop(n, None))
        try:
            await asyncio.shield(task)
        except WakeFailed as exc:
            return str(exc)
        return None

    def _forget_restart(self, backend) -> None:
        if backend.sleep_state != AWAKE and backend.generation != backend.sleep_generation:
            backend.sleep_state = AWAKE             # a restarted engine starts awake

    # -- sleeping --------------------------------------------------------------------------
    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for backend in self.tick(time.monotonic()):
                self._start_sleep(backend)
            wanted = await self._for_demand(time.monotonic())
            if wanted is not None:
                self._start_sleep(wanted, release=True)

    async def _for_demand(self, now: float):
        """:meth:`for_demand`, the ledger read off the event loop (None when no model could
        sleep for it: the ledger is then not read)."""
        if self.demand is None or self._sleeps or not self._demand_candidates(now):
            return None
        try:
            wanted = await asyncio.to_thread(self.demand)
        except Exception as exc:  # noqa: BLE001 - an unreadable ledger: no demand seen
            log.debug("the GPU's ledger could not be read (%s)", exc)
            return None
        return self.for_demand(now, wanted)

    def _demand_candidates(self, now: float) -> list:
        return [b for b in self._candidates(None, {})
                if now >= b.last_request + min(b.sleep_after, self._idle_s(b))
                and now >= b.sleep_retry_at]

    def _idle_s(self, backend) -> float:
        """How long ``backend`` must have been idle to sleep for another's demand: longer
        when its last sleep was undone by a request a short while after its last one."""
        return max(self.demand_idle_s, self.held_idle_s) if backend.held \
            else self.demand_idle_s

    def for_demand(self, now: float, wanted: list[tuple[int, int]]):
        """The model to put to sleep now for the other engines' unmet demand ``wanted``
        ((port, bytes) of each engine on the GPU that wants; see the module's doc), or
        None. Logs why."""
        if self._sleeps:
            return None             # one at a time: a sleep in flight is freeing memory

        def others(backend) -> int:
            port = _port(backend.url)
            return sum(b for p, b in wanted if b > 0 and p != port)

        chosen = residency.victim([b for b in self._demand_candidates(now) if others(b) > 0],
                                  lambda b: b.last_request)
        if chosen is not None:
            log.info("model %s sleeps for the GPU's other engines: %.2f GiB wanted (idle "
                     "%.0f s)", chosen.name, others(chosen) / 2**30, now - chosen.last_request)
        return chosen

    def tick(self, now: float) -> list:
        """The models due to sleep now. A model's idle time counts from its last request,
        or from when its engine became ready (a model is not slept for the minutes its
        engine took to start)."""
        due = []
        for backend in self.router.backends.values():
            self._forget_restart(backend)
            if not backend.ready:
                backend.last_request = max(backend.last_request, now)
            elif self.due(backend, now):
                due.append(backend)
        return due

    def _start_sleep(self, backend, release: bool = False) -> asyncio.Task:
        task = self._sleeps.get(backend.name)
        if task is None:
            task = self._sleeps[backend.name] = asyncio.create_task(
                self._sleep(backend, release), name=f"proxima-sleep-{backend.name}")
        return task

    async def sleep_now(self, backend, release: bool = False) -> str | None:
        """Put ``backend``'s model to sleep now (``POST /engines/NAME/proxima/sleep``
        through the endpoint; ``release``: its KV given back at once, not after its idle
        release): None once asleep, else why not (one line)."""
        self._forget_restart(backend)
        if backend.sleep_state == ASLEEP:
            return None
        if backend.sleep_state == WAKING or backend.in_flight:
            return f"it is {'waking' if backend.sleep_state == WAKING else 'serving requests'}"
        if not backend.ready:
            return f"its engine is {backend.state}"
        await asyncio.shield(self._start_sleep(backend, release))
        return None if backend.sleep_state == ASLEEP else self.refusals.get(
            backend.name, "its engine refused")

    def due(self, backend, now: float) -> bool:
        # deadlines are instants (last request + sleep_after): a difference of two clock
        # readings rounds, and read a model idle for 60 s as idle for 59.99999999999977
        return bool(backend.sleep_after and backend.ready and backend.sleep_state == AWAKE
                    and backend.in_flight == 0 and backend.name not in self._sleeps
                    and now >= backend.last_request + backend.sleep_after
                    and now >= backend.sleep_retry_at)

    async def _sleep(self, backend, release: bool = False) -> None:
        began = time.monotonic()
        backend.sleep_state = FALLING_ASLEEP
        backend.sleep_generation = backend.generation
        body = {"timeout_s": self.sleep_timeout, **({"release": True} if release else {})}
        try:
            status, answer = await self._post(backend, "/proxima/sleep", body,
                                              self.sleep_timeout + 60)
            if status != 200:
                backend.sleep_state = AWAKE
                backend.sleep_retry_at = time.monotonic() + self.retry_s
                self.refusals[backend.name] = f"its engine answered {status}: {_why(answer)}"
                log.info("model %s: not put to sleep now (its engine answered %d: %s); "
                         "trying again in %g s", backend.name, status,
                         _why(answer), self.retry_s)
                return
            backend.sleep_state = ASLEEP
            backend.weights_bytes = int(answer.get("weights_bytes") or 0)
            backend.sleeps += 1
            log.info("model %s: asleep in %.2f s (idle %.0f s; weights ~%.2f GiB in host "
                     "memory)", backend.name, time.monotonic() - began,
                     max(0.0, began - backend.last_request), backend.weights_bytes / 2**30)
        except Exception as exc:  # noqa: BLE001 - no answer: asleep or not, unknown
            # counted asleep: the next request's wake is harmless on an awake engine (it
            # answers 200 at once), and a dead one is restarted (awake) by the supervisor
            backend.sleep_state = ASLEEP
            self.refusals[backend.name] = f"no answer ({type(exc).__name__})"
            log.warning("model %s: no answer to the sleep (%s: %s): counted asleep, its next "
                        "request wakes it", backend.name, type(exc).__name__, exc)
        finally:
            self._sleeps.pop(backend.name, None)

    # -- waking ----------------------------------------------------------------------------
    async def _wake(self, backend) -> None:
        began = time.monotonic()
        try:
            async with self._room:
                backend.sleep_state = WAKING        # counted awake from now on
                room_s = await self._wake_with_room(backend, began)
        except WakeFailed as exc:
            backend.sleep_state = ASLEEP
            backend.wake_failures += 1
            log.error("model %s: wake failed after %.2f s: %s", backend.name,
                      time.monotonic() - began, exc)
            raise
        except BaseException:
            backend.sleep_state = ASLEEP
            raise
        backend.sleep_state = AWAKE
        backend.wakes += 1
        backend.last_wake_s = time.monotonic() - began
        backend.last_request = time.monotonic()
        log.info("model %s: awake in %.2f s (room %.2f s, wake %.2f s)", backend.name,
                 backend.last_wake_s, room_s, backend.last_wake_s - room_s)

    async def _wake_with_room(self, backend, began: float) -> float:
        """Room (sleepers put to sleep, then the ledger's ask), then vLLM's wake: the
        seconds the room took. WakeFailed (one line) when it does not happen."""
        if self.short(backend):
            try:
                await asyncio.wait_for(self.evict_for(backend), self.wake_timeout)
            except asyncio.TimeoutError:
                raise WakeFailed(f"the models put to sleep to make room did not sleep within "
                                 f"{self.wake_timeout:g} s") from None
        if self.make_room is not None and backend.weights_bytes:
            await self._ask_room(backend, began)
        room_s = time.monotonic() - began
        left = max(1.0, self.wake_timeout - room_s)
        try:
            status, answer = await self._post(backend, "/proxima/wake_up", None, left)
        except asyncio.TimeoutError:
            raise WakeFailed(f"its engine did not wake within {left:.0f} s") from None
        except Exception as exc:  # noqa: BLE001 - the engine is gone
            raise WakeFailed(f"its engine did not answer ({type(exc).__name__})") from None
        if status != 200:
            raise WakeFailed(f"its engine answered {status} to the wake: {_why(answer)}")
        return room_s

    async def _ask_room(self, backend, began: float) -> None:
        """The weights' bytes asked of the GPU's other engines (``make_room``, bounded by
        what is left of the wake's time). While an idle model that may sleep is there, the
        ask gets half of that; if the KV they give back is not enough by then, the least
        recently used one is put to sleep and the ask made again."""
        refused: dict[str, str] = {}
        while True:
            left = self.wake_timeout - (time.monotonic() - began)
            chosen = residency.victim(self._candidates(backend, refused),
                                      lambda b: b.last_request)
            bound = max(0.1, left / 2 if chosen is not None else left)
            try:
                await asyncio.wait_for(
                    self.make_room(backend.name, backend.weights_bytes, bound), bound)
                return
            except (asyncio.TimeoutError, WakeFailed) as exc:
                if chosen is None or left - bound <= 0:
                    if isinstance(exc, WakeFailed):
                        raise
                    raise WakeFailed(f"no room on the GPU for its weights "
                                     f"({backend.weights_bytes / 2**30:.2f} GiB) within "
                                     f"{self.wake_timeout:g} s") from None
            chosen = residency.victim(self._candidates(backend, refused),
                                      lambda b: b.last_request)
            if chosen is None:
                continue                    # the one seen is busy now: the rest of the time
            log.info("model %s sleeps to make room for %s (the KV given back was not "
                     "enough)", chosen.name, backend.name)
            why = await self.sleep_now(chosen, release=True)
            if why is not None:
                refused[chosen.name] = why

    # -- room: more models than fit at once ------------------------------------------------
    def holds(self, backend) -> int:
        """What the model's engine holds on the GPU now, as counted (0: not running)."""
        if backend.pid is None and not backend.admitted:
            return 0
        return backend.asleep_bytes if backend.sleep_state == ASLEEP else backend.awake_bytes

    def short(self, backend) -> int:
        """Bytes the GPU lacks for ``backend`` awake beside the others as they are (0: it
        fits, or nothing is counted)."""
        if self.capacity is None or not backend.awake_bytes:
            return 0
        others = sum(self.holds(b) for b in self.router.backends.values() if b is not backend)
        return max(0, others + backend.awake_bytes - self.capacity)

    def _candidates(self, backend, refused) -> list:
        return [b for b in self.router.backends.values()
                if b is not backend and b.sleep_after and b.ready and b.pid is not None
                and b.sleep_state == AWAKE and b.in_flight == 0
                and b.name not in self._sleeps and b.name not in refused]

    async def evict_for(self, backend) -> None:
        """Put the least recently used idle models that may sleep to sleep until
        ``backend`` fits awake (:meth:`short`); WakeFailed when none is left. Called with
        the room's lock held."""
        refused: dict[str, str] = {}
        while (short := self.short(backend)) > 0:
            falling = [t for n, t in self._sleeps.items() if n != backend.name]
            if falling:         # a model falling asleep on its own: its room first
                await asyncio.gather(*map(asyncio.shield, falling), return_exceptions=True)
                continue
            chosen = residency.victim(self._candidates(backend, refused),
                                      lambda b: b.last_request)
            if chosen is None:
                awake = [b.name for b in self.router.backends.values()
                         if b is not backend and self.holds(b) and b.sleep_state != ASLEEP]
                tried = "".join(f"; {name} refused: {why}" for name, why in refused.items())
                raise WakeFailed(
                    f"the GPU lacks {short / 2**30:.2f} GiB for it beside the models awake "
                    f"({', '.join(awake) or 'none'}), and none of them may be put to sleep "
                    f"now (no --sleep-after, a request in flight, or not ready{tried})")
            log.info("model %s sleeps to make room for %s", chosen.name, backend.name)
            why = await self.sleep_now(chosen, release=True)
            if why is not None:
                refused[chosen.name] = why
                log.info("model %s: not put to sleep for %s (%s)", chosen.name, backend.name,
                         why)

    async def admit(self, backend) -> None:
        """Before ``backend``'s engine starts or restarts (the supervisor's
        ``before_start``): room for it awake, idle sleepers put to sleep for it. While
        none can be, waits for one (a request in flight ends) up to the wake's bound, then
        lets it start anyway (its own sizing then asks the others, or refuses)."""
        self._forget_restart(backend)
        deadline = time.monotonic() + self.wake_timeout
        said = False
        while True:
            async with self._room:
                try:
                    await self.evict_for(backend)
                    backend.admitted = True
                    return
                except WakeFailed as exc:
                    if time.monotonic() >= deadline:
                        log.warning("model %s: starting without room counted for it (%s)",
                                    backend.name, exc)
                        backend.admitted = True
                        return
                    if not said:
                        log.info("model %s: waits to start: %s", backend.name, exc)
                        said = True
            await asyncio.sleep(min(1.0, self.tick_s))

    async def _post(self, backend, path: str, body, timeout: float) -> tuple[int, dict]:
        import aiohttp

        async with self.router.session.post(
                f"{backend.url}{path}", json=body,
                timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            try:
                payload = await answer.json(content_type=None)
            except Exception:  # noqa: BLE001 - not JSON: its text says why
                payload = {"error": (await answer.text())[:300]}
            return answer.status, payload if isinstance(payload, dict) else {}


def _port(url: str) -> int | None:
    """The port of an engine's ``http://host:PORT`` (None: none said)."""
    tail = url.rstrip("/").rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _why(answer: dict) -> str:
    error = answer.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return str(error or answer)[:300]


def unavailable_message(backend, why: str) -> str:
    """What the held requests are told (503, OpenAI's error shape) when the wake failed."""
    return f"The model `{backend.name}` is asleep and could not be woken now: {why}. Retry later."


def gpu_demand(uuid: str | None, ledger_dir: str | None = None) -> DemandFn | None:
    """The unmet demand on the GPU ``uuid``'s ledger: (port, bytes) of each live engine that
    wants memory the GPU cannot give now. None without a GPU uuid."""
    if not uuid:
        return None
    from proxima.memory.ledger import ledger_path, live_records

    path = ledger_path(uuid, ledger_dir)

    def demand() -> list[tuple[int, int]]:
        return [(r.port, r.unmet) for r in live_records(path) if r.unmet > 0]
    return demand


def gpu_room(uuid: str | None, ledger_dir: str | None = None,
             free: Callable[[], int | None] | None = None, keep_free: int = 0) -> RoomFn | None:
    """The wake's room on the GPU ``uuid``: what of ``need`` bytes, plus ``keep_free`` left
    free after the wake (what an engine's KV map leaves free for the forward's activations,
    ``gpu_free_low`` of the GPU), is not free now (NVML, or ``free()``) is asked of the other
    engines through the GPU's ledger, waiting until it is (bounded). None without a GPU uuid
    (nothing to ask)."""
    if not uuid:
        return None
    from proxima.errors import UserError
    from proxima.serve import autosize

    free = free or autosize._nvml_free(uuid)

    async def room(name: str, need: int, timeout: float) -> None:
        now = await asyncio.to_thread(free)
        if now is None or now >= need + keep_free:
            return
        short = need + keep_free - now
        log.info("model %s: asking the GPU's other engines for %.2f GiB to wake it", name,
                 short / 2**30)
        try:
            await asyncio.to_thread(autosize.ask_others, uuid, short, free,
                                    ledger_dir=ledger_dir, timeout=timeout)
        except UserError:
            raise WakeFailed(f"the GPU's other engines did not give back the "
                             f"{short / 2**30:.2f} GiB its weights need (with "
                             f"{keep_free / 2**30:.2f} GiB left free) within "
                             f"{timeout:g} s") from None
    return room
