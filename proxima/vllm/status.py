"""The engine's status file: how a process outside the engine core sees Proxima.

vLLM runs its scheduler (and so the block pool) in an engine-core process apart from the
API server. When ``PROXIMA_STATS_FILE`` names a path, the engine adapter writes a JSON
snapshot there at activation and then at most once a second while it schedules. The
server's /metrics collector and the self-check read it. Writes are atomic (rename); the
periodic ones are made by a background thread, so the scheduler does not wait for the disk.

Layout::

    {"active": true, "pid": 1234, "engine": "vllm-v1", "vllm_version": "0.26.0",
     "num_blocks": 55735, "block_size": 16, "time": 1764470000.0,
     "allocator": {<RunAllocator.stats()>}, "num_evictable": 12,
     "running_blocks_per_run": [1.0, 3.5, ...], "alloc_seconds_total": 0.12, "steps": 420,
     "finished_blocks_per_run": {"count": 880, "mean": 12.0}, "invariants_ok": true}

With KV compaction on (:mod:`proxima.vllm.compaction_v1`) the snapshot also carries
``"compaction": {<Compactor.stats()>}`` (block copies, bytes, moving steps, placements,
planning and GPU milliseconds per moving step as p50/p99/max), which ``/metrics`` exposes.

With Proxima off and ``PROXIMA_OBSERVE=1`` the read-only observer of stock vLLM
(:mod:`proxima.vllm.observe_v1`) writes the same contiguity fields with
``"active": false, "observer": true`` (no allocator fields).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from proxima.allocator import InvariantError
from proxima.vllm.activation import STATS_ENV
from proxima.ioutil import publish_text_later


def percentiles(values, digits: int | None = None) -> dict:
    """``{"n", "p50", "p99", "max"}`` of ``values`` (Nones when empty), each rounded to
    ``digits`` when given: what the status files report for a window of samples."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    r = (lambda x: x) if digits is None else (lambda x: round(x, digits))
    return {"n": len(ordered), "p50": r(ordered[len(ordered) // 2]),
            "p99": r(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]),
            "max": r(ordered[-1])}

STATUS_INTERVAL_S = 1.0
INVARIANTS_INTERVAL_S = 60.0


def stats_path() -> Path | None:
    """``PROXIMA_STATS_FILE`` as a path (None when unset or empty). Not checked here: the
    plugin and ``proxima serve`` check it once (``activation.check_environment``); readers
    must not fail on it."""
    value = os.environ.get(STATS_ENV, "").strip()
    return Path(value).expanduser() if value else None


def write_status(payload: dict, path: Path | None = None, wait: bool = True) -> None:
    """One snapshot (stamped with the time and pid). ``wait=False``: the file is written
    off the caller's thread (``publish_text_later``), as the periodic snapshots are."""
    path = path or stats_path()
    if path is None:
        return
    payload = dict(payload, time=time.time(), pid=os.getpid())
    publish_text_later(path, json.dumps(payload), wait=wait)


def invariants_verdict(buddy) -> dict:
    """``{"invariants_ok": ...}`` for the live pool (``RunAllocator.check``, O(N), which
    raises ``InvariantError``, also under ``python -O``), with the first broken invariant
    when there is one: what the self-check reads."""
    try:
        buddy.check()
    except InvariantError as exc:
        return {"invariants_ok": False, "invariants_error": str(exc)}
    except Exception as exc:    # check() itself broke: the pool cannot be vouched for
        return {"invariants_ok": False,
                "invariants_error": f"check() failed: {type(exc).__name__}: {exc}"}
    return {"invariants_ok": True}


class InvariantWatch:
    """The live pool's invariants: checked when the pool is created and again at most once
    every ``INVARIANTS_INTERVAL_S`` as the status is written (an O(N) check, ~2 ms for
    55,735 blocks in ~700 free runs on the CI VM). Every snapshot carries the last verdict
    and when it was taken (``invariants_checked_at``), so the self-check and
    ``proxima_invariants_ok`` always read a verdict on the pool as it is in use, at most a
    minute old."""

    def __init__(self) -> None:
        self.verdict: dict | None = None
        self._next = 0.0

    def current(self, buddy, force: bool = False) -> dict:
        now = time.monotonic()
        if force or self.verdict is None or now >= self._next:
            self._next = now + INVARIANTS_INTERVAL_S
            self.verdict = dict(invariants_verdict(buddy), invariants_checked_at=time.time())
        return self.verdict


class StatusWriter:
    """How an engine writes its status: to ``PROXIMA_STATS_FILE`` (read when the writer is
    made; no file, no work), at most once every ``interval`` seconds unless ``force``d.
    Given the pool's buddy allocator, each snapshot carries the last invariant verdict
    (:class:`InvariantWatch`; ``check`` renews it now). Used by both engine adapters and by
    the stock observer, so all three throttle and stamp snapshots the same way."""

    def __init__(self, interval: float | None = None) -> None:
        self.path = stats_path()
        self.interval = STATUS_INTERVAL_S if interval is None else interval
        self._next = 0.0
        self._invariants = InvariantWatch()

    def due(self) -> bool:
        return self.path is not None and time.monotonic() >= self._next

    def publish(self, stats: Callable[[], dict], buddy=None, force: bool = False,
                check: bool = False, wait: bool | None = None) -> None:
        """Write ``stats()`` if a file is set and it is time (or ``force`` / ``check``).
        A periodic snapshot is written off the scheduler's thread; a forced one (the end
        of a batch, a check) is on disk when this returns, unless ``wait=False``."""
        if self.path is None or not (force or check or self.due()):
            return
        self._next = time.monotonic() + self.interval
        payload = stats()
        if buddy is not None:
            payload.update(self._invariants.current(buddy, force=check))
        write_status(payload, self.path, wait=(force or check) if wait is None else wait)


def read_status(path: Path | None = None) -> dict | None:
    """The last snapshot, or None when there is none (engine not started, Proxima off)."""
    path = path or stats_path()
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
