"""proxima.replay.oracle on a real replay (vLLM 0.26's scheduler on CPU): the content model
read off vLLM's blocks reproduces the granule tally exactly for stock's own layout, so the
no-move layouts it scores are scored on the tally's terms."""

import pytest

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("name, blocks, G", [("multiturn", 768, 16), ("pressure", 640, 8)])
def test_the_content_model_reproduces_the_tally_for_stocks_layout(name, blocks, G):
    from proxima.replay import driver_v1, oracle
    from proxima.workloads import make_workload

    rec = oracle.ContentRecorder()
    r = driver_v1.run_replay(make_workload(name, requests=60), proxima=False,
                             num_blocks=blocks, granule_blocks=G, on_sample=rec)
    assert rec.samples == r.steps
    revived = sum(1 for intervals, _ in rec.contents if len(intervals) > 1)
    assert revived > 0                                   # prefix hits revive contents
    found = oracle.layouts(rec.contents, rec.samples, blocks, G)
    stock = found["stock"]
    assert stock["reclaimable_granule_fraction"] == pytest.approx(
        r.details["reclaimable_granule_fraction"], abs=1e-12)
    assert stock["packed_ideal_fraction"] == pytest.approx(
        r.details["packed_ideal_fraction"], abs=1e-12)
    for layout in found.values():
        assert layout["packed_ideal_fraction"] == stock["packed_ideal_fraction"]
        assert 0 <= layout["reclaimable_granule_fraction"] <= layout["packed_ideal_fraction"]
