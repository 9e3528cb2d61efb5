"""One offline vLLM 0.26 run for tests/gpu/test_elastic_vllm_gpu.py: stock, or Proxima with
elastic KV memory and forced unmap/remap cycles of free granules. Writes the greedy output
token ids (and, for elastic, the connector's counters) as JSON.

    python tests/gpu/elastic_run.py --mode stock|elastic --model DIR --out FILE [--eager]

The tiny Llama (random weights, ``load_format=dummy``, token-id prompts): 48 requests of
100-700 tokens, a third of them sharing one of four 256-token prefixes (prefix-cache hits),
64 output tokens each; a 256 MiB KV cache of 64 granules (256 blocks each), so most
granules are free and the cycles take no capacity a request needs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16 * 2 * 2 * 64 * 2                 # tokens x KV heads x (K, V) x head dim x bf16
KV_BYTES = 64 * 256 * PAGE * 2             # 64 granules x 256 blocks x page x 2 layers


def prompts(n: int = 48) -> list[list[int]]:
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(4)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(100, 450))]
        out.append(prefixes[i % 4] + body if i % 3 == 0 else body)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("stock", "elastic"), required=True)
    ap.add_argument("--model", required=True, help="a Llama config dir (weights: dummy)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (default: graphs)")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    kwargs = {}
    stats = Path(args.out).with_suffix(".elastic.json")
    if args.mode == "elastic":
        os.environ.update(PROXIMA_ALLOCATOR="1", PROXIMA_ELASTIC="1")
        from vllm.config import KVTransferConfig

        from proxima.vllm import elastic_v1, plugin

        plugin.register()        # as vLLM's entry point would (Proxima may not be installed)
        # placement by granule with the whole pool mapped and strict LRU, plus forced safe
        # cycles: the schedule stays stock's, so any token difference is corrupted KV
        from tests.support import forced

        kwargs["kv_transfer_config"] = KVTransferConfig(**elastic_v1.connector_config({
            "policy": "fixed", "eviction": "lru", "stats_file": str(stats),
            "compactor": forced.cycles(every=4, hold=2, granules=8)}))
    else:
        os.environ.pop("PROXIMA_ALLOCATOR", None)
        os.environ.pop("PROXIMA_ELASTIC", None)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # 48 requests: at most 64 in a batch, so few CUDA-graph sizes (a shorter start-up)
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=0,
              max_model_len=2048, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=True,
              max_num_seqs=64, enforce_eager=args.eager,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48, 64]},
              **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params,
                        use_tqdm=False)
    result = {"mode": args.mode, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    del llm                                   # shuts the engine down: the stats are final
    import gc

    gc.collect()
    if args.mode == "elastic":
        result["elastic"] = json.loads(stats.read_text()) if stats.exists() else None
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
