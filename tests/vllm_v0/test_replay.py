"""Short replays of every workload through vLLM 0.6.3's real V0 scheduler on CPU, stock
and Proxima on the identical trace: the parity and contiguity targets of the card stack.

Sizes are cut down from the defaults of `proxima replay` (see docs/card-stack.md for the
full-size numbers); the pool sizes are the defaults (55,735 blocks, pressure 1,920).
Scheduler time is measured and recorded (``record_property``), but only a gross
regression is asserted: this machine has 2 shared cores.
"""

from __future__ import annotations

import pytest

from tests.vllm_v0.helpers import card_stack_or_skip

card_stack_or_skip()

from proxima.replay.driver_v0 import run_replay  # noqa: E402
from proxima.workloads import make_workload  # noqa: E402

DEFAULT_BLOCKS = 55735
CASES = {
    # name: (requests, num_blocks, extra run_replay arguments)
    "chat": (100, DEFAULT_BLOCKS, {}),
    "sharegpt": (300, DEFAULT_BLOCKS, {}),
    "multiturn": (240, DEFAULT_BLOCKS, {}),
    "pressure": (160, 1920, {}),
    "pressure-swap": (120, 1920, {"preemption_mode": "swap"}),
}
_results: dict[str, dict] = {}


def replay(case: str) -> dict:
    """``{"stock": ReplayResult, "proxima": ReplayResult}`` of one case (run once)."""
    if case not in _results:
        requests, num_blocks, extra = CASES[case]
        workload = make_workload(case.split("-")[0], requests, seed=0)
        _results[case] = {
            side: run_replay(workload, proxima=side == "proxima", num_blocks=num_blocks,
                             **extra)
            for side in ("stock", "proxima")}
    return _results[case]


@pytest.mark.parametrize("case", list(CASES))
def test_parity(case, record_property):
    result = replay(case)
    stock, proxima = result["stock"].as_dict(), result["proxima"].as_dict()
    for key in ("completed", "steps", "preemptions", "prefix_hit_rate", "single_run_fraction",
                "blocks_per_run", "own_single_run_fraction", "scheduler_ms_per_step"):
        record_property(f"stock_{key}", stock[key])
        record_property(f"proxima_{key}", proxima[key])
    assert proxima["completed"] == stock["completed"] == CASES[case][0]
    assert proxima["preemptions"] <= stock["preemptions"]
    assert proxima["recompute_preemptions"] <= stock["recompute_preemptions"]
    assert proxima["swap_preemptions"] <= stock["swap_preemptions"]
    assert proxima["prefix_hit_rate"] >= stock["prefix_hit_rate"] - 0.005
    assert proxima["blocks_leaked"] == stock["blocks_leaked"] == 0
    assert proxima["allocator_stats"]["num_reserved"] == 0


@pytest.mark.parametrize("case", ["chat", "sharegpt"])
def test_contiguity(case):
    proxima = replay(case)["proxima"]
    assert proxima.single_run_fraction >= 0.95
    assert replay(case)["stock"].single_run_fraction < 0.5


def test_contiguity_multiturn():
    """70 % of multiturn's prompt blocks are prefix-cache hits: blocks of the previous turn.
    While the pool is mostly free, runs are spread out, so a turn continues its previous
    turn's run in place and the whole table (hits included) is one run."""
    result = replay("multiturn")
    assert result["proxima"].prefix_hit_rate > 0.5
    assert result["proxima"].single_run_fraction >= 0.95
    assert result["proxima"].details["own_single_run_fraction"] >= 0.95
    assert result["stock"].details["own_single_run_fraction"] < 0.5


def test_pressure_preempts_and_swaps():
    assert replay("pressure")["stock"].details["recompute_preemptions"] > 0
    swap = replay("pressure-swap")
    assert swap["stock"].details["swap_preemptions"] > 0
    assert swap["proxima"].details["swap_preemptions"] == swap["stock"].details["swap_preemptions"]
    # A pool full of running prompts (V0 admits until it is) grows only by preemption:
    # Proxima's runs are short there, but never shorter than stock's.
    for case in ("pressure", "pressure-swap"):
        result = replay(case)
        assert result["proxima"].blocks_per_run >= result["stock"].blocks_per_run


def test_scheduler_time_recorded(record_property):
    """What the replay reports as scheduler time is a time per step of the same steps on
    both sides: positive, at most the run's wall time, ``scheduler_seconds / steps``, over
    identical step counts. How the two compare is a benchmark's business, not a test's
    (``proxima replay --repeat``; docs/card-stack.md): the ratio of the best of two
    interleaved runs is recorded, not judged."""
    import time

    workload = make_workload("chat", 100, seed=0)
    best = {"stock": float("inf"), "proxima": float("inf")}
    steps = {}
    for _ in range(2):
        for side in best:
            t0 = time.perf_counter()
            result = run_replay(workload, proxima=side == "proxima", num_blocks=4096)
            wall = time.perf_counter() - t0
            assert 0 < result.details["scheduler_seconds"] <= wall
            assert result.scheduler_ms_per_step == pytest.approx(
                1000 * result.details["scheduler_seconds"] / result.steps)
            steps.setdefault(side, result.steps)
            assert result.steps == steps[side]            # deterministic per side
            best[side] = min(best[side], result.scheduler_ms_per_step)
    assert steps["stock"] == steps["proxima"]
    ratio = best["proxima"] / best["stock"]
    record_property("scheduler_ms_per_step_ratio", ratio)
    print(f"chat scheduler ms/step: stock {best['stock']:.3f} proxima "
          f"{best['proxima']:.3f} ratio {ratio:.3f}")


def test_progress_and_result_type():
    """The V0 driver returns the V1 driver's result type, and calls the progress callback."""
    from proxima.replay.result import FIELDS, ReplayResult

    calls = []
    result = run_replay(make_workload("chat", 12, seed=1), proxima=True, num_blocks=4096,
                        progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (12, 12) and all(t == 12 for _, t in calls)
    assert type(result) is ReplayResult and result.completed == 12
    assert result.largest_free_run_timeline == []          # only when asked for
    figures = result.as_dict()
    for key in (*FIELDS, "recompute_preemptions", "swap_preemptions"):
        assert key in figures


def test_timeline_when_asked_for():
    result = run_replay(make_workload("chat", 12, seed=1), proxima=False, num_blocks=4096,
                        timeline_every=5)
    steps = [t[0] for t in result.largest_free_run_timeline]
    assert steps and steps == sorted(steps) and all(s % 5 == 0 for s in steps)
    assert all(0 < largest <= free <= 4096 for _, free, largest in
               result.largest_free_run_timeline)


def test_replay_cli_on_the_card_stack_reports_the_median(tmp_path, capsys):
    """`proxima replay` drives the V0 driver: the shared table and JSON, the median time."""
    import json
    import statistics

    from proxima.cli import main

    out = tmp_path / "r.json"
    assert main(["replay", "--workload", "pressure", "--requests", "40", "--num-blocks", "300",
                 "--preemption-mode", "swap", "--repeat", "3", "--no-progress",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["preemption_mode"] == "swap"
    for side in ("stock", "proxima"):
        figures = report["results"][side]
        assert figures["completed"] == 40 and figures["swap_preemptions"] > 0
        assert figures["scheduler_ms_per_step"] == statistics.median(
            figures["scheduler_ms_per_step_runs"])
    assert "parity checks: all passed" in capsys.readouterr().out


def test_async_scheduling_is_refused_on_the_v0_engine(capsys):
    from proxima.cli import main

    assert main(["replay", "--workload", "chat", "--requests", "4", "--async-scheduling",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("proxima replay: error: --async-scheduling needs vLLM's V1 engine")
