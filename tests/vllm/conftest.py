import pytest

vllm = pytest.importorskip("vllm", reason="needs vllm==0.26.0 (the tested stack: ./dev test)")
if not vllm.__version__.startswith("0.26"):
    pytest.skip(f"V1 tests need vLLM 0.26.x, found {vllm.__version__}", allow_module_level=True)


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Every test leaves vLLM's classes as it found them (stock)."""
    from proxima.engines import observe_v1, vllm_v1

    vllm_v1.deactivate()
    observe_v1.deactivate()
    yield
    vllm_v1.deactivate()
    observe_v1.deactivate()
