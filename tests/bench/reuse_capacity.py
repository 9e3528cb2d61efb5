"""What KV capacity does to a reuse burst of ``two_engines.py --contexts`` (CPU replay).

    ./dev python -m tests.bench.reuse_capacity [COUNT[+COUNT...],...] [TOKENS] [VISITS] [OUTPUT]

For each context count (default 50,75,100,125,150; contexts of TOKENS tokens, default
4,096, each asked VISITS times, default 4, after a 64-token question, OUTPUT output tokens,
default 128: one burst of driver B's reuse workload, seed 0), replays the burst through vLLM 0.26's
real (async) scheduler with stock pools the size of a static 0.45 share (46.6 GiB of
Llama-3.1-8B KV: 23,859 blocks) and of an elastic engine's maximum (90 GiB: 46,080 blocks),
and then as driver B's elastic engine runs it (``proxima_elastic``: Proxima's pool with the
real connector and grow/shrink policy, min 2 GiB, max 90 GiB, 2 s release delay, 32 MiB
granules a layer, starting at its minimum; a step is 25 ms on the policy's clock, the
worker a stand-in: :mod:`proxima.replay.elastic`), and prints one JSON line per count: the
working set (GiB of the contexts' KV), and per pool its steps, the tokens the runner would
compute (``scheduled_tokens``: prefill chunks and decodes), prefix-hit rate and
preemptions (the elastic one also its mean mapped size, its grows and shrinks and the
cached blocks its releases evicted). ``50+50+100`` is one row of three bursts in a row on
the same engines (each with contexts of its own, ``GAP_STEPS`` apart: the engine idles in
between), as driver B's engines see them with several ``--contexts`` workloads; the
working set is the largest burst's. A measurement script, not a test: the steps are
scheduler steps (prefill and decode tokens per step differ), not time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB = 1 << 30
TOKEN_BYTES = 128 * 1024                # Llama-3.1-8B's KV a token
BLOCK_BYTES = 16 * TOKEN_BYTES          # a block of 16 tokens
MAX_GIB = 90                            # driver B's elastic maximum (--max-gib 90)
GAP_STEPS = 400                         # bursts in a sequence arrive this many steps apart
POOLS = (("static", int(46.6 * GiB) // BLOCK_BYTES), ("elastic", MAX_GIB * GiB // BLOCK_BYTES))


def burst_sequence(sequence: list[int], tokens: int, visits: int, prompt: int, output: int,
                   gap: int = GAP_STEPS):
    """Driver B's reuse bursts as one replay workload: a burst of ``count`` contexts for each
    count of ``sequence`` (``two_engines.burst_requests``, seed 100 x its place, so each has
    contexts of its own), ``gap`` steps apart. One burst keeps the names ``r0``, ``r1``, ..."""
    proof = str(Path(__file__).resolve().parents[2] / "tools" / "gpu")
    if proof not in sys.path:
        sys.path.insert(0, proof)
    import two_engines

    from proxima.workloads import RequestSpec, Workload

    specs = []
    for k, count in enumerate(sequence):     # one burst after another, new contexts each
        burst = two_engines.burst_requests(0, seed=100 * k, prompt=prompt, output=output,
                                           contexts=(count, tokens, visits))
        name = "r" if len(sequence) == 1 else f"b{k}r"
        specs += [RequestSpec(f"{name}{i}", p, m, arrival_step=gap * k)
                  for i, (p, m) in enumerate(burst)]
    return Workload("contexts", specs)


def main(argv: list[str]) -> int:
    try:
        counts = [[int(c) for c in x.split("+")]
                  for x in (argv[0] if argv else "50,75,100,125,150").split(",")]
        tokens = int(argv[1]) if len(argv) > 1 else 4096
        visits = int(argv[2]) if len(argv) > 2 else 4
        output = int(argv[3]) if len(argv) > 3 else 128
    except ValueError:
        print("usage: python -m tests.bench.reuse_capacity [COUNT[+COUNT...],...] [TOKENS] "
              "[VISITS] [OUTPUT]",
              file=sys.stderr)
        return 2
    from proxima.replay.driver_v1 import run_replay
    from proxima.replay.elastic import ElasticReplay

    for sequence in counts:
        workload = burst_sequence(sequence, tokens, visits, prompt=64, output=output)
        row = {"contexts": sequence[0] if len(sequence) == 1 else "+".join(map(str, sequence)),
               "tokens": tokens, "visits": visits, "output": output,
               "working_set_gib": round(max(sequence) * tokens * TOKEN_BYTES / GiB, 1)}
        # as driver B's servers: the longest request fits, vLLM 0.26's async scheduling
        # and its 8,192-token step
        engine = dict(max_model_len=tokens + 96 + output, async_scheduling=True,
                      max_num_batched_tokens=8192)
        for name, blocks in POOLS:
            r = run_replay(workload, proxima=False, num_blocks=blocks, **engine)
            row[name] = {"blocks": blocks, "steps": r.steps,
                         "scheduled_tokens": r.details["scheduled_tokens"],
                         "prefix_hit_rate": round(r.prefix_hit_rate, 4),
                         "preemptions": r.preemptions}
        spec = ElasticReplay(min_bytes=2 * GiB, max_bytes=MAX_GIB * GiB, release_delay_s=2.0,
                             extra={"initial_bytes": 2 * GiB})
        r = run_replay(workload, proxima=True, num_blocks=POOLS[1][1], elastic=spec,
                       granule_blocks=512, **engine)
        e = r.details["elastic"]
        row["proxima_elastic"] = {"steps": r.steps,
                                  "scheduled_tokens": r.details["scheduled_tokens"],
                                  "prefix_hit_rate": round(r.prefix_hit_rate, 4),
                                  "preemptions": r.preemptions,
                                  "mean_mapped_gib": round(r.details["mapped_granule_fraction"]
                                                           * MAX_GIB, 1),
                                  "grows": e.get("grows"), "shrinks": e.get("shrinks"),
                                  "evicted_cached": e.get("evicted_cached")}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
