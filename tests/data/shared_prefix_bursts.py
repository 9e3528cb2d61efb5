"""Write a replay trace of four bursts with shared prefixes, deterministically (JSONL on stdout).

    ./dev python tests/data/shared_prefix_bursts.py > /tmp/shared-prefix-bursts.jsonl
    ./dev proxima replay --trace /tmp/shared-prefix-bursts.jsonl --num-blocks 8000 --elastic

Four bursts of 100 requests, 1,000 steps apart (25 s at the replay's 25 ms a step: longer
than the default 10 s release delay, so an elastic engine gives memory back between them).
Each request opens with one of four system prompts of 1,024 tokens (``prefix_id``), the
same four in every burst, then its own text: prompts of 1,300-3,000 tokens, outputs of
128-384, arrivals spread over a burst's first 20 steps. What it asks of elastic KV: grow
fast at each burst's start, and keep (or win back) the prefixes the next burst hits.
"""

from __future__ import annotations

import json
import random
import sys

BURSTS, PER_BURST, GAP_STEPS, SPREAD_STEPS = 4, 100, 1000, 20
PREFIXES, PREFIX_LEN = 4, 1024


def rows(seed: int = 0):
    rng = random.Random(f"shared-prefix-bursts:{seed}")
    for b in range(BURSTS):
        for _ in range(PER_BURST):
            yield {"prompt_len": rng.randint(1300, 3000), "output_len": rng.randint(128, 384),
                   "prefix_id": f"sys-{rng.randrange(PREFIXES)}", "prefix_len": PREFIX_LEN,
                   "arrival_step": b * GAP_STEPS + rng.randrange(SPREAD_STEPS)}


def main() -> None:
    for row in sorted(rows(), key=lambda r: r["arrival_step"]):
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
