"""``proxima kv`` without ``--url``: every Proxima engine on this machine's GPUs, read from
the per-GPU ledgers (:mod:`proxima.memory.ledger`), like kvcached's ``kvtop``.

One table per GPU ledger: each live engine's pid, model and port (where its ``proxima
serve`` recorded them), KV memory mapped, its minimum and maximum, what it holds besides KV
(the estimate its sizing used) and its unmet demand (what it wants and the GPU cannot give
now). A killed engine's record is not shown: a record whose process is gone (or whose pid
now names another process) is dropped by every reader. ``--watch [SECONDS]`` redraws until
Ctrl-C (exit 130). Reads files only: no server, no GPU, no CUDA.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

from proxima.memory.ledger import DEFAULT_DIR, DIR_ENV, damage, ledger_files, live_records

DEFAULT_WATCH_S = 2.0
COLUMNS = ("PID", "MODEL", "PORT", "MAPPED", "MIN", "MAX", "NON-KV", "UNMET")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}G"


def snapshot(directory: str | None = None) -> list[dict]:
    """Every GPU ledger in ``directory`` (None: ``PROXIMA_LEDGER_DIR``, else ``/dev/shm``)
    with its live records: ``[{"gpu", "path", "engines": [record, ...], "damaged"}]``;
    ``damaged``: why the file cannot be read (its engines cannot be shown), else None."""
    out = []
    for gpu, path in ledger_files(directory):
        records = sorted(live_records(path), key=lambda r: (r.model, r.pid, r.name))
        out.append({"gpu": gpu, "path": str(path), "engines": [asdict(r) for r in records],
                    "damaged": damage(path)})
    return out


def render(gpus: list[dict], directory: str | None = None) -> str:
    """The tables, as text (one line when there is no engine)."""
    where = directory or os.environ.get(DIR_ENV) or DEFAULT_DIR
    live = [g for g in gpus if g["engines"]]
    # a damaged ledger reads as empty: said, or "no engine is running" would hide its engines
    lines = [f"GPU {g['gpu']}: the ledger {g['path']} {g['damaged']}: its engines cannot be "
             f"shown (an engine's next update rewrites it)" for g in gpus if g.get("damaged")]
    if not live:
        return "\n".join(lines + [f"no Proxima engine is running (no live record in the GPU "
                                  f"ledgers of {where})"])
    for gpu in live:
        engines = gpu["engines"]
        mapped = sum(e["mapped"] for e in engines)
        unmet = sum(e["unmet"] for e in engines)
        lines.append(f"GPU {gpu['gpu']}: {len(engines)} engine(s), {_gib(mapped)} of KV mapped"
                     f"{f', {_gib(unmet)} wanted and not given' if unmet else ''}")
        rows = [COLUMNS]
        for e in engines:
            label = e["model"] or (f"({e['name']})" if e["name"] else "-")
            rows.append((str(e["pid"]), label[:32], str(e["port"] or "-"), _gib(e["mapped"]),
                         _gib(e["min"]), _gib(e["max"]) if e["max"] else "-",
                         _gib(e["nonkv"]) if e["nonkv"] else "-",
                         _gib(e["unmet"]) if e["unmet"] else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)


def run(directory: str | None, as_json: bool, watch: float | None,
        out=None, sleep=time.sleep, rounds: int | None = None) -> int:
    """Print the engines once, or every ``watch`` seconds until interrupted (Ctrl-C is a
    KeyboardInterrupt: the command's exit 130). ``rounds``: stop after that many (tests)."""
    out = out or sys.stdout
    shown = 0
    while True:
        gpus = snapshot(directory)
        text = json.dumps(gpus, indent=2) if as_json else render(gpus, directory)
        if watch is not None and not as_json and out.isatty():
            out.write("\x1b[H\x1b[2J")              # clear the screen, as top does
        stamp = time.strftime("%H:%M:%S") + "\n" if watch is not None and not as_json else ""
        out.write(stamp + text + "\n")
        out.flush()
        shown += 1
        if watch is None or (rounds is not None and shown >= rounds):
            return 0
        sleep(watch)
