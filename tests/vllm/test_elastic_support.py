"""Where elastic KV memory runs, as the version table (activation.TESTED) says: the scheduler
side (pool, connector, compactor: the CPU replay) on every tested V1 release; the worker side
in an engine where it is proven on a GPU (0.26.0). On 0.33.0 the worker side has run on CPU
only: PROXIMA_ELASTIC=1 in an engine is one clear refusal naming the override, not a crash
deep inside the worker, and PROXIMA_ALLOW_UNPROVEN_ELASTIC=1 lets it through."""

import pytest
import vllm

from proxima.vllm import activation, elastic_v1


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv(activation.ALLOW_UNPROVEN_ENV, raising=False)
    yield
    elastic_v1.deactivate()


def test_the_scheduler_side_runs_on_every_tested_v1_release():
    assert activation.support(vllm.__version__).elastic_scheduler in (activation.GPU,
                                                                      activation.CPU_ONLY)
    assert elastic_v1.unsupported_reason("scheduler") is None


def test_the_engine_runs_where_proven_and_is_refused_in_one_line_where_not(monkeypatch):
    support = activation.support(vllm.__version__)
    reason = elastic_v1.unsupported_reason("engine")
    if support.elastic_worker == activation.GPU:
        assert reason is None
        return
    assert support.elastic_worker == activation.CPU_ONLY
    assert reason and "\n" not in reason and vllm.__version__ in reason
    assert "PROXIMA_ALLOW_UNPROVEN_ELASTIC=1" in reason and "vLLM 0.26.0" in reason
    with pytest.raises(activation.ActivationError, match="PROXIMA_ELASTIC=1 on vLLM") as info:
        elastic_v1.activate()
    assert "\n" not in str(info.value)
    assert not elastic_v1.is_active()
    monkeypatch.setenv(activation.ALLOW_UNPROVEN_ENV, "1")
    assert elastic_v1.unsupported_reason("engine") is None


def test_a_bad_override_value_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(activation.ALLOW_UNPROVEN_ENV, "yes")
    with pytest.raises(activation.ActivationError, match="PROXIMA_ALLOW_UNPROVEN_ELASTIC must "
                                                         "be 1") as info:
        activation.check_environment()
    assert "'yes'" in str(info.value)


def test_the_connector_s_worker_side_is_refused_where_unproven(monkeypatch):
    """The connector configured by hand (no plugin) meets the same refusal in the worker."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from proxima.vllm.elastic_connector import ProximaElasticConnector
    from proxima.errors import UserError
    from proxima.replay.driver_v1 import build_scheduler
    from vllm.config import KVTransferConfig

    if activation.support(vllm.__version__).elastic_worker == activation.GPU:
        pytest.skip(f"vLLM {vllm.__version__}'s worker side is proven on a GPU")
    ktc = KVTransferConfig(**elastic_v1.connector_config({"policy": "off"}))
    scheduler = build_scheduler(proxima=True, num_blocks=512, kv_transfer_config=ktc)
    try:
        with pytest.raises(UserError, match="PROXIMA_ALLOW_UNPROVEN_ELASTIC=1"):
            ProximaElasticConnector(scheduler.vllm_config, KVConnectorRole.WORKER,
                                    scheduler.kv_cache_config)
    finally:
        from proxima.vllm import vllm_v1

        vllm_v1.deactivate()
