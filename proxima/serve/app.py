"""The ASGI app gunicorn's worker serves: a gate in front of vLLM's own OpenAI app.

vLLM's app can only be built once its engine runs (its routes depend on the model's tasks),
and the engine takes minutes to start. The gate answers from the first second:

- ``GET /health``: 200 once the self-check passed and while the engine lives, else 503 with
  ``{"status": <phase>}`` (phases in :mod:`proxima.serve.supervisor`).
- ``GET /proxima/selfcheck``: the self-check report as JSON (``passed`` is null while running).
- ``GET /proxima/kv``, ``POST /proxima/kv`` (``{"min_bytes": ..., "max_bytes": ...}``):
  elastic KV memory -- mapped, used and reclaimable bytes, limits, counters -- read and set
  in the engine core through vLLM's utility call (:func:`proxima.vllm.elastic_v1.
  engine_core_proxima_kv`); 503 while the engine is not ready, 404 without elastic KV,
  400 for a bad request.
- ``POST /proxima/sleep``, ``POST /proxima/wake_up``: the engine's weights to host memory
  and back, once its KV is given back (``--sleep-mode``; :mod:`proxima.serve.engine_sleep`);
  ``GET /proxima/kv`` says ``"sleeping"``. An asleep engine answers inference with 503.
- ``/metrics``: vLLM's exposition once its app exists; before that the same registry directly,
  so Proxima's gauges and the process metrics are scrapeable during start-up.
- anything else: vLLM's app when ready (and the self-check's canary while checking); 503 with
  ``Retry-After`` otherwise, never a hang.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from proxima.serve import logs, metrics
from proxima.serve.engine_sleep import EngineSleep
from proxima.serve.engine_checks import CANARY_HEADER
from proxima.serve.supervisor import CHECKING, ENGINE_DEAD, FAILED, READY, Supervisor

log = logging.getLogger("proxima.serve")

RETRY_AFTER_S = "10"
_WHY_UNAVAILABLE = {
    "not-started": "the engine has not been started",
    "starting": "the engine is starting (loading the model)",
    "checking": "the start-up self-check is running",
    FAILED: "the start-up self-check failed; see GET /proxima/selfcheck",
    ENGINE_DEAD: "the engine died; a fresh worker with a new engine is starting",
    "stopping": "the server is shutting down",
}


class ProximaApp:
    """ASGI callable. ``supervisor`` owns the engine; this class only routes."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.sleep = EngineSleep(supervisor)
        metrics.register()

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            return await self._lifespan(receive, send)
        path = scope.get("path", "")
        if kind == "http":
            if path == "/health":
                return await self._health()(scope, receive, send)
            if path == "/proxima/selfcheck":
                return await JSONResponse(self.supervisor.status())(scope, receive, send)
            if path == "/proxima/kv":
                return await (await self._kv(Request(scope, receive)))(scope, receive, send)
            if path in ("/proxima/sleep", "/proxima/wake_up"):
                answer = await self.sleep.route(Request(scope, receive), path[len("/proxima/"):])
                return await answer(scope, receive, send)
            if path == "/metrics" or path.startswith("/metrics/"):
                # Scrapes are answered in every phase: metrics matter most when things go wrong.
                if self.supervisor.inner is not None:
                    return await self.supervisor.inner(scope, receive, send)
                return await _metrics_response()(scope, receive, send)
        canary = Request(scope).headers.get(CANARY_HEADER) if kind == "http" else None
        inner = self.supervisor.inner
        if inner is not None and self.sleep.sleeping and kind == "http":
            return await self.sleep.unavailable()(scope, receive, send)
        if inner is not None and self.supervisor.admits(canary):
            return await inner(scope, receive, send)
        if kind == "websocket":
            return await send({"type": "websocket.close", "code": 1013})  # try again later
        return await self._unavailable()(scope, receive, send)

    async def _kv(self, request: Request) -> Response:
        if request.method not in ("GET", "POST"):
            return JSONResponse({"error": f"{request.method} is not allowed: GET reads, POST "
                                          "{\"min_bytes\": ..., \"max_bytes\": ...} sets"},
                                status_code=405, headers={"Allow": "GET, POST"})
        engine = self.supervisor.engine
        if engine is None or self.supervisor.phase not in (CHECKING, READY):
            phase = self.supervisor.phase
            return JSONResponse({"error": f"the engine is not running: "
                                          f"{_WHY_UNAVAILABLE.get(phase, phase)}"},
                                status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        payload = {}
        if request.method == "POST":
            try:
                payload = await request.json()
            except ValueError:
                return JSONResponse({"error": "the body is not JSON: send "
                                              "{\"min_bytes\": ..., \"max_bytes\": ...}"},
                                    status_code=400)
            if not isinstance(payload, dict) or not payload:
                return JSONResponse({"error": "send a JSON object with min_bytes and/or "
                                              "max_bytes (a number of bytes, a size such as "
                                              "\"8GiB\", or null for no maximum)"},
                                    status_code=400)
        core = getattr(engine, "engine_core", None)
        call = getattr(core, "call_utility_async", None)
        if call is None:
            return JSONResponse({"error": "elastic KV memory needs vLLM's V1 engine (0.26)"},
                                status_code=404)
        try:
            answer = await call("proxima_kv", payload)
        except Exception as exc:  # noqa: BLE001 - the engine lacks the utility, or died
            return JSONResponse({"error": f"the engine did not answer proxima_kv "
                                          f"({type(exc).__name__}: {exc}): is it running with "
                                          f"elastic KV memory (proxima serve --elastic)?"},
                                status_code=404)
        if isinstance(answer, dict) and "error" in answer:
            status = 404 if "not active" in answer["error"] else 400
            return JSONResponse(answer, status_code=status)
        if isinstance(answer, dict):
            answer.update(sleeping=self.sleep.sleeping, sleep_state=self.sleep.state)
        return JSONResponse(answer)

    def _health(self) -> Response:
        if self.supervisor.healthy:
            return Response(status_code=200)
        phase = self.supervisor.phase
        if phase == READY:  # the watchdog has not noticed yet, but the engine is gone
            phase = ENGINE_DEAD
        return JSONResponse({"status": phase, "detail": _WHY_UNAVAILABLE.get(phase, phase)},
                            status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    def _unavailable(self) -> Response:
        phase = self.supervisor.phase
        message = f"Service unavailable: {_WHY_UNAVAILABLE.get(phase, phase)}. Retry later."
        return JSONResponse(
            {"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                       "code": 503}},
            status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.supervisor.start()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.supervisor.stop()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return


def _metrics_response() -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def create_app(args: argparse.Namespace, *, vllm_config=None, preflight=None,
               preflight_time: float = 0.0, failure_file: Path | None = None) -> ProximaApp:
    """The app factory gunicorn's worker loads. Starts nothing: the engine starts with the
    ASGI lifespan, in the worker process, so gunicorn never forks a process holding CUDA."""
    logs.setup()
    supervisor = Supervisor(args, vllm_config=vllm_config, preflight=preflight,
                            preflight_time=preflight_time, failure_file=failure_file)
    return ProximaApp(supervisor)
