"""Talking to a running ``proxima serve`` from the command line (``proxima kv``,
``proxima selfcheck --url``): one HTTP request, bounded, and nothing in its answer trusted.

- :func:`server_url` checks ``--url`` (one :class:`UserError` line, exit 2, for anything that
  is not ``http(s)://HOST[:PORT][/PATH]``) and gives the base the routes are appended to.
- :func:`request` sends one request and bounds the WHOLE of it (name lookup, connect, the
  answer's status line, headers and body) by ``timeout`` seconds: the request runs on a
  thread, and when the deadline passes its socket is shut, so a server that drips a byte a
  second cannot hold the command. The body is capped (:data:`MAX_BODY_BYTES`). Redirects
  are not followed.
- Nothing listening (refused, unknown host, TLS handshake refused) is :class:`UserError`:
  ``--url`` names no server. Everything the server did wrong -- no answer in time, a
  broken answer, a status other than 200, a body that is not the JSON asked for -- is
  :class:`ServerFailure` (exit 1), its message one line with the status and a short,
  sanitized snippet of what came back.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import re
import socket
import ssl
import threading
import unicodedata
from dataclasses import dataclass
from html import unescape
from urllib.parse import quote, unquote, urlsplit

from proxima.errors import UserError

#: the most of an answer's body read (a status or a self-check report is a few KiB)
MAX_BODY_BYTES = 1 << 20
#: the longest --timeout taken (threading's waits overflow long before inf)
MAX_TIMEOUT_S = 3600.0
SNIPPET_CHARS = 160


class ServerFailure(Exception):
    """The server did not answer, or answered what was not asked for: exit 1, one line."""


def server_url(url: str | None, flag: str = "--url",
               server: str = "a running proxima serve") -> str:
    """``http(s)://HOST[:PORT][/PATH]`` without a trailing slash, or one UserError line
    (``server``: what the URL names, for the line)."""
    example = "http://127.0.0.1:8000"
    if url is None or not url.strip():
        raise UserError(f"give {flag} URL: {server.replace('a running', 'the')} to talk to "
                        f"(e.g. {example})")
    text = url.strip()
    shape = f"{flag} must look like http://HOST:PORT ({server}, e.g. {example})"
    if any(ch.isspace() or unicodedata.category(ch)[0] == "C" for ch in text):
        raise UserError(f"{shape}, got {url!r}: it holds a space or a control character")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:             # "http://[::1", "http://h:port", "http://h:70000"
        raise UserError(f"{shape}, got {url!r} ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.netloc:
        hint = (f": add the scheme, http://{text}" if "://" not in text and scheme not in
                ("http", "https") else ": it has no host" if scheme in ("http", "https")
                else "")
        raise UserError(f"{shape}, got {url!r}{hint}")
    if not parts.hostname:
        raise UserError(f"{shape}, got {url!r}: it has no host")
    if port == 0:
        raise UserError(f"{shape}, got {url!r}: port 0 is no server's port")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise UserError(f"{shape}, got {url!r}: drop the query or fragment (?...#...): the "
                        f"routes are added to the URL's path")
    return f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}"


def check_timeout(value: float, flag: str = "--timeout") -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a number of seconds > 0, got {value}")
    if value > MAX_TIMEOUT_S:
        raise UserError(f"{flag} {value:g} is above the bound of {MAX_TIMEOUT_S:g} seconds")
    return float(value)


def one_line(text: str, limit: int = SNIPPET_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters: control characters
    (terminal escapes, newlines) become spaces, runs of spaces one."""
    text = re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]", " ", str(text)[:64 * limit])  # ANSI colours
    text = "".join(" " if unicodedata.category(ch)[0] in "CZ" else ch for ch in text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def snippet(body: bytes | str, limit: int = SNIPPET_CHARS) -> str:
    """A short, printable, one-line excerpt of an answer (markup and control characters
    gone), for an error line: never the whole body, never a terminal escape."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    text = text[:64 * limit]
    if "<" in text and ">" in text:          # HTML: its text, not its tags
        text = re.sub(r"(?is)<(script|style)\b.*?</\1\s*>", " ", text)
        text = unescape(re.sub(r"(?s)<[^>]*>", " ", text))
    return one_line(text, limit) or "(an empty body)"


@dataclass
class Answer:
    url: str
    status: int
    reason: str
    content_type: str
    location: str
    body: bytes

    @property
    def head(self) -> str:
        """``the server answered 500 Internal Server Error``"""
        reason = one_line(self.reason, 40)
        return f"{self.url} answered {self.status} {reason}".rstrip()


def request(url: str, timeout: float, payload: dict | None = None,
            max_bytes: int = MAX_BODY_BYTES, timeout_flag: str | None = "--timeout") -> Answer:
    """GET ``url``, or POST ``payload`` as JSON; the whole exchange bounded by ``timeout``.

    UserError: nothing reachable there. ServerFailure: no (complete) answer in time, or an
    answer that is not HTTP, or a body over ``max_bytes``. ``timeout_flag``: the option
    that sets ``timeout``, named in the messages (None: it is fixed)."""
    within = f"{timeout_flag} {timeout:g} s" if timeout_flag else f"{timeout:g} s"
    raise_it = f", or raise {timeout_flag}" if timeout_flag else ""
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    headers = {"Accept": "application/json", "User-Agent": "proxima-cli"}
    if parts.username is not None:
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
    data = None
    if payload is not None:
        data = json.dumps(payload).encode()
        headers["Content-Type"] = "application/json"
    state = {"stage": "connecting"}

    def exchange() -> None:
        try:
            conn.connect()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's thread
            state.update(stage="connect", error=exc)
            return
        state["sock"] = conn.sock      # (getresponse drops conn.sock of a closing answer)
        response = None
        try:
            state["stage"] = "waiting for the status line and headers"
            conn.request("POST" if data is not None else "GET", path, body=data,
                         headers=headers)
            response = conn.getresponse()
            state["stage"] = "reading the body"
            body = response.read(max_bytes + 1)
            if response.length and len(body) <= max_bytes:   # EOF before Content-Length
                raise http.client.IncompleteRead(body, response.length)
            state["answer"] = Answer(url, response.status, response.reason or "",
                                     response.getheader("Content-Type", "") or "",
                                     response.getheader("Location", "") or "", body)
        except BaseException as exc:  # noqa: BLE001
            state["error"] = exc
        finally:               # the socket really closed (not held by the response's file):
            if response is not None:     # a server still sending learns that nobody listens
                response.close()
            conn.close()

    worker = threading.Thread(target=exchange, name="proxima-http", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        stage = state["stage"]
        sock = state.get("sock")
        if sock is not None:           # wakes the thread: its read ends at once
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        raise ServerFailure(f"{url} did not answer within {within} (still {stage}): is the "
                            f"server overloaded or stuck? Try again{raise_it}")
    error = state.get("error")
    if error is not None:
        if isinstance(error, KeyboardInterrupt):
            raise error
        if state["stage"] == "connect":
            if isinstance(error, (socket.timeout, TimeoutError)):
                raise ServerFailure(f"{url}: no connection within {within} ({_why(error)}): "
                                    f"is proxima serve running there?")
            tls = (": is it http://, not https://?" if isinstance(error, ssl.SSLError)
                   else ": is proxima serve running there? Check --url")
            raise UserError(f"cannot reach {url} ({_why(error)}){tls}")
        if isinstance(error, (socket.timeout, TimeoutError)):
            raise ServerFailure(f"{url} did not answer within {within}{raise_it}")
        if isinstance(error, http.client.IncompleteRead):
            got = len(error.partial)
            raise ServerFailure(f"{url} broke off mid-answer ({got:,} of "
                                f"{got + (error.expected or 0):,} bytes of the body came): did "
                                f"the server die?")
        if isinstance(error, (http.client.HTTPException, OSError, ssl.SSLError, ValueError)):
            raise ServerFailure(f"{url} broke off or did not answer HTTP ({_why(error)}): is "
                                f"this a proxima serve?")
        raise ServerFailure(f"{url}: the request failed ({_why(error)})")
    answer = state["answer"]
    if len(answer.body) > max_bytes:
        raise ServerFailure(f"{answer.head} with a body over {max_bytes:,} bytes (read no "
                            f"further): is this a proxima serve?")
    return answer


def _why(exc: BaseException) -> str:
    text, name = one_line(str(exc), 120), type(exc).__name__
    return f"{name}: {text}" if text else name


def error_message(data) -> str | None:
    """The message of an error body: proxima's ``{"error": "..."}``, OpenAI's ``{"error":
    {"message": "..."}}``, FastAPI's ``{"detail": ...}``; None for anything else."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    for value in (error, data.get("detail"), data.get("message")):
        if isinstance(value, str) and one_line(value):
            return one_line(value, 300)
    return None


def json_body(answer: Answer):
    """The answer's body as JSON, or ServerFailure naming what came instead."""
    try:
        return json.loads(answer.body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ServerFailure(f"{answer.head} with a body that is not JSON "
                            f"({answer.content_type or 'no Content-Type'}: "
                            f"{snippet(answer.body)!r}): is this a proxima serve?") from None


def refusal(answer: Answer, hint: str) -> ServerFailure:
    """A non-200 answer as one line: the status, and the server's message or a snippet."""
    if 300 <= answer.status < 400:
        where = f" to {one_line(answer.location, 120)}" if answer.location.strip() else ""
        return ServerFailure(f"{answer.head}, a redirect{where}, which is not followed: give "
                             f"--url the proxima serve's own address")
    try:
        message = error_message(json.loads(answer.body))
    except (ValueError, RecursionError):
        message = None
    if message is None:
        message = snippet(answer.body)
    extra = f" ({hint})" if answer.status == 404 and hint else ""
    return ServerFailure(f"{answer.head}: {message}{extra}")
