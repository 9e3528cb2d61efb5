"""A CPU stand-in for elastic_child.py and the GPU taker (``--dry-run`` of the drivers):
same arguments, same files, plausible numbers, a second or two of work. It checks the
drivers' orchestration (budgets, files in $OUT, summaries, killing children) on a machine
without a GPU; it proves nothing about elastic KV memory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

GiB = 1 << 30


def step_log(rate: float, seconds: float) -> list:
    """A step every ~10 ms for ``seconds``, each with ``rate`` x the time since the last
    (a process stopped by the driver steps not, and its first step after makes up for the
    pause: what the driver's settle time must leave out)."""
    log, last = [], time.monotonic()
    end = last + seconds
    while True:
        time.sleep(0.01)
        now = time.monotonic()
        if now >= end:
            return log
        log.append((round(now, 4), rate * (now - last)))
        last = now


def main() -> int:
    argv = sys.argv[1:]
    if argv and argv[0] == "taker":
        progress, out = Path(argv[1]), Path(argv[2])
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                if json.loads(progress.read_text()).get("phase") == "released":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        out.write_text(json.dumps({"free_at_peak": 10 * GiB, "free_after_release": 25 * GiB,
                                   "released": 15 * GiB, "allocated": int(14.25 * GiB),
                                   "seen_release": True}))
        return 0
    job = argv[0]
    opts, rest = {}, argv[1:]
    while rest:                               # "--key value" pairs, and bare flags
        if len(rest) > 1 and not rest[1].startswith("--"):
            opts[rest[0]], rest = rest[1], rest[2:]
        else:
            opts[rest[0]], rest = True, rest[1:]
    out = Path(opts["--out"])
    executor = str(opts.get("--executor", "default"))     # as the real child reports it
    if opts.get("--mode") == "hang":
        time.sleep(3600)
    if job == "identity":
        tokens = [[i, i + 1, i + 2] for i in range(16)]
        heavy = [[i] * 4 for i in range(200)]
        result = {"light": {"tokens": tokens, "cached_tokens": [0] * 16, "preemptions": 0},
                  "pressure": {"tokens": heavy, "cached_tokens": [16] * 200, "preemptions": 9},
                  "elastic": {"forced_cycles": 3, "granules_unmapped": 24, "granules_mapped": 24,
                              "map_failures": 0}, "start_s": 1.0}
    elif job == "burst" or (job == "throughput" and opts.get("--release")):
        progress = Path(opts["--progress"])
        progress.write_text(json.dumps({"phase": "peak", "mapped": 16 * GiB}))
        time.sleep(0.5)
        progress.write_text(json.dumps({"phase": "released", "released": 15 * GiB,
                                        "mapped": GiB}))
        go = Path(opts["--go"])
        end = time.monotonic() + 30
        while not go.exists() and time.monotonic() < end:
            time.sleep(0.1)
        result = {"min_bytes": GiB, "burst1": {"peak_mapped_bytes": 16 * GiB},
                  "released": {"mapped_bytes": GiB, "seconds_after_burst": 13.0},
                  "burst2": {"peak_mapped_bytes": 16 * GiB}, "taker_done": go.exists()}
    else:
        result = {}
    if job == "throughput":
        modes = str(opts.get("--modes", "stock,elastic-auto")).split(",")
        if opts.get("--start-after"):       # side by side: the real child's protocol
            from elastic_child import start_together

            result["waited_s"] = start_together(Path(opts["--start-after"]), timeout=30)
            result["kv_gib"] = float(opts.get("--kv-gib") or 0)
        result["load"] = load = opts.get("--load", "steady")
        if load == "passes":
            speeds = {"stock": (1000.0, 1010.0), "elastic-auto": (990.0, 1005.0),
                      "elastic-off": (995.0, 1000.0), "elastic-fixed": (994.0, 999.0),
                      "elastic-compacted": (992.0, 1001.0),
                      "proxima": (1001.0, 1009.0)}
            result.update({m: {"passes": [{"output_tokens_per_s": v} for v in speeds[m]]}
                           for m in modes})
        else:           # window 0 (warm-up), then --windows windows, as closed_loop reports
            warm, span, k = (float(opts["--warmup-s"]), float(opts["--window-s"]),
                             int(opts["--windows"]))
            speeds = {"stock": [9000.0] + [10000.0 + 100 * i for i in range(k)],
                      "elastic-auto": [8500.0] + [9950.0 + 100 * i for i in range(k)],
                      "elastic-off": [8900.0] + [9900.0 + 100 * i for i in range(k)],
                      "elastic-fixed": [8900.0] + [9850.0 + 100 * i for i in range(k)],
                      "elastic-compacted": [8800.0] + [9800.0 + 100 * i for i in range(k)],
                      "proxima": [9000.0] + [10010.0 + 100 * i for i in range(k)]}
            for m in modes:
                edges = [0.0, warm] + [warm + span * (i + 1) for i in range(k)]
                windows = [{"window": i, "kind": "measure" if i else "warmup",
                            "start_s": edges[i], "end_s": edges[i + 1],
                            "output_tokens_per_s": v,
                            "output_tokens": int(v * (edges[i + 1] - edges[i]))}
                           for i, v in enumerate(speeds[m])]
                run = {"windows": windows, "concurrency": int(opts["--concurrency"]),
                       "completed": 1500 if m == "stock" else 1480, "submitted": 1756,
                       "preemptions": 0, "drain": {"aborted": 200, "seconds": 5.0}}
                events = []
                if opts.get("--step-log"):          # --d-interleave: the real step log
                    run["step_log"] = step_log(speeds[m][1], warm + span * k)
                    if m != "stock":                # a grow at its 60th step, as the
                        events = [[run["step_log"][59][0], "grow", 4]]    # policy logs one
                if int(opts.get("--turns") or 0):   # the real child's turn protocol
                    from elastic_child import wait_for

                    turns, where = [], Path(opts["--turn-dir"])
                    for t in range(int(opts["--turns"])):
                        wait_for(where / f"turn-{t}-{m}", 30)
                        time.sleep(0.3)
                        turns.append({"turn": t, "steady": run})
                        (where / f"done-{t}-{m}").write_text("done")
                    result[m] = {"turns": turns}
                else:
                    result[m] = {"steady": run}
                if events:
                    result[m]["elastic"] = {"grows": 1, "events": events}
    result["executor"] = executor
    time.sleep(0.2)
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
