"""The arithmetic of a benchmark report: percentiles, medians, spreads and ratios.

Pure functions over plain numbers, so every figure in a report can be recomputed from
the raw samples kept in the JSON. ``None`` means "not measured" and propagates: a
ratio with an unknown side is unknown, never 0 or 1.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default), or None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(seconds: Sequence[float]) -> dict:
    """Mean and p50/p90/p99 in milliseconds, plus the sample count (``n``).

    Every key is present; values are None when there are no samples, so the layout of
    a report does not depend on whether requests succeeded."""
    ms = [s * 1000.0 for s in seconds]
    out = {"n": len(ms), "mean": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q)
    return out


def median(values: Iterable[float | None]) -> float | None:
    """Median of the known values (None entries are skipped); None when none is known."""
    known = [v for v in values if v is not None]
    return percentile(known, 50)


def spread(values: Iterable[float | None]) -> dict:
    """Median, min, max and the relative spread ``(max - min) / median`` in percent.

    With fewer than two known values the spread is None: one run says nothing about
    noise."""
    known = [v for v in values if v is not None]
    mid = median(known)
    out = {"median": mid, "min": min(known) if known else None,
           "max": max(known) if known else None, "spread_pct": None}
    if len(known) >= 2 and mid:
        out["spread_pct"] = (out["max"] - out["min"]) / mid * 100.0
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is unknown or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def flatten(result: dict, keys: Sequence[str]) -> dict:
    """Pick ``keys`` from a result; a key ``"ttft_ms.p50"`` reads a nested summary."""
    out = {}
    for key in keys:          # bools pass (a yes/no row); ratios never ask for them
        value = result
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = value if isinstance(value, (int, float)) else None
    return out


def ratios(results: dict[str, dict], keys: Sequence[str]) -> dict[str, dict]:
    """Each result after the first divided by the first, key by key: ``{"B/A": {...}}``.

    The first label is the baseline (stock), so a throughput ratio above 1 and a
    latency ratio below 1 both favour the later one."""
    labels = list(results)
    if len(labels) < 2:
        return {}
    base = flatten(results[labels[0]], keys)
    out = {}
    for label in labels[1:]:
        other = flatten(results[label], keys)
        out[f"{label}/{labels[0]}"] = {k: ratio(other[k], base[k]) for k in keys}
    return out
