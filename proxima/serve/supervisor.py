"""Inside the gunicorn worker: start the engine, check it, serve, and give up cleanly.

Life of one worker::

    not-started -> starting -> checking -> ready -> engine-dead   (exit 0: gunicorn restarts)
                        \\           \\
                         +-----------+-> failed                   (exit 3: gunicorn halts)

The engine is started by the launcher of the installed engine generation
(:mod:`proxima.serve.launch`), without blocking the event loop, so it keeps answering
``/health`` (503) and gunicorn's heartbeat while the model loads. The self-check then runs against the live
engine and, last, a canary request through the real listening socket; traffic other than the
canary is refused with 503 until every check passed. After that a watchdog polls the engine:
when it died, in-flight requests already got vLLM's EngineDeadError responses, and the worker
exits so gunicorn starts a fresh one (new engine, new self-check).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import secrets
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Callable

from proxima.vllm import activation
from proxima.vllm.status import read_status, stats_path
from proxima.serve import startup_errors
from proxima.serve.launch import launcher_for
from proxima.serve.engine_checks import (check_active, check_elastic, check_invariants,
                                         pick_invariants_status, run_canary)
from proxima.serve.preflight import run_preflight
from proxima.serve.report import CHECK_ORDER, Check, Report, failed, ok, skipped
from proxima.serve.tee import OutputTee

log = logging.getLogger("proxima.serve")

NOT_STARTED, STARTING, CHECKING, READY = "not-started", "starting", "checking", "ready"
FAILED, ENGINE_DEAD, STOPPING = "failed", "engine-dead", "stopping"

EXIT_RESTART = 0     # gunicorn starts a fresh worker
EXIT_BOOT_ERROR = 3  # gunicorn's WORKER_BOOT_ERROR: the arbiter halts, proxima serve exits
PREFLIGHT_MAX_AGE_S = 60  # older pre-flight results (a restart) are measured again
STATUS_WAIT_S = 30
WATCH_INTERVAL_S = 1.0


class BootFailed(Exception):
    """A check failed; the report says which and why."""


def canary_target(args: argparse.Namespace) -> tuple[str, str | None, bool]:
    """(base_url, uds, verify) to reach this server the way a client does."""
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    if getattr(args, "uds", None):
        return f"{scheme}://localhost", args.uds, False
    host = args.host or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{args.port}", None, scheme == "http"


class Supervisor:
    def __init__(self, args: argparse.Namespace, *, vllm_config=None,
                 preflight: list[Check] | None = None, preflight_time: float = 0.0,
                 failure_file: Path | None = None):
        self.args = args
        self.vllm_config = vllm_config  # built by the arbiter; each forked worker has a copy
        self.preflight = preflight
        self.preflight_time = preflight_time
        self.failure_file = failure_file
        self.report = Report()
        self.phase = NOT_STARTED
        self.launcher = launcher_for()   # how this vLLM's engine and app are started
        self.inner = None   # vLLM's FastAPI app, once the engine runs
        self.engine = None  # vLLM's engine client (V1: AsyncLLM)
        self.supported_tasks: tuple = ("generate",)
        self.canary_token = secrets.token_urlsafe(16)
        self.request_exit: Callable[[int], None] | None = None  # set by the gunicorn worker
        self._task: asyncio.Task | None = None
        self._stack = AsyncExitStack()

    # -- what the gate asks ------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.phase == READY and self.engine is not None and not self.engine.errored

    def admits(self, canary_header: str | None) -> bool:
        if self.phase == READY:
            return True
        return (self.phase == CHECKING and canary_header is not None
                and secrets.compare_digest(canary_header, self.canary_token))

    def status(self) -> dict:
        return {"phase": self.phase, **self.report.to_json()}

    # -- lifespan ------------------------------------------------------------------------
    async def start(self) -> None:
        self.phase = STARTING
        self._task = asyncio.create_task(self._run(), name="proxima-supervisor")

    async def stop(self) -> None:
        self.phase = STOPPING
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self.engine is None:
            _stop_children()  # an engine still starting: its process is ours to end
        await self._stack.aclose()

    # -- the run -------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._boot()
        except BootFailed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a verdict: still one line and a clean exit
            log.exception("self-check crashed")
            name = next((n for n in CHECK_ORDER if n not in {c.name for c in self.report.checks}),
                        "engine")
            self.report.add(failed(name, f"unexpected {type(exc).__name__}: {exc}",
                                   "see the traceback in the log above"))
        self.report.finish()
        for line in self.report.lines():
            log.info("self-check %s", line)
        if self.report.any_failed:
            self.phase = FAILED
            self._skip_rest()
            self._write_failure()
            log.error("self-check failed: not serving; stopping (gunicorn halts)")
            self._exit(EXIT_BOOT_ERROR)
            return
        self.phase = READY
        log.info("self-check passed: serving %s", ", ".join(self.served_names()))
        await self._watch()

    async def _boot(self) -> None:
        if self.preflight is None or time.time() - self.preflight_time > PREFLIGHT_MAX_AGE_S:
            self.preflight = await asyncio.to_thread(run_preflight)
            self.preflight_time = time.time()
        self.report.extend(self.preflight)
        self._fail_if_any()

        path = stats_path()
        if path is not None:
            path.unlink(missing_ok=True)  # a previous engine's snapshot proves nothing
        started = time.time()
        await self._start_engine()
        self.report.add(ok("engine", self._engine_summary(time.time() - started)))

        self.phase = CHECKING
        status = await self._wait_status(newer_than=started, timeout=STATUS_WAIT_S)
        self.report.add(check_active(status, server_pid=os.getpid(),
                                     engine_pids=self._engine_pids(), since=started, path=path,
                                     in_process=self.engine_in_process()))
        self._fail_if_any()

        canary_started = time.time()
        self.report.add(await self._canary())
        self._fail_if_any()
        # The engine writes at most once a second while scheduling: prefer a snapshot taken
        # after the canary ran if it carries a verdict; an idle engine may not write again.
        latest = await self._wait_status(newer_than=canary_started, timeout=3)
        self.report.add(check_invariants(pick_invariants_status(latest, status)))
        self.report.add(check_elastic(latest or status, activation.elastic()))
        self._fail_if_any()

    async def _start_engine(self) -> None:
        launcher = self.launcher
        tee = OutputTee()
        try:
            with tee:
                self.engine = await self._stack.enter_async_context(
                    launcher.engine_client(self.args, self.vllm_config))
        except Exception as exc:
            why = startup_errors.explain(f"{tee.text()}\n{type(exc).__name__}: {exc}",
                                         **launcher.sizing(self.args))
            self.report.add(failed("engine", why.why, why.fix))
            raise BootFailed from exc
        inner, self.supported_tasks = await launcher.build_app(self.engine, self.args)
        await self._stack.enter_async_context(inner.router.lifespan_context(inner))
        self.inner = inner

    def engine_in_process(self) -> bool:
        """The engine runs in this process (vLLM 0.6 without its multiprocessing front end)."""
        return self.engine is not None and self.launcher.in_process(self.engine)

    async def _canary(self) -> Check:
        if "generate" not in self.supported_tasks:
            return skipped("canary", "the model does not generate text (pooling model)")
        base_url, uds, verify = canary_target(self.args)
        keys = [k for k in (getattr(self.args, "api_key", None) or [os.environ.get("VLLM_API_KEY")])
                if k]
        return await run_canary(base_url, self.served_names()[0], token=self.canary_token,
                                api_key=keys[0] if keys else None, uds=uds, verify=verify)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.engine is not None and self.engine.errored:
                self.phase = ENGINE_DEAD
                log.error("the engine process died: /health now answers 503; in-flight requests "
                          "got EngineDeadError; ending this worker so gunicorn starts a new one")
                self._exit(EXIT_RESTART)
                return

    # -- helpers -------------------------------------------------------------------------
    def served_names(self) -> list[str]:
        return list(getattr(self.args, "served_model_name", None) or [self.args.model])

    def _engine_pids(self) -> list[int]:
        return self.launcher.engine_pids(self.engine) if self.engine is not None else []

    def _engine_summary(self, seconds: float) -> str:
        pids = ", ".join(map(str, self._engine_pids())) or "?"
        return (f"started in {seconds:.1f} s: {self.served_names()[0]} ({self.args.model}), "
                f"{self.launcher.summary(self.engine)}, engine pid {pids}")

    async def _wait_status(self, newer_than: float, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            status = read_status()
            if status is not None and float(status.get("time", 0)) >= newer_than:
                return status
            if time.monotonic() >= deadline:
                return status
            await asyncio.sleep(0.2)

    def _fail_if_any(self) -> None:
        if self.report.any_failed:
            raise BootFailed

    def _skip_rest(self) -> None:
        done = {c.name for c in self.report.checks}
        first = self.report.first_failure()
        for name in CHECK_ORDER:
            if name not in done:
                self.report.add(skipped(name, f"not run: {first.name if first else 'an earlier check'} failed"))

    def _write_failure(self) -> None:
        first = self.report.first_failure()
        if self.failure_file is not None and first is not None:
            try:
                self.failure_file.write_text(first.line() + "\n")
            except OSError:
                pass

    def _exit(self, code: int) -> None:
        if self.request_exit is not None:
            self.request_exit(code)
        else:
            log.warning("no gunicorn worker attached: not exiting (exit code would be %d)", code)


def _stop_children(timeout: float = 5.0) -> None:
    for child in multiprocessing.active_children():
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
