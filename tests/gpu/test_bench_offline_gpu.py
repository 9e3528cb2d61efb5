"""Issue 4, items 1 and 2 at a small scale: `proxima bench --offline` on a real GPU.

A tiny Llama (hidden 256, 2 layers, 4 heads, 2 KV heads, vocab 32000) with random weights
(``load_format=dummy``, config only, no tokenizer) is run by real vLLM, stock and Proxima,
through the CLI in a subprocess: the subprocess keeps CUDA out of pytest's process (vLLM
forks its engine core; a parent that touched CUDA breaks the child) and runs exactly
what a user runs. Proxima must be installed (``pip install -e .`` or the wheel) so that
vLLM finds its ``vllm.general_plugins`` entry point in the engine-core process.

Run on the H200:  VLLM_USE_FLASHINFER_SAMPLER=0 python -m pytest -m gpu tests/gpu/test_bench_offline_gpu.py -v
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

ROOT = Path(__file__).resolve().parents[2]
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 2      # layers * (K, V) * kv heads * head dim * bf16
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    "attention_bias": False, "mlp_bias": False,
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def bench_offline(tmp_path: Path, *argv: str) -> tuple[int, dict, str]:
    """Run `proxima bench --offline` in a fresh process; (exit status, JSON, output)."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    proc = subprocess.run([sys.executable, "-m", "proxima.cli", "bench", "--offline",
                           "--no-progress", "--load-format", "dummy", "--json", str(out), *argv],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    log = proc.stdout + proc.stderr
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{log[-6000:]}"
    return proc.returncode, json.loads(out.read_text()), log


def bench_tiny(tmp_path: Path, model: Path, kv_tokens: int, *argv: str):
    """:func:`bench_offline` on the tiny Llama: eager, 2,048-token context, a fixed KV cache
    of ``kv_tokens`` (left to vLLM's memory profiling it varies between engines of one
    process: 8,401,590 vs 8,405,430 blocks seen for two stock engines on the H200), outputs
    compared."""
    return bench_offline(tmp_path, "--model", str(model), "--max-model-len", "2048",
                         "--enforce-eager", "--kv-cache-memory-bytes",
                         str(kv_tokens * KV_BYTES_PER_TOKEN), "--check-outputs", *argv)


def shared_prefix_trace(path: Path, n: int) -> str:
    """Mixed lengths, four shared 256-token prefixes (prefix-cache hits)."""
    lines = []
    for i in range(n):
        lines.append(json.dumps({"prompt_len": 300 + (i * 37) % 700,
                                 "output_len": 32 + (i * 53) % 224,
                                 "prefix_id": f"sys-{i % 4}", "prefix_len": 256}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def assert_proxima_was_on(rep: dict, log: str) -> None:
    assert rep["results"]["proxima"]["proxima_active"] is True, (
        "Proxima did not report itself active: is proxima installed so that vLLM loads "
        f"its general plugin?\n{log[-4000:]}")


def assert_token_identical(rep: dict, log: str) -> None:
    check = rep["check_outputs"]
    for run, cmp in check["runs"].items():
        assert cmp["differing"] == 0, f"{run}: {cmp} (reference {check['reference']})\n{log[-3000:]}"
    stock, prox = rep["results"]["stock"], rep["results"]["proxima"]
    assert stock["kv_blocks"] is not None and stock["kv_blocks"] == prox["kv_blocks"]
    assert stock["short_outputs"] == prox["short_outputs"] == 0


def test_identical_tokens_under_prefix_sharing_and_preemption(tmp_path, tiny_llama):
    """Item 1, small: 160 prompts sharing prefixes, KV cache of 8,192 tokens (forces
    preemption), greedy; every output token-identical, block counts identical."""
    trace = shared_prefix_trace(tmp_path / "trace.jsonl", 160)
    rc, rep, log = bench_tiny(tmp_path, tiny_llama, 8192, "--trace", trace)
    assert_proxima_was_on(rep, log)
    assert_token_identical(rep, log)
    assert rep["check_outputs"]["runs"]["proxima#1"]["identical"] == 160
    assert rep["results"]["stock"]["preemptions"] > 0, "the load did not force preemption"
    assert rc == 0, log[-3000:]


def test_throughput_side_by_side_with_noise_band(tmp_path, tiny_llama):
    """Item 2, small: the chat workload, each allocator twice (alternating); contiguity is
    measured for both, and Proxima's runs must be longer than stock's.

    Throughput: Proxima's median must be at least 0.9 of stock's, or within stock's own
    spread if that is wider. Why 0.9 and not issue 4's 0.99: a tiny model on a big GPU
    in eager mode is noise-bound (two runs a side; stock's run-to-run spread against
    itself reached 8 % on the H200, docs/benchmarks.md 3.1), and the full-scale 0.99
    runs are the proof of parity. What 0.9 catches is the allocator costing the engine
    real time: here the scheduler's CPU work is a large part of each step, so a placement
    or free path gone slow (the 41,556 one-id frees of issue 12) shows up first."""
    rc, rep, log = bench_tiny(tmp_path, tiny_llama, 65536, "--workload", "chat",
                              "--requests", "100", "--repeat", "2")
    assert_proxima_was_on(rep, log)
    assert_token_identical(rep, log)
    stock, prox = rep["results"]["stock"], rep["results"]["proxima"]
    assert stock["runs"] == prox["runs"] == 2
    assert [r["allocator"] for r in rep["runs"]] == ["stock", "proxima", "stock", "proxima"]
    for r in rep["runs"]:
        assert r["output_tokens"] == 100 * 100 and r["output_tokens_per_s"] > 0
    spread_pct = stock["output_tokens_per_s_spread"]["spread_pct"]
    assert spread_pct is not None
    ratio = rep["ratios"]["proxima/stock"]["output_tokens_per_s"]
    floor = min(0.9, 1 - spread_pct / 100)
    assert ratio >= floor, (f"Proxima's throughput is {ratio:.3f} of stock's, below "
                            f"{floor:.3f} (stock's own spread {spread_pct:.1f} %)")
    assert stock["proxima_active"] is False          # observed, not replaced
    assert stock["blocks_per_run"] is not None and prox["blocks_per_run"] is not None
    assert prox["blocks_per_run"] > stock["blocks_per_run"] >= 1.0
    assert rc == 0, log[-3000:]


def test_held_arrivals_give_both_allocators_the_same_preemptions(tmp_path, tiny_llama):
    """With arrivals held (the default), every run's first step sees every request, so the
    scheduler's decisions no longer depend on timing: under memory pressure stock and
    Proxima, each run twice, preempt exactly as often (CPU replay: docs/benchmarks.md §3.1)."""
    rc, rep, log = bench_tiny(tmp_path, tiny_llama, 4096, "--workload", "pressure",
                              "--requests", "200", "--repeat", "2")
    assert_proxima_was_on(rep, log)
    assert_token_identical(rep, log)
    assert [r["arrivals"] for r in rep["runs"]] == ["held"] * 4
    counts = [r["preemptions"] for r in rep["runs"]]
    assert counts[0] > 0, "the load did not force preemption"
    assert counts == [counts[0]] * 4, counts
    assert rc == 0, log[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_identical_tokens_with_tensor_parallel_2(tmp_path, tiny_llama):
    """Item 3, small: the allocator lives in the scheduler, so TP=2 changes nothing."""
    trace = shared_prefix_trace(tmp_path / "trace.jsonl", 60)
    rc, rep, log = bench_tiny(tmp_path, tiny_llama, 4096, "--trace", trace,
                              "--tensor-parallel-size", "2")
    assert_proxima_was_on(rep, log)
    assert_token_identical(rep, log)
    assert rc == 0, log[-3000:]
