"""PNG for `proxima replay --plot`: runs per finished request, and free space over time."""

from __future__ import annotations


def write_plot(report: dict, runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"stock": "tab:gray", "proxima": "tab:blue"}
    for label, results in runs.items():
        hist = {int(k): v for k, v in results[0]["runs_per_request_histogram"].items()}
        xs = sorted(hist)
        left.bar([x + (0.2 if label == "proxima" else -0.2) for x in xs],
                 [hist[x] for x in xs], width=0.4, label=label, color=colors[label])
        timeline = results[0].get("largest_free_run_timeline") or []   # step, free, largest
        if timeline:
            steps = [t[0] for t in timeline]
            right.plot(steps, [t[2] for t in timeline],
                       label=f"{label}: largest free run", color=colors[label])
            right.plot(steps, [t[1] for t in timeline],
                       label=f"{label}: free blocks", color=colors[label], linestyle=":")
    left.set_xlabel("contiguous runs in a finished request's block table")
    left.set_ylabel("requests")
    left.set_title("Contiguity (1 = one run)")
    left.legend()
    right.set_xlabel("scheduler step")
    right.set_ylabel("blocks")
    right.set_title("Free space (free or evictable blocks)")
    right.legend(fontsize=8)
    fig.suptitle(f"proxima replay: {report['workload']}, {report['requests']} requests, "
                 f"{report['settings']['num_blocks']} blocks, vLLM {report['vllm_version']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
