import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM's V1 engine (the tested stack: ./dev test)")
if vllm.__version__.startswith("0.6."):
    pytest.skip(f"V1 tests need a V1-engine vLLM (0.26.0, 0.33.0), found {vllm.__version__}",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Every test leaves vLLM's classes as it found them (stock)."""
    from proxima.engines import observe_v1, vllm_v1

    vllm_v1.deactivate()
    observe_v1.deactivate()
    yield
    vllm_v1.deactivate()
    observe_v1.deactivate()
