"""``proxima serve MODEL --elastic`` with no sizing flag: the facts for
:func:`proxima.serve.sizing.plan` gathered (the GPU's size and free memory from the
pre-flight probe, the model's config, the GPU's ledger) and its answer applied to vLLM's
options and the engine's elastic options.

``--gpu-memory-bytes SIZE`` sizes for a GPU of that many bytes instead of the probed one
(leave the rest to other processes; or plan, on any machine, whether models fit).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from proxima.config import parse_size
from proxima.errors import UserError
from proxima.serve import sizing
from proxima.serve.argv import flag_value, given, last_value

log = logging.getLogger("proxima.serve")

GPU_BYTES_FLAG = "--gpu-memory-bytes"
ASK_TIMEOUT_S = 60.0        # how long a starting engine waits for the others to give back


def take_gpu_bytes(argv: list[str]) -> tuple[list[str], int | None]:
    """``argv`` without ``--gpu-memory-bytes SIZE``, and the size (None: not given)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        flag, eq, inline = argv[i].partition("=")
        if flag == GPU_BYTES_FLAG:
            text, i = flag_value(argv, i, inline if eq else None,
                                 f"{GPU_BYTES_FLAG} needs a value (e.g. {GPU_BYTES_FLAG} 80GiB)")
            value = parse_size(text, GPU_BYTES_FLAG, least=1)
        else:
            rest.append(argv[i])
        i += 1
    return rest, value


#: vLLM's default --max-num-seqs for its API server on a large GPU (the bound of what the
#: KV of one engine could ever hold, when the option is not given)
DEFAULT_MAX_NUM_SEQS = 1024


def model_nonkv(model: str, dtype: str | None = None, quantization: str | None = None,
                gpus: int = 1) -> int | None:
    """What one GPU of the model's engine holds besides KV (:func:`sizing.nonkv_estimate`
    of its weights, split over ``gpus``); None where the model has no local config.json."""
    weights = model_weights(model, dtype, quantization, gpus)
    return None if weights is None else sizing.nonkv_estimate(weights)


def model_weights(model: str, dtype: str | None = None, quantization: str | None = None,
                  gpus: int = 1) -> int | None:
    """The model's weights on one GPU of ``gpus`` (None: no local config.json)."""
    config = sizing.read_model_config(model)
    if config is None:
        return None
    try:
        weights = sizing.weights_estimate(config, dtype, quantization)
    except ValueError as exc:
        raise UserError(f"{model}: cannot estimate the model's size ({exc}): give "
                        f"--kv-cache-memory-bytes and --gpu-memory-utilization") from None
    return -(-weights // max(1, gpus))


def usable_kv(vargs, gpus: int = 1) -> int | None:
    """The most KV the engine could ever use on one GPU: ``--max-num-seqs`` sequences of
    ``--max-model-len`` tokens (else the config's longest), None without a config."""
    config = sizing.read_model_config(vargs.model)
    if config is None:
        return None
    length = getattr(vargs, "max_model_len", None) or \
        sizing._text_config(config).get("max_position_embeddings")
    if not isinstance(length, int) or length <= 0:
        return None
    seqs = getattr(vargs, "max_num_seqs", None) or DEFAULT_MAX_NUM_SEQS
    kv_dtype = str(getattr(vargs, "kv_cache_dtype", None) or "auto")
    per_token = sizing.kv_bytes_per_token(config, 1 if "fp8" in kv_dtype else 2)
    return -(-per_token * length * seqs // max(1, gpus))


def ledger_others(uuid: str | None, ledger_dir: str | None = None) -> list[sizing.Other]:
    """The Proxima engines on the GPU ``uuid`` now, from its ledger (none without a uuid)."""
    if not uuid:
        return []
    from proxima.memory.ledger import ledger_path, live_records

    try:
        records = live_records(ledger_path(uuid, ledger_dir))
    except (OSError, ValueError):
        return []
    return [sizing.Other(nonkv=r.nonkv, min=r.min, mapped=r.mapped,
                         label=r.model or str(r.pid)) for r in records]


def gpu_facts(facts: dict) -> tuple[int | None, int | None, str | None]:
    """(total, free, uuid) of the engine's GPU (the first visible one) from the probe."""
    devices = facts.get("devices") or []
    if not devices:
        return None, None, None
    first = devices[0]
    return first.get("total_memory"), first.get("free_memory"), first.get("uuid")


def apply(vargs, argv: list[str], elastic: dict, facts: dict,
          gpu_bytes: int | None = None, demo: bool = False) -> sizing.Sizing | None:
    """Size the engine of ``vargs`` (vLLM's parsed options): sets ``kv_cache_memory_bytes``
    and ``gpu_memory_utilization`` where not given on ``argv``, and in ``elastic`` (the
    engine's elastic options) ``min_bytes``/``max_bytes`` where not given and what the
    ledger says of this engine (``demo``: the embedded demo's own sizes are kept). Returns
    the sizing (None: the GPU's size is not known)."""
    gpus = (getattr(vargs, "tensor_parallel_size", 1) or 1) * \
        (getattr(vargs, "pipeline_parallel_size", 1) or 1)
    total, free, uuid = gpu_facts(facts)
    if gpu_bytes is not None:
        total, free = gpu_bytes, None
    if not total:
        return None
    nonkv = model_nonkv(vargs.model, getattr(vargs, "dtype", None),
                        getattr(vargs, "quantization", None), gpus)
    if nonkv is None:
        log.info("elastic sizing: %s has no local config.json to estimate its weights from; "
                 "counting none (give --kv-cache-memory-bytes to size it yourself)", vargs.model)
        nonkv = sizing.nonkv_estimate(0)
    others = ledger_others(uuid, elastic.get("ledger_dir")) if gpus == 1 else []
    kv_bytes_given = given(argv, "--kv-cache-memory-bytes") or demo
    util_given = given(argv, "--gpu-memory-utilization") or demo
    plan = sizing.plan(
        total, nonkv, others,
        kv_min=parse_size(elastic["min_bytes"]) if "min_bytes" in elastic else None,
        kv_max=parse_size(elastic["max_bytes"]) if elastic.get("max_bytes") is not None
        else None,
        reservation=vargs.kv_cache_memory_bytes if kv_bytes_given else None,
        utilization=vargs.gpu_memory_utilization if util_given else None,
        gpu_free=free, usable=usable_kv(vargs, gpus), what=f"model {vargs.model}")
    if not kv_bytes_given and not util_given:
        vargs.kv_cache_memory_bytes = plan.reservation
    if not util_given:
        vargs.gpu_memory_utilization = plan.utilization
    elastic.setdefault("min_bytes", plan.kv_min)
    if elastic.get("max_bytes") is None:
        # no --kv-max: what the GPU's other engines leave is kept at run time from the
        # ledger (proxima.memory.sharing), so the fixed maximum is the pool's; the room at
        # start-up would keep an engine started beside another below what that one holds
        # after it stopped or slept (H100, s32: the second of two models stayed at 42 GiB
        # while the first slept, the first had grown to 53)
        follows = bool(uuid) and gpus == 1
        elastic["max_bytes"] = plan.reservation if follows else plan.kv_max
        if follows and plan.others:
            plan = dataclasses.replace(plan, follows=True)
    served = getattr(vargs, "served_model_name", None)
    elastic.setdefault("ledger_model", (served[0] if served else vargs.model)[:200])
    if getattr(vargs, "port", None) and getattr(vargs, "uds", None) is None:
        elastic.setdefault("ledger_port", int(vargs.port))
    elastic.setdefault("ledger_nonkv_bytes", nonkv)
    if plan.ask_bytes and uuid:
        ask_others(uuid, plan.ask_bytes, free_now=_nvml_free(uuid),
                   ledger_dir=elastic.get("ledger_dir"))
    return plan


def ask_others(uuid: str, ask: int, free_now: Callable[[], int | None], *,
               ledger_dir: str | None = None, timeout: float = ASK_TIMEOUT_S,
               poll_s: float = 0.5, sleep=time.sleep) -> None:
    """Post ``ask`` bytes of unmet demand in the GPU's ledger (the other engines give back
    what they hold above their minimums, at their next step) until the GPU has that much
    more free than now, or ``timeout``: then one UserError. The record goes either way."""
    from proxima.memory.ledger import Ledger, ledger_path

    start = free_now()
    if start is None:
        return
    ledger = Ledger(ledger_path(uuid, ledger_dir), name="starting")
    log.info("elastic sizing: asking the GPU's other engines for %.2f GiB through %s",
             ask / 2**30, ledger.path)
    try:
        ledger.post(0, 0, ask)
        waited = 0.0
        while True:
            now = free_now()
            if now is not None and now - start >= ask:
                return
            if waited >= timeout:
                raise UserError(f"the GPU's other engines gave back "
                                f"{max(0, (now or start) - start) / 2**30:.2f} GiB of the "
                                f"{ask / 2**30:.2f} GiB this engine needs to start, within "
                                f"{timeout:.0f} s (they keep what serves live requests): "
                                f"start it when they are idler, or lower their --kv-max")
            sleep(poll_s)
            waited += poll_s
    finally:
        ledger.close()


def _nvml_free(uuid: str) -> Callable[[], int | None]:
    """NVML's free memory of the GPU ``uuid`` (no CUDA context in this process)."""
    def free() -> int | None:
        try:
            try:
                import pynvml
            except ImportError:
                from vllm.third_party import pynvml  # type: ignore[no-redef]
            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
            finally:
                pynvml.nvmlShutdown()
        except Exception:       # noqa: BLE001 - not known: the engine just starts
            return None
    return free


def model_sizes(models) -> list[tuple[str, int | None, int, int]]:
    """``(name, nonkv or None, weights, kv_min)`` of each ``(name, path, argv)``: the non-KV
    memory and weights on one GPU from its config.json (None and 0 without one), --dtype,
    --quantization and --tensor-parallel-size read from argv, and its --kv-min (default
    :data:`sizing.DEFAULT_KV_MIN`)."""
    rows = []
    for name, path, argv in models:
        tp = last_value(argv, "--tensor-parallel-size")
        weights = model_weights(path, last_value(argv, "--dtype"),
                                last_value(argv, "--quantization"),
                                int(tp) if tp and tp.isdigit() else 1)
        least = last_value(argv, "--kv-min")
        rows.append((name, None if weights is None else sizing.nonkv_estimate(weights),
                     weights or 0,
                     sizing.DEFAULT_KV_MIN if least is None
                     else parse_size(least, f"model {name!r}: --kv-min")))
    return rows


def check_alone(model: str | None, argv: list[str], elastic: dict, gpu_bytes: int) -> None:
    """``--gpu-memory-bytes`` given: whether the model fits on a GPU of that size at its
    minimum, before the GPU is probed (UserError, one line, when it does not)."""
    if not model:
        return
    tp = last_value(argv, "--tensor-parallel-size")
    nonkv = model_nonkv(model, last_value(argv, "--dtype"), last_value(argv, "--quantization"),
                        int(tp) if tp and tp.isdigit() else 1)
    if nonkv is None:
        return
    least = parse_size(elastic["min_bytes"]) if "min_bytes" in elastic else None
    sizing.plan(gpu_bytes, nonkv, kv_min=least, what=f"model {model}")
