"""The steady load of the elastic proof's (d) (tools/gpu/elastic_child.py
``closed_loop``), on CPU against a small stand-in of vLLM V1's offline ``LLMEngine``.

vLLM's engine cannot run a model on this CPU-only machine, so the stand-in implements the
four calls the loop makes (add_request, step, has_unfinished_requests, abort_request) with
DELTA outputs as vLLM gives them, on a clock of its own: each step takes time that grows
with the batch and gives every running request up to two new tokens. What is checked is the
loop's own behaviour: it keeps C in flight and never more, it submits the list in order,
cycled, it counts each generated token once, in the window where its step ended, and it
drains then aborts when the windows are over.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "gpu"))

from elastic_child import closed_loop  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Engine:
    """A deterministic stand-in for ``LLMEngine`` (V1, DELTA outputs)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.running: dict[str, int] = {}          # request id -> tokens still to generate
        self.added: list[tuple[list[int], int]] = []
        self.emitted: dict[str, int] = {}
        self.wanted: dict[str, int] = {}
        self.steps: list[tuple[float, int, int]] = []   # (end time, tokens, running at start)
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        assert request_id not in self.wanted, f"request id {request_id} used twice"
        self.running[request_id] = params.max_tokens
        self.wanted[request_id] = params.max_tokens
        self.emitted[request_id] = 0
        self.added.append((prompt["prompt_token_ids"], params.max_tokens))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def abort_request(self, request_ids):
        for rid in request_ids:
            del self.running[rid]
            self.aborted.append(rid)

    def step(self):
        running = len(self.running)
        self.clock.t += 0.05 + 0.01 * running
        outs, total = [], 0
        for rid, left in list(self.running.items()):
            new = min(2, left)
            self.emitted[rid] += new
            total += new
            if left == new:
                del self.running[rid]
            else:
                self.running[rid] = left - new
            outs.append(SimpleNamespace(request_id=rid, finished=left == new,
                                        outputs=[SimpleNamespace(token_ids=[7] * new)]))
        self.steps.append((self.clock.t, total, running))
        return outs


REQUESTS = [([3 + i] * (4 + i), n) for i, n in enumerate([5, 40, 9, 22, 3, 61, 14])]


def run(concurrency=4, drain_s=30.0, requests=REQUESTS):
    clock = Clock()
    engine = Engine(clock)
    seen = []
    done = closed_loop(engine, requests, concurrency,
                       params=lambda m: SimpleNamespace(max_tokens=m), warmup_s=2.0,
                       windows=2, window_s=3.0, drain_s=drain_s, clock=clock,
                       on_window=lambda i, w: seen.append((i, dict(w))))
    return engine, done, seen


def test_the_closed_loop_keeps_c_in_flight_in_list_order_and_counts_each_token_once():
    engine, done, seen = run()
    start = 100.0
    bounds = [start, start + 2, start + 5, start + 8]
    # never more than C at once, and C at every step while submitting
    assert max(r for _, _, r in engine.steps) == 4
    assert all(r == 4 for t, _, r in engine.steps if t - (0.05 + 0.01 * r) < bounds[-1])
    # submitted in list order, cycled (the list went round more than once)
    n = done["submitted"]
    assert n > 2 * len(REQUESTS) and n == len(engine.added)
    assert engine.added == [REQUESTS[i % len(REQUESTS)] for i in range(n)]
    # the drain was long enough: every request finished, each with all its tokens
    assert done["drain"]["aborted"] == 0 and not engine.running
    assert engine.emitted == engine.wanted and done["completed"] == n
    # every generated token counted once, in the window in which its step ended
    wins = done["windows"]
    assert [w["kind"] for w in wins] == ["warmup", "measure", "measure"]
    assert sum(w["output_tokens"] for w in wins) + done["drain"]["output_tokens"] == \
        sum(engine.emitted.values())
    for i, w in enumerate(wins):
        assert w["output_tokens"] == sum(k for t, k, _ in engine.steps
                                         if bounds[i] <= t < bounds[i + 1])
        assert w["steps"] == sum(1 for t, _, _ in engine.steps if bounds[i] <= t < bounds[i + 1])
        assert w["output_tokens_per_s"] == round(w["output_tokens"] / (bounds[i + 1] - bounds[i]),
                                                 1)
        assert w["output_tokens"] > 0
    assert done["drain"]["output_tokens"] == sum(k for t, k, _ in engine.steps if t >= bounds[-1])
    assert sum(w["submitted"] for w in wins) == n
    # each window reported once, in order, when it had closed
    assert [i for i, _ in seen] == [0, 1, 2] and [w for _, w in seen] == wins


def test_the_drain_is_bounded_then_what_still_runs_is_aborted():
    long = [([5] * 8, 400), ([6] * 3, 2)]
    engine, done, _ = run(concurrency=3, drain_s=1.0, requests=long)
    assert done["drain"]["aborted"] == len(engine.aborted) > 0
    assert not engine.running                      # nothing left behind in the engine
    assert set(engine.aborted) == {rid for rid, n in engine.emitted.items()
                                   if n < engine.wanted[rid]}
    assert 1.0 <= done["drain"]["seconds"] < 1.0 + 0.2   # one step past the bound at most
    assert done["completed"] == done["submitted"] - len(engine.aborted)
    assert sum(w["output_tokens"] for w in done["windows"]) + done["drain"]["output_tokens"] \
        == sum(engine.emitted.values())


def test_the_step_log_has_every_step_at_its_end_with_its_tokens():
    clock = Clock()
    engine = Engine(clock)
    log: list = []
    done = closed_loop(engine, REQUESTS, 4, params=lambda m: SimpleNamespace(max_tokens=m),
                       warmup_s=2.0, windows=2, window_s=3.0, drain_s=30.0, clock=clock,
                       step_log=log)
    assert log == [(round(t, 4), k) for t, k, _ in engine.steps]
    assert sum(k for _, k in log) == sum(engine.emitted.values()) == \
        sum(w["output_tokens"] for w in done["windows"]) + done["drain"]["output_tokens"]


def test_the_closed_loop_refuses_an_empty_list():
    with pytest.raises(ValueError, match="no requests"):
        run(requests=[])


def test_side_by_side_engines_start_their_loads_when_the_driver_says_go(tmp_path):
    import threading
    import time as _time

    from elastic_child import start_together

    go = tmp_path / "go"

    def driver():                       # as elastic_proof.py: wait for ready, then go
        while not list(tmp_path.glob("go.ready-*")):
            _time.sleep(0.01)
        _time.sleep(0.2)
        go.write_text("go")

    threading.Thread(target=driver, daemon=True).start()
    waited = start_together(go, timeout=10)
    assert go.exists() and 0.2 <= waited < 5
    go.unlink()
    with pytest.raises(RuntimeError, match="did not appear within 0s"):
        start_together(go, timeout=0.1)
