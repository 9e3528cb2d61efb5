"""Online mode's figures: one server's run (:func:`summarize`, from its requests' records)
and several rounds merged into one result per server (:func:`merge_rounds`)."""

from __future__ import annotations

from typing import Sequence

from proxima.bench.online_request import RequestRecord
from proxima.bench.stats import latency_summary, median, spread

MAX_ERROR_SAMPLES = 5


def summarize(base_url: str, records: Sequence[RequestRecord], duration: float,
              preemptions: int | None) -> dict:
    """One server's figures (``base_url``: the server's). Throughput counts successful requests over the wall time
    from the first dispatch to the last completion (failed requests included in time)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_known) if ok and len(prompt_known) == len(ok) else None
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    sources = {r.tokens_from_usage for r in ok}
    return {
        "base_url": base_url,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:MAX_ERROR_SAMPLES]),
        "duration_s": duration,
        "requests_per_s": per_s(len(ok)),
        "output_tokens_per_s": per_s(out_tokens),
        "total_tokens_per_s": per_s(out_tokens + prompt_tokens) if prompt_tokens is not None else None,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_source": ("usage" if sources == {True} else "chunks" if sources == {False}
                                 else "mixed" if sources else None),
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.expected_tokens),
        "ttft_ms": latency_summary([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": latency_summary([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_summary([r.e2e for r in ok]),
        "preemptions": preemptions,
    }


SUMMED = ("requests", "completed", "errors", "output_tokens", "short_outputs")


def merge_rounds(rounds: Sequence[dict[str, dict]]) -> dict[str, dict]:
    """Several rounds (each ``{label: summarize(...)}``) -> one result per label.

    Counts are summed over rounds (``preemptions`` too, None if any round lacks it); rates,
    durations and each latency percentile are the median over rounds; ``rounds`` and
    ``output_tokens_per_s_spread`` (the label's noise band) are added and every round's own
    figures are kept in ``per_round``. A single round is returned as it is."""
    if len(rounds) == 1:
        return dict(rounds[0])
    merged = {}
    for label in rounds[0]:
        per = [r[label] for r in rounds]
        out = {"base_url": per[0]["base_url"], "rounds": len(per)}
        for key, first in per[0].items():
            if key in ("base_url", "error_samples", "output_tokens_source"):
                continue
            values = [p.get(key) for p in per]
            if key in SUMMED:
                out[key] = sum(v or 0 for v in values)
            elif key == "preemptions":
                out[key] = None if any(v is None for v in values) else sum(values)
            elif isinstance(first, dict):
                out[key] = {q: (sum(p[key].get(q) or 0 for p in per) if q == "n" else
                                median(p[key].get(q) for p in per)) for q in first}
            else:
                out[key] = median(values)
        samples: dict[str, int] = {}
        for p in per:
            for err, n in p["error_samples"].items():
                samples[err] = samples.get(err, 0) + n
        out["error_samples"] = dict(sorted(samples.items(), key=lambda kv: -kv[1])
                                    [:MAX_ERROR_SAMPLES])
        sources = {p["output_tokens_source"] for p in per}
        out["output_tokens_source"] = sources.pop() if len(sources) == 1 else "mixed"
        out["output_tokens_per_s_spread"] = spread(p["output_tokens_per_s"] for p in per)
        out["per_round"] = per
        merged[label] = out
    return merged
