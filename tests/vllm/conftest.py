import pytest

vllm = pytest.importorskip("vllm", reason="needs a tested vLLM of the V1 engine (./dev test)")

from proxima.vllm import activation  # noqa: E402

_entry = activation.tested(vllm.__version__)
if _entry is None or _entry.engine != "v1":
    pytest.skip(f"V1 tests need a tested vLLM of the V1 engine "
                f"({', '.join(t.vllm for t in activation.TESTED if t.engine == 'v1')}), "
                f"found {vllm.__version__}; tests/contract runs on any vLLM",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Every test leaves vLLM's classes as it found them (stock)."""
    from proxima.vllm import observe_v1, vllm_v1

    vllm_v1.deactivate()
    observe_v1.deactivate()
    yield
    vllm_v1.deactivate()
    observe_v1.deactivate()
