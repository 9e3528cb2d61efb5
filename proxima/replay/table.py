"""The replay's report as a person reads it: the parity checks on stock's and Proxima's
figures, and the side-by-side table with its summary lines."""

from __future__ import annotations

from proxima.replay.result import FIELDS, LATENCY_FIELDS, OPTIONAL_FIELDS


#: request latency (p50 or p99 of queue wait or TTFT) above this times stock's fails parity
LATENCY_PARITY = 1.02


def parity_checks(results: dict) -> dict:
    """The parity and contiguity targets of the V1 issue, evaluated on these figures;
    with the V1 driver's latency figures, issue 33's: each of them at most
    :data:`LATENCY_PARITY` times stock's (stock's 0 allows only 0)."""
    s, p = results["stock"], results["proxima"]
    checks = {
        "completed_equal": p["completed"] == s["completed"],
        "preemptions_not_above_stock": p["preemptions"] <= s["preemptions"],
        "prefix_hit_rate_within_0.005": p["prefix_hit_rate"] >= s["prefix_hit_rate"] - 0.005,
        "scheduler_time_ratio": (p["scheduler_ms_per_step"] / s["scheduler_ms_per_step"]
                                 if s["scheduler_ms_per_step"] else None),
        "no_blocks_leaked": p["blocks_leaked"] == 0 and s["blocks_leaked"] == 0,
    }
    for key in LATENCY_FIELDS:
        if s.get(key) is not None and p.get(key) is not None:
            name = key.removesuffix("_steps")
            checks[f"{name}_within_{LATENCY_PARITY}x"] = p[key] <= LATENCY_PARITY * s[key]
    return checks


def format_table(report: dict) -> str:
    s, p = report["results"]["stock"], report["results"]["proxima"]
    lines = [f"{'':28} {'stock':>12} {'proxima':>12} {'proxima/stock':>14}"]
    shown = list(FIELDS) + [k for k in OPTIONAL_FIELDS if k in s and k in p
                            and (k != "mapped_granule_fraction" or s[k] != p[k])]
    idle = p.get("idle_steps") or 0     # elastic: steps waiting to release memory
    for key in shown:
        a, b = s[key], p[key]
        ratio = f"{b / a:.3f}" if isinstance(a, (int, float)) and a else "-"
        fmt = (lambda v: f"{v:.4f}") if isinstance(a, float) else str
        mark = ""
        if key == "steps" and idle:         # not a slowdown: the busy steps are compared
            mark, ratio = "*", f"{(b - idle) / a:.3f}*" if a else "-"
        lines.append(f"{key:28} {fmt(a):>12} {fmt(b) + mark:>12} {ratio:>14}")
    if idle:
        lines.append(f"* incl. {idle} idle steps waiting to release memory (no request left; "
                     f"--release-delay): {p['steps'] - idle} steps with requests, stock "
                     f"{s['steps']}")
    if "packed_ideal_fraction" in p and p["packed_ideal_fraction"]:
        lines.append(f"reclaimable / packed ideal: stock "
                     f"{s['reclaimable_granule_fraction'] / s['packed_ideal_fraction']:.3f}, "
                     f"proxima {p['reclaimable_granule_fraction'] / p['packed_ideal_fraction']:.3f}"
                     f" (granules of {p.get('granule_blocks')} blocks)")
    elastic = p.get("elastic")
    if isinstance(elastic, dict) and elastic.get("mapped_bytes") is not None:
        from proxima.memory.policy_options import format_bytes

        mean = p.get("mean_mapped_bytes")
        lines.append(f"elastic ({elastic.get('policy')}): mean mapped "
                     f"{format_bytes(int(mean)) if mean else '-'} of "
                     f"{format_bytes(elastic.get('pool_bytes', 0))}; {elastic.get('grows', 0)} "
                     f"grows, {elastic.get('shrinks', 0)} shrinks, "
                     f"{elastic.get('failed_grow_attempts', 0)} failed "
                     f"({elastic.get('failed_grows_per_minute', 0):.1f} a minute, "
                     f"{elastic.get('failed_grows', 0)} granules), "
                     f"{format_bytes(elastic.get('bytes_returned', 0))} returned, "
                     f"{elastic.get('evicted_cached', 0)} cached blocks evicted by releases; "
                     f"worker map {elastic.get('worker_map_seconds', 0):.2f} s, unmap "
                     f"{elastic.get('worker_unmap_seconds', 0):.2f} s")
    c = p.get("compaction")
    if c:
        lines.append(f"compaction ({c['mode']}): {c['relocations']} block copies, "
                     f"{c['bytes_moved'] / 2**30:.1f} GiB of Llama-3.1-8B KV over "
                     f"{c['steps_with_moves']} of {c['steps']} steps; per moving step "
                     f"{c['blocks_per_moving_step']['p50']} blocks p50, "
                     f"{c['blocks_per_moving_step']['p99']} p99; planning "
                     f"{c['plan_ms']['p50'] or 0:.2f} ms p50")
    checks = report["checks"]
    ok = all(v for k, v in checks.items() if k != "scheduler_time_ratio")
    lines.append(f"parity checks: {'all passed' if ok else 'FAILED'} "
                 f"({', '.join(k for k, v in checks.items() if v is False) or 'none failed'}); "
                 f"scheduler time ratio {checks['scheduler_time_ratio']:.3f}")
    return "\n".join(lines)
