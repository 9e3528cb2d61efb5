"""How the gunicorn worker starts vLLM's engine and app: one small launcher per engine
generation, behind one interface. The supervisor asks the launcher and never which vLLM
it is.

``engine_client(args, vllm_config)``
    An async context manager that owns the engine's life, as vLLM's own
    ``build_async_engine_client`` does: it yields a started engine client and shuts the
    engine down on exit (also when the start failed half-way or the worker is stopping).
``build_app(engine, args)``
    vLLM's OpenAI app for that engine, its state initialised: ``(app, supported tasks)``.
``engine_pids(engine)``, ``in_process(engine)``, ``summary(engine)``
    Where the engine runs, and what the ``engine`` self-check line says about it.
``sizing(args)``
    The memory options that :func:`proxima.serve.startup_errors.explain` reasons about.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from contextlib import asynccontextmanager
from typing import Callable

log = logging.getLogger("proxima.serve")


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


class V1Launcher:
    """vLLM's V1 engine (0.26 and later): ``AsyncLLM`` with its engine-core process.

    What ``build_async_engine_client_from_engine_args`` does, with two differences: the
    config is the one the arbiter built (so a bad option failed before gunicorn forked),
    and ``AsyncLLM`` is built in a daemon thread, so the event loop keeps answering
    ``/health`` and gunicorn's heartbeat while the model loads. vLLM starts the engine's
    output handler itself on the first request (the canary)."""

    generation = "v1"

    @asynccontextmanager
    async def engine_client(self, args, vllm_config=None):
        engine = await _in_daemon_thread(lambda: self._make_engine(args, vllm_config),
                                         on_orphan=self._shutdown)
        try:
            await engine.reset_mm_cache()   # as vLLM does: no dummy data kept in memory
            yield engine
        finally:
            self._shutdown(engine)

    @staticmethod
    def _make_engine(args, vllm_config):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = AsyncEngineArgs.from_cli_args(args)
        config = vllm_config or engine_args.create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        return AsyncLLM.from_vllm_config(
            vllm_config=config, usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            aggregate_engine_logging=engine_args.aggregate_engine_logging,
            disable_log_stats=engine_args.disable_log_stats)

    @staticmethod
    def _shutdown(engine) -> None:
        try:
            engine.shutdown(timeout=engine.vllm_config.shutdown_timeout)
        except Exception:
            log.exception("engine shutdown failed")

    async def build_app(self, engine, args):
        """What vLLM's ``build_and_serve`` does before it binds a socket (gunicorn has it)."""
        from proxima.vllm.vllm_v1_compat import api_server_app

        build_app, init_app_state = api_server_app()     # where this vLLM keeps them

        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        return app, tasks

    def engine_pids(self, engine) -> list[int]:
        try:
            return [p.pid for p in engine.engine_core.resources.engine_manager.processes]
        except AttributeError:   # an in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            return []

    def in_process(self, engine) -> bool:
        return False

    def summary(self, engine) -> str:
        cache = engine.vllm_config.cache_config
        return f"{cache.num_gpu_blocks} KV blocks of {cache.block_size} tokens"

    def sizing(self, args) -> dict:
        return dict(gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                    max_model_len=getattr(args, "max_model_len", None),
                    kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None))


class V0Launcher:
    """vLLM 0.6's V0 engine (the card stack): what its ``api_server.run_server`` does, minus
    binding a socket. Its ``build_async_engine_client`` spawns the engine process
    (MQLLMEngine) and awaits it, so the event loop stays free while the model loads; with
    ``--disable-frontend-multiprocessing`` (or a config MQLLMEngine does not support) it
    runs the engine in this process instead (AsyncLLMEngine)."""

    generation = "v0"

    def engine_client(self, args, vllm_config=None):
        from vllm.entrypoints.openai.api_server import build_async_engine_client

        return build_async_engine_client(args)   # builds its config from args itself

    async def build_app(self, engine, args):
        from vllm.entrypoints.openai.api_server import build_app, init_app_state

        from proxima.serve import metrics

        app = build_app(args)
        metrics.add_to_vllm0_app(app)
        model_config = await engine.get_model_config()
        init_app_state(engine, model_config, app.state, args)
        tasks = ("embed",) if getattr(model_config, "embedding_mode", False) else ("generate",)
        return app, tasks

    def engine_pids(self, engine) -> list[int]:
        if self.in_process(engine):
            return [os.getpid()]
        # vLLM 0.6 keeps its engine process in a local of build_async_engine_client: it is
        # this worker's only multiprocessing child (the engine's own workers are its children).
        return [p.pid for p in multiprocessing.active_children()]

    def in_process(self, engine) -> bool:
        from vllm.engine.async_llm_engine import AsyncLLMEngine

        return isinstance(engine, AsyncLLMEngine)

    def summary(self, engine) -> str:
        where = " (in this process)" if self.in_process(engine) else ""
        return f"vLLM 0.6 V0 engine{where}"   # its front end does not know the block count

    def sizing(self, args) -> dict:
        return dict(gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                    max_model_len=getattr(args, "max_model_len", None))


LAUNCHERS = {"v1": V1Launcher, "v0": V0Launcher}


def launcher_for(vllm_version: str | None = None):
    """The launcher of the installed vLLM's engine generation (the version policy's
    :func:`~proxima.vllm.activation.engine_for`)."""
    from proxima.vllm import activation

    version = vllm_version or activation.installed_version("vllm")
    return LAUNCHERS[activation.engine_for(version)]()
