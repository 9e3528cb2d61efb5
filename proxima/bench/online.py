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

What is measured per request (``time.perf_counter``, from just before the POST):
TTFT is the arrival of the first chunk that carries output tokens; inter-token latency
(ITL) the gaps between consecutive token-carrying chunks (vLLM streams one chunk per
engine step, normally one token); end-to-end the end of the stream. Output tokens are
counted from the server's ``usage`` (``stream_options.continuous_usage_stats``, a vLLM
extension, gives a running count on every chunk) and, for servers without usage, one per
non-empty chunk; ``output_tokens_source`` says which.

The body carries vLLM's ``ignore_eos: true`` and ``temperature: 0`` so every request
generates exactly ``max_tokens`` tokens: ``short_outputs`` counts those that did not.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlsplit

import aiohttp

from proxima import interrupts
from proxima.bench.stats import latency_summary, median, spread
from proxima.errors import UserError
from proxima.workloads import RequestSpec

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Counter names for vLLM's preemptions: prometheus_client exposes a counter named
# "vllm:num_preemptions" as "..._total"; older servers exposed the bare name.
PREEMPTION_METRICS = ("vllm:num_preemptions_total", "vllm:num_preemptions")
PREFLIGHT_TIMEOUT_S = 10.0
MAX_ERROR_SAMPLES = 5


@dataclass(frozen=True)
class Target:
    """One server under test: a label for the report and its normalised base URL."""
    label: str
    base_url: str


@dataclass
class RequestRecord:
    """What the client saw for one request. Times are seconds; None = did not happen."""
    request_id: str
    expected_tokens: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False


def normalize_base_url(url: str) -> str:
    """``http://host:port`` from what a user may type (trailing ``/`` or ``/v1`` dropped)."""
    text = url.strip().rstrip("/")
    if text.endswith("/v1"):
        text = text[:-3]
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--base-url must look like http://HOST:PORT, got {url!r}")
    return text


def chat_text(token_ids: Sequence[int]) -> str:
    """A deterministic text standing for a token-id prompt (the chat endpoint takes text).

    Each id becomes one pseudo-word of consonant-vowel syllables, so equal id lists give
    equal texts and shared id prefixes give shared text prefixes (prefix caching still
    hits). The server's tokenizer decides the real prompt length: the report shows the
    server-counted ``prompt_tokens``, not the workload's."""
    cons, vows = "bdfghklmnprstvz", "aeiou"
    syllables = [c + v for c in cons for v in vows]           # 75 syllables
    base = len(syllables)
    words = []
    for tid in token_ids:
        word = ""
        value = int(tid)
        while True:
            word += syllables[value % base]
            value //= base
            if not value:
                break
        words.append(word)
    return " ".join(words)


def request_body(spec: RequestSpec, endpoint: str, model: str) -> dict:
    """The JSON body for one request: identical for every server."""
    body = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": chat_text(spec.prompt_token_ids)}]
    else:
        body["prompt"] = list(spec.prompt_token_ids)
    return body


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
        shown = json.dumps(payload)[:80] if _jsonable(payload) else repr(payload)[:80]
        raise UserError(f"{where} answered GET /v1/models with {shown}, not an OpenAI model "
                        f'list {{"data": [{{"id": ...}}]}}: is it an OpenAI-compatible server?')
    return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id") is not None]


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


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
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
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


def _sse_payloads(buffer: bytearray):
    """Pop complete SSE ``data:`` payloads (as str) from the front of ``buffer``."""
    while True:
        end = buffer.find(b"\n")
        if end < 0:
            return
        line = bytes(buffer[:end]).strip()
        del buffer[:end + 1]
        if line.startswith(b"data:"):
            yield line[5:].strip().decode("utf-8", "replace")


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "") \
        + (delta.get("reasoning") or "")


async def send_one(session: aiohttp.ClientSession, url: str, body: dict, spec: RequestSpec,
                   timeout_s: float) -> RequestRecord:
    """Send one streaming request; every failure ends up in ``record.error``."""
    rec = RequestRecord(spec.request_id, spec.max_tokens)
    start = time.perf_counter()
    last = None
    chunk_tokens = 0
    usage_tokens = None
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.text()).strip().replace("\n", " ")
                rec.error = f"HTTP {resp.status}: {text[:160]}"
                return rec
            buffer = bytearray()
            done = False
            async for data in resp.content.iter_any():
                buffer += data
                for payload in _sse_payloads(buffer):
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        err = chunk["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        rec.error = f"error in stream: {str(msg)[:160]}"
                        return rec
                    usage = chunk.get("usage") or {}
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
                    new_tokens = 0
                    if usage.get("completion_tokens") is not None:
                        count = int(usage["completion_tokens"])
                        new_tokens = count - (usage_tokens or 0)
                        usage_tokens = count
                    choices = chunk.get("choices") or []
                    if not choices:
                        continue            # the final usage-only chunk
                    if "completion_tokens" not in usage and _chunk_text(choices[0]):
                        new_tokens = 1
                        chunk_tokens += 1
                    if new_tokens > 0:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                if done:
                    break
            if not done:                # not a short completion: the answer was cut
                rec.output_tokens = usage_tokens if usage_tokens is not None else chunk_tokens
                rec.error = ("stream cut before [DONE] (the connection closed mid-answer: "
                             "did the server die?)")
                return rec
        rec.e2e = time.perf_counter() - start
        rec.tokens_from_usage = usage_tokens is not None
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunk_tokens
        rec.ok = True
    except asyncio.TimeoutError:
        rec.error = f"timed out after {timeout_s:g} s (--timeout)"
    except (aiohttp.ClientError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc)[:160]}"
    except ValueError as exc:               # a data: line that is not JSON
        rec.error = f"bad stream chunk: {str(exc)[:160]}"
    return rec


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
    return summarize(target, records, duration, preemptions)


def summarize(target: Target, records: Sequence[RequestRecord], duration: float,
              preemptions: int | None) -> dict:
    """One server's figures. Throughput counts successful requests over the wall time
    from the first dispatch to the last completion (failed requests included in time)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_known) if ok and len(prompt_known) == len(ok) else None
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    sources = {r.tokens_from_usage for r in ok}
    return {
        "base_url": target.base_url,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:MAX_ERROR_SAMPLES]),
        "duration_s": duration,
        "requests_per_s": per_s(len(ok)),
        "output_tokens_per_s": per_s(out_tokens),
        "total_tokens_per_s": per_s(out_tokens + prompt_tokens) if prompt_tokens is not None else None,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_source": ("usage" if sources == {True} else "chunks" if sources == {False}
                                 else "mixed" if sources else None),
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.expected_tokens),
        "ttft_ms": latency_summary([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": latency_summary([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_summary([r.e2e for r in ok]),
        "preemptions": preemptions,
    }


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


SUMMED = ("requests", "completed", "errors", "output_tokens", "short_outputs")


def merge_rounds(rounds: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """Several rounds (each ``{label: summarize(...)}``) -> one result per label.

    Counts are summed over rounds (``preemptions`` too, None if any round lacks it); rates,
    durations and each latency percentile are the median over rounds; ``rounds`` and
    ``output_tokens_per_s_spread`` (the label's noise band) are added and every round's own
    figures are kept in ``per_round``. A single round is returned as it is."""
    if len(rounds) == 1:
        return dict(rounds[0])
    merged = {}
    for label in rounds[0]:
        per = [r[label] for r in rounds]
        out = {"base_url": per[0]["base_url"], "rounds": len(per)}
        for key, first in per[0].items():
            if key in ("base_url", "error_samples", "output_tokens_source"):
                continue
            values = [p.get(key) for p in per]
            if key in SUMMED:
                out[key] = sum(v or 0 for v in values)
            elif key == "preemptions":
                out[key] = None if any(v is None for v in values) else sum(values)
            elif isinstance(first, dict):
                out[key] = {q: (sum(p[key].get(q) or 0 for p in per) if q == "n" else
                                median(p[key].get(q) for p in per)) for q in first}
            else:
                out[key] = median(values)
        samples: dict[str, int] = {}
        for p in per:
            for err, n in p["error_samples"].items():
                samples[err] = samples.get(err, 0) + n
        out["error_samples"] = dict(sorted(samples.items(), key=lambda kv: -kv[1])
                                    [:MAX_ERROR_SAMPLES])
        sources = {p["output_tokens_source"] for p in per}
        out["output_tokens_source"] = sources.pop() if len(sources) == 1 else "mixed"
        out["output_tokens_per_s_spread"] = spread(p["output_tokens_per_s"] for p in per)
        out["per_round"] = per
        merged[label] = out
    return merged
