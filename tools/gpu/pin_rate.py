"""Why vLLM's sleep of an 8B model takes 10 s (issue 36, s27): time its copy of the weights to
host memory, as vLLM 0.26's ``CuMemAllocator.sleep`` does it, against the copy alone.

    PYTHONPATH=$PWD python3 tools/gpu/pin_rate.py --out $OUT [--repeat 2]

No vLLM. On the GPU, one tensor per weight of Llama-3.1-8B (bf16, vLLM's fused qkv and
gate_up: 195 tensors, 14.96 GiB). Each round, as vLLM's sleep: per tensor a new pinned host
tensor (``torch.empty(..., pin_memory=True)``) and a device-to-host copy; then, as its wake,
host-to-device copies, and the host tensors dropped. Also per round: the same copies into
host tensors allocated once (pinned, kept), and the pinned allocations alone. Rounds after
the first show whether torch's pinned-memory cache makes a later sleep cheaper. Prints and
writes ``pin_rate.json``: seconds and GiB/s of each part.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

GiB = 2**30
HIDDEN, INTER, VOCAB, LAYERS, KV_HEADS, HEAD = 4096, 14336, 128256, 32, 8, 128


def llama8b_shapes() -> list[tuple[int, ...]]:
    """The weights of Llama-3.1-8B as vLLM holds them (qkv and gate_up fused)."""
    qkv = HIDDEN + 2 * KV_HEADS * HEAD
    layer = [(qkv, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER),
             (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN)] + layer * LAYERS + [(HIDDEN,), (VOCAB, HIDDEN)]


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-out", help="where pin_rate.json goes (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds (default: %(default)s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pin_rate: needs an NVIDIA GPU (torch sees none)")
        return 2
    weights = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in llama8b_shapes()]
    total = sum(w.numel() * w.element_size() for w in weights)
    kept = [torch.empty(w.numel() * w.element_size(), dtype=torch.uint8, pin_memory=True)
            for w in weights]
    torch.cuda.synchronize()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def as_bytes(w):
        return w.view(-1).view(torch.uint8)

    rounds = []
    for r in range(args.repeat):
        backups: list = []

        def sleep_like_vllm():
            for w in weights:
                host = torch.empty(w.numel() * w.element_size(), dtype=torch.uint8,
                                   pin_memory=True)
                host.copy_(as_bytes(w))
                backups.append(host)

        def wake_like_vllm():
            for w, host in zip(weights, backups):
                as_bytes(w).copy_(host)

        def pin_only():
            extra = [torch.empty(w.numel() * w.element_size(), dtype=torch.uint8,
                                 pin_memory=True) for w in weights]
            del extra

        def copy_to_kept():
            for w, host in zip(weights, kept):
                host.copy_(as_bytes(w))

        row = {"sleep_like_vllm_s": timed(sleep_like_vllm),
               "wake_like_vllm_s": timed(wake_like_vllm)}
        backups.clear()                       # as vLLM drops them after the wake
        row["pin_alloc_only_s"] = timed(pin_only)
        row["copy_to_kept_pinned_s"] = timed(copy_to_kept)
        row = {k: round(v, 3) for k, v in row.items()}
        row.update({k.replace("_s", "_gib_s"): round(total / GiB / v, 2) if v else None
                    for k, v in list(row.items())})
        rounds.append(row)
        print(f"round {r + 1}: {json.dumps(row)}", flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "tensors": len(weights), "gib": round(total / GiB, 2), "rounds": rounds}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "pin_rate.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
