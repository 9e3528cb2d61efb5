"""The pieces of online mode and of the report arithmetic, one by one."""

from __future__ import annotations

import statistics

import pytest

from proxima.bench import stats
from proxima.bench.online import normalize_base_url, parse_preemptions, poisson_offsets
from proxima.bench.online_request import chat_text, request_body
from proxima.errors import UserError
from proxima.workloads import RequestSpec


def test_parse_preemptions_prefers_total_and_sums_label_sets():
    text = ("# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="m"} 4.0\n'
            'vllm:num_preemptions_created{engine="0"} 1.7e9\n'
            'vllm:num_preemptions{engine="0"} 100\n')
    assert parse_preemptions(text) == 7
    assert parse_preemptions('vllm:num_preemptions{engine="0"} 2\n') == 2
    assert parse_preemptions("vllm:num_requests_running 1\n# vllm:num_preemptions_total 5\n") is None
    assert parse_preemptions("") is None


@pytest.mark.parametrize("given, want", [
    ("http://h:8000", "http://h:8000"), ("http://h:8000/", "http://h:8000"),
    ("http://h:8000/v1", "http://h:8000"), ("https://h/v1/", "https://h"),
])
def test_normalize_base_url(given, want):
    assert normalize_base_url(given) == want


def test_normalize_base_url_rejects():
    with pytest.raises(UserError):
        normalize_base_url("h:8000")


def test_chat_text_is_deterministic_injective_and_keeps_prefixes():
    assert chat_text([3, 31999]) == chat_text([3, 31999])
    words = [chat_text([i]) for i in range(0, 32000, 7)]
    assert len(set(words)) == len(words)
    assert chat_text([5, 6, 7]).startswith(chat_text([5, 6]) + " ")
    assert len(chat_text(list(range(100, 150))).split()) == 50


def test_request_body_carries_the_workload_unchanged():
    spec = RequestSpec("r", [9, 8, 7], 42)
    body = request_body(spec, "completions", "m")
    assert body["prompt"] == [9, 8, 7] and body["max_tokens"] == 42 and body["model"] == "m"
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["stream"] is True
    chat = request_body(spec, "chat", "m")
    assert "prompt" not in chat and chat["messages"][0]["content"] == chat_text([9, 8, 7])


def test_poisson_offsets_are_seeded_and_have_the_asked_rate():
    a = poisson_offsets(2000, 50.0, seed=1)
    assert a == poisson_offsets(2000, 50.0, seed=1) and a != poisson_offsets(2000, 50.0, seed=2)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.1)


def test_percentile_matches_linear_interpolation():
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([10], 99) == 10
    assert stats.percentile([4, 1, 3, 2], 0) == 1 and stats.percentile([4, 1, 3, 2], 100) == 4
    assert stats.percentile(list(range(101)), 90) == 90
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError):
        stats.percentile([1], 101)


def test_latency_summary_in_ms_with_fixed_layout():
    s = stats.latency_summary([0.1, 0.2, 0.3])
    assert s["n"] == 3 and s["p50"] == pytest.approx(200) and s["mean"] == pytest.approx(200)
    assert stats.latency_summary([]) == {"n": 0, "mean": None, "p50": None, "p90": None,
                                         "p99": None}


def test_spread_and_ratio_treat_unknown_as_unknown():
    assert stats.spread([100, 110, 90]) == {"median": 100, "min": 90, "max": 110,
                                            "spread_pct": 20.0}
    assert stats.spread([100])["spread_pct"] is None
    assert stats.spread([None, None])["median"] is None
    assert stats.ratio(3, 2) == 1.5
    assert stats.ratio(None, 2) is None and stats.ratio(3, 0) is None


def test_ratios_divide_by_the_first_label():
    results = {"A": {"x": 2.0, "lat": {"p50": 10.0}}, "B": {"x": 3.0, "lat": {"p50": 5.0}},
               "C": {"x": None, "lat": {}}}
    r = stats.ratios(results, ["x", "lat.p50"])
    assert r == {"B/A": {"x": 1.5, "lat.p50": 0.5}, "C/A": {"x": None, "lat.p50": None}}
    assert stats.ratios({"A": results["A"]}, ["x"]) == {}
