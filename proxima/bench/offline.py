"""Offline mode: vLLM's ``LLM`` in this process, stock block pool vs Proxima, same prompts.

Why the order and the environment matter:

* ``PROXIMA_ALLOCATOR`` is read by the Proxima plugin when vLLM loads general plugins in
  the *engine-core child process*, which V1 starts anew for every ``LLM``. So the variable
  is set before each ``LLM`` is built and every run gets a fresh engine; an in-process
  engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) would load the plugin once for the
  whole process and is refused.
* The engine core is *spawned* (``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless set): this
  process loads the general plugins while building the first ``LLM`` (vLLM loads them once
  per process, then sets a flag), and a *forked* engine core would inherit that flag and
  that state, so the second run's plugin would never see its own ``PROXIMA_ALLOCATOR``.
  A spawned child is a fresh interpreter that loads the plugin with this run's flag.
  Whatever the method, each run's report says whether Proxima reported itself active.
* With ``--repeat K`` the runs alternate (stock, proxima, stock, proxima, ...) so slow
  drift of the machine (clocks, heat) falls on both sides; each run rebuilds the engine,
  so no run inherits another's prefix cache, and every run gets the identical prompts.
  The stock runs among themselves give the noise band (``spread_pct``).
* The engine is shut down and collected before the next is built: two engines would not
  fit on one GPU with default memory settings.
* Arrivals are held (``--arrivals held``, the default;
  :func:`~proxima.bench.offline_engine.hold_arrivals`): the engine's
  first step sees every request, so the scheduler makes the same decisions in every run
  and a difference between the allocators cannot hide in the timing of request arrival.

Per run: elapsed wall time of ``LLM.generate`` (engine start-up excluded), requests/s,
output and total tokens/s, preemptions (``vllm:num_preemptions`` via ``get_metrics``,
difference across the run), the KV-cache block count, and contiguity read from the
status file (``PROXIMA_STATS_FILE``, sampled while the run goes): Proxima's pool writes it,
and stock runs get ``PROXIMA_OBSERVE=1``, whose read-only observer writes the stock block
tables' blocks per run (V1 engine; elsewhere stock contiguity is n/a; the sampling and
those figures: :mod:`proxima.bench.offline_status`). ``--check-outputs`` compares every
run's token ids with the first stock run's, request by request.

Everything except vLLM's ``LLM`` itself (built, read and stopped in
:mod:`proxima.bench.offline_engine`) is plain Python, so the orchestration and the
arithmetic are tested on CPU with a stand-in ``build_llm``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from proxima.bench.offline_engine import collect, default_build_llm, default_sampling_params, \
    hold_arrivals, kv_blocks_of, metric_total, scoped_env, shutdown
from proxima.bench.offline_status import StatusSampler, contiguity, elastic_figures
from proxima.bench.stats import median, spread
from proxima.vllm.activation import ELASTIC_ENV, ENV as ALLOCATOR_ENV, OBSERVE_ENV
from proxima.vllm.status import STATS_ENV
from proxima.errors import UserError
from proxima.workloads import RequestSpec

ALLOCATORS = ("stock", "proxima")
ARRIVALS = ("held", "as-sent")
MAX_DIFFERING_SHOWN = 5
# Set for the engines of a bench run unless the user set them (restored afterwards).
ENGINE_DEFAULTS = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",        # see the module docstring
    # Greedy decoding never uses the FlashInfer top-k/top-p sampler, but vLLM 0.26.0 builds
    # it at start-up and fails where FlashInfer is missing (the offline GPU host).
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
}


#: vLLM seeds numpy with --seed (in each worker), which takes 0 to 2^32 - 1 only
MAX_SEED_OFFLINE = 2**32 - 1

@dataclass(frozen=True)
class OfflineConfig:
    """Settings shared by every run: only the allocator differs between runs."""
    model: str
    load_format: str | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    repeat: int = 1
    seed: int = 0
    check_outputs: bool = False
    progress: bool = True
    arrivals: str = "held"      # see hold_arrivals
    #: the Proxima runs with elastic KV memory (PROXIMA_ELASTIC=1 and Proxima's connector,
    #: these options): the stock runs are unchanged
    elastic: bool = False
    elastic_options: dict | None = None


def validate(config: OfflineConfig) -> None:
    """Refuse settings that cannot give a fair comparison, before any engine starts."""
    if config.repeat < 1:
        raise UserError(f"--repeat must be >= 1, got {config.repeat}")
    if not 0 <= config.seed <= MAX_SEED_OFFLINE:
        raise UserError(f"--seed must be from 0 to {MAX_SEED_OFFLINE:,} with --offline (vLLM "
                        f"seeds numpy with it), got {config.seed}")
    if config.kv_cache_memory_bytes is not None and config.kv_cache_memory_bytes < 1:
        raise UserError(f"--kv-cache-memory-bytes must be >= 1, got {config.kv_cache_memory_bytes}")
    if config.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be >= 1, got {config.tensor_parallel_size}")
    if config.gpu_memory_utilization is not None and not 0 < config.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization must be in (0, 1], got "
                        f"{config.gpu_memory_utilization}")
    if config.max_model_len is not None and config.max_model_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {config.max_model_len}")
    path = Path(config.model)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {config.model}: no config.json in that directory "
                            f"(a config.json is enough with --load-format dummy)")
    elif config.model.startswith((".", "/", "~")):
        raise UserError(f"--model {config.model}: no such directory")
    if config.arrivals not in ARRIVALS:
        raise UserError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {config.arrivals}")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() == "0":
        raise UserError("VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core in this process, "
                        "where the Proxima plugin is loaded once for both runs: unset it")


def plan_runs(repeat: int) -> list[tuple[str, int]]:
    """``[("stock", 1), ("proxima", 1), ("stock", 2), ...]``: alternating, stock first."""
    return [(allocator, rep) for rep in range(1, repeat + 1) for allocator in ALLOCATORS]


def llm_kwargs(config: OfflineConfig) -> dict:
    """Keyword arguments of ``LLM``, identical for both allocators.

    Prompts are token ids, so no tokenizer is loaded (``skip_tokenizer_init``) and
    stats logging is on so that ``get_metrics`` has the preemption counter."""
    kwargs = dict(model=config.model, skip_tokenizer_init=True, seed=config.seed,
                  disable_log_stats=False, tensor_parallel_size=config.tensor_parallel_size,
                  enforce_eager=config.enforce_eager)
    optional = dict(load_format=config.load_format,
                    kv_cache_memory_bytes=config.kv_cache_memory_bytes,
                    gpu_memory_utilization=config.gpu_memory_utilization,
                    max_model_len=config.max_model_len)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    return kwargs


def compare_tokens(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                   request_ids: Sequence[str]) -> dict:
    """Request-by-request equality of generated token ids (order = the request list)."""
    if len(reference) != len(other):
        raise ValueError(f"cannot compare {len(other)} outputs with {len(reference)}")
    differing = [rid for rid, a, b in zip(request_ids, reference, other) if list(a) != list(b)]
    return {"identical": len(reference) - len(differing), "differing": len(differing),
            "first_differing": differing[:MAX_DIFFERING_SHOWN]}


def run_once(allocator: str, config: OfflineConfig, specs: Sequence[RequestSpec],
             status_dir: Path, build_llm: Callable, sampling_params: Callable,
             rep: int) -> tuple[dict, list[list[int]]]:
    """One engine, one ``generate`` over all requests; returns (figures, token ids)."""
    status_path = status_dir / f"{allocator}-{rep}.json"
    # Stock runs are observed (read-only, see proxima.vllm.observe_v1) for their contiguity.
    flags = {ALLOCATOR_ENV: "1" if allocator == "proxima" else "0", STATS_ENV: str(status_path),
             OBSERVE_ENV: "0" if allocator == "proxima" else "1"}
    kwargs = llm_kwargs(config)
    elastic = config.elastic and allocator == "proxima"
    flags[ELASTIC_ENV] = "1" if elastic else "0"
    if elastic:
        # The engine core's plugin activates elastic mode; the connector must also be in
        # this process's engine config (its plugin was loaded once, by the first run).
        from proxima.vllm.elastic_v1 import connector_config

        kwargs["kv_transfer_config"] = connector_config(config.elastic_options)
    with scoped_env(flags):                 # the engine core copies them when it starts
        llm = build_llm(kwargs)
    try:
        blocks = kv_blocks_of(llm)
        before = metric_total(llm.get_metrics(), "vllm:num_preemptions")
        prompts = [{"prompt_token_ids": list(s.prompt_token_ids)} for s in specs]
        params = [sampling_params(s.max_tokens) for s in specs]
        held = config.arrivals == "held" and hold_arrivals(llm)
        with StatusSampler(status_path) as sampler:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=config.progress)
            elapsed = time.perf_counter() - start
        after = metric_total(llm.get_metrics(), "vllm:num_preemptions")
    finally:
        shutdown(llm)
        del llm
        collect()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    prompt_tokens = sum(len(s.prompt_token_ids) for s in specs)
    output_tokens = sum(len(t) for t in tokens)
    figures = {
        "allocator": allocator,
        "rep": rep,
        "elapsed_s": elapsed,
        "requests_per_s": len(specs) / elapsed if elapsed > 0 else None,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else None,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed if elapsed > 0 else None,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "short_outputs": sum(1 for s, t in zip(specs, tokens) if len(t) != s.max_tokens),
        "preemptions": None if before is None or after is None else after - before,
        "kv_blocks": blocks,
        "arrivals": "held" if held else "as-sent",
        "contiguity": contiguity(sampler.snapshots),
        "elastic": elastic_figures(sampler.snapshots) if elastic else None,
    }
    return figures, tokens


def summarize(runs: Sequence[dict]) -> dict:
    """One allocator's runs -> medians, the min-max spread of throughput, and the values
    that must not vary (KV blocks: None with ``kv_blocks_per_run`` listed if they do)."""
    blocks = [r["kv_blocks"] for r in runs]
    cont = [r["contiguity"] for r in runs]
    return {
        "runs": len(runs),
        "elapsed_s": median(r["elapsed_s"] for r in runs),
        "requests_per_s": median(r["requests_per_s"] for r in runs),
        "output_tokens_per_s": median(r["output_tokens_per_s"] for r in runs),
        "total_tokens_per_s": median(r["total_tokens_per_s"] for r in runs),
        "output_tokens_per_s_spread": spread(r["output_tokens_per_s"] for r in runs),
        "preemptions": median(r["preemptions"] for r in runs),
        "preemptions_per_run": [r["preemptions"] for r in runs],
        "kv_blocks": blocks[0] if len(set(blocks)) == 1 else None,
        "kv_blocks_per_run": blocks,
        "blocks_per_run": median(c["blocks_per_run"] for c in cont),
        "largest_free_run": median(c["largest_free_run"] for c in cont),
        "proxima_active": (None if all(c["active"] is None for c in cont)
                           else all(c["active"] is True for c in cont)),
        "short_outputs": max(r["short_outputs"] for r in runs),
    }


def run_offline(config: OfflineConfig, specs: Sequence[RequestSpec],
                build_llm: Callable | None = None,
                sampling_params: Callable | None = None,
                after_run: Callable[[list, dict | None, int], None] | None = None) -> dict:
    """All runs of :func:`plan_runs`; returns ``{"runs", "results", "check_outputs"}``.

    ``build_llm(kwargs)`` and ``sampling_params(max_tokens)`` default to vLLM's.
    ``after_run(runs, check_outputs, planned)`` is called after every run with what has been
    measured so far (the CLI saves it, so a run cut short loses nothing already measured)."""
    build_llm = build_llm or default_build_llm
    sampling_params = sampling_params or default_sampling_params
    validate(config)
    if not specs:
        raise UserError("the request list is empty: --requests must be >= 1")
    check_device = getattr(build_llm, "check_device", None)
    if check_device is not None:
        check_device()
    request_ids = [s.request_id for s in specs]
    runs: list[dict] = []
    reference: list[list[int]] | None = None
    check: dict | None = None
    if config.check_outputs:
        check = {"reference": "stock#1", "requests": len(specs), "runs": {}}
    planned = plan_runs(config.repeat)
    with scoped_env({}, ENGINE_DEFAULTS), \
            tempfile.TemporaryDirectory(prefix="proxima-bench-") as tmp:
        for allocator, rep in planned:
            print(f"proxima bench: {allocator} run {rep}/{config.repeat}", file=sys.stderr,
                  flush=True)
            figures, tokens = run_once(allocator, config, specs, Path(tmp), build_llm,
                                       sampling_params, rep)
            runs.append(figures)
            if check is not None:
                if reference is None:
                    reference = tokens
                else:
                    check["runs"][f"{allocator}#{rep}"] = compare_tokens(reference, tokens,
                                                                       request_ids)
            print(f"proxima bench: {allocator} run {rep}/{config.repeat} done: "
                  f"{figures['elapsed_s']:.2f} s, {figures['output_tokens_per_s']:.1f} output "
                  f"tok/s ({len(runs)} of {len(planned)} runs)", file=sys.stderr, flush=True)
            if after_run is not None:
                after_run(runs, check, len(planned))
    results = {a: summarize([r for r in runs if r["allocator"] == a]) for a in ALLOCATORS}
    return {"runs": runs, "results": results, "check_outputs": check}
