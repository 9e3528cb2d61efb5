"""vLLM's ``LLM`` in offline mode: building one (:func:`default_build_llm`, refused in one
line where vLLM finds no GPU), reading its metrics and KV-block count, holding its
arrivals (:func:`hold_arrivals`), shutting it down and dropping what it held, and the
environment a run's engine core is started with (:func:`scoped_env`). Only
:func:`default_build_llm`, :func:`require_device` and :func:`default_sampling_params`
import vLLM: the rest is plain Python, tested with a stand-in ``LLM``.
"""

from __future__ import annotations

import gc
import os
import sys
from contextlib import contextmanager
from typing import Sequence

from proxima.errors import UserError


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


def check_load_format(value: str | None) -> None:
    """--load-format among the installed vLLM's formats (plugins' included), before any
    engine: vLLM checks it in the worker, once the engine is up (a traceback there). A
    vLLM without the table (0.6) is left to check it itself."""
    if value is None:
        return
    try:
        from vllm.model_executor import model_loader
    except ImportError:
        return
    known = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
    if isinstance(known, dict) and known and value.lower() not in known:
        raise UserError(f"--load-format {value!r} is not a load format of this vLLM: give one "
                        f"of {', '.join(sorted(known))} (dummy: random weights, config.json "
                        f"only)")


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
