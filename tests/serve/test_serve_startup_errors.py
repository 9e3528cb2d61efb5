"""An engine that fails to start is explained in one line naming the option to change. The
messages are produced by vLLM's own checks, so a vLLM upgrade that rewords them fails here."""

from __future__ import annotations

import pytest

from proxima.serve import startup_errors

vllm = pytest.importorskip("vllm")

from .conftest import v1_only  # noqa: E402

pytestmark = v1_only  # the texts of the V1 engine's own start-up errors (0.26.0, 0.33.0)


def kv_cache_memory_check():
    """vLLM's check that the KV cache holds one request of max_model_len tokens:
    ``_check_enough_kv_cache_memory``, moved from kv_cache_utils (0.26) to kv_cache_planning
    (0.33) with the same messages."""
    try:
        from vllm.v1.core.kv_cache_planning import _check_enough_kv_cache_memory
    except ImportError:
        from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
    return _check_enough_kv_cache_memory


def vllm_error(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    return f"ERROR [core.py] EngineCore failed to start.\nValueError: {info.value}\n" \
           "RuntimeError: Engine core initialization failed. See root cause above."


def test_free_memory_below_gpu_memory_utilization():
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    snapshot = MemorySnapshot(device="cpu", auto_measure=False, free_memory=10 * 2**30,
                              total_memory=140 * 2**30)
    text = vllm_error(request_memory, snapshot, CacheConfig(gpu_memory_utilization=0.9))
    failure = startup_errors.explain(text, gpu_memory_utilization=0.9)
    assert failure.out_of_memory
    assert failure.fix.startswith("lower --gpu-memory-utilization (now 0.9)")


def test_kv_cache_too_small_for_max_model_len():
    text = vllm_error(kv_cache_memory_check(), 2**30, lambda: 4 * 2**30, 131072,
                      lambda memory: 32768)
    failure = startup_errors.explain(text, max_model_len=131072, gpu_memory_utilization=0.9)
    assert failure.fix.startswith("lower --max-model-len (now 131072)")


def test_nothing_left_for_the_kv_cache():
    text = vllm_error(kv_cache_memory_check(), 0, lambda: 1, 2048, lambda memory: 0)
    failure = startup_errors.explain(text, gpu_memory_utilization=0.5)
    assert "nothing is left for the KV cache" in failure.why
    assert "lower --max-num-batched-tokens" in failure.fix and "(now 0.5)" in failure.fix


def test_cuda_oom_names_kv_cache_memory_bytes_when_it_was_given():
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 139.81 GiB of which 1.12 GiB is free.")
    failure = startup_errors.explain(text, kv_cache_memory_bytes=200 * 2**30)
    assert failure.out_of_memory
    assert failure.fix == "lower --kv-cache-memory-bytes (now 214748364800 = 200.00 GiB)"
    failure = startup_errors.explain(text, gpu_memory_utilization=0.95)
    assert failure.fix.startswith("lower --gpu-memory-utilization (now 0.95)")


def test_other_failures_quote_the_root_cause_not_the_wrapper():
    text = ("(EngineCore pid=12) ERROR KeyError: 'rope_type'\n"
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore': 1}")
    failure = startup_errors.explain(text)
    assert not failure.out_of_memory
    assert failure.why == "the engine failed to start: KeyError: 'rope_type'"
