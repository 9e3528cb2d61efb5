"""Scheduler time per steady step in the CPU replay of issue 13's proof (d).

    ./dev python -m tests.bench.steady_scheduler stock|proxima|elastic [REQUESTS] [BLOCKS] [--status]

Replays ShareGPT-like requests (default 1,500) in a closed loop of 256 through vLLM's real
(async) scheduler over BLOCKS blocks (default 20,480: the 40 GiB of Llama-3.1-8B KV each
engine of ``elastic_proof.py --d-turns`` has), stock vLLM, Proxima, or Proxima elastic
with the default policy, and prints the time ``Scheduler.schedule`` and
``update_from_output`` take per step, counting only steps with at least 250 requests
running as the step (or the update) starts (the replay's ramp and drain, and elastic's
idle steps while it waits to release memory, are left out). A measurement script, not a test: compare runs made one after the
other on the same machine (docs/benchmarks.md section 7.3).

A second line gives the same steps by phase, as the H200 proof's ``--d-phases`` names them
(``tools/gpu/engineprof.py``): ``allocate_slots`` (per scheduled request), within it
``get_new_blocks`` and the rest (``allocate_other``), ``free_blocks``, and Proxima's
``connector_meta`` (the elastic connector's step), in ms per steady step.

``--status`` (proxima and elastic) sets ``PROXIMA_STATS_FILE`` as the engines of ``proxima
serve`` and the H200 proof have it, and adds a third line: the scheduler thread's time in
the status path over the whole replay (every ``StatusWriter.publish`` call, most of which
only read the clock), and per snapshot what it spent building the payload and handing it
to the file (``write_status``; the file itself is written by a background thread).
"""

from __future__ import annotations

import sys
from time import perf_counter


def main(argv: list[str]) -> int:
    status = "--status" in argv
    argv = [a for a in argv if a != "--status"]
    if not argv or argv[0] not in ("stock", "proxima", "elastic") or len(argv) > 3 or (
            status and argv[0] == "stock"):
        print("usage: python -m tests.bench.steady_scheduler stock|proxima|elastic "
              "[REQUESTS] [BLOCKS] [--status] (--status: proxima or elastic)",
              file=sys.stderr)
        return 2
    which = argv[0]
    requests = int(argv[1]) if len(argv) > 1 else 1500
    blocks = int(argv[2]) if len(argv) > 2 else 20480
    import vllm.v1.core.sched.scheduler as sched

    from tests.bench.elastic_trace import replay_d

    acc = {"schedule": 0.0, "update": 0.0, "steps": 0}
    schedule, update = sched.Scheduler.schedule, sched.Scheduler.update_from_output

    def timed_schedule(self):
        # one choice per step, as it starts, for schedule() and the phases inside it
        steady = acc["steady"] = len(self.running) >= 250
        t0 = perf_counter()
        out = schedule(self)
        if steady:
            acc["schedule"] += perf_counter() - t0
            acc["steps"] += 1
        return out

    def timed_update(self, *args):
        steady = acc["steady"] = len(self.running) >= 250
        t0 = perf_counter()
        out = update(self, *args)
        if steady:
            acc["update"] += perf_counter() - t0
        return out

    inner = _inner_phases(acc, lambda: acc.get("steady", False))
    if status:
        inner += _status_timers(acc)
    sched.Scheduler.schedule, sched.Scheduler.update_from_output = timed_schedule, timed_update
    try:
        replay_d(which, requests, blocks)
    finally:
        sched.Scheduler.schedule, sched.Scheduler.update_from_output = schedule, update
        for owner, name, original in inner:
            setattr(owner, name, original)
    k = acc["steps"]
    if not k:
        print(f"{which}: no step had 250 requests running", file=sys.stderr)
        return 1
    print(f"{which:8s} steady steps {k} schedule {1e3 * acc['schedule'] / k:.3f} "
          f"update {1e3 * acc['update'] / k:.3f} "
          f"total {1e3 * (acc['schedule'] + acc['update']) / k:.3f} ms/step")
    per = {name: 1e3 * acc.get(name, 0.0) / k for name in INNER}
    per["allocate_other"] = per["allocate_slots"] - per["get_new_blocks"]
    print(f"{which:8s} by phase, ms/step: " + " ".join(
        f"{name} {value:.3f}" for name, value in per.items()))
    if status:
        publish, writes = acc["status_publish"], acc["status_write"]
        if not writes:
            print(f"{which}: no status snapshot was written", file=sys.stderr)
            return 1
        print(f"{which:8s} status: {len(publish)} publish calls {1e3 * sum(publish):.1f} ms "
              f"in all; {len(writes)} snapshots, write_status {1e6 * sum(writes) / len(writes):.0f}"
              f" us each (median {1e6 * sorted(writes)[len(writes) // 2]:.0f})")
    return 0


def _status_timers(acc: dict) -> list:
    """A status file in a temporary directory, and timers on its two calls: every
    ``StatusWriter.publish`` and every snapshot's ``write_status`` (all steps, not only the
    steady ones: a snapshot is due once a second whatever the step)."""
    import os
    import tempfile

    from proxima.vllm import status

    os.environ["PROXIMA_STATS_FILE"] = os.path.join(tempfile.mkdtemp(), "status.json")
    saved = [(status.StatusWriter, "publish", status.StatusWriter.__dict__["publish"]),
             (status, "write_status", status.write_status)]
    for (owner, name, original), key in zip(saved, ("status_publish", "status_write")):
        acc[key] = []
        setattr(owner, name, _timed(original, acc[key].append))
    return saved


def _timed(original, record):
    """``original`` wrapped: ``record(seconds)`` after each call."""
    def timed(*args, **kwargs):
        t0 = perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record(perf_counter() - t0)

    return timed


# phases inside schedule() / update_from_output(): these rows of engineprof.py's PHASES
INNER = ("allocate_slots", "get_new_blocks", "free_blocks", "connector_meta")


def _inner_phases(acc: dict, steady) -> list:
    """Time INNER's methods into ``acc`` while ``steady()``; returns what to restore."""
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))
    import engineprof

    saved = []
    for name, module, cls, method in engineprof.PHASES:
        if name not in INNER:
            continue
        owner = getattr(importlib.import_module(module), cls)
        original = owner.__dict__[method]

        def record(seconds, _name=name):
            if steady():
                acc[_name] = acc.get(_name, 0.0) + seconds

        setattr(owner, method, _timed(original, record))
        saved.append((owner, method, original))
    return saved


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
