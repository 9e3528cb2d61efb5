"""The eviction Pareto of elastic KV placement: reclaimable memory against prefix-hit rate.

    ./dev python -m proxima.replay.pareto [--out DIR] [--quick]

For each workload at its proof size (sharegpt on 8,000 blocks: no reuse but preemption's
recomputation; multiturn on 4,000: conversations, ~70 % hits; bursts on 8,000: shared
system prompts, load that comes and goes), replays stock once and Proxima's elastic
placement (``--elastic --elastic-policy fixed``: the whole pool mapped, so only the
placement and the eviction choice differ) once per eviction policy, from strict LRU
through fixed reuse horizons to evicting anything old (``age:0``), and the default
(``auto``). Writes ``pareto.json``, ``pareto.md`` (the table) and ``pareto.png`` (one
panel per workload: reclaimable fraction against hit rate, stock marked, the 0.5-point
band shaded) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CASES = (("sharegpt", 8000), ("multiturn", 4000), ("bursts", 8000))
POLICIES = ("lru", "age:800", "age:400", "age:200", "age:100", "age:50", "age:20", "age:5",
            "age:0", "window:64", "window:1024", "auto:0.999", "auto:0.95", "auto")
QUICK = ("lru", "age:100", "age:0", "auto")


def run(cases=CASES, policies=POLICIES, progress=print) -> list[dict]:
    from proxima.replay import driver_v1
    from proxima.replay.elastic import ElasticReplay
    from proxima.workloads import make_workload

    rows = []
    for name, blocks in cases:
        workload = make_workload(name)
        for policy in ("stock", *policies):
            t0 = time.time()
            if policy == "stock":
                r = driver_v1.run_replay(workload, proxima=False, num_blocks=blocks)
            else:
                r = driver_v1.run_replay(workload, proxima=True, num_blocks=blocks,
                                         elastic=ElasticReplay(policy="fixed", eviction=policy))
            d = r.details
            row = {"workload": name, "num_blocks": blocks, "eviction": policy,
                   "completed": r.completed, "preemptions": r.preemptions, "steps": r.steps,
                   "prefix_hit_rate": r.prefix_hit_rate,
                   "reclaimable_granule_fraction": d["reclaimable_granule_fraction"],
                   "packed_ideal_fraction": d["packed_ideal_fraction"],
                   "blocks_per_run": r.blocks_per_run,
                   "scheduler_ms_per_step": r.scheduler_ms_per_step}
            pool = (d.get("elastic") or {}).get("pool") or {}
            row["early_evictions"] = pool.get("early_evictions", 0)
            row["horizon_steps"] = pool.get("horizon_steps")
            rows.append(row)
            progress(f"{name:9} {blocks:5} {policy:11} hit {r.prefix_hit_rate:.4f} reclaimable "
                     f"{row['reclaimable_granule_fraction']:.3f} (ideal "
                     f"{row['packed_ideal_fraction']:.3f}) pre {r.preemptions} "
                     f"[{time.time() - t0:.0f}s]")
    return rows


def table(rows: list[dict]) -> str:
    stock = {r["workload"]: r for r in rows if r["eviction"] == "stock"}
    out = ["| workload | eviction | prefix-hit rate (vs stock, points) | reclaimable | "
           "x stock | / packed ideal | preemptions | blocks per run |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = stock[r["workload"]]
        dh = 100 * (r["prefix_hit_rate"] - s["prefix_hit_rate"])
        ok = "" if r["eviction"] == "stock" else (" ok" if dh >= -0.5 else " **over**")
        ideal = r["packed_ideal_fraction"]
        out.append(f"| {r['workload']} ({r['num_blocks']:,}) | {r['eviction']} | "
                   f"{r['prefix_hit_rate']:.4f} ({dh:+.2f}{ok}) | "
                   f"{r['reclaimable_granule_fraction']:.3f} | "
                   f"{r['reclaimable_granule_fraction'] / s['reclaimable_granule_fraction']:.2f} | "
                   f"{r['reclaimable_granule_fraction'] / ideal if ideal else 0:.3f} | "
                   f"{r['preemptions']} | {r['blocks_per_run']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 5))
    for ax, name in zip(axes if len(names) > 1 else [axes], names):
        mine = [r for r in rows if r["workload"] == name]
        s = next(r for r in mine if r["eviction"] == "stock")
        ax.axvspan(100 * s["prefix_hit_rate"] - 0.5, 100 * s["prefix_hit_rate"] + 0.5,
                   color="0.9", label="within 0.5 points of stock")
        ax.axhline(s["packed_ideal_fraction"], color="tab:green", linewidth=1,
                   label="packed ideal")
        for r in mine:
            x, y = 100 * r["prefix_hit_rate"], r["reclaimable_granule_fraction"]
            color = {"stock": "tab:gray", "auto": "tab:red", "lru": "black"}.get(
                r["eviction"], "tab:blue")
            ax.scatter([x], [y], color=color, zorder=3, s=40 if r["eviction"] in
                       ("stock", "auto") else 18)
            ax.annotate(r["eviction"], (x, y), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xlabel("prefix-hit rate (%)")
        ax.set_ylabel("reclaimable granule fraction (mean over steps)")
        ax.set_title(f"{name}, {s['num_blocks']:,} blocks")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("Elastic placement: memory that could be given back vs prefix-cache hits "
                 "(vLLM 0.26 scheduler on CPU; red: the default policy, auto)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/replay-elastic",
                   help="directory for pareto.json/.md/.png (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK)} (default: all {len(POLICIES)} policies)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(policies=QUICK if args.quick else POLICIES,
               progress=lambda line: print(line, file=sys.stderr, flush=True))
    (out / "pareto.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "pareto.md").write_text(table(rows) + "\n")
    plot(rows, out / "pareto.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
