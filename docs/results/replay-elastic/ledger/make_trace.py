"""Four bursts of 100 requests sharing four 1,024-token prefixes, ``gap`` steps apart:
python3 make_trace.py GAP > trace-bursts4-gapGAP.jsonl (deterministic, standard library)."""
import json
import random
import sys

gap = int(sys.argv[1])
rng = random.Random(33)
for burst in range(4):
    for _ in range(100):
        print(json.dumps({"prompt_len": 1024 + rng.randint(32, 512),
                          "output_len": rng.randint(32, 256),
                          "prefix_id": f"sys-{rng.randrange(4)}", "prefix_len": 1024,
                          "arrival_step": burst * gap + rng.randint(0, 50)}))
