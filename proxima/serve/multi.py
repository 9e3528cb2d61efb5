"""``proxima serve`` with several models: one supervised engine per model, one endpoint.

Process layout::

    proxima serve (this process)   checks the input, runs the endpoint (router.py), supervises
      ├ proxima serve PATH_1 --port P1 --served-model-name NAME_1 --elastic ...   (127.0.0.1)
      ├ proxima serve PATH_2 --port P2 ...   each its own gunicorn arbiter, worker, engine,
      └ ...                                  self-check, /health, /metrics, /proxima/kv

Each engine is the single-model ``proxima serve`` (it restarts its own worker when its
engine core dies). This process restarts an engine's whole ``proxima serve`` when it exits:
after a backoff (1, 2, 4, 8, 16, 30 s), at most :data:`MAX_RESTARTS` times in
:data:`RESTART_WINDOW_S`; after that the model is given up (503, named by ``/health``)
while the others keep serving. An engine that exits before it was ever ready (bad model,
failed self-check) stops everything: exit 1 with its error line. Engines start side by
side where the GPU has ample room for all of them (:func:`start_side_by_side`: no model
sleeps, and the models need at most half the free memory at their minimums); otherwise one
after another, each once the previous one is ready: each is then sized counting the engines
already on the GPU's ledger, and one short of memory at start asks them for it (vLLM's
start-up memory profiling is not the reason: it is skipped where the KV size is given, as it
is for every elastic engine). With models that may sleep (``sleep_after``) more models than
fit at once are served (:mod:`proxima.serve.residency`): before each start and restart the
supervisor's ``before_start`` (:meth:`proxima.serve.sleepwake.SleepWake.admit`) puts
idle sleepers to sleep until the engine fits.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from proxima.errors import UserError
from proxima.serve import multi_config
from proxima.serve.argv import option_name
from proxima.serve.multi_config import ENGINE_HOST, engine_command, engine_env, free_port
from proxima.serve.router import (FAILED, READY, RESTARTING, STARTING, STOPPED, Backend,
                                  Router)

log = logging.getLogger("proxima.serve")

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
MAX_RESTARTS = 5            # restarts within RESTART_WINDOW_S before a model is given up
RESTART_WINDOW_S = 600.0
STOP_TIMEOUT_S = 30.0       # SIGTERM, then this long, then SIGKILL of the engine's group
STOP_DRAIN_S = 6.0         # then this long for the engines' output to end (a relay waits 5 s)


@dataclass
class Engine:
    """One model's engine process, as the supervisor keeps it."""

    backend: Backend
    command: list[str]
    env: dict | None = None
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    starts: int = 0
    last_error: str = ""            # its "proxima serve: error:" line, else its last error line
    verdict: bool = False           # last_error is the "proxima serve: error:" line
    deaths: collections.deque = field(default_factory=collections.deque)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Supervisor:
    """Starts every engine (one after another, or all at once with ``side_by_side``),
    restarts the dead ones, stops them all."""

    def __init__(self, engines: list[Engine], *, backoff=BACKOFF_S, max_restarts=MAX_RESTARTS,
                 window_s=RESTART_WINDOW_S, stop_timeout=STOP_TIMEOUT_S, side_by_side=False,
                 on_fatal=None, output=None, before_start=None):
        self.engines = engines
        self.backoff = tuple(backoff)
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.stop_timeout = stop_timeout
        self.side_by_side = side_by_side
        self.on_fatal = on_fatal            # called with one line when serving must stop
        # awaited with the backend before each start and restart: room made for it
        # (sleepwake.SleepWake.admit puts idle sleepers to sleep)
        self.before_start = before_start
        self.output = output if output is not None else sys.stderr
        self.fatal: str | None = None
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._starter: asyncio.Task | None = None

    async def start(self) -> None:
        self._starter = asyncio.create_task(self._start_all(), name="proxima-multi-start")

    async def _start_all(self) -> None:
        for engine in self.engines:
            if self._stopping:
                return
            task = asyncio.create_task(self._keep(engine), name=f"proxima-engine-{engine.backend.name}")
            self._tasks.append(task)
            if not self.side_by_side:
                while not engine.backend.ever_ready and not task.done() and not self._stopping:
                    await asyncio.sleep(0.1)
                if self.fatal:
                    return

    async def _keep(self, engine: Engine) -> None:
        backend = engine.backend
        while not self._stopping:
            if self.before_start is not None:
                await self.before_start(backend)
            code = await self._run_once(engine)
            if self._stopping:
                return
            backend.generation += 1
            why = f"exit {_exit_text(code)}" + (f": {engine.last_error}" if engine.last_error else "")
            if engine.starts == 1 and not backend.ever_ready:
                backend.set_state(FAILED, f"stopped before it was ready ({why})")
                self._fail(f"model {backend.name!r}: its engine stopped before it was ready "
                           f"({why})")
                return
            now = time.monotonic()
            engine.deaths.append(now)
            while engine.deaths and now - engine.deaths[0] > self.window_s:
                engine.deaths.popleft()
            if len(engine.deaths) > self.max_restarts:
                backend.set_state(FAILED, f"died {len(engine.deaths)} times in "
                                          f"{self.window_s:.0f} s, given up; last: {why}")
                log.error("model %s: its engine died %d times in %.0f s: given up (the other "
                          "models keep serving)", backend.name, len(engine.deaths), self.window_s)
                return
            delay = self.backoff[min(len(engine.deaths), len(self.backoff)) - 1]
            backend.set_state(RESTARTING, f"{why}; restart {backend.restarts + 1} in {delay:g} s")
            log.warning("model %s: its engine died (%s): restarting in %g s", backend.name, why,
                        delay)
            await asyncio.sleep(delay)
            backend.restarts += 1

    async def _run_once(self, engine: Engine) -> int:
        backend = engine.backend
        backend.generation += 1
        backend.models_entry = None
        engine.starts += 1
        engine.last_error, engine.verdict = "", False
        backend.set_state(STARTING)
        try:
            engine.process = await asyncio.create_subprocess_exec(
                *engine.command, env=engine.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,     # its own group: stopped as one, with its children
                preexec_fn=_term_with_parent)
        except OSError as exc:
            backend.admitted = False
            engine.last_error = f"cannot start {engine.command[0]}: {exc.strerror}"
            return 127
        backend.pid, backend.admitted = engine.process.pid, False
        relay = asyncio.create_task(self._relay(engine, engine.process))
        code = await _exited(engine.process)
        backend.pid = None
        if not self._stopping:              # 503 for its model from now, not at the next poll
            backend.generation += 1
            backend.set_state(RESTARTING, f"exit {_exit_text(code)}")
        await self._end_group(engine.process.pid, grace=2.0)   # the arbiter's orphans, if any
        try:
            await asyncio.wait_for(relay, timeout=5)
        except (asyncio.TimeoutError, Exception):
            relay.cancel()
        return code

    async def _relay(self, engine: Engine, process) -> None:
        """The engine's output, each line prefixed with its model's name."""
        prefix = f"[{engine.backend.name}] "
        while True:
            line = await process.stdout.readline()
            if not line:
                return
            text = line.decode(errors="replace").rstrip("\n")
            if "proxima serve: error: " in text:           # its own one-line verdict
                engine.last_error = text.split("proxima serve: error: ", 1)[1].strip()[:400]
                engine.verdict = True
            elif not engine.verdict and ("error" in text.lower()):
                engine.last_error = text.strip()[-400:]
            try:
                self.output.write(prefix + text + "\n")
                self.output.flush()
            except (OSError, ValueError):
                pass

    async def _end_group(self, pgid: int, grace: float) -> None:
        if not _group_alive(pgid):
            return
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _group_alive(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)

    def _fail(self, line: str) -> None:
        if self.fatal is None:
            self.fatal = line
            log.error("%s: stopping every engine", line)
            if self.on_fatal is not None:
                self.on_fatal(line)

    async def stop(self) -> None:
        self._stopping = True
        for engine in self.engines:
            engine.backend.set_state(STOPPED)
        if self._starter is not None:
            self._starter.cancel()
        running = [e.process for e in self.engines
                   if e.process is not None and e.process.returncode is None]
        for process in running:
            try:
                process.send_signal(signal.SIGTERM)     # its arbiter stops worker and engine
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout
        for process in running:
            try:
                await asyncio.wait_for(_exited(process), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("pid %d did not stop in %.0f s: killing its group", process.pid,
                            self.stop_timeout)
        for engine in self.engines:
            if engine.process is not None:
                _signal_group(engine.process.pid, signal.SIGKILL)
        # each supervising task ends its run: the engine's output read to its end, so asyncio
        # closes the pipes while the loop still runs (cancelled at once, they were left to
        # be closed at exit, after the loop: two tracebacks at every stop)
        pending = [task for task in self._tasks if not task.done()]
        if pending:
            _, pending = await asyncio.wait(pending, timeout=STOP_DRAIN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _exited(process, poll: float = 0.1) -> int:
    """The engine's exit code, as soon as its process has exited. Not ``process.wait()``:
    asyncio answers that only once the output pipe is closed too, and a process left behind
    in the group (gunicorn's worker, after a kill -9 of its arbiter) keeps it open."""
    while process.returncode is None:
        await asyncio.sleep(poll)
    return process.returncode


def _exit_text(code: int) -> str:
    if code is not None and code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def _term_with_parent() -> None:
    """In the engine's process before exec: SIGTERM when this process dies (Linux), so that
    no engine outlives a ``proxima serve`` that was killed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# -- the command ------------------------------------------------------------------------------
def prepare(argv: list[str]) -> tuple[multi_config.MultiPlan, str, int, list[Engine]]:
    """Every check that needs no engine; UserError (one line) on bad input."""
    from proxima.serve import validate
    from proxima.serve.serve_flags import check_bare_sleep_mode

    plan = multi_config.parse_command_line(argv)
    multi_config.check_plan(plan, validate.check_model)
    for spec in plan.models:
        try:
            check_bare_sleep_mode(*model_options(plan, spec))
        except UserError as exc:
            raise UserError(f"model {spec.name!r}: {exc}") from None
    # every engine runs elastic: the switches are checked as they will be there
    validate.validate_environment({**os.environ, "PROXIMA_ELASTIC": "1"})
    if plan.gpu_bytes is not None:      # a GPU of a given size: the fit needs no GPU
        check_fit(plan)
    host = plan.host or "0.0.0.0"
    port = plan.port if plan.port is not None else validate.DEFAULT_PORT
    validate.check_port(host, port)
    taken = {port}
    for spec in plan.models:
        if spec.port is not None:
            try:
                validate.check_port(ENGINE_HOST, spec.port)
            except UserError as exc:
                raise UserError(f"model {spec.name!r}: {exc}") from None
            taken.add(spec.port)
    engines = []
    for index, spec in enumerate(plan.models):
        engine_port = spec.port if spec.port is not None else free_port(avoid=taken)
        taken.add(engine_port)
        backend = Backend(name=spec.name, url=f"http://{ENGINE_HOST}:{engine_port}", path=spec.path,
                          sleep_after=spec.sleep_after)
        engines.append(Engine(backend=backend, command=engine_command(spec, engine_port, plan),
                              env=engine_env(index, len(plan.models))))
    return plan, host, port, engines


def api_keys(plan: multi_config.MultiPlan, environ=os.environ) -> set[str]:
    """The keys the engines accept (``--api-key`` for every model or one, ``VLLM_API_KEY``):
    the endpoint asks for one of them where it answers itself (``/v1/models``)."""
    keys = {environ["VLLM_API_KEY"]} if environ.get("VLLM_API_KEY") else set()
    for argv in [plan.common, *(spec.args for spec in plan.models)]:
        for i, token in enumerate(argv):
            flag, eq, inline = token.partition("=")
            if option_name(flag) == "--api-key":
                if eq:
                    keys.add(inline)
                elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    keys.add(argv[i + 1])
    return keys


def check_fit(plan: multi_config.MultiPlan, facts: dict | None = None) -> int | None:
    """The models fit on one GPU at their minimums (weights from each config.json, plus
    activations and --kv-min), beside the engines already on its ledger: on
    ``--gpu-memory-bytes`` when given (before the GPU is probed), else on the probed GPU
    (``facts``). With models that may sleep (``sleep_after``), those that never sleep and
    the largest sleeper must fit (:func:`proxima.serve.residency.check`). Returns the bytes
    needed (None: the GPU's size is not known yet)."""
    fit = fit_models(plan, facts)
    return None if fit is None else fit[0]


def model_sizes(plan: multi_config.MultiPlan) -> list[tuple[str, int | None, int, int]]:
    """Each model's :func:`proxima.serve.autosize.model_sizes` row, from its options."""
    from proxima.serve import autosize

    return autosize.model_sizes(
        [(s.name, s.path, [*plan.common, *s.args, *s.elastic_args()]) for s in plan.models])


def fit_models(plan: multi_config.MultiPlan, facts: dict | None = None):
    """:func:`check_fit`'s work: ``(need, capacity, places, source)`` (None: the GPU's size
    is not known yet); ``capacity`` what the GPU has for the models, ``places`` each
    model's :class:`~proxima.serve.residency.Place`. UserError (one line) when they do not
    fit."""
    from proxima.serve import autosize, residency, sizing

    total, _, uuid = autosize.gpu_facts(facts or {})
    if plan.gpu_bytes is not None:
        total, source = plan.gpu_bytes, "--gpu-memory-bytes"
    else:
        source = "the GPU"
    if not total:
        return None
    others = autosize.ledger_others(uuid) if plan.gpu_bytes is None else []
    claim = sum(o.claim for o in others)
    sizes = model_sizes(plan)
    sleeps = {s.name for s in plan.models if s.sleep_after is not None}
    places = [residency.Place(name, (nonkv or 0) + least,
                              (nonkv or 0) - weights + least if name in sleeps else None)
              for name, nonkv, weights, least in sizes]
    if sleeps:
        need = residency.check(places, total, claim, len(others), source=source,
                               unknown=[n for n, nonkv, _, _ in sizes if nonkv is None])
    else:
        need = sizing.check_fit([(n, nonkv, least) for n, nonkv, _, least in sizes], total,
                                others, source=source)
    return need, total - claim, places, source


def check_engines_options(plan: multi_config.MultiPlan) -> dict:
    """The GPU pre-flight once, the models' fit on the GPU, and each model's options through
    vLLM's own parser (as the single-model serve does), so bad input is refused before any
    engine starts. Returns the GPU's facts (the probe's)."""
    from proxima.serve import gpuprobe, vllm_args
    from proxima.serve.preflight import run_preflight

    # as for one elastic model: vLLM loads Proxima's plugin when its parser is built, and the
    # plugin checks the switches (PROXIMA_COMPACTION=1 needs PROXIMA_ELASTIC=1)
    os.environ["PROXIMA_ALLOCATOR"] = "1"
    os.environ["PROXIMA_ELASTIC"] = "1"
    facts = gpuprobe.probe()
    checks = run_preflight(facts)
    for check in checks:
        log.info("self-check %s", check.line())
    first = next((c for c in checks if c.failed), None)
    if first is not None:
        if first.name in ("gpu", "cuda"):
            for label, argv in _option_sets(plan):
                try:
                    vllm_args.check_options_without_gpu(
                        argv, f"{first.name} self-check failed too (see above)",
                        multi_config.OWN_FLAGS)
                except UserError as exc:
                    raise UserError(f"{label}: {exc}") from None
        raise UserError(f"self-check failed, not serving: {first.line()}")
    if any(spec.sleep_after is not None for spec in plan.models):
        from proxima.serve.serve_flags import check_sleep_mode_vllm
        from proxima.vllm.activation import installed_version

        check_sleep_mode_vllm(installed_version("vllm"))
    if plan.gpu_bytes is None:
        need = check_fit(plan, facts)
        if need is not None:
            log.info("the models fit: %.2f GiB at their minimums", need / 2**30)
    for label, argv in _option_sets(plan):
        try:
            vargs = vllm_args.parse(argv, own_flags=multi_config.OWN_FLAGS)
            vllm_args.check_supported(vargs)
        except UserError as exc:
            raise UserError(f"{label}: {exc}") from None
    return facts


def model_options(plan: multi_config.MultiPlan,
                  spec: multi_config.ModelSpec) -> tuple[list[str], dict]:
    """A model's engine options as its ``proxima serve --elastic`` reads them (the options for
    every model, then its own, then its sizing and sleep flags): vLLM's part, and the elastic
    options Proxima takes out (UserError on a bad value)."""
    from proxima.serve.serve_flags import take_elastic_options

    return take_elastic_options(["--elastic", *plan.common, *spec.args, *spec.elastic_args()])


def _option_sets(plan: multi_config.MultiPlan):
    """(label, vllm serve argv): the options for every model first, then each model's;
    Proxima's own (--kv-min, --kv-max, --elastic-options) taken out, as the engine's
    proxima serve takes them out before vLLM's parser sees the rest."""
    from proxima.serve.serve_flags import take_elastic_options

    common = take_elastic_options(["--elastic", *plan.common])[0]
    if common:
        yield "the options for every model", [plan.models[0].path, *common]
    for spec in plan.models:
        yield f"model {spec.name!r}", [spec.path, *model_options(plan, spec)[0]]


def run(argv: list[str]) -> int:
    from proxima.serve import logs

    logs.setup()
    plan, host, port, engines = prepare(argv)
    facts = check_engines_options(plan)
    for engine in engines:
        log.info("model %s: %s", engine.backend.name, " ".join(engine.command[2:]))
    from proxima.serve import autosize
    from proxima.serve.sleepwake import gpu_demand, gpu_room

    total, _, uuid = autosize.gpu_facts(facts)
    # a wake leaves free what the engines' KV maps leave: the forward's activations' room
    room = gpu_room(uuid, keep_free=int(wake_margin(plan) * total) if total else 0)
    together, why = start_side_by_side(plan, facts)
    log.info("the engines start %s (%s)", "side by side" if together else "one after another",
             why)
    return asyncio.run(serve(engines, host, port, api_keys=api_keys(plan), side_by_side=together,
                             sleep_options={"make_room": room, "demand": gpu_demand(uuid),
                                            "capacity": plan_residency(plan, facts, engines)}))


def wake_margin(plan: multi_config.MultiPlan) -> float:
    """The share of the GPU a wake leaves free: the largest ``gpu_free_low`` among the models
    (each one's ``--elastic-options``, else the policy's 5 %), as every engine's KV map
    leaves its own share free for its forward's activations."""
    from proxima.memory.policy_options import PolicyOptions

    return max((float(model_options(plan, spec)[1].get("gpu_free_low",
                                                       PolicyOptions.gpu_free_low))
                for spec in plan.models), default=PolicyOptions.gpu_free_low)


def start_side_by_side(plan: multi_config.MultiPlan, facts: dict) -> tuple[bool, str]:
    """:func:`proxima.serve.residency.side_by_side` of these models on the probed GPU."""
    from proxima.serve import autosize, residency

    needs = {name: None if nonkv is None else nonkv + least
             for name, nonkv, _, least in model_sizes(plan)}
    free = None if plan.gpu_bytes is not None else autosize.gpu_facts(facts or {})[1]
    return residency.side_by_side(needs, free,
                                  any(s.sleep_after is not None for s in plan.models))


def plan_residency(plan: multi_config.MultiPlan, facts: dict,
                   engines: list[Engine]) -> int | None:
    """With models that may sleep and a GPU of known size: each backend's place awake and
    asleep, the start-up plan logged; returns what the GPU has for the models (None: not
    counted, every model starts and stays awake as its own sizing allows)."""
    from proxima.serve.residency import plan_lines

    fit = fit_models(plan, facts) if any(s.sleep_after for s in plan.models) else None
    if fit is None:
        return None
    _, capacity, places, source = fit
    for engine, place in zip(engines, places):
        engine.backend.awake_bytes = place.awake
        engine.backend.asleep_bytes = place.asleep if place.sleeps else place.awake
    for line in plan_lines(places, capacity, source):
        log.info("%s", line)
    return capacity


class Endpoint:
    """The endpoint (uvicorn serving :class:`~proxima.serve.router.Router`) and the
    engines' :class:`Supervisor`, started and stopped together (the router's lifespan)."""

    def __init__(self, engines: list[Engine], host: str, port: int, *, health_interval=1.0,
                 api_keys=(), sleep_options=None, **supervisor_options):
        import uvicorn

        self.code, self.line = 0, None
        self.supervisor = Supervisor(engines, on_fatal=self._fatal, **supervisor_options)
        self.router = Router([e.backend for e in engines], health_interval=health_interval,
                             api_keys=api_keys, on_startup=self.supervisor.start,
                             on_shutdown=self.supervisor.stop, sleep_options=sleep_options)
        if self.router.sleepwake.capacity is not None:     # more models than fit at once
            self.supervisor.before_start = self.router.sleepwake.admit
        config = uvicorn.Config(self.router, host=host, port=port, lifespan="on",
                                log_level="warning", access_log=False,
                                timeout_graceful_shutdown=10)
        self.server = _Server(config)
        self.host, self.port = host, port

    def _fatal(self, line: str) -> None:
        self.code, self.line = 1, line
        self.server.should_exit = True

    def stop(self) -> None:
        """Ask the endpoint to stop (from any thread)."""
        self.server.should_exit = True

    async def run(self) -> int:
        """Serve until stopped or interrupted (0), or until an engine cannot start (1)."""
        log.info("endpoint: http://%s:%d (models: %s)", self.host, self.port,
                 ", ".join(self.router.backends))
        await self.server.serve()
        if self.code:
            print(f"proxima serve: error: {self.line}", file=sys.stderr)
        return self.code


def _Server(config):
    """uvicorn's server, except that a stop asked by SIGTERM or SIGINT, once done, is a clean
    exit (0, as the one-model `proxima serve` under gunicorn), not the signal raised again
    (uvicorn's default: the process then dies of it, exit -15)."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()

    return Server(config)


async def serve(engines: list[Engine], host: str, port: int, **options) -> int:
    return await Endpoint(engines, host, port, **options).run()


__all__ = ["Endpoint", "Engine", "Supervisor", "prepare", "run", "serve", "READY"]
