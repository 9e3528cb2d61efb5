"""What one replay run returns, whichever engine generation ran it, and how repeats combine.

Both drivers (:mod:`proxima.replay.driver_v1`, :mod:`proxima.replay.driver_v0`) return a
:class:`ReplayResult`; ``proxima replay`` combines each allocator's repeats with
:func:`combine` (counts must agree, the scheduler time is the median) and writes the
figures of :data:`FIELDS` side by side.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from proxima.allocator import count_runs

#: the figures of the table, in its order
FIELDS = ("completed", "steps", "peak_running", "preemptions", "prefix_hit_rate",
          "blocks_per_run", "single_run_fraction", "scheduler_ms_per_step")
#: figures shown when both results have them (the V1 driver's request latency, in steps
#: of the step clock, and its granule samples)
LATENCY_FIELDS = ("queue_wait_p50_steps", "queue_wait_p99_steps", "ttft_p50_steps",
                  "ttft_p99_steps")
OPTIONAL_FIELDS = ("busy_steps", *LATENCY_FIELDS, "reclaimable_granule_fraction",
                   "packed_ideal_fraction", "mapped_granule_fraction")
#: figures that must be equal on every repeat (the scheduler is deterministic)
DETERMINISTIC = ("completed", "steps", "preemptions", "blocks_per_run")


@dataclass
class ReplayResult:
    """One allocator's run over one workload.

    ``blocks_per_run``, ``single_run_fraction`` and ``runs_per_request_histogram`` are over
    every finished request's whole block table (its prefix-cache hits included), taken just
    before vLLM freed it (:func:`contiguity`). ``largest_free_run_timeline`` is filled only
    when the caller asked for it (``timeline_every``): ``(step, free blocks, largest run of
    consecutive free ids, ...)``. ``details`` holds what only one engine generation
    measures (V1: ``prefix_hit_rate_new_requests``; V0: the preemptions by kind, the
    contiguity of each request's own blocks, the buddy's statistics)."""

    allocator: str                  #: "stock" or "proxima"
    completed: int
    steps: int
    peak_running: int
    preemptions: int
    prefix_hit_rate: float          #: the engine's own metric (V1: tokens; V0: blocks)
    blocks_per_run: float
    single_run_fraction: float
    scheduler_ms_per_step: float
    blocks_leaked: int              #: blocks neither free nor evictable after the run
    num_blocks: int
    runs_per_request_histogram: dict[int, int] = field(default_factory=dict)
    largest_free_run_timeline: list = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The JSON layout: every field, ``details`` flattened in."""
        out = asdict(self)
        out.update(out.pop("details"))
        return out


def contiguity(tables: list[list[int]]) -> dict:
    """``blocks_per_run``, ``single_run_fraction``, ``runs_per_request_histogram`` of
    finished requests' block tables (id lists; empty ones are left out)."""
    runs = [count_runs(t) for t in tables if t]
    histogram: dict[int, int] = {}
    for r in runs:
        histogram[r] = histogram.get(r, 0) + 1
    return {
        "blocks_per_run": sum(len(t) for t in tables) / sum(runs) if runs else 0.0,
        "single_run_fraction": runs.count(1) / len(runs) if runs else 0.0,
        "runs_per_request_histogram": dict(sorted(histogram.items())),
    }


def combine(results: list[ReplayResult]) -> dict:
    """One allocator's repeats as the report's dict: the counts must agree (else
    RuntimeError); the scheduler time is the median, every run's time listed beside it.
    The timeline (a plot's input) is left out."""
    first = results[0]
    for other in results[1:]:
        for key in DETERMINISTIC:
            if getattr(other, key) != getattr(first, key):
                raise RuntimeError(f"replay is not deterministic: {key} "
                                   f"{getattr(first, key)} vs {getattr(other, key)}")
    out = first.as_dict()
    times = [r.scheduler_ms_per_step for r in results]
    out["scheduler_ms_per_step"] = statistics.median(times)
    out["scheduler_ms_per_step_runs"] = times
    out.pop("largest_free_run_timeline", None)
    out.pop("reclaim_timeline", None)
    return out
