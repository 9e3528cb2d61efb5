"""``proxima kv --url URL [--min SIZE] [--max SIZE|none] [--json]``: a running server's
elastic KV memory -- read it, or set its bounds. ``proxima kv [--watch [SECONDS]]`` without
``--url``: every Proxima engine on this machine's GPUs, from the GPU ledgers
(:mod:`proxima.serve.kvtop`).

Talks to ``GET/POST URL/proxima/kv`` of ``proxima serve --elastic``. Without ``--min`` /
``--max`` it reads; with either it sets (the engine acts at its next step boundary: a
minimum above the mapped size grows now, a maximum below it releases granules without
live blocks now). Sizes: bytes or a number with a unit (``8GiB``, ``512MiB``, ``20GB``);
``--max none`` removes the maximum (the pool's size is the limit).

Exit status: 0 done; 1 the server refused or failed (an error status, an answer that is
not an elastic KV status, no whole answer within ``--timeout``); 2 bad input (a malformed
``--url``, size or ``--timeout``) or nothing listening at ``--url``. Errors are one line on
stderr; stdout carries only the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from proxima.errors import UserError
from proxima.serve.remote import (ServerFailure, check_timeout, error_message, json_body,
                                  one_line, refusal, request, server_url)

EXIT_STATUS = """\
exit status:
  0  done: the status (after the change, if one was asked) is printed on stdout
  1  server or runtime failure: the server refused the change or answered an error
     (its status and message are shown), its answer is not an elastic KV status, or
     no whole answer came within --timeout (one line on stderr)
  2  bad input: a malformed --url, --min/--max or --timeout, or nothing listening at
     --url (one line on stderr)"""

ROWS = (("mapped_bytes", "mapped"), ("used_bytes", "used by requests"),
        ("reclaimable_bytes", "reclaimable (granules without a live block)"),
        ("min_bytes", "minimum"), ("max_bytes", "maximum"), ("pool_bytes", "pool (reserved)"))
COUNTERS = (("grows", "grows"), ("shrinks", "shrinks"), ("failed_grows", "failed grows"),
            ("bytes_returned", "bytes returned"), ("evicted_cached", "cached blocks evicted"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from proxima.config import MAX_BYTES, SIZE_FORMS, size_text

    parser.description = ("Without --url: every Proxima engine on this machine's GPUs (pid, "
                          "model, port, KV mapped, min/max, non-KV, unmet demand) from the "
                          "per-GPU ledgers, like kvtop. With --url: read a running proxima "
                          "serve's elastic KV memory (mapped, used and "
                          f"reclaimable bytes, bounds, counters), or set its bounds. SIZE: "
                          f"{SIZE_FORMS} (a bare G is refused: write GiB or GB); e.g. "
                          f"8GiB, 512MiB, 20GB; from 0 to "
                          f"{size_text(MAX_BYTES)}.")
    parser.epilog = EXIT_STATUS
    parser.add_argument("--url",
                        help="the proxima serve to talk to, e.g. http://127.0.0.1:8000 "
                             "(default: none: every engine in the GPU ledgers)")
    parser.add_argument("--watch", nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="show again every SECONDS (2 when given without a value) until "
                             "Ctrl-C (exit 130) (default: once)")
    parser.add_argument("--ledger-dir", metavar="DIR",
                        help="where the GPU ledgers are (default: PROXIMA_LEDGER_DIR, else "
                             "/dev/shm)")
    parser.add_argument("--min", dest="min_bytes", metavar="SIZE",
                        help="set the least KV memory kept mapped, e.g. 4GiB (units: KiB "
                             "MiB GiB TiB, KB MB GB TB; default: unchanged)")
    parser.add_argument("--max", dest="max_bytes", metavar="SIZE",
                        help="set the most KV memory mapped, e.g. 80GiB, or 'none' for the "
                             "pool's size (default: unchanged)")
    parser.add_argument("--json", action="store_true",
                        help="print the server's answer (without --url: the ledgers' records) as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds the whole request may take (connecting, and the whole answer)")


def _request(args) -> dict:
    from proxima.config import parse_size

    body = {}
    for flag, key, value in (("--min", "min_bytes", args.min_bytes),
                             ("--max", "max_bytes", args.max_bytes)):
        if value is None:
            continue
        if key == "max_bytes" and str(value).strip().lower() in ("none", "null", "pool"):
            body[key] = None
            continue
        body[key] = parse_size(value, flag)
    lo, hi = body.get("min_bytes"), body.get("max_bytes")
    if lo is not None and hi is not None and hi < lo:
        raise UserError(f"--max {args.max_bytes} is below --min {args.min_bytes}: give a "
                        f"maximum at least the minimum")
    return body


def _url(url: str | None) -> str:
    return server_url(url) + "/proxima/kv"


#: what the command reads of the server's answer: field -> (kind, required); the kinds are
#: _KINDS' keys. An optional field may be missing or null.
FIELDS = {"policy": ("text", True), "granule_blocks": ("positive", True),
          "bytes_per_granule": ("bytes", True), "mapped_bytes": ("bytes", True),
          "pool_bytes": ("bytes", True), "used_bytes": ("bytes", False),
          "reclaimable_bytes": ("bytes", False), "min_bytes": ("bytes", False),
          "max_bytes": ("bytes", False), "grows": ("count", False),
          "shrinks": ("count", False), "failed_grows": ("count", False),
          "bytes_returned": ("bytes", False), "evicted_cached": ("count", False),
          "short": ("flag", False), "sleeping": ("flag", False)}
_KINDS = {"text": "a string", "count": "an integer from 0 to 2**63", "positive":
          "an integer from 1 to 2**63", "bytes": "a number of bytes from 0 to 2**63",
          "flag": "true or false"}


def check_answer(data) -> dict:
    """The server's 200 answer, if it is an elastic KV status (every field this command
    reads, of its type; ``null`` allowed where a field is optional); else ServerFailure."""
    where = "the server's answer is not an elastic KV status"
    if not isinstance(data, dict):
        raise ServerFailure(f"{where}: it is {_shown(data)}, not a JSON object")
    if "error" in data:
        raise ServerFailure(f"{where}: it carries an error with status 200: "
                            f"{error_message(data) or _shown(data['error'])}")
    for key, (kind, required) in FIELDS.items():
        value = data.get(key)
        if value is None:
            if required:
                raise ServerFailure(f"{where}: {key} is {'null' if key in data else 'missing'}"
                                    f" (expected {_KINDS[kind]}): is this proxima serve "
                                    f"--elastic?")
            continue
        if kind == "text":
            good = isinstance(value, str)
        elif kind == "flag":
            good = isinstance(value, bool)
        else:
            good = (isinstance(value, int) and not isinstance(value, bool)
                    and (1 if kind == "positive" else 0) <= value < 2**63)
        if not good:
            raise ServerFailure(f"{where}: {key} is {_shown(value)} (expected {_KINDS[kind]})")
    return data


def _shown(value) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), "?")
    return kind if value is None else f"{kind} {one_line(json.dumps(value), 40)}"


def _watch(value) -> float | None:
    if value is None:
        return None
    from proxima.config import parse_number

    return float(parse_number(value, "--watch", least=0.1, most=3600, unit="seconds"))


def run(args: argparse.Namespace) -> int:
    watch = _watch(args.watch)
    timeout = check_timeout(args.timeout)      # checked even where unused (the ledgers)
    if args.url is None:
        if args.min_bytes is not None or args.max_bytes is not None:
            raise UserError("--min/--max set one engine's bounds: give its --url (every "
                            "engine's is in the table of `proxima kv`)")
        from proxima.memory.ledger import DIR_ENV

        named = (("--ledger-dir", args.ledger_dir) if args.ledger_dir is not None
                 else (DIR_ENV, os.environ.get(DIR_ENV) or None))
        if named[1] is not None and not os.path.isdir(named[1]):
            raise UserError(f"{named[0]} {named[1]!r} is not a directory: give the directory "
                            f"the engines' GPU ledgers are in (their {DIR_ENV}; default "
                            f"/dev/shm)")
        from proxima.serve import kvtop

        return kvtop.run(args.ledger_dir, args.json, watch)
    if args.ledger_dir is not None:
        raise UserError("--ledger-dir reads the GPU ledgers: drop --url, or drop --ledger-dir")
    if watch is not None and (args.min_bytes is not None or args.max_bytes is not None):
        raise UserError("--watch shows the status again and again: it cannot set --min/--max "
                        "(set them once without --watch)")
    target = _url(args.url)
    body = _request(args)
    while watch is not None:
        code = _show(target, body, timeout, args.json)
        if code:
            return code
        time.sleep(watch)
    return _show(target, body, timeout, args.json)


def _show(target: str, body: dict, timeout: float, as_json: bool) -> int:
    try:
        answer = request(target, timeout, payload=body or None)
        if answer.status != 200:
            raise refusal(answer, "is this proxima serve with --elastic? GET /proxima/kv is "
                                  "its route")
        data = check_answer(json_body(answer))
    except ServerFailure as exc:
        print(f"proxima kv: error: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        print(format_status(data))
    return 0


def format_status(data: dict) -> str:
    from proxima.memory.policy_options import format_bytes

    lines = [f"elastic KV memory (policy {one_line(data.get('policy', '?'), 40)}, granules of "
             f"{data.get('granule_blocks', '?')} blocks = "
             f"{format_bytes(int(data.get('bytes_per_granule') or 0))}):"]
    for key, label in ROWS:
        value = data.get(key)
        if value is not None:
            lines.append(f"  {label:46} {format_bytes(int(value))}")
    counts = [f"{label} {format_bytes(int(data[key])) if key == 'bytes_returned' else data[key]}"
              for key, label in COUNTERS if data.get(key) is not None]
    if counts:
        lines.append("  " + ", ".join(counts))
    if data.get("sleeping"):
        state = one_line(str(data.get("sleep_state") or "asleep"), 20)
        lines.append(f"  the model is {state.replace('-', ' ')} (vLLM's sleep mode: its weights "
                     f"in host memory; its next request through proxima serve's endpoint "
                     f"wakes it)")
    if data.get("short"):
        lines.append("  the GPU could not give more memory at the last grow (another process "
                     "holds it): serving at the current size, retrying")
    return "\n".join(lines)
