"""One streaming request of online mode: its body (identical for every server), the
reading of its server-sent events, and what the client saw (:class:`RequestRecord`).

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
import time
from dataclasses import dataclass, field
from typing import Sequence

import aiohttp

from proxima.workloads import RequestSpec


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
