"""Where elastic KV memory runs: the KV allocation of vLLM 0.26's V2 model runner. On any
other V1 release (0.33.0 is tested) PROXIMA_ELASTIC=1 is one clear refusal, not a crash
deep inside the worker."""

import pytest
import vllm

from proxima.engines import activation, elastic_v1


def test_elastic_runs_on_0_26_and_is_refused_in_one_line_elsewhere():
    reason = elastic_v1.unsupported_reason()
    if vllm.__version__ == "0.26.0":
        assert reason is None
        return
    assert reason and "vLLM 0.26.0" in reason and vllm.__version__ in reason
    with pytest.raises(activation.ActivationError, match="PROXIMA_ELASTIC=1 needs") as info:
        elastic_v1.activate()
    assert "\n" not in str(info.value)
    assert not elastic_v1.is_active()
