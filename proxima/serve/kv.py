"""``proxima kv --url URL [--min SIZE] [--max SIZE|none] [--json]``: a running server's
elastic KV memory -- read it, or set its bounds.

Talks to ``GET/POST URL/proxima/kv`` of ``proxima serve --elastic``. Without ``--min`` /
``--max`` it reads; with either it sets (the engine acts at its next step boundary: a
minimum above the mapped size grows now, a maximum below it releases granules without
live blocks now). Sizes: bytes or a number with a unit (``8GiB``, ``512MiB``, ``20GB``);
``--max none`` removes the maximum (the pool's size is the limit).

Exit status: 0 done, 1 the server refused or failed, 2 bad input or no server there.
"""

from __future__ import annotations

import argparse
import json

from proxima.errors import UserError

ROWS = (("mapped_bytes", "mapped"), ("used_bytes", "used by requests"),
        ("reclaimable_bytes", "reclaimable (granules without a live block)"),
        ("min_bytes", "minimum"), ("max_bytes", "maximum"), ("pool_bytes", "pool (reserved)"))
COUNTERS = (("grows", "grows"), ("shrinks", "shrinks"), ("failed_grows", "failed grows"),
            ("bytes_returned", "bytes returned"), ("evicted_cached", "cached blocks evicted"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from proxima.config import MAX_BYTES, SIZE_FORMS, size_text

    parser.description = ("Read a running proxima serve's elastic KV memory (mapped, used and "
                          f"reclaimable bytes, bounds, counters), or set its bounds. SIZE: "
                          f"{SIZE_FORMS} (a bare G is refused: write GiB or GB); e.g. "
                          f"8GiB, 512MiB, 20GB; from 0 to "
                          f"{size_text(MAX_BYTES)}.")
    parser.epilog = ("exit status: 0 done; 1 the server refused the change or answered an "
                     "error; 2 bad input or nothing listening at --url")
    parser.add_argument("--url",
                        help="the proxima serve to talk to, e.g. http://127.0.0.1:8000 (required)")
    parser.add_argument("--min", dest="min_bytes", metavar="SIZE",
                        help="set the least KV memory kept mapped, e.g. 4GiB (units: KiB "
                             "MiB GiB TiB, KB MB GB TB; default: unchanged)")
    parser.add_argument("--max", dest="max_bytes", metavar="SIZE",
                        help="set the most KV memory mapped, e.g. 80GiB, or 'none' for the "
                             "pool's size (default: unchanged)")
    parser.add_argument("--json", action="store_true",
                        help="print the server's answer as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for the server")


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
    from urllib.parse import urlsplit

    if not url:
        raise UserError("give --url URL: the proxima serve to talk to (e.g. "
                        "http://127.0.0.1:8000)")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--url must look like http://HOST:PORT (a running proxima serve), "
                        f"got {url!r}")
    return url.strip().rstrip("/") + "/proxima/kv"


def run(args: argparse.Namespace) -> int:
    target = _url(args.url)
    body = _request(args)
    if not args.timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {args.timeout}")
    import httpx

    try:
        if body:
            response = httpx.post(target, json=body, timeout=args.timeout)
        else:
            response = httpx.get(target, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise UserError(f"cannot reach {target} ({type(exc).__name__}: {exc}): is proxima "
                        f"serve running there?") from None
    try:
        data = response.json()
    except ValueError:
        raise UserError(f"{target} answered {response.status_code} without JSON: is this a "
                        f"proxima serve?") from None
    if args.json:
        print(json.dumps(data, indent=2))
    if response.status_code != 200:
        message = data.get("error") if isinstance(data, dict) else data
        if not args.json:
            print(f"proxima kv: error: the server answered {response.status_code}: {message}")
        return 1
    if not args.json:
        print(format_status(data))
    return 0


def format_status(data: dict) -> str:
    from proxima.memory.policy import format_bytes

    lines = [f"elastic KV memory (policy {data.get('policy', '?')}, granules of "
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
    if data.get("short"):
        lines.append("  the GPU could not give more memory at the last grow (another process "
                     "holds it): serving at the current size, retrying")
    return "\n".join(lines)
