"""PNG for `proxima replay --plot`: how contiguous finished requests were, how the free
space of the pool looked over the run, and (V1) how much of the KV memory was mapped, used
and reclaimable. Each panel carries a caption saying what it shows,
so the picture can be read without the docs.

Left: the runs (ranges of consecutive block ids) of each finished request, binned by powers
of two (1, 2, 3-4, 5-8, ...) as a share of the finished requests, so that a workload with
a hundred distinct counts stays a few readable bar pairs. Right: the largest free run and
the free blocks over the scheduler steps, with the largest single request as a reference
line; a run too short to have samples says so in the panel instead of leaving it empty.
"""

from __future__ import annotations

import statistics
import textwrap

from proxima.ioutil import write_atomic

COLORS = {"stock": "tab:gray", "proxima": "tab:blue"}
CAPTION_WIDTH = 78


def runs_histogram(result: dict) -> dict[int, int]:
    """{runs in a finished request's block table: requests} of one replay result."""
    hist = result.get("runs_per_request_histogram") or result.get("runs_per_request") or {}
    return {int(k): int(v) for k, v in hist.items()}


def timeline(result: dict) -> list[tuple[int, int, int]]:
    """[(step, free blocks, largest free run)] of one replay result (V1 or V0 layout)."""
    rows = result.get("largest_free_run_timeline") or result.get("free_runs_over_time") or []
    return [(int(r[0]), int(r[1]), int(r[2])) for r in rows]


def bins(largest: int) -> list[tuple[int, int]]:
    """Power-of-two bins covering 1..largest: (1, 1), (2, 2), (3, 4), (5, 8), ..."""
    out, lo = [(1, 1)], 2
    while lo <= max(largest, 1):
        hi = (lo - 1) * 2
        out.append((lo, hi))
        lo = hi + 1
    return out


def binned(hist: dict[int, int], edges: list[tuple[int, int]]) -> list[float]:
    """Share (0..1) of the requests of ``hist`` in each bin."""
    total = sum(hist.values())
    return [sum(n for runs, n in hist.items() if lo <= runs <= hi) / total if total else 0.0
            for lo, hi in edges]


def _caption(ax, text: str) -> None:
    ax.text(0.0, -0.2, textwrap.fill(text, CAPTION_WIDTH), transform=ax.transAxes,
            va="top", ha="left", fontsize=8.5, color="0.2")


def _left(ax, report: dict, runs: dict[str, list[dict]]) -> None:
    hists = {label: runs_histogram(rs[0]) for label, rs in runs.items() if rs}
    largest = max((k for h in hists.values() for k in h), default=1)
    edges = bins(largest)
    width = 0.8 / max(1, len(hists))
    for i, (label, hist) in enumerate(hists.items()):
        shares = binned(hist, edges)
        xs = [k + (i - (len(hists) - 1) / 2) * width for k in range(len(edges))]
        res = report["results"][label]
        ax.bar(xs, [100 * s for s in shares], width, color=COLORS.get(label),
               label=f"{label}: {res['single_run_fraction']:.0%} in one run, "
                     f"{res['blocks_per_run']:.2f} blocks per run")
        for x, share in zip(xs, shares):
            if share > 0:
                ax.annotate(f"{100 * share:.0f}%" if share >= 0.01 else "<1%", (x, 100 * share),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(edges)),
                  [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in edges])
    ax.set_xlabel("contiguous runs in a finished request's block table")
    ax.set_ylabel("share of finished requests (%)")
    ax.set_ylim(0, 132)                 # room for the legend above the 100% bars
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("Contiguity of each finished request")
    if hists:
        ax.legend(fontsize=8, loc="upper left")
    _caption(ax, "A run is a range of consecutive KV block ids. 1 run: the request's whole KV "
                 "is one contiguous range (cheapest to copy, offload or transfer). Bars: the "
                 "share of finished requests per bin (1, 2, 3-4, 5-8, ...); legend: "
                 "single-run fraction and blocks per run (higher = more contiguous).")


def _right(ax, report: dict, runs: dict[str, list[dict]], largest_request_blocks) -> None:
    lines = {label: timeline(rs[0]) for label, rs in runs.items() if rs}
    drawn = False
    # stock drawn wide and pale, proxima narrow on top: where they coincide both show
    style = {"stock": dict(linewidth=3.2, alpha=0.55), "proxima": dict(linewidth=1.3)}
    for label, points in lines.items():
        if not points:
            continue
        steps = [p[0] for p in points]
        extra = dict(marker="o", markersize=3) if len(points) < 12 else {}
        look = style.get(label, dict(linewidth=1.3))
        ax.plot(steps, [p[2] for p in points], color=COLORS.get(label),
                label=f"{label}: largest free run", **look, **extra)
        ax.plot(steps, [p[1] for p in points], color=COLORS.get(label), linestyle=(0, (1, 1.5)),
                label=f"{label}: free blocks", **look, **extra)
        drawn = True
    if largest_request_blocks and drawn:
        ax.axhline(largest_request_blocks, color="tab:red", linestyle="--", linewidth=1,
                   label=f"largest request: {largest_request_blocks:,} blocks")
    pool = (report.get("settings") or {}).get("num_blocks") or 0
    log = bool(drawn and largest_request_blocks and pool > 50 * largest_request_blocks)
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("blocks (log scale)" if log else "blocks")
    ax.set_title("Free space in the pool during the run")
    if drawn:
        if log:             # the pool and the largest request differ by orders of magnitude
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylim(largest_request_blocks / 4, pool * 3)
        else:
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=7.5, loc="lower left" if log else "best")
    else:
        steps = max((rs[0].get("steps", 0) for rs in runs.values() if rs), default=0)
        ax.text(0.5, 0.5, f"no free-space samples\n(the run took {steps} scheduler steps)",
                transform=ax.transAxes, ha="center", va="center", color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
    medians = {label: statistics.median(p[2] for p in pts) for label, pts in lines.items() if pts}
    free_kind = "free" if str(report.get("vllm_version", "")).startswith("0.6.") else \
        "free (or evictable)"                # the V1 driver counts cached blocks too
    text = f"Solid: the largest run of consecutive {free_kind} blocks; dotted: all of them. "
    if "stock" in medians and "proxima" in medians and medians["proxima"] < 0.5 * medians["stock"]:
        text += ("Proxima's largest free run is lower by design, not lost memory: while the "
                 "pool has room to spare it places new requests apart, so that each can grow "
                 "in place; when the pool fills it packs them. ")
    free = [p[1] for pts in lines.values() for p in pts]
    if free and pool and statistics.median(free) < 0.1 * pool:
        text += ("The pool is nearly full for most of the run: an allocation takes nearly all "
                 "that is free (with prefix caching, exactly the cached blocks stock would "
                 "evict), leaving little choice of ids, so runs stay short for both. ")
    if largest_request_blocks and drawn:
        text += ("Above the dashed line (this workload's largest request) any request fits "
                 "in one run.")
    _caption(ax, text)


def reclaim_timeline(result: dict) -> list[tuple[int, int, int, int, int]]:
    """[(step, mapped, used, reclaimable granules, live blocks)] of a V1 replay result."""
    return [tuple(int(x) for x in r) for r in result.get("reclaim_timeline") or []]


def _memory(ax, report: dict, runs: dict[str, list[dict]]) -> None:
    """Mapped / used / reclaimable granules over the run, as fractions of the pool."""
    drawn = False
    for label, rs in runs.items():
        if not rs:
            continue
        rows = reclaim_timeline(rs[0])
        ng = rs[0].get("num_granules") or 0
        if not rows or not ng:
            continue
        steps = [r[0] for r in rows]
        color = COLORS.get(label)
        width = 3.2 if label == "stock" else 1.3
        alpha = 0.55 if label == "stock" else 1.0
        if any(r[1] != ng for r in rows):
            ax.plot(steps, [r[1] / ng for r in rows], color=color, linewidth=width,
                    alpha=alpha, label=f"{label}: mapped")
        ax.plot(steps, [r[2] / ng for r in rows], color=color, linestyle=(0, (4, 2)),
                linewidth=width, alpha=alpha, label=f"{label}: used (holds a live block)")
        ax.plot(steps, [r[3] / ng for r in rows], color=color, linestyle=(0, (1, 1.5)),
                linewidth=width, alpha=alpha, label=f"{label}: reclaimable")
        G = rs[0].get("granule_blocks") or 1
        ax.plot(steps, [1 - -(-(r[4] + 1) // G) / ng for r in rows], color="tab:green",
                linewidth=0.8, alpha=0.7 if label == "stock" else 0.0,
                label="packed ideal (reclaimable)" if label == "stock" else None)
        drawn = True
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("share of the pool's granules")
    ax.set_ylim(0, 1.05)
    ax.set_title("KV memory: mapped, used, reclaimable")
    if drawn:
        ax.legend(fontsize=7, loc="best")
    res = report.get("results", {})
    text = ("Granules of G block ids (the unit memory is mapped and given back in). Used: "
            "holds a live block; reclaimable: holds none (its cached blocks would be "
            "evicted); packed ideal: the live blocks packed into the fewest granules. ")
    if "stock" in res and "proxima" in res and "reclaimable_granule_fraction" in res["stock"]:
        s, p = res["stock"], res["proxima"]
        text += (f"Means: reclaimable {s['reclaimable_granule_fraction']:.1%} stock, "
                 f"{p['reclaimable_granule_fraction']:.1%} Proxima, ideal "
                 f"{s['packed_ideal_fraction']:.1%}.")
    _caption(ax, text)


def write_plot(report: dict, runs: dict[str, list[dict]], path: str,
               largest_request_blocks: int | None = None) -> None:
    """Write the PNG to ``path`` (a temporary name first, renamed when complete).

    ``runs``: {allocator: [replay results]}; the first result of each is drawn (the counts
    and the free-space timeline are the same on every repeat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = any(reclaim_timeline(rs[0]) for rs in runs.values() if rs)
    if memory:
        fig, (left, right, third) = plt.subplots(1, 3, figsize=(19, 5.8))
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.8))
    _left(left, report, runs)
    _right(right, report, runs, largest_request_blocks)
    if memory:
        _memory(third, report, runs)
    settings = report.get("settings", {})
    title = (f"proxima replay: {report['workload']}, {report['requests']} requests, "
             f"{settings.get('num_blocks')} blocks of {settings.get('block_size')} tokens, "
             f"vLLM {report['vllm_version']} (scheduler on CPU)")
    if report.get("partial"):
        title += f" — interrupted: {report.get('repeats_done')} of {report['repeat']} repeats"
    fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(left=0.05 if memory else 0.06, right=0.98, top=0.9, bottom=0.27,
                        wspace=0.22)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
