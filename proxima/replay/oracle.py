"""How far placement *without moving blocks* can go: offline layouts of a recorded replay.

    ./dev python -m proxima.replay.oracle [--out DIR]

Replays stock vLLM once per workload (the proof sizes of :mod:`proxima.replay.pareto`) and
records, at every step the granule tally samples (:mod:`proxima.replay.reclaim`), which
blocks are live and what they hold. That gives each *content* (a logical block: written
once, live while requests use it, kept in its id while cached, live again on each prefix
hit) its live intervals and its *occupancy*, from the step it first appears to the step it
is last live. Every stock prefix hit is kept and a content leaves its id only once it is
never needed again. Any placement that moves nothing assigns each content one granule for
its whole occupancy, and a granule's contents may at no step occupy more ids than it has.
Three such layouts, each scored with the tally's definitions (a granule is reclaimable at a
step when none of its contents is live then; packed ideal as there):

* ``stock``: the granules stock's own block ids gave (checks the model: it reproduces the
  tally's stock figure);
* ``best_fit_own_future``: contents in the order they appear, each where it adds the least
  granule-busy time, knowing its *own* future (when it will be reused and when it dies) but
  nothing about contents yet to come -- more than an online allocator knows;
* ``first_fit_latest_end``: clairvoyant: all contents known beforehand, latest-ending first,
  each into the lowest granule with room over its whole occupancy (first fit in order of
  end for the busy-time problem).

These are layouts, not proofs of optimality: the best layout without moves is an NP-hard
busy-time schedule; the packed ideal stays the bound. A content occupies its id from one
step before it first appears: a block freed and one allocated in the same step may not
share an id (vLLM allocates in ``schedule()`` before it frees finished requests). A block
allocated and freed within one step is seen neither by the tally nor here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CASES = (("sharegpt", 8000), ("multiturn", 4000), ("bursts", 8000))
LAYOUTS = ("stock", "best_fit_own_future", "first_fit_latest_end")


class ContentRecorder:
    """``on_sample`` for :func:`proxima.replay.driver_v1.run_replay`: builds the contents'
    live intervals from vLLM's block list, one sample per step.

    :attr:`contents` is a list of ``[intervals, block_id]``: ``intervals`` the half-open
    ``[first, end)`` sample indices at which the content was live, ``block_id`` where stock
    kept it. A block that is live again after a gap holds the same content when its prefix
    hash is the one it had (a hit: vLLM revived it); a block without a hash (a partial
    block) or with another hash holds a new one."""

    def __init__(self) -> None:
        self.contents: list[list] = []
        self.samples = 0
        self._live: dict[int, int] = {}        # block id -> its content, while live
        self._hash: dict[int, object] = {}     # block id -> its content's last prefix hash
        self._owner: dict[int, int] = {}       # block id -> the content it last held

    def __call__(self, step: int, blocks) -> None:
        t = self.samples
        self.samples += 1
        live, hashes, owner, contents = self._live, self._hash, self._owner, self.contents
        now: dict[int, int] = {}
        for b in blocks:
            if b.ref_cnt <= 0 or b.is_null:
                continue
            i, h = b.block_id, b.block_hash
            k = live.get(i)
            if k is None:
                k = owner.get(i)
                if k is not None and h is not None and hashes.get(i) == h:
                    contents[k][0].append([t, t + 1])            # revived by a hit
                else:
                    k = len(contents)
                    contents.append([[[t, t + 1]], i])
                    owner[i] = k
                    hashes.pop(i, None)
            if h is not None:
                hashes[i] = h
            now[i] = k
        for i, k in live.items():
            if i not in now:
                contents[k][0][-1][1] = t                       # ended before this sample
        for i, k in now.items():
            contents[k][0][-1][1] = t + 1
        self._live = now


def score(assign, contents, steps: int, num_blocks: int, G: int) -> dict:
    """The tally's means for a layout: ``assign[k]`` the granule of content ``k``."""
    import numpy as np

    ng = -(-num_blocks // G)
    live = np.zeros((ng, steps), dtype=np.int32)
    live[0, :] = 1                                              # the null block
    for (intervals, _), g in zip(contents, assign):
        for a, b in intervals:
            live[g, a:b] += 1
    used = (live > 0).sum(axis=0)
    packed = -(-live.sum(axis=0) // G)
    reclaimable = float((ng - used).mean() / ng) if steps else 0.0
    ideal = float((ng - packed).mean() / ng) if steps else 0.0
    return {"reclaimable_granule_fraction": reclaimable, "packed_ideal_fraction": ideal,
            "reclaimable_vs_ideal": reclaimable / ideal if ideal else 0.0}


def _capacity(num_blocks: int, G: int, steps: int):
    import numpy as np

    ng = -(-num_blocks // G)
    cap = np.full(ng, G, dtype=np.int32)
    cap[-1] = num_blocks - (ng - 1) * G
    occ = np.zeros((ng, steps + 1), dtype=np.int32)
    occ[0, :] = 1                                               # the null block
    return cap, occ


def _span(intervals) -> tuple[int, int]:
    return max(0, intervals[0][0] - 1), intervals[-1][1]


def best_fit_own_future(contents, steps: int, num_blocks: int, G: int) -> list[int]:
    """In order of appearance, each content into the granule with room over its occupancy
    where its live steps add the fewest steps at which the granule would be busy (ties:
    the lowest granule)."""
    import numpy as np

    cap, occ = _capacity(num_blocks, G, steps)
    live = np.zeros_like(occ)
    live[0, :] = 1
    assign = [0] * len(contents)
    for k in sorted(range(len(contents)), key=lambda k: (contents[k][0][0][0],
                                                          -contents[k][0][-1][1])):
        intervals = contents[k][0]
        s, e = _span(intervals)
        fits = np.nonzero(cap - occ[:, s:e].max(axis=1) > 0)[0]
        mask = np.zeros(e - s, dtype=bool)
        for a, b in intervals:
            mask[a - s:b - s] = True
        added = ((live[fits, s:e] == 0) & mask).sum(axis=1)
        g = int(fits[int(np.argmin(added))])
        occ[g, s:e] += 1
        for a, b in intervals:
            live[g, a:b] += 1
        assign[k] = g
    return assign


def first_fit_latest_end(contents, steps: int, num_blocks: int, G: int) -> list[int]:
    """All contents known: latest-ending first (then earliest-starting), each into the
    lowest granule with room over its whole occupancy."""
    import numpy as np

    cap, occ = _capacity(num_blocks, G, steps)
    assign = [0] * len(contents)
    for k in sorted(range(len(contents)), key=lambda k: (-contents[k][0][-1][1],
                                                          contents[k][0][0][0])):
        s, e = _span(contents[k][0])
        g = int(np.argmax(cap - occ[:, s:e].max(axis=1) > 0))
        occ[g, s:e] += 1
        assign[k] = g
    return assign


def layouts(contents, steps: int, num_blocks: int, G: int) -> dict[str, dict]:
    """Each of :data:`LAYOUTS` scored (``stock`` from the block ids stock used)."""
    out = {"stock": score([i // G for _, i in contents], contents, steps, num_blocks, G)}
    out["best_fit_own_future"] = score(best_fit_own_future(contents, steps, num_blocks, G),
                                       contents, steps, num_blocks, G)
    out["first_fit_latest_end"] = score(first_fit_latest_end(contents, steps, num_blocks, G),
                                        contents, steps, num_blocks, G)
    return out


def run(cases=CASES, granule_blocks: int = 32, progress=print) -> list[dict]:
    from proxima.replay import driver_v1
    from proxima.workloads import make_workload

    rows = []
    for name, blocks in cases:
        t0 = time.time()
        recorder = ContentRecorder()
        r = driver_v1.run_replay(make_workload(name), proxima=False, num_blocks=blocks,
                                 granule_blocks=granule_blocks, on_sample=recorder)
        found = layouts(recorder.contents, recorder.samples, blocks, granule_blocks)
        tally = r.details["reclaimable_granule_fraction"]
        if abs(found["stock"]["reclaimable_granule_fraction"] - tally) > 1e-9:
            raise RuntimeError(f"{name}: the content model gives stock "
                               f"{found['stock']['reclaimable_granule_fraction']:.6f}, the "
                               f"tally {tally:.6f}")
        row = {"workload": name, "num_blocks": blocks, "granule_blocks": granule_blocks,
               "steps": recorder.samples, "contents": len(recorder.contents),
               "prefix_hit_rate": r.prefix_hit_rate, "layouts": found}
        rows.append(row)
        progress(f"{name:9} {blocks:5}  " + "  ".join(
            f"{k} {v['reclaimable_granule_fraction']:.3f} ({v['reclaimable_vs_ideal']:.3f})"
            for k, v in found.items()) + f"  [{time.time() - t0:.0f}s]")
    return rows


def table(rows: list[dict]) -> str:
    out = ["| workload (blocks) | packed ideal | " + " | ".join(
        f"{k}: reclaimable (x stock, / ideal)" for k in LAYOUTS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in LAYOUTS) + " |"]
    for r in rows:
        lay = r["layouts"]
        s = lay["stock"]["reclaimable_granule_fraction"]
        cells = [f"{lay[k]['reclaimable_granule_fraction']:.3f} "
                 f"({lay[k]['reclaimable_granule_fraction'] / s if s else 0:.2f}x, "
                 f"{lay[k]['reclaimable_vs_ideal']:.3f})" for k in LAYOUTS]
        out.append(f"| {r['workload']} ({r['num_blocks']:,}) | "
                   f"{lay['stock']['packed_ideal_fraction']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="docs/results/replay-elastic/merged",
                   help="directory for oracle.json and oracle.md")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"proxima.replay.oracle: cannot create --out {str(out)!r}: {exc.strerror}; "
              f"give a writable directory", file=sys.stderr)
        return 2
    rows = run()
    (out / "oracle.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "oracle.md").write_text(table(rows) + "\n")
    print(table(rows))
    print(f"wrote {out / 'oracle.json'} and {out / 'oracle.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
