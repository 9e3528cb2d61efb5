"""What offline mode reads from a run's Proxima status file (``PROXIMA_STATS_FILE``): the
snapshots, sampled while the run goes (:class:`StatusSampler`), and the figures taken from
them: contiguity (:func:`contiguity`) and, in elastic mode, the mapped KV memory
(:func:`elastic_figures`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Sequence

from proxima.vllm.status import read_status

STATUS_POLL_S = 0.5
FINAL_SNAPSHOT_WAIT_S = 1.0


class StatusSampler:
    """Reads the Proxima status file every ``STATUS_POLL_S`` while a run goes.

    The engine writes a snapshot at most once a second; the last one may be taken when
    few requests are still running, so contiguity is averaged over all snapshots of the
    run rather than read from the last. Each distinct snapshot (by its ``time``) is kept
    once."""

    def __init__(self, path: Path):
        self.path = path
        self.snapshots: list[dict] = []
        self._seen: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proxima-status", daemon=True)

    def __enter__(self) -> "StatusSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # The engine writes a last snapshot when its last request is freed, which can land
        # just after generate() returns here: wait briefly for it (seen on the H200: one of
        # 200 finished requests missing from the stock tally without this).
        deadline = time.monotonic() + FINAL_SNAPSHOT_WAIT_S
        while not self._take() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _take(self) -> bool:
        """Keep the current snapshot if it is new; True when it was."""
        snap = read_status(self.path)
        if snap is not None and snap.get("time") not in self._seen:
            self._seen.add(snap.get("time"))
            self.snapshots.append(snap)
            return True
        return False

    def _loop(self) -> None:
        while not self._stop.wait(STATUS_POLL_S):
            self._take()


def contiguity(snapshots: Sequence[dict]) -> dict:
    """Contiguity figures from status snapshots; every value None when there are none.

    ``blocks_per_run``: a request's blocks divided by its runs of consecutive ids (1.0 =
    fully scattered), averaged. Preferred source (``blocks_per_run_source: "finished"``):
    the engine's tally over every request at completion, its whole KV just before it is
    freed (``finished_blocks_per_run`` of the last snapshot; counters are cumulative and
    each run has its own engine). Otherwise (``"running"``, e.g. the V0 engine): the mean
    over all ``running_blocks_per_run`` entries of all snapshots, sampled at most once a
    second. ``largest_free_run`` and ``fragmentation``: the allocator's, last snapshot."""
    finished = next((s["finished_blocks_per_run"] for s in reversed(snapshots)
                     if isinstance(s.get("finished_blocks_per_run"), dict)), {})
    values = [float(v) for s in snapshots
              for v in (s.get("running_blocks_per_run") or [])
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if finished.get("count") and isinstance(finished.get("mean"), (int, float)):
        source, mean, samples = "finished", float(finished["mean"]), int(finished["count"])
    elif values:
        source, mean, samples = "running", sum(values) / len(values), len(values)
    else:
        source, mean, samples = None, None, 0
    last_alloc = next((s["allocator"] for s in reversed(snapshots)
                       if isinstance(s.get("allocator"), dict)), {})
    checks = [s["invariants_ok"] for s in snapshots if isinstance(s.get("invariants_ok"), bool)]
    return {
        "active": any(s.get("active") is True for s in snapshots) if snapshots else None,
        "snapshots": len(snapshots),
        "blocks_per_run": mean,
        "blocks_per_run_samples": samples,
        "blocks_per_run_source": source,
        "largest_free_run": last_alloc.get("largest_free_run"),
        "fragmentation": last_alloc.get("fragmentation"),
        "invariants_ok": all(checks) if checks else None,
    }


def elastic_figures(snapshots: Sequence[dict]) -> dict | None:
    """Mapped KV bytes over a run from the status snapshots (mean, peak, last) and the
    policy's counters at the end; None when the engine reported no elastic section."""
    sections = [s["elastic"] for s in snapshots if isinstance(s.get("elastic"), dict)]
    if not sections:
        return None
    mapped = [e.get("mapped_bytes") or 0 for e in sections]
    last = sections[-1]
    return {"mapped_bytes_mean": sum(mapped) / len(mapped), "mapped_bytes_peak": max(mapped),
            "mapped_bytes_last": mapped[-1], "pool_bytes": last.get("pool_bytes"),
            **{k: last.get(k) for k in ("grows", "shrinks", "failed_grows", "bytes_returned",
                                        "evicted_cached", "policy")}}
