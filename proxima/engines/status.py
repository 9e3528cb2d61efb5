"""The engine's status file: how a process outside the engine core sees Proxima.

vLLM runs its scheduler (and so the block pool) in an engine-core process apart from the
API server. When ``PROXIMA_STATS_FILE`` names a path, the engine adapter writes a JSON
snapshot there at activation and then at most once a second while it schedules. The
server's /metrics collector and the self-check read it. Writes are atomic (rename).

Layout::

    {"active": true, "pid": 1234, "engine": "vllm-v1", "vllm_version": "0.26.0",
     "num_blocks": 55735, "block_size": 16, "time": 1764470000.0,
     "allocator": {<BuddyAllocator.stats()>}, "num_evictable": 12,
     "running_blocks_per_run": [1.0, 3.5, ...], "alloc_seconds_total": 0.12, "steps": 420,
     "finished_blocks_per_run": {"count": 880, "mean": 12.0}, "invariants_ok": true}

With Proxima off and ``PROXIMA_OBSERVE=1`` the read-only observer of stock vLLM
(:mod:`proxima.engines.observe_v1`) writes the same contiguity fields with
``"active": false, "observer": true`` (no allocator fields).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATS_ENV = "PROXIMA_STATS_FILE"


def stats_path() -> Path | None:
    value = os.environ.get(STATS_ENV)
    return Path(value) if value else None


def write_status(payload: dict, path: Path | None = None) -> None:
    path = path or stats_path()
    if path is None:
        return
    payload = dict(payload, time=time.time(), pid=os.getpid())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def invariants_verdict(buddy) -> dict:
    """``{"invariants_ok": ...}`` for the live pool (``BuddyAllocator.check``, O(N)), with
    the first broken invariant when there is one: what the self-check reads."""
    try:
        buddy.check()
    except AssertionError as exc:
        return {"invariants_ok": False, "invariants_error": str(exc)}
    return {"invariants_ok": True}


def read_status(path: Path | None = None) -> dict | None:
    """The last snapshot, or None when there is none (engine not started, Proxima off)."""
    path = path or stats_path()
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
