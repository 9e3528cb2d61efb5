"""Inside the gunicorn worker: start the engine, check it, serve, and give up cleanly.

Life of one worker::

    not-started -> starting -> checking -> ready -> engine-dead   (exit 0: gunicorn restarts)
                        \\           \\
                         +-----------+-> failed                   (exit 3: gunicorn halts)

The engine starts in a background thread so the event loop keeps answering ``/health`` (503)
and gunicorn's heartbeat while the model loads. The self-check then runs against the live
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
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Callable

from proxima.engines.status import read_status, stats_path
from proxima.serve import metrics, startup_errors
from proxima.serve.engine_checks import (check_active, check_invariants,
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


def _in_daemon_thread(fn: Callable, on_orphan: Callable = lambda result: None):
    """Run blocking ``fn`` in a daemon thread (never joined at exit, unlike to_thread's pool).
    If the awaiting task was cancelled meanwhile, ``on_orphan`` receives the result."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result=None, error=None):
        if future.cancelled():
            if error is None:
                on_orphan(result)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target():
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=target, daemon=True, name="proxima-engine-start").start()
    return future


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
        self.inner = None   # vLLM's FastAPI app, once the engine runs
        self.engine = None  # vLLM's AsyncLLM
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
        self._fail_if_any()

    async def _start_engine(self) -> None:
        if self.card_stack:
            return await self._start_engine_v0()
        from proxima.engines.vllm_v1_compat import api_server_app

        build_app, init_app_state = api_server_app()
        tee = OutputTee()
        try:
            with tee:
                self.engine = await _in_daemon_thread(self._make_engine, on_orphan=_shutdown)
        except Exception as exc:
            why = startup_errors.explain(
                f"{tee.text()}\n{type(exc).__name__}: {exc}",
                gpu_memory_utilization=getattr(self.args, "gpu_memory_utilization", None),
                max_model_len=getattr(self.args, "max_model_len", None),
                kv_cache_memory_bytes=getattr(self.args, "kv_cache_memory_bytes", None))
            self.report.add(failed("engine", why.why, why.fix))
            raise BootFailed from exc
        self._stack.callback(_shutdown, self.engine)
        engine = self.engine
        # AsyncLLM starts its output handler when built inside a running loop; it was built in
        # a thread, so start it here, as early as vLLM would have.
        start_output_handler = getattr(engine, "_run_output_handler", None)
        if callable(start_output_handler):
            start_output_handler()
        await engine.reset_mm_cache()
        tasks = await engine.get_supported_tasks()
        inner = build_app(self.args, tasks, engine.model_config)
        await init_app_state(engine, inner.state, self.args, tasks)
        await self._stack.enter_async_context(inner.router.lifespan_context(inner))
        self.inner = inner
        self.supported_tasks = tasks

    async def _start_engine_v0(self) -> None:
        """vLLM 0.6.3 (V0): what its api_server.run_server does, minus binding a socket
        (gunicorn has it). build_async_engine_client spawns the engine process (MQLLMEngine)
        and awaits it, so the event loop stays free while the model loads; with
        --disable-frontend-multiprocessing (or a config MQLLMEngine does not support) vLLM 0.6
        runs the engine in this process instead (AsyncLLMEngine)."""
        from vllm.entrypoints.openai.api_server import (build_app, build_async_engine_client,
                                                        init_app_state)

        tee = OutputTee()
        try:
            with tee:
                self.engine = await self._stack.enter_async_context(
                    build_async_engine_client(self.args))
        except Exception as exc:
            why = startup_errors.explain(
                f"{tee.text()}\n{type(exc).__name__}: {exc}",
                gpu_memory_utilization=getattr(self.args, "gpu_memory_utilization", None),
                max_model_len=getattr(self.args, "max_model_len", None))
            self.report.add(failed("engine", why.why, why.fix))
            raise BootFailed from exc
        engine = self.engine
        inner = build_app(self.args)
        metrics.add_to_vllm0_app(inner)
        model_config = await engine.get_model_config()
        init_app_state(engine, model_config, inner.state, self.args)
        await self._stack.enter_async_context(inner.router.lifespan_context(inner))
        self.inner = inner
        self.supported_tasks = (("embed",) if getattr(model_config, "embedding_mode", False)
                                else ("generate",))

    @property
    def card_stack(self) -> bool:
        from proxima.serve.vllm_args import card_stack

        return card_stack()

    def engine_in_process(self) -> bool:
        """vLLM 0.6 without its multiprocessing front end: the engine runs in this process."""
        if not self.card_stack or self.engine is None:
            return False
        from vllm.engine.async_llm_engine import AsyncLLMEngine

        return isinstance(self.engine, AsyncLLMEngine)

    def _make_engine(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = self.args
        config = self.vllm_config or AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        return AsyncLLM.from_vllm_config(
            vllm_config=config, usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=args.enable_log_requests,
            aggregate_engine_logging=getattr(args, "aggregate_engine_logging", False),
            disable_log_stats=args.disable_log_stats)

    async def _canary(self) -> Check:
        if "generate" not in getattr(self, "supported_tasks", ("generate",)):
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
        if self.card_stack:
            if self.engine_in_process():
                return [os.getpid()]
            # vLLM 0.6 keeps its engine process in a local of build_async_engine_client: it is
            # this worker's only multiprocessing child (the engine's own workers are its children).
            return [p.pid for p in multiprocessing.active_children()]
        try:
            return [p.pid for p in self.engine.engine_core.resources.engine_manager.processes]
        except AttributeError:
            return []

    def _engine_summary(self, seconds: float) -> str:
        cache = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        size = getattr(cache, "block_size", None)
        pids = ", ".join(map(str, self._engine_pids())) or "?"
        if self.card_stack:  # vLLM 0.6: the front end does not know the block count
            where = " (in this process)" if self.engine_in_process() else ""
            return (f"started in {seconds:.1f} s: {self.served_names()[0]} ({self.args.model}), "
                    f"vLLM 0.6 V0 engine, engine pid {pids}{where}")
        return (f"started in {seconds:.1f} s: {self.served_names()[0]} ({self.args.model}), "
                f"{blocks} KV blocks of {size} tokens, engine pid {pids}")

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


def _shutdown(engine) -> None:
    if engine is None:
        return
    try:
        engine.shutdown(timeout=getattr(engine.vllm_config, "shutdown_timeout", None))
    except TypeError:
        engine.shutdown()
    except Exception:
        log.exception("engine shutdown failed")


def _stop_children(timeout: float = 5.0) -> None:
    for child in multiprocessing.active_children():
        child.terminate()
    deadline = time.monotonic() + timeout
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
