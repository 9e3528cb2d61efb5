"""Why the engine failed to start, in one line, with the option to change.

vLLM's engine core reports its own failures in its log (the front end only learns "Engine core
initialization failed. See root cause above"). The supervisor captures the engine's output
while it starts (:mod:`proxima.serve.tee`) and passes it here with the exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ERROR_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)")


@dataclass
class StartupFailure:
    why: str
    fix: str
    out_of_memory: bool = False


def _gib(value) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, (int, float)) else str(value)


def last_error(text: str) -> str | None:
    """The last ``SomeError: message`` line, skipping vLLM's 'see root cause above'."""
    for line in reversed(text.splitlines()):
        match = _ERROR_LINE.search(line)
        if match and "See root cause above" not in line:
            return f"{match.group(1)}: {match.group(2).strip()}"
    return None


def explain(text: str, *, gpu_memory_utilization=None, max_model_len=None,
            kv_cache_memory_bytes=None) -> StartupFailure:
    """Classify a start-up failure from the engine's log tail plus the exception text."""
    util = f"now {gpu_memory_utilization}" if gpu_memory_utilization is not None else "default 0.9"
    mml = f"now {max_model_len}" if max_model_len is not None else "default: the model's maximum"
    if "less than desired GPU memory utilization" in text:
        return StartupFailure(
            f"out of GPU memory at start: the GPU has less free memory than "
            f"--gpu-memory-utilization asks for (other processes hold GPU memory)",
            f"lower --gpu-memory-utilization ({util}), or free the GPU (see nvidia-smi)", True)
    if "larger than the available KV cache memory" in text:
        return StartupFailure(
            "out of GPU memory at start: the KV cache cannot hold one request of "
            "--max-model-len tokens",
            f"lower --max-model-len ({mml}), or raise --gpu-memory-utilization ({util}) / "
            f"--kv-cache-memory-bytes", True)
    if ("No available memory for the cache blocks" in text
            or "not enough GPU memory available to serve even a single token" in text):
        return StartupFailure(
            "out of GPU memory at start: nothing is left for the KV cache after the model "
            "weights and the profiling run",
            f"lower --max-num-batched-tokens / --max-num-seqs (smaller profiling peak), or raise "
            f"--gpu-memory-utilization ({util}) or set --kv-cache-memory-bytes; or use a "
            f"smaller model", True)
    if re.search(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory", text):
        if kv_cache_memory_bytes:
            fix = (f"lower --kv-cache-memory-bytes (now {kv_cache_memory_bytes} = "
                   f"{_gib(kv_cache_memory_bytes)})")
        else:
            fix = (f"lower --gpu-memory-utilization ({util}) to leave room for CUDA graphs and "
                   f"other processes, or lower --max-model-len ({mml}) / --max-num-seqs")
        return StartupFailure("out of GPU memory at start (CUDA out of memory)", fix, True)
    error = last_error(text) or "no error message found"
    return StartupFailure(f"the engine failed to start: {error}",
                          "see the engine's log above; fix the option it names")
