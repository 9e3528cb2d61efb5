"""One engine's sleep and wake (``proxima serve --elastic --idle-release S --sleep-mode``):
the routes ``POST /proxima/sleep`` and ``POST /proxima/wake_up`` of :mod:`proxima.serve.app`
(Proxima's own, not vLLM's ``VLLM_SERVER_DEV_MODE`` routes).

- ``POST /proxima/sleep`` (body optional: ``{"timeout_s": 30, "release": false}``; with
  ``"release": true`` an idle engine gives back its KV at once, without waiting for its
  idle release: the several-models endpoint's eviction): waits until the idle
  release has given back the engine's KV (mapped down to its null granule, read through
  the ``proxima_kv`` utility), tells the connector to stop asking for idle steps (vLLM's
  pause completes only once the engine has no work, and it counts the connector's pending
  work), then ``engine_client.sleep(level=1, mode="wait")`` (vLLM
  copies the weights to host memory and frees them on the GPU; Proxima's KV is outside
  vLLM's pool and stays as it is: one granule), then tells the engine's ledger record
  that the weights' bytes are free while it sleeps. 200 ``{"sleeping": true, "seconds",
  "weights_bytes"}``; 409 when the KV is not given back within the timeout (a request
  came, or the idle release is not due yet): nothing changed, try later.
- ``POST /proxima/wake_up``: the ledger counts the weights again, then
  ``engine_client.wake_up()``; 200 ``{"sleeping": false, "seconds"}``; 500 when vLLM's wake
  fails (the engine stays asleep as far as this route knows).
- Both: 409 for an engine started without ``--sleep-mode``; 503 while it is not running.
  A sleep or wake asked while another runs waits for it (one at a time).

While the engine is asleep (or falling asleep, or waking) its inference routes answer 503
with ``Retry-After`` and say how to wake it (the several-models endpoint does it itself).
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("proxima.serve")

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling-asleep", "asleep", "waking"
SLEEP_TIMEOUT_S = 30.0          # how long a sleep waits for the KV to be given back
MAX_SLEEP_TIMEOUT_S = 600.0
POLL_S = 0.2


def weights_bytes(args) -> int:
    """The model's weights on one GPU, estimated from its config.json as the sizing does
    (:func:`proxima.serve.autosize.model_weights`); 0 where it cannot be read."""
    from proxima.serve import autosize

    gpus = (getattr(args, "tensor_parallel_size", 1) or 1) * \
        (getattr(args, "pipeline_parallel_size", 1) or 1)
    try:
        return autosize.model_weights(args.model, getattr(args, "dtype", None),
                                      getattr(args, "quantization", None), gpus) or 0
    except Exception:   # noqa: BLE001 - an estimate only: the ledger then keeps its figure
        return 0


def _error(status: int, message: str, **extra) -> Response:
    headers = {"Retry-After": "5"} if status in (409, 503) else None
    return JSONResponse({"error": message, **extra}, status_code=status, headers=headers)


class EngineSleep:
    """The sleep state of the supervisor's engine and the two routes."""

    def __init__(self, supervisor, poll_s: float = POLL_S):
        self.supervisor = supervisor
        self.state = AWAKE
        self.poll_s = poll_s
        self._lock = asyncio.Lock()
        self._weights: int | None = None
        self._engine = None                 # the engine the state is about

    # -- what the app asks -----------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        self._forget_dead_engine()
        return self.state != AWAKE

    def _forget_dead_engine(self) -> None:
        if self._engine is not None and self._engine is not self.supervisor.engine:
            self.state, self._engine = AWAKE, None     # a fresh engine starts awake

    def enabled(self) -> bool:
        engine = self.supervisor.engine
        config = getattr(engine, "vllm_config", None) or self.supervisor.vllm_config
        model = getattr(config, "model_config", None)
        return bool(getattr(model, "enable_sleep_mode", False))

    def unavailable(self) -> Response:
        message = ("Service unavailable: the model is asleep (its weights are in host "
                   "memory)" if self.state == ASLEEP else
                   f"Service unavailable: the model is {self.state.replace('-', ' ')}")
        return JSONResponse(
            {"error": {"message": f"{message}: POST /proxima/wake_up, or send the request "
                                  f"through proxima serve's several-models endpoint (it wakes "
                                  f"the model). Retry later.",
                       "type": "ServiceUnavailableError", "param": None, "code": 503}},
            status_code=503, headers={"Retry-After": "5"})

    # -- the routes ------------------------------------------------------------------------
    async def route(self, request: Request, action: str) -> Response:
        if request.method != "POST":
            return JSONResponse({"error": f"{request.method} is not allowed: POST"},
                                status_code=405, headers={"Allow": "POST"})
        from proxima.serve.supervisor import READY

        engine = self.supervisor.engine
        if engine is None or self.supervisor.phase != READY:
            return _error(503, f"the engine is not running (phase {self.supervisor.phase})")
        if not self.enabled():
            return _error(409, "this engine was started without sleep mode: start it with "
                               "proxima serve --elastic --idle-release S --sleep-mode (several "
                               "models: --sleep-after S inside --model)")
        self._forget_dead_engine()
        async with self._lock:
            self._engine = engine
            if action == "sleep":
                options = await _sleep_options(request)
                if isinstance(options, Response):
                    return options
                return await self._sleep(engine, *options)
            return await self._wake(engine)

    async def _kv(self, engine, request: dict) -> dict:
        answer = await engine.engine_core.call_utility_async("proxima_kv", request)
        if not isinstance(answer, dict):
            raise RuntimeError(f"proxima_kv answered {answer!r}")
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    async def _sleep(self, engine, timeout: float, release: bool = False) -> Response:
        if self.state == ASLEEP:
            return JSONResponse({"sleeping": True, "seconds": 0.0,
                                 "weights_bytes": self._weights or 0})
        begun = time.monotonic()
        deadline = begun + timeout
        if release:         # an idle engine gives back its KV now, not after idle_release
            try:
                await self._kv(engine, {"release_now": True})
            except Exception as exc:  # noqa: BLE001 - no elastic KV, or the engine died
                return _error(503, f"the engine did not answer proxima_kv ({exc})")
        while True:
            try:
                kv = await self._kv(engine, {})
            except Exception as exc:  # noqa: BLE001 - no elastic KV, or the engine died
                return _error(503, f"the engine did not answer proxima_kv ({exc})")
            mapped, grain = kv.get("mapped_bytes") or 0, kv.get("bytes_per_granule") or 0
            if mapped <= grain:
                break
            if time.monotonic() >= deadline:
                return _error(409, f"the KV is not given back yet ({mapped} bytes mapped, "
                                   f"{kv.get('used_bytes')} in use) after {timeout:g} s: the "
                                   f"model is not idle, or its idle release is not due; "
                                   f"nothing changed, try later", mapped_bytes=mapped)
            await asyncio.sleep(self.poll_s)
        self.state = FALLING_ASLEEP
        started = time.monotonic()
        try:
            # the connector stops asking for idle steps first: vLLM's pause completes only
            # once the engine has no work, and it counts the connector's
            await self._kv(engine, {"sleeping": True})
            await engine.sleep(level=1, mode="wait")
        except Exception as exc:  # noqa: BLE001 - vLLM's sleep failed: still awake
            self.state = AWAKE
            try:
                await self._kv(engine, {"sleeping": False})
            except Exception:  # noqa: BLE001 - the engine is gone: the supervisor sees it
                pass
            log.error("sleep failed: %s: %s", type(exc).__name__, exc)
            return _error(500, f"sleep failed ({type(exc).__name__}: {exc})")
        seconds = time.monotonic() - started
        self.state = ASLEEP
        if self._weights is None:
            self._weights = weights_bytes(self.supervisor.args)
        try:
            await self._kv(engine, {"asleep_bytes": self._weights})
        except Exception as exc:  # noqa: BLE001 - the ledger keeps counting the weights
            log.warning("asleep, but the GPU's ledger still counts the weights (%s)", exc)
        log.info("asleep in %.2f s (weights, ~%.2f GiB, in host memory; KV given back, "
                 "waited %.2f s for it)", seconds, self._weights / 2**30, started - begun)
        return JSONResponse({"sleeping": True, "seconds": round(seconds, 3),
                             "weights_bytes": self._weights})

    async def _wake(self, engine) -> Response:
        if self.state == AWAKE:
            return JSONResponse({"sleeping": False, "seconds": 0.0})
        self.state = WAKING
        try:
            await self._kv(engine, {"asleep_bytes": 0})     # count the weights again first
        except Exception as exc:  # noqa: BLE001 - a wake matters more than the ledger
            log.warning("waking, but the GPU's ledger could not be told (%s)", exc)
        started = time.monotonic()
        try:
            await engine.wake_up()
        except Exception as exc:  # noqa: BLE001 - vLLM's wake failed (e.g. no GPU memory)
            self.state = ASLEEP
            try:
                await self._kv(engine, {"asleep_bytes": self._weights or 0})
            except Exception:  # noqa: BLE001 - the ledger then counts the weights: safe
                pass
            log.error("wake failed: %s: %s", type(exc).__name__, exc)
            return _error(500, f"vLLM's wake failed ({type(exc).__name__}: {exc})")
        seconds = time.monotonic() - started
        self.state = AWAKE
        try:
            await self._kv(engine, {"sleeping": False})     # its policy steps again
        except Exception as exc:  # noqa: BLE001 - serving matters more
            log.warning("awake, but the connector could not be told (%s)", exc)
        log.info("awake in %.2f s (weights back on the GPU)", seconds)
        return JSONResponse({"sleeping": False, "seconds": round(seconds, 3)})


async def _sleep_options(request: Request) -> tuple[float, bool] | Response:
    """(timeout_s, release) from the sleep's body, or the 400 answer."""
    body = await request.body()
    if not body.strip():
        return SLEEP_TIMEOUT_S, False
    import json

    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    value = payload.get("timeout_s", SLEEP_TIMEOUT_S) if isinstance(payload, dict) else None
    release = payload.get("release", False) if isinstance(payload, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 <= value <= MAX_SLEEP_TIMEOUT_S or not isinstance(release, bool) or \
            set(payload) - {"timeout_s", "release"}:
        return _error(400, f"send {{\"timeout_s\": SECONDS, \"release\": true|false}} "
                           f"(SECONDS 0 to {MAX_SLEEP_TIMEOUT_S:g}; both optional) or "
                           f"nothing, got {body[:200].decode(errors='replace')!r}")
    return float(value), release
