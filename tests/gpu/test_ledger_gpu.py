"""The GPU ledger as the elastic connector opens it on a real GPU: keyed by the GPU's UUID,
NVML's free/total memory read without a CUDA context in the (scheduler's) process.

    PROXIMA_EXPECT_GPU=1 python -m pytest -m gpu tests/gpu/test_ledger_gpu.py -v
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu


def test_the_connector_opens_the_gpus_ledger_without_a_cuda_context(tmp_path):
    try:
        from vllm.platforms import current_platform
    except ImportError:
        pytest.skip("needs vLLM")
    if not current_platform.is_cuda():
        if os.environ.get("PROXIMA_EXPECT_GPU") == "1":
            pytest.fail("PROXIMA_EXPECT_GPU=1 but vLLM sees no CUDA GPU")
        pytest.skip("needs an NVIDIA GPU")
    import torch

    from proxima.vllm.elastic_control import open_gpu_ledger
    from proxima.vllm.elastic_v1 import ElasticOptions

    ledger, gpu_memory = open_gpu_ledger(ElasticOptions(ledger_dir=str(tmp_path)), 1)
    assert ledger is not None and ledger.path.name.startswith("proxima-ledger-GPU-")
    free, total = gpu_memory()
    assert 0 < free <= total
    assert not torch.cuda.is_initialized()       # NVML only: no context, no memory taken
    ledger.post(1 << 30, 0, 0)
    assert [r.mapped for r in ledger.read().records] == [1 << 30]
    assert open_gpu_ledger(ElasticOptions(ledger=False), 1)[0] is None
    assert open_gpu_ledger(ElasticOptions(ledger_dir=str(tmp_path)), 2) == (None, None)
