"""PNG for `proxima replay --engines 2 --plot`: two engines on one simulated GPU, elastic
against the static split, in the style of :mod:`proxima.replay.plot` (a caption under
each panel says what it shows).

Left: each engine's mapped KV memory over the shared clock -- the elastic engines' lines,
the static split's fixed half, the GPU's room. Middle: requests finished over the clock,
both sides (where a line reaches the total is the time to finish). Right: request
latency, queue wait and time to first token (p50, p99) over both engines' requests.
"""

from __future__ import annotations

from proxima.ioutil import write_atomic
from proxima.replay.plot import COLORS, _caption

GiB = 1 << 30
SIDE_COLORS = {"static": COLORS["stock"], "elastic": COLORS["proxima"]}
ENGINE_COLORS = {"A": "tab:blue", "B": "tab:orange"}


def _memory(ax, report: dict) -> None:
    settings = report["settings"]
    gpu = settings["gpu_kv_bytes"] / GiB
    static = report["results"]["static"]
    elastic = report["results"]["elastic"]
    rows = elastic["memory_timeline"]
    end = max(elastic["steps"], static["steps"], 1)
    steps = [r[0] for r in rows] + [end]
    for i, name in enumerate(elastic["engines"], 1):
        ax.step(steps, [r[i] / GiB for r in rows] + [rows[-1][i] / GiB], where="post",
                color=ENGINE_COLORS.get(name), linewidth=1.4,
                label=f"elastic {name}: mean "
                      f"{elastic['engines'][name]['mean_mapped_bytes'] / GiB:.1f} GiB")
    ax.step(steps, [sum(r[1:]) / GiB for r in rows] + [sum(rows[-1][1:]) / GiB],
            where="post", color="0.35", linewidth=0.8, linestyle=(0, (1, 1.5)),
            label="elastic A + B")
    half = static["memory_timeline"][0][1] / GiB
    ax.axhline(half, color=SIDE_COLORS["static"], linewidth=3.2, alpha=0.55,
               label=f"static split: {half:.1f} GiB each")
    ax.axhline(gpu, color="tab:red", linestyle="--", linewidth=1,
               label=f"the GPU's KV room: {gpu:.1f} GiB")
    ax.set_ylim(0, gpu * 1.38)          # room for the legend above the GPU line
    ax.set_xlabel(f"step of the shared clock ({settings['step_seconds'] * 1000:g} ms)")
    ax.set_ylabel("mapped KV memory (GiB)")
    ax.set_title("KV memory per engine")
    ax.legend(fontsize=7.5, loc="upper left", ncol=2)
    _caption(ax, "Each elastic engine maps what its load wants, within the GPU's room: the "
                 "busy one grows into what the idle one gave back (through the GPU's "
                 "ledger), and an idle one goes back towards its minimum. The static split "
                 "holds half the GPU per engine whatever the load.")


def _finished(ax, report: dict, completions: dict) -> None:
    total = report["requests"]
    for side, ticks in completions.items():
        if not ticks:
            continue
        finish = report["results"][side]["total"]["finish_steps"]
        ax.step([0] + list(ticks), range(len(ticks) + 1), where="post",
                color=SIDE_COLORS.get(side), linewidth=3.2 if side == "static" else 1.4,
                alpha=0.55 if side == "static" else 1.0,
                label=f"{side}: last at step {finish:,}")
    ax.axhline(total, color="0.6", linewidth=0.8, linestyle=":")
    ax.set_ylim(0, total * 1.08)
    ax.set_xlabel("step of the shared clock")
    ax.set_ylabel("requests finished (both engines)")
    ax.set_title("Requests finished over time")
    ax.legend(fontsize=8, loc="lower right")
    _caption(ax, "Both sides replay the same requests on the same clock (one step per "
                 "engine per tick; memory, not compute, is what differs). A line to the left "
                 "finished its requests sooner.")


def _latency(ax, report: dict) -> None:
    keys = (("queue_wait_p50_steps", "queue wait\np50"), ("queue_wait_p99_steps",
                                                         "queue wait\np99"),
            ("ttft_p50_steps", "TTFT\np50"), ("ttft_p99_steps", "TTFT\np99"))
    width = 0.38
    top = 0.0
    for j, side in enumerate(("static", "elastic")):
        total = report["results"][side]["total"]
        values = [total[k] or 0 for k, _ in keys]
        top = max(top, *values)
        xs = [i + (j - 0.5) * width for i in range(len(keys))]
        ax.bar(xs, values, width, color=SIDE_COLORS[side], label=side)
        for x, v in zip(xs, values):
            ax.annotate(f"{v:,}", (x, v), ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    ax.set_ylim(0, max(1.0, top) * 1.18)
    ax.set_ylabel("steps")
    ax.set_title("Request latency (both engines' requests)")
    ax.legend(fontsize=8, loc="upper left")
    failed = [k for k, v in report["checks"].items() if not v]
    verdict = "passed" if not failed else "FAILED: " + ", ".join(failed)
    _caption(ax, "Queue wait: from a request's arrival to the first step that schedules it; "
                 "TTFT: to the end of the step that samples its first token (map time "
                 f"included). Comparison: {verdict}.")


def write_plot(report: dict, completions: dict[str, list[int]], path: str) -> None:
    """Write the PNG to ``path`` (a temporary name first, renamed when complete).
    ``completions``: {side: the sorted steps at which its requests finished}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(19, 5.8))
    _memory(left, report)
    _finished(middle, report, completions)
    _latency(right, report)
    settings = report["settings"]
    fig.suptitle(f"proxima replay --engines 2: {report['workload']}, {report['requests']} "
                 f"requests, one GPU of {settings['gpu_kv_bytes'] / GiB:.1f} GiB KV "
                 f"({settings['gpu_blocks']:,} blocks of {settings['block_size']} tokens), "
                 f"vLLM {report['vllm_version']} (schedulers on CPU)", fontsize=11)
    fig.subplots_adjust(left=0.05, right=0.98, top=0.9, bottom=0.27, wspace=0.22)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
