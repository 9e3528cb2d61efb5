"""One OpenAI-compatible endpoint in front of several engines, one model each.

Why our own and not vLLM's ``vllm-router`` (0.1.17): see docs/results/router/README.md. In
short, its regular mode ignores the request's ``model`` (one pool, round robin), and its
multi-model mode (``--enable-igw``, workers registered with a ``model_id``) routes by model
but sends an unknown model to some engine anyway, lists models as ``{"models": [...]}``,
answers ``/health`` 200 whatever the engines do, and has no ``/metrics`` of the engines.

Routes (an ASGI app; :class:`Router`; aiohttp to the engines):

- ``POST`` with a JSON body (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/embeddings``, and any other): to the engine of the body's ``model``; streamed
  through as it comes (SSE unbuffered). Unknown model: 404 in OpenAI's error shape; a
  known model whose engine is not ready (starting, restarting): 503 with ``Retry-After``.
- ``GET /v1/models``: every model, ready or not (an engine's own entry once it answers).
- ``GET /health``: 200 when every engine is ready, else 503 and which are not, and why.
- ``GET /metrics``: every engine's exposition, each sample labelled ``model="NAME"``, one
  HELP/TYPE per family; plus ``proxima_router_engine_up`` and ``..._restarts_total``.
- ``/engines/NAME/...``: passed to that engine as ``/...`` (``proxima kv --url
  http://HOST:PORT/engines/NAME``, ``/engines/NAME/proxima/selfcheck``).

A model given ``sleep_after`` sleeps when idle and wakes on its next request
(:mod:`proxima.serve.sleepwake`); ``/v1/models`` still lists it (``proxima_sleeping``),
``/health`` counts it ready, ``/metrics`` has ``proxima_sleeping{model=...}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from proxima.serve import sleepwake

log = logging.getLogger("proxima.serve")

STARTING, READY, UNHEALTHY, RESTARTING, FAILED, STOPPED = (
    "starting", "ready", "unhealthy", "restarting", "failed", "stopped")
WHY = {
    STARTING: "its engine is starting (loading the model and running its self-check)",
    UNHEALTHY: "its engine does not answer /health with 200 (e.g. its worker is being restarted)",
    RESTARTING: "its engine died and is being restarted",
    FAILED: "its engine died too often and was given up",
    STOPPED: "the server is shutting down",
}
RETRY_AFTER_S = "5"
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
MAX_BODY_BYTES = 64 * 2**20


@dataclass
class Backend:
    """One engine behind the endpoint. The supervisor (:mod:`proxima.serve.multi`) sets the
    state on process events; the router's health poll moves it between starting, ready and
    unhealthy while the process lives."""

    name: str
    url: str                            # http://127.0.0.1:PORT
    path: str | None = None             # the model's path, shown as "root" in /v1/models
    state: str = STARTING
    detail: str = ""
    restarts: int = 0
    generation: int = 0                 # bumped at every start and death: stale polls ignored
    ever_ready: bool = False
    pid: int | None = None              # its process (the engine's proxima serve), if running
    models_entry: dict | None = field(default=None, repr=False)
    # sleep and wake (proxima.serve.sleepwake): only for a model given sleep_after
    sleep_after: float | None = None
    sleep_state: str = sleepwake.AWAKE
    sleep_generation: int = 0           # the engine's generation the sleep state is about
    last_request: float = 0.0           # monotonic: the last request's begin or end
    in_flight: int = 0
    sleep_retry_at: float = 0.0
    weights_bytes: int = 0              # what the engine's sleep freed (its answer)
    awake_bytes: int = 0                # its place on the GPU awake / asleep (residency.py;
    asleep_bytes: int = 0               # 0: not counted)
    admitted: bool = False              # room made for its engine, about to start
    sleeps: int = 0
    wakes: int = 0
    wake_failures: int = 0
    last_wake_s: float | None = None
    held: bool = False                  # its last wake came soon after its last request:
    # it sleeps for another's demand only after a longer idle (sleepwake.HELD_IDLE_S)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def set_state(self, state: str, detail: str = "") -> None:
        if state != self.state:
            log.info("model %s: %s%s", self.name, state, f" ({detail})" if detail else "")
        self.state, self.detail = state, detail
        if state == READY:
            self.ever_ready = True


def openai_error(status: int, message: str, type_: str, param: str | None = None,
                 code=None, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code if code is not None else status}},
                        status_code=status, headers=headers)


class Router:
    """The ASGI app. Its HTTP client to the engines (aiohttp, made in the lifespan) is
    aiohttp rather than httpx: on the comparison's stand-ins it cut the median added latency
    by ~0.4 ms and the time to first token of 16 concurrent streams by about half."""

    def __init__(self, backends: list[Backend], *, health_interval: float = 1.0,
                 poll_health: bool = True, connect_timeout: float = 5.0,
                 metrics_timeout: float = 5.0, api_keys=(), on_startup=None,
                 on_shutdown=None, sleep_options: dict | None = None):
        self.backends = {b.name: b for b in backends}
        self.health_interval = health_interval
        self.poll_health = poll_health
        self.connect_timeout = connect_timeout
        self.metrics_timeout = metrics_timeout
        self.api_keys = set(api_keys)   # asked for where the endpoint answers /v1 itself
        self.on_startup, self.on_shutdown = on_startup, on_shutdown
        self.session = None
        self._poller: asyncio.Task | None = None
        self.sleepwake = sleepwake.SleepWake(self, **(sleep_options or {}))

    # -- lifespan --------------------------------------------------------------------------
    async def start(self) -> None:
        import aiohttp

        if self.session is None:
            # No read timeout: a generation may take minutes between chunks (long prompts).
            # No connection limit (aiohttp's default is 100 at once); bodies pass through
            # as sent (a content-encoding stays the engine's).
            self.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        if self.poll_health:
            self._poller = asyncio.create_task(self._poll_forever(), name="proxima-router-health")
        self.sleepwake.start()
        if self.on_startup is not None:
            await self.on_startup()

    async def stop(self) -> None:
        await self.sleepwake.stop()
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
        try:
            if self.on_shutdown is not None:
                await self.on_shutdown()
        finally:
            if self.session is not None:
                await self.session.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(b) for b in self.backends.values()))
            await asyncio.sleep(self.health_interval)

    async def poll(self, backend: Backend) -> None:
        """One health probe; applied only if nothing happened to the engine meanwhile."""
        if backend.state not in (STARTING, READY, UNHEALTHY):
            return
        generation = backend.generation
        try:
            status = await self._get(f"{backend.url}/health", self.connect_timeout)
            healthy = status == 200
            why = "" if healthy else f"/health answered {status}"
        except Exception as exc:  # noqa: BLE001 - not listening yet, or died
            healthy, why = False, f"not answering ({type(exc).__name__})"
        if generation != backend.generation or backend.state not in (STARTING, READY, UNHEALTHY):
            return
        if healthy:
            if backend.models_entry is None:
                backend.models_entry = await self._models_entry(backend)
            backend.set_state(READY)
        elif backend.ever_ready and backend.state != STARTING:
            backend.set_state(UNHEALTHY, why)
        else:
            backend.detail = why

    async def _get(self, url: str, timeout: float, body: bool = False):
        """GET url: its status, or (status, text) with ``body``."""
        import aiohttp

        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            if not body:
                return answer.status
            raw = await answer.read()
            return answer.status, raw.decode("utf-8", errors="replace")

    async def _models_entry(self, backend: Backend) -> dict | None:
        try:
            status, text = await self._get(f"{backend.url}/v1/models", self.connect_timeout,
                                           body=True)
            for entry in json.loads(text).get("data", []):
                if isinstance(entry, dict) and entry.get("id") == backend.name:
                    return entry
        except Exception:  # noqa: BLE001 - the listing falls back to what we know
            pass
        return None

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        from starlette.requests import Request

        request = Request(scope, receive)
        path, method = scope.get("path", ""), request.method
        if path == "/health":
            response = self.health()
        elif path.startswith("/v1/models") and method == "GET" and not self._authorized(request):
            response = openai_error(401, "Unauthorized: give an API key of the engines as "
                                         "Authorization: Bearer KEY", "AuthenticationError")
        elif path == "/v1/models" and method == "GET":
            response = self.models()
        elif path.startswith("/v1/models/") and method == "GET":
            response = await self._model_by_path(request, path[len("/v1/models/"):])
        elif path == "/metrics" and method == "GET":
            response = await self.metrics()
        elif path.startswith("/engines/"):
            response = await self._engine_passthrough(request, path)
        elif method == "POST":
            response = await self._route_by_body(request)
        else:
            response = openai_error(404, f"{method} {path} is not served here: POST the "
                                         f"OpenAI routes with a \"model\", GET /v1/models, "
                                         f"/health, /metrics, or /engines/NAME/...",
                                    "NotFoundError")
        await response(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:
                    log.exception("router start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.stop()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return

    # -- the routes ------------------------------------------------------------------------
    def _authorized(self, request) -> bool:
        if not self.api_keys:
            return True
        given = request.headers.get("authorization", "")
        import secrets

        return any(secrets.compare_digest(given, f"Bearer {key}") for key in self.api_keys)

    def health(self):
        from starlette.responses import JSONResponse

        engines = {name: {"state": b.state, **({"detail": b.detail or WHY.get(b.state, "")}
                                               if not b.ready else {}),
                          "restarts": b.restarts, "pid": b.pid,
                          **({"sleep": b.sleep_state} if b.sleep_after else {})}
                   for name, b in self.backends.items()}
        not_ready = [name for name, b in self.backends.items() if not b.ready]
        if not not_ready:
            return JSONResponse({"status": "ok", "engines": engines})
        return JSONResponse({"status": "unavailable", "not_ready": not_ready, "engines": engines},
                            status_code=503, headers={"Retry-After": RETRY_AFTER_S})

    def models(self):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self._entry(b) for b in self.backends.values()]})

    def _entry(self, backend: Backend) -> dict:
        entry = dict(backend.models_entry or {"id": backend.name, "object": "model",
                                              "created": int(time.time()),
                                              "owned_by": "proxima"})
        if backend.path is not None:
            entry.setdefault("root", backend.path)
        entry["proxima_state"] = backend.state
        if backend.sleep_after:
            entry["proxima_sleeping"] = backend.sleep_state != sleepwake.AWAKE
            entry["proxima_sleep_state"] = backend.sleep_state
        return entry

    async def _model_by_path(self, request, name: str):
        from starlette.responses import JSONResponse

        backend = self.backends.get(name)
        if backend is None:
            return self._unknown_model(name)
        return JSONResponse(self._entry(backend))

    def _unknown_model(self, name):
        served = ", ".join(self.backends)
        return openai_error(404, f"The model `{name}` does not exist. Served here: {served}.",
                            "invalid_request_error", "model", "model_not_found")

    def _unavailable(self, backend: Backend):
        return openai_error(503, f"The model `{backend.name}` is not available now: "
                                 f"{WHY.get(backend.state, backend.state)}"
                                 f"{f' ({backend.detail})' if backend.detail else ''}. "
                                 f"Retry later.",
                            "ServiceUnavailableError", "model", 503,
                            headers={"Retry-After": RETRY_AFTER_S})

    async def _route_by_body(self, request):
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return openai_error(413, f"the request body is over {MAX_BODY_BYTES} bytes",
                                "invalid_request_error")
        try:
            payload = json.loads(body) if body else None
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            return openai_error(400, "the body must be a JSON object with a \"model\" (one of "
                                     f"{', '.join(self.backends)})", "invalid_request_error")
        name = payload.get("model")
        if name is None:
            if len(self.backends) != 1:
                return openai_error(400, f"\"model\" is required: one of "
                                         f"{', '.join(self.backends)}", "invalid_request_error",
                                    "model")
            name = next(iter(self.backends))
        if not isinstance(name, str) or name not in self.backends:
            return self._unknown_model(name)
        backend = self.backends[name]
        if backend.sleep_after:
            why = await self.sleepwake.awake(backend)
            if why is not None:
                return openai_error(503, sleepwake.unavailable_message(backend, why),
                                    "ServiceUnavailableError", "model", 503,
                                    headers={"Retry-After": sleepwake.RETRY_AFTER_S})
        return await self._forward(backend, request, request.url.path, body,
                                   end=self.sleepwake.begin(backend))

    async def _engine_passthrough(self, request, path: str):
        rest = path[len("/engines/"):]
        for name, backend in self.backends.items():
            if rest == name or rest.startswith(name + "/"):
                sub = rest[len(name):]
                if backend.sleep_after and request.method == "POST" and \
                        sub in ("/proxima/sleep", "/proxima/wake_up"):
                    return await self._sleep_or_wake(backend, sub)
                if not backend.ready and backend.state != UNHEALTHY:
                    return self._unavailable(backend)
                return await self._forward(backend, request, rest[len(name):] or "/",
                                           await request.body())
        return self._unknown_model(rest.split("/", 1)[0])

    async def _sleep_or_wake(self, backend: Backend, sub: str):
        """``POST /engines/NAME/proxima/sleep|wake_up`` of a model with ``sleep_after``: done
        by the router's own sleep and wake, so that it knows the model's state."""
        from starlette.responses import JSONResponse

        if sub == "/proxima/wake_up":
            why = await self.sleepwake.awake(backend)
        else:
            why = await self.sleepwake.sleep_now(backend)
        state = {"model": backend.name, "sleep": backend.sleep_state}
        if why is None:
            return JSONResponse({"sleeping": backend.sleep_state != sleepwake.AWAKE, **state})
        waking = sub == "/proxima/wake_up"
        return JSONResponse({"error": f"model {backend.name}: not "
                                      f"{'woken' if waking else 'put to sleep'} now: {why}",
                             **state}, status_code=503 if waking else 409,
                            headers={"Retry-After": sleepwake.RETRY_AFTER_S})

    async def _forward(self, backend: Backend, request, path: str, body: bytes, end=None):
        """``end``: called once when the engine's answer is over (or never came)."""
        try:
            response = await self._forward_to(backend, request, path, body, end)
        except BaseException:
            if end is not None:
                end()
            raise
        if end is not None and not hasattr(response, "body_iterator"):
            end()
        return response

    async def _forward_to(self, backend: Backend, request, path: str, body: bytes, end):
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        if not backend.ready and not path.startswith("/proxima/") and path != "/metrics":
            return self._unavailable(backend)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        query = request.url.query
        url = f"{backend.url}{path}{'?' + query if query else ''}"
        try:
            upstream = await self.session.request(request.method, url, headers=headers,
                                                  data=body)
        except Exception as exc:  # noqa: BLE001 - the engine went away between polls
            return openai_error(503, f"The model `{backend.name}` is not available now: its "
                                     f"engine did not answer ({type(exc).__name__}). Retry later.",
                                "ServiceUnavailableError", "model", 503,
                                headers={"Retry-After": RETRY_AFTER_S})
        # raw bytes pass through: a content-encoding stays as the engine sent it
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}

        async def chunks():
            whole = False
            try:
                async for chunk in upstream.content.iter_any():   # as it comes: SSE unbuffered
                    yield chunk
                whole = True
            except Exception as exc:  # noqa: BLE001 - the engine died mid-stream
                log.warning("model %s: the engine's answer was cut (%s)", backend.name,
                            type(exc).__name__)
            finally:
                # an answer not read to its end (the client left): close the connection, so
                # the engine sees it and aborts the request
                upstream.release() if whole else upstream.close()
                if end is not None:
                    end()

        def finish():
            if not upstream.closed:   # the client left before the first chunk
                upstream.close()
            if end is not None:
                end()

        return StreamingResponse(chunks(), status_code=upstream.status, headers=out_headers,
                                 background=BackgroundTask(finish))

    async def metrics(self):
        from starlette.responses import Response

        names = list(self.backends)

        async def scrape(backend: Backend) -> str | None:
            if backend.state in (RESTARTING, FAILED, STOPPED):
                return None
            try:
                status, text = await self._get(f"{backend.url}/metrics", self.metrics_timeout,
                                               body=True)
                return text if status == 200 else None
            except Exception:  # noqa: BLE001 - a scrape misses an engine, says so in _up
                return None

        texts = await asyncio.gather(*(scrape(self.backends[n]) for n in names))
        text = merge_expositions(list(zip(names, texts)), self.backends)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def merge_expositions(scrapes: list[tuple[str, str | None]], backends: dict | None = None) -> str:
    """Prometheus text expositions of several engines -> one, every sample labelled
    ``model="NAME"`` and every family's HELP/TYPE once. Parsed and written by
    prometheus_client; a family whose type differs between engines keeps the first type
    and drops the others' samples (logged)."""
    from prometheus_client.core import Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    up = Metric("proxima_router_engine_up", "1 when the model's engine answered the scrape "
                "and is ready", "gauge")
    sleeping = Metric("proxima_sleeping", "1 while the model sleeps (its weights in host "
                      "memory; falling asleep or waking too), 0 awake", "gauge")
    wakes = Metric("proxima_router_wakes", "times the model was woken by a request", "counter")
    wake_s = Metric("proxima_router_last_wake_seconds", "seconds the model's last wake took "
                    "(room on the GPU and vLLM's wake; NaN: none yet)", "gauge")
    restarts = Metric("proxima_router_engine_restarts", "times the model's engine was "
                      "restarted after it died", "counter")
    for name, text in scrapes:
        backend = (backends or {}).get(name)
        up.add_sample("proxima_router_engine_up", {"model": name},
                      1.0 if text is not None and (backend is None or backend.ready) else 0.0)
        restarts.add_sample("proxima_router_engine_restarts_total", {"model": name},
                            float(backend.restarts if backend is not None else 0))
        if backend is not None and backend.sleep_after:
            sleeping.add_sample("proxima_sleeping", {"model": name},
                                0.0 if backend.sleep_state == sleepwake.AWAKE else 1.0)
            wakes.add_sample("proxima_router_wakes_total", {"model": name}, float(backend.wakes))
            wake_s.add_sample("proxima_router_last_wake_seconds", {"model": name},
                              float("nan") if backend.last_wake_s is None
                              else backend.last_wake_s)
        if text is None:
            continue
        try:
            parsed = list(text_string_to_metric_families(text))
        except Exception as exc:  # noqa: BLE001 - one engine's bad exposition loses only it
            log.warning("model %s: its /metrics could not be parsed (%s)", name, exc)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            elif merged.type != family.type:
                log.warning("metric %s is a %s on one engine and a %s on model %s's: dropped "
                            "there", family.name, merged.type, family.type, name)
                continue
            for s in family.samples:
                merged.samples.append(Sample(s.name, {**s.labels, "model": name}, s.value,
                                             s.timestamp, s.exemplar))

    class _Once:
        def collect(self):
            yield up
            yield restarts
            if sleeping.samples:
                yield sleeping
                yield wakes
                yield wake_s
            yield from families.values()

    return generate_latest(_Once()).decode()


# -- standalone: ``python -m proxima.serve.router --backend NAME=URL ...`` ---------------------
def main(argv: list[str] | None = None) -> int:
    """The router alone, over engines that run already (used by the router comparison in
    docs/results/router/)."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m proxima.serve.router")
    parser.add_argument("--backend", action="append", required=True, metavar="NAME=URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    backends = []
    for value in args.backend:
        name, _, url = value.partition("=")
        backends.append(Backend(name=name, url=url.rstrip("/")))
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(Router(backends), host=args.host, port=args.port, log_level="warning",
                lifespan="on", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
