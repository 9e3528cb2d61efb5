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
* Arrivals are held (``--arrivals held``, the default; :func:`hold_arrivals`): the engine's
  first step sees every request, so the scheduler makes the same decisions in every run
  and a difference between the allocators cannot hide in the timing of request arrival.

Per run: elapsed wall time of ``LLM.generate`` (engine start-up excluded), requests/s,
output and total tokens/s, preemptions (``vllm:num_preemptions`` via ``get_metrics``,
difference across the run), the KV-cache block count, and contiguity read from the
status file (``PROXIMA_STATS_FILE``, sampled while the run goes): Proxima's pool writes it,
and stock runs get ``PROXIMA_OBSERVE=1``, whose read-only observer writes the stock block
tables' blocks per run (V1 engine; elsewhere stock contiguity is n/a). ``--check-outputs`` compares every run's token
ids with the first stock run's, request by request.

Everything except :func:`default_build_llm` is plain Python, so the orchestration and the
arithmetic are tested on CPU with a stand-in ``build_llm``.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from proxima.bench.stats import median, spread
from proxima.engines.activation import ELASTIC_ENV, ENV as ALLOCATOR_ENV, OBSERVE_ENV
from proxima.engines.status import STATS_ENV, read_status
from proxima.errors import UserError
from proxima.workloads import RequestSpec

ALLOCATORS = ("stock", "proxima")
ARRIVALS = ("held", "as-sent")
STATUS_POLL_S = 0.5
FINAL_SNAPSHOT_WAIT_S = 1.0
MAX_DIFFERING_SHOWN = 5
# Set for the engines of a bench run unless the user set them (restored afterwards).
ENGINE_DEFAULTS = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",        # see the module docstring
    # Greedy decoding never uses the FlashInfer top-k/top-p sampler, but vLLM 0.26.0 builds
    # it at start-up and fails where FlashInfer is missing (the offline GPU host).
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
}


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


def metric_total(metrics: Sequence, name: str) -> int | None:
    """Sum of a counter over its label sets in ``LLM.get_metrics()``; None if absent."""
    values = [m.value for m in metrics if getattr(m, "name", None) == name
              and isinstance(getattr(m, "value", None), (int, float))]
    return int(sum(values)) if values else None


def kv_blocks_of(llm) -> int | None:
    """The KV-cache block count the engine settled on at start-up.

    Read from the front end's config (the engine core reports it back at start), else
    from the ``vllm:cache_config_info`` metric's ``num_gpu_blocks`` label."""
    try:
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        if blocks:
            return int(blocks)
    except AttributeError:
        pass
    try:
        for m in llm.get_metrics():
            if m.name == "vllm:cache_config_info" and m.labels.get("num_gpu_blocks") not in (None, "None"):
                return int(m.labels["num_gpu_blocks"])
    except Exception:  # noqa: BLE001 - metrics are a best-effort extra
        pass
    return None


class StatusSampler:
    """Reads the Proxima status file every ``STATUS_POLL_S`` while a run goes.

    The engine writes a snapshot at most once a second; the last one may be taken when
    few requests are still running, so contiguity is averaged over all snapshots of the
    run rather than read from the last. Each distinct snapshot (by its ``time``) is kept
    once."""

    def __init__(self, path: Path):
        self.path = path
        self.snapshots: list[dict] = []
        self._seen: set = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="proxima-status", daemon=True)

    def __enter__(self) -> "StatusSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # The engine writes a last snapshot when its last request is freed, which can land
        # just after generate() returns here: wait briefly for it (seen on the H200: one of
        # 200 finished requests missing from the stock tally without this).
        deadline = time.monotonic() + FINAL_SNAPSHOT_WAIT_S
        while not self._take() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _take(self) -> bool:
        """Keep the current snapshot if it is new; True when it was."""
        snap = read_status(self.path)
        if snap is not None and snap.get("time") not in self._seen:
            self._seen.add(snap.get("time"))
            self.snapshots.append(snap)
            return True
        return False

    def _loop(self) -> None:
        while not self._stop.wait(STATUS_POLL_S):
            self._take()


def contiguity(snapshots: Sequence[dict]) -> dict:
    """Contiguity figures from status snapshots; every value None when there are none.

    ``blocks_per_run``: a request's blocks divided by its runs of consecutive ids (1.0 =
    fully scattered), averaged. Preferred source (``blocks_per_run_source: "finished"``):
    the engine's tally over every request at completion, its whole KV just before it is
    freed (``finished_blocks_per_run`` of the last snapshot; counters are cumulative and
    each run has its own engine). Otherwise (``"running"``, e.g. the V0 engine): the mean
    over all ``running_blocks_per_run`` entries of all snapshots, sampled at most once a
    second. ``largest_free_run`` and ``fragmentation``: the allocator's, last snapshot."""
    finished = next((s["finished_blocks_per_run"] for s in reversed(snapshots)
                     if isinstance(s.get("finished_blocks_per_run"), dict)), {})
    values = [float(v) for s in snapshots
              for v in (s.get("running_blocks_per_run") or [])
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if finished.get("count") and isinstance(finished.get("mean"), (int, float)):
        source, mean, samples = "finished", float(finished["mean"]), int(finished["count"])
    elif values:
        source, mean, samples = "running", sum(values) / len(values), len(values)
    else:
        source, mean, samples = None, None, 0
    last_alloc = next((s["allocator"] for s in reversed(snapshots)
                       if isinstance(s.get("allocator"), dict)), {})
    checks = [s["invariants_ok"] for s in snapshots if isinstance(s.get("invariants_ok"), bool)]
    return {
        "active": any(s.get("active") is True for s in snapshots) if snapshots else None,
        "snapshots": len(snapshots),
        "blocks_per_run": mean,
        "blocks_per_run_samples": samples,
        "blocks_per_run_source": source,
        "largest_free_run": last_alloc.get("largest_free_run"),
        "fragmentation": last_alloc.get("fragmentation"),
        "invariants_ok": all(checks) if checks else None,
    }


def compare_tokens(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]],
                   request_ids: Sequence[str]) -> dict:
    """Request-by-request equality of generated token ids (order = the request list)."""
    if len(reference) != len(other):
        raise ValueError(f"cannot compare {len(other)} outputs with {len(reference)}")
    differing = [rid for rid, a, b in zip(request_ids, reference, other) if list(a) != list(b)]
    return {"identical": len(reference) - len(differing), "differing": len(differing),
            "first_differing": differing[:MAX_DIFFERING_SHOWN]}


def default_build_llm(kwargs: dict):
    """Build vLLM's ``LLM`` (imported here: the rest of this module needs no vLLM)."""
    from vllm import LLM
    if isinstance(kwargs.get("kv_transfer_config"), dict):
        from vllm.config import KVTransferConfig

        kwargs = dict(kwargs, kv_transfer_config=KVTransferConfig(**kwargs["kv_transfer_config"]))
    try:
        return LLM(**kwargs)
    except ValueError as exc:               # vLLM's own argument checks, e.g. KV too small
        raise UserError(f"vLLM refused the settings: {' '.join(str(exc).split())}") from None


def require_device() -> None:
    """One line before the first engine where vLLM finds no GPU platform (vLLM itself
    fails deep inside its config with "Device string must not be empty"). vLLM detects
    the platform through NVML, without initialising CUDA in this process."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    unspecified = getattr(current_platform, "is_unspecified", None)
    if (callable(unspecified) and unspecified()) or getattr(current_platform, "device_type",
                                                            None) == "" \
            or str(getattr(current_platform, "_enum", "")).endswith("UNSPECIFIED"):  # vLLM 0.6
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UserError(f"--offline runs vLLM's engine on a GPU and vLLM finds none{why}: run "
                        f"on a machine with an NVIDIA GPU, or benchmark running servers with "
                        f"--base-url URL")


# Checked by run_offline before the first run (stand-in builders in tests carry none).
default_build_llm.check_device = require_device


def default_sampling_params(max_tokens: int):
    from vllm import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


def shutdown(llm) -> None:
    """Stop the engine-core processes (they hold the GPU memory, not this process)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def collect() -> None:
    """Drop what this process still holds before the next engine is built."""
    gc.collect()
    torch = sys.modules.get("torch")       # never import (or initialise CUDA) just for this
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextmanager
def scoped_env(values: dict[str, str], defaults: dict[str, str] | None = None):
    """Set ``values`` (and ``defaults`` where unset) for the block, then restore exactly."""
    defaults = defaults or {}
    saved = {k: os.environ.get(k) for k in [*values, *defaults]}
    os.environ.update(values)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def hold_arrivals(llm) -> bool:
    """Make the engine's first step of the next ``llm.generate`` see every request.

    ``LLM.generate`` sends its requests one by one to the engine-core process, which starts
    scheduling on the first to arrive, so how many the first steps see depends on timing;
    under memory pressure that split alone moves the preemption count (197 to 215 for the
    same 500 requests, docs/benchmarks.md §3.1), whichever allocator runs. Here vLLM's own
    ``pause_scheduler("keep")`` utility holds the scheduler, generate() queues everything,
    and ``resume_scheduler`` runs just before generate() starts its engine loop (utility
    calls and requests travel in order on one socket, so every request is queued by then).
    An engine stepped in this process (vLLM 0.6's V0 ``LLMEngine``) needs nothing: generate()
    queues every request before its first step. Returns False, changing nothing, where this
    vLLM lacks what holding needs."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is None and callable(getattr(engine, "step", None)):
        return True
    run_engine = getattr(llm, "_run_engine", None)
    if not callable(getattr(core, "call_utility", None)) or not callable(run_engine):
        return False
    try:
        core.call_utility("pause_scheduler", "keep", False)
    except Exception as exc:     # an engine without the utility answers with an error
        print(f"proxima bench: cannot hold arrivals ({exc}); requests go as sent",
              file=sys.stderr, flush=True)
        return False

    def resume_then_run(*args, **kwargs):
        del llm._run_engine                  # once: later calls find LLM's own method
        core.call_utility("resume_scheduler")
        return run_engine(*args, **kwargs)

    llm._run_engine = resume_then_run
    return True


def run_once(allocator: str, config: OfflineConfig, specs: Sequence[RequestSpec],
             status_dir: Path, build_llm: Callable, sampling_params: Callable,
             rep: int) -> tuple[dict, list[list[int]]]:
    """One engine, one ``generate`` over all requests; returns (figures, token ids)."""
    status_path = status_dir / f"{allocator}-{rep}.json"
    # Stock runs are observed (read-only, see proxima.engines.observe_v1) for their contiguity.
    flags = {ALLOCATOR_ENV: "1" if allocator == "proxima" else "0", STATS_ENV: str(status_path),
             OBSERVE_ENV: "0" if allocator == "proxima" else "1"}
    kwargs = llm_kwargs(config)
    elastic = config.elastic and allocator == "proxima"
    flags[ELASTIC_ENV] = "1" if elastic else "0"
    if elastic:
        # The engine core's plugin activates elastic mode; the connector must also be in
        # this process's engine config (its plugin was loaded once, by the first run).
        from proxima.engines.elastic_v1 import connector_config

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


def elastic_figures(snapshots: Sequence[dict]) -> dict | None:
    """Mapped KV bytes over a run from the status snapshots (mean, peak, last) and the
    policy's counters at the end; None when the engine reported no elastic section."""
    sections = [s["elastic"] for s in snapshots if isinstance(s.get("elastic"), dict)]
    if not sections:
        return None
    mapped = [e.get("mapped_bytes") or 0 for e in sections]
    last = sections[-1]
    return {"mapped_bytes_mean": sum(mapped) / len(mapped), "mapped_bytes_peak": max(mapped),
            "mapped_bytes_last": mapped[-1], "pool_bytes": last.get("pool_bytes"),
            **{k: last.get(k) for k in ("grows", "shrinks", "failed_grows", "bytes_returned",
                                        "evicted_cached", "policy")}}


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
