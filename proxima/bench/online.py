"""Online mode: stream a request list to OpenAI-compatible servers and measure the client side.

Invariants that make two servers comparable:

* every server receives the identical request list, in the same dispatch order, with the
  same pacing (closed loop at a fixed concurrency, or the same seeded Poisson schedule);
* every server is checked (reachable, serves the model) before any load is sent, so a
  typo in the second URL does not waste the first server's run;
* a failed request is counted and described, never raised: throughput and latency come
  from the successful requests only, and ``errors`` says how many were left out. A request
  is successful only when its stream ended with ``data: [DONE]``: a stream cut short (the
  server died, the connection closed) is an error, never a short completion.

What is measured per request, and the request's body: :mod:`proxima.bench.online_request`;
the figures of a server and of several rounds: :mod:`proxima.bench.online_summary`.
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import aiohttp

from proxima import interrupts
from proxima.bench.online_request import RequestRecord, request_body, send_one
from proxima.bench.online_summary import summarize
from proxima.errors import UserError
from proxima.ioutil import shown
from proxima.workloads import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Counter names for vLLM's preemptions: prometheus_client exposes a counter named
# "vllm:num_preemptions" as "..._total"; older servers exposed the bare name.
PREEMPTION_METRICS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PREFLIGHT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Target:
    """One server under test: a label for the report and its normalised base URL."""
    label: str
    base_url: str


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from what a user may type (trailing ``/`` or ``/v1`` dropped)."""
    from proxima.serve.remote import server_url   # one URL check: kv, selfcheck, bench

    text = server_url(url, "--base-url", "an OpenAI-compatible server")
    return text[:-3] if text.endswith("/v1") else text


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_preemptions(metrics_text: str) -> int | None:
    """Total preemptions in a Prometheus text exposition, summed over label sets.

    The ``_total`` sample is preferred over the bare name (both may be present on some
    servers; adding them would double-count). None when neither is present."""
    sums: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in PREEMPTION_METRICS:
            continue
        try:
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(3))
        except ValueError:
            continue
    for name in PREEMPTION_METRICS:
        if name in sums:
            return int(round(sums[name]))
    return None


def served_models(payload, where: str) -> list[str]:
    """The model ids of a ``GET /v1/models`` answer (``{"data": [{"id": ...}, ...]}``)."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        raise UserError(f"{where} answered GET /v1/models with {shown(payload)[:80]}, not an "
                        f'OpenAI model list {{"data": [{{"id": ...}}]}}: is it an '
                        f"OpenAI-compatible server?")
    return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id") is not None]


async def preflight(session: aiohttp.ClientSession, target: Target,
                    model: str | None) -> list[str]:
    """Raise UserError unless the server answers GET /v1/models and lists ``model`` (any
    model when ``model`` is None); return the models it serves, in its order."""
    url = target.base_url + "/v1/models"
    where = f"server {target.label} ({target.base_url})"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)) as resp:
            if resp.status != 200:
                raise UserError(f"{where} answered HTTP {resp.status} to GET /v1/models: is it "
                                f"an OpenAI-compatible server?")
            payload = await resp.json(content_type=None)
    except asyncio.TimeoutError:    # connected (or not) but no answer: not "cannot reach"
        raise UserError(f"{where} did not answer GET /v1/models within "
                        f"{PREFLIGHT_TIMEOUT_S:g} s: is it still starting, overloaded or stuck? "
                        f"Try again once {url} answers") from None
    except (aiohttp.ClientError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        raise UserError(f"cannot reach server {target.label} at {target.base_url} ({reason}): "
                        f"is it running? check --base-url") from None
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{where} sent a /v1/models answer that is not JSON: is it an "
                        f"OpenAI-compatible server?") from None
    served = served_models(payload, where)
    if model is None and not served:
        raise UserError(f"{where} serves no model (its /v1/models list is empty): start it "
                        f"with a model, or pass --model")
    if model is not None and model not in served:
        raise UserError(f"{where} does not serve model {model!r}; it serves: "
                        f"{', '.join(served) or 'nothing'} (pass one of these to --model)")
    return served


async def read_preemptions(session: aiohttp.ClientSession, base_url: str) -> int | None:
    """The server's preemption counter now, or None when /metrics is absent or lacks it."""
    try:
        async with session.get(base_url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            return parse_preemptions(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
        return None


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Start times (s from the first request) of a Poisson process at ``rate`` req/s.

    Seeded, so every server gets the same schedule."""
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _raise_fd_limit(wanted: int) -> None:
    """Allow ``wanted`` sockets at once if the hard limit permits (best effort)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted + 64 if hard == resource.RLIM_INFINITY else min(hard, wanted + 64)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


async def load_one_server(target: Target, specs: Sequence[RequestSpec], model: str,
                          endpoint: str, concurrency: int | None, rate: float | None,
                          seed: int, timeout_s: float, progress: bool) -> dict:
    """Run the whole request list against one server; return its summary."""
    from tqdm import tqdm

    url = target.base_url + ENDPOINTS[endpoint]
    in_flight = len(specs) if concurrency is None else min(concurrency, len(specs))
    _raise_fd_limit(in_flight)
    connector = aiohttp.TCPConnector(limit=in_flight)
    records: list[RequestRecord | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), desc=f"{target.label}", unit="req", file=sys.stderr,
               disable=not progress, leave=True, dynamic_ncols=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        before = await read_preemptions(session, target.base_url)
        start = time.perf_counter()

        async def one(i: int) -> None:
            records[i] = await send_one(session, url, request_body(specs[i], endpoint, model),
                                        specs[i], timeout_s)
            bar.update(1)

        if rate is not None:
            # Poisson starts; with a concurrency too, at most that many run at once (a start
            # waits for a free slot, as vllm bench serve's --max-concurrency does).
            slots = asyncio.Semaphore(in_flight)

            async def at(i: int, offset: float) -> None:
                await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
                async with slots:
                    await one(i)
            await asyncio.gather(*(at(i, off) for i, off in
                                   enumerate(poisson_offsets(len(specs), rate, seed))))
        else:
            queue = iter(range(len(specs)))

            async def worker() -> None:
                for i in queue:            # shared iterator: dispatch stays in list order
                    await one(i)
            await asyncio.gather(*(worker() for _ in range(in_flight)))
        duration = time.perf_counter() - start
        after = await read_preemptions(session, target.base_url)
    bar.close()
    preemptions = None if before is None or after is None else after - before
    return summarize(target.base_url, records, duration, preemptions)


async def resolve_model(targets: Sequence[Target], model: str | None) -> str:
    """Check every server before any load; the model is ``model``, else the first server's
    first model (as ``vllm bench serve`` does without --model), which every other server
    must serve too."""
    async with aiohttp.ClientSession() as session:
        for target in targets:
            served = await preflight(session, target, model)
            if model is None:
                model = served[0]
                print(f"proxima bench: --model not given: using {model!r}, the first model "
                      f"of server {target.label}", file=sys.stderr, flush=True)
    return model


async def _run_all(targets: Sequence[Target], specs: Sequence[RequestSpec], model: str,
                   endpoint: str, concurrency: int | None, rate: float | None, seed: int,
                   timeout_s: float, progress: bool) -> dict[str, dict]:
    model = await resolve_model(targets, model)
    results = {}
    for target in targets:                  # one after the other: never load both at once
        results[target.label] = await load_one_server(target, specs, model, endpoint,
                                                      concurrency, rate, seed, timeout_s,
                                                      progress)
    return results


def _run(make_coroutine):
    """``asyncio.run(make_coroutine())`` where SIGINT and SIGTERM never raise inside the
    event loop's own machinery (a loop cut while it is built, run or closed prints a
    traceback when collected): while the loop lives, a stop only records itself and cancels
    the bench's task. It then leaves as ``KeyboardInterrupt`` (SIGINT) or
    :class:`proxima.interrupts.Terminated` (SIGTERM), raised here once the loop is closed:
    one line on stderr."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(make_coroutine())    # signals reach the main thread only
    signals = (signal.SIGINT, signal.SIGTERM)
    stopped: list[int] = []
    running: list = []                          # (loop, task) while the bench's task runs

    def on_signal(sig, frame):                  # the main thread, between two bytecodes
        stopped.append(sig)
        if running:
            loop, task = running[0]
            loop.call_soon_threadsafe(task.cancel)

    async def main():
        running.append((asyncio.get_running_loop(), asyncio.current_task()))
        if stopped:                             # a stop before the task could be cancelled
            raise asyncio.CancelledError
        return await make_coroutine()

    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, on_signal)
    try:
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(main())
        except asyncio.CancelledError:
            if not stopped:
                raise
        finally:
            running.clear()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
    finally:
        for sig in signals:
            signal.signal(sig, previous[sig])
    raise interrupts.Terminated() if stopped[0] == signal.SIGTERM else KeyboardInterrupt()


def check_servers(targets: Sequence[Target], model: str | None) -> str:
    """:func:`resolve_model`, synchronously: the model every server will be asked for."""
    return _run(lambda: resolve_model(targets, model))


def run_online(targets: Sequence[Target], specs: Sequence[RequestSpec], model: str | None,
               endpoint: str = "completions", concurrency: int | None = None,
               rate: float | None = None, seed: int = 0, timeout_s: float = 600.0,
               progress: bool = True) -> dict[str, dict]:
    """Check every server, then load each in turn with ``specs``; results keyed by label."""
    if endpoint not in ENDPOINTS:
        raise UserError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if not specs:
        raise UserError("the request list is empty: --requests must be >= 1")
    return _run(lambda: _run_all(targets, specs, model, endpoint, concurrency, rate, seed,
                                 timeout_s, progress))


