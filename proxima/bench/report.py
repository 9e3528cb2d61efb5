"""Show a benchmark result three ways: a terminal table, a JSON file, a PNG.

All three read the same dict (``{"mode", "workload", "results": {label: {...}},
"ratios": {...}}``), so the table never shows a number the JSON lacks. Unknown values
print as ``unknown`` (a server that did not expose a counter) or ``n/a`` (a figure that
does not apply, e.g. contiguity of the stock pool); they are ``null`` in the JSON.
"""

from __future__ import annotations

import json
import math
from typing import Sequence

from proxima.bench.stats import flatten
from proxima.errors import UserError
from proxima.ioutil import check_output_path, write_atomic, write_text_atomic

# (title, key in a result, format, text when missing)
ONLINE_ROWS = [
    ("requests/s", "requests_per_s", "{:.2f}", "n/a"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}", "n/a"),
    ("total tokens/s", "total_tokens_per_s", "{:.1f}", "n/a"),
    ("TTFT p50 (ms)", "ttft_ms.p50", "{:.1f}", "n/a"),
    ("TTFT p90 (ms)", "ttft_ms.p90", "{:.1f}", "n/a"),
    ("TTFT p99 (ms)", "ttft_ms.p99", "{:.1f}", "n/a"),
    ("ITL p50 (ms)", "itl_ms.p50", "{:.2f}", "n/a"),
    ("ITL p90 (ms)", "itl_ms.p90", "{:.2f}", "n/a"),
    ("ITL p99 (ms)", "itl_ms.p99", "{:.2f}", "n/a"),
    ("E2E p50 (ms)", "e2e_ms.p50", "{:.1f}", "n/a"),
    ("E2E p90 (ms)", "e2e_ms.p90", "{:.1f}", "n/a"),
    ("E2E p99 (ms)", "e2e_ms.p99", "{:.1f}", "n/a"),
    ("completed", "completed", "{:d}", "n/a"),
    ("errors", "errors", "{:d}", "n/a"),
    ("short outputs", "short_outputs", "{:d}", "n/a"),
    ("output tokens", "output_tokens", "{:d}", "n/a"),
    ("duration (s)", "duration_s", "{:.2f}", "n/a"),
    ("preemptions", "preemptions", "{:d}", "unknown"),
]

OFFLINE_ROWS = [
    ("runs", "runs", "{:d}", "n/a"),
    ("elapsed (s, median)", "elapsed_s", "{:.2f}", "n/a"),
    ("requests/s", "requests_per_s", "{:.2f}", "n/a"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}", "n/a"),
    ("total tokens/s", "total_tokens_per_s", "{:.1f}", "n/a"),
    ("output tok/s min", "output_tokens_per_s_spread.min", "{:.1f}", "n/a"),
    ("output tok/s max", "output_tokens_per_s_spread.max", "{:.1f}", "n/a"),
    ("run-to-run spread (%)", "output_tokens_per_s_spread.spread_pct", "{:.2f}", "n/a"),
    ("preemptions (median)", "preemptions", "{:g}", "unknown"),
    ("KV-cache blocks", "kv_blocks", "{:d}", "unknown"),
    ("blocks per run (mean)", "blocks_per_run", "{:.2f}", "n/a"),
    ("largest free run", "largest_free_run", "{:g}", "n/a"),
    ("short outputs", "short_outputs", "{:d}", "n/a"),
    ("Proxima active", "proxima_active", "yesno", "n/a"),
]

# Online with --repeat K > 1: the rounds and the noise band, before the other rows.
ONLINE_ROUND_ROWS = [
    ("rounds", "rounds", "{:d}", "n/a"),
    ("output tok/s min", "output_tokens_per_s_spread.min", "{:.1f}", "n/a"),
    ("output tok/s max", "output_tokens_per_s_spread.max", "{:.1f}", "n/a"),
    ("run-to-run spread (%)", "output_tokens_per_s_spread.spread_pct", "{:.2f}", "n/a"),
]

# Ratio columns are shown for these keys only: a ratio of error counts means nothing.
RATIO_KEYS = {
    "online": ["requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
               "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99", "itl_ms.p50", "itl_ms.p90",
               "itl_ms.p99", "e2e_ms.p50", "e2e_ms.p90", "e2e_ms.p99"],
    "offline": ["elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "blocks_per_run"],
}


def _fmt(value, fmt: str, missing: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    if fmt == "yesno":
        return "yes" if value else "no"
    if fmt == "{:d}":
        value = int(value)
    return fmt.format(value)


def format_table(report: dict) -> str:
    """The terminal table: one column per label, then one per ratio."""
    rows = ONLINE_ROWS if report["mode"] == "online" else OFFLINE_ROWS
    labels = list(report["results"])
    if report["mode"] == "online" and any("rounds" in report["results"][l] for l in labels):
        rows = ONLINE_ROUND_ROWS + ONLINE_ROWS
    ratio_names = list(report.get("ratios", {}))
    header = [""] + labels + ratio_names
    body = []
    for title, key, fmt, missing in rows:
        line = [title]
        for label in labels:
            line.append(_fmt(flatten(report["results"][label], [key])[key], fmt, missing))
        for name in ratio_names:
            value = report["ratios"][name].get(key)
            line.append(_fmt(value, "{:.3f}", "n/a") if key in report["ratios"][name] else "")
        body.append(line)
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]
    lines = [_describe(report), ""]
    for row in [header] + body:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines += _footer(report)
    return "\n".join(lines)


def _describe(report: dict) -> str:
    w = report["workload"]
    parts = [f"{report['mode']} benchmark, workload {w['name']}: {w['requests']} requests"]
    if report["mode"] == "online":
        pacing = (f"request rate {w['request_rate']:g}/s" if w.get("request_rate") is not None
                  else f"concurrency {w['concurrency']}")
        parts.append(f"{pacing}, endpoint {w['endpoint']}, model {w['model']}")
        if (w.get("repeat") or 1) > 1:
            done = (f"{report['rounds_done']} of {w['repeat']}" if report.get("partial")
                    and report.get("rounds_done") is not None else w["repeat"])
            parts.append(f"{done} rounds (medians; round r uses seed + r - 1)")
    else:
        parts.append(f"model {w['model']}")
        arrivals = (w.get("settings") or {}).get("arrivals")
        if arrivals:
            parts.append("arrivals held (every request in the first step)" if arrivals == "held"
                         else "arrivals as sent")
    parts.append(f"seed {w['seed']}")
    return ", ".join(parts)


def _footer(report: dict) -> list[str]:
    lines = []
    for label, result in report["results"].items():
        for message, count in (result.get("error_samples") or {}).items():
            lines.append(f"{label}: {count} x {message}")
    check = report.get("check_outputs")
    if check:
        lines.append(f"token identity against {check['reference']} "
                     f"({check['requests']} requests):")
        for run, cmp in check["runs"].items():
            extra = (f"; first differing: {', '.join(cmp['first_differing'])}"
                     if cmp["first_differing"] else "")
            lines.append(f"  {run}: {cmp['identical']} identical, {cmp['differing']} differing"
                         f"{extra}")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return [""] + lines if lines else []


def check_writable(path: str | None, flag: str, suffix: str | None = None) -> None:
    """Fail before a long run, not after it, when an output path cannot be written."""
    check_output_path(path, flag, suffix)


def check_plot(path: str | None) -> None:
    """--plot, before a long run: a writable .png, and matplotlib importable (it was found
    missing only once the run was over)."""
    check_output_path(path, "--plot", ".png")
    if path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'proxima[plot]' (or "
                            "leave --plot out)") from None


def write_json(report: dict, path: str) -> None:
    """Strict JSON (no NaN), stable key order: what was measured, with null for unknown.
    Written to a temporary name and renamed: never half a file."""
    write_text_atomic(path, json.dumps(report, indent=2, allow_nan=False) + "\n")


def write_plot(report: dict, path: str) -> None:
    """PNG: throughput per label, then latency percentiles (online) or contiguity
    (offline), side by side. Missing values are drawn as empty bars labelled n/a."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'proxima[plot]'") from None
    labels = list(report["results"])
    results = report["results"]
    if report["mode"] == "online":
        panels = [("output tokens/s", ["output_tokens_per_s"], ["throughput"]),
                  ("TTFT (ms)", [f"ttft_ms.p{q}" for q in (50, 90, 99)], ["p50", "p90", "p99"]),
                  ("inter-token latency (ms)", [f"itl_ms.p{q}" for q in (50, 90, 99)],
                   ["p50", "p90", "p99"]),
                  ("end-to-end latency (ms)", [f"e2e_ms.p{q}" for q in (50, 90, 99)],
                   ["p50", "p90", "p99"])]
    else:
        panels = [("output tokens/s (median, min-max)", ["output_tokens_per_s"], ["throughput"]),
                  ("elapsed (s, median)", ["elapsed_s"], ["elapsed"]),
                  ("blocks per run (mean)", ["blocks_per_run"], ["contiguity"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0))
    width = 0.8 / max(1, len(labels))
    for ax, (title, keys, ticks) in zip(axes, panels):
        for i, label in enumerate(labels):
            values = flatten(results[label], keys)
            xs = [k + (i - (len(labels) - 1) / 2) * width for k in range(len(keys))]
            heights = [values[k] if values[k] is not None else 0.0 for k in keys]
            yerr = _spread_err(results[label], keys)
            ax.bar(xs, heights, width, label=label, yerr=yerr, capsize=3 if yerr else 0)
            for x, key in zip(xs, keys):
                text = _short(values[key])
                ax.annotate(text, (x, values[key] or 0.0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)), ticks)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(_describe(report), fontsize=8)
    fig.tight_layout()
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def _short(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _spread_err(result: dict, keys: Sequence[str]):
    """Min-max error bars for offline throughput (None when not measured)."""
    if keys != ["output_tokens_per_s"]:
        return None
    s = result.get("output_tokens_per_s_spread") or {}
    mid = result.get("output_tokens_per_s")
    if s.get("min") is None or s.get("max") is None or mid is None:
        return None
    return [[mid - s["min"]], [s["max"] - mid]]
