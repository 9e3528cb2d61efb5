"""Two engines on one simulated GPU (issue 33, item 5): `proxima replay --engines 2`, vLLM
0.26's real schedulers, Proxima's real elastic connector and policy with a real ledger
file, against a static split of two stock engines with half the GPU's KV each.

Small sizes: a GPU of 4 GiB of Llama-3.1-8B KV (2,048 blocks, 64 granules of 64 MiB),
48 requests, 64 running at most (vLLM's warm-up then maps 3 granules per engine)."""

from __future__ import annotations

import json

import pytest

from proxima.cli import main
from proxima.vllm import elastic_v1

if elastic_v1.unsupported_reason("scheduler"):
    pytest.skip(elastic_v1.unsupported_reason("scheduler"), allow_module_level=True)

GiB = 1 << 30
BLOCK = 2 << 20        # one block of the replay's Llama-3.1-8B shape, every layer
GPU = 4 * GiB
SMALL = ["--gpu-kv", "4GiB", "--requests", "48", "--max-num-seqs", "64"]


def replay(path, *argv) -> tuple[int, dict]:
    out = path / "two.json"
    code = main(["replay", "--engines", "2", "--no-progress", "--json", str(out), *SMALL,
                 *argv])
    return code, json.loads(out.read_text())


@pytest.fixture(scope="module")
def alternating(tmp_path_factory):
    path = tmp_path_factory.mktemp("two")
    plot = []
    try:
        import matplotlib  # noqa: F401

        plot = ["--plot", str(path / "two.png")]
    except ImportError:
        pass
    code, report = replay(path, "--workload", "alternating-bursts", *plot)
    return code, report, path / "two.png" if plot else None


def test_elastic_beats_the_static_split_on_alternating_bursts(alternating, capsys):
    code, report, _ = alternating
    s, e = report["results"]["static"]["total"], report["results"]["elastic"]["total"]
    assert e["completed"] == s["completed"] == 48
    for side in ("static", "elastic"):
        assert [x["completed"] for x in report["results"][side]["engines"].values()] == [24, 24]
    # the busy engine borrows the idle one's memory: its last requests do not queue
    assert e["ttft_p99_steps"] < s["ttft_p99_steps"]
    assert e["queue_wait_p99_steps"] < s["queue_wait_p99_steps"]
    assert e["finish_steps"] <= s["finish_steps"]
    assert e["preemptions"] <= s["preemptions"]
    assert code == 0 and all(report["checks"].values()), report["checks"]


def test_the_engines_never_hold_more_than_the_gpu_and_each_borrows_beyond_its_half(
        alternating):
    _, report, _ = alternating
    elastic = report["results"]["elastic"]
    rows = elastic["memory_timeline"]
    assert all(a + b <= GPU for _, a, b in rows)          # confirmed maps, every change
    assert elastic["total"]["peak_mapped_bytes"] <= GPU    # the workers' (maps in flight too)
    for name, engine in elastic["engines"].items():
        assert engine["peak_mapped_bytes"] > GPU // 2, name
        assert engine["elastic"]["failed_grow_attempts"] >= 1    # the GPU was full...
        assert engine["elastic"]["yields"] >= 1, name            # ...and each gave way
    static = report["results"]["static"]
    assert static["memory_timeline"] == [[0, GPU // 2, GPU // 2]]


def test_the_idle_engine_goes_back_to_its_minimum_during_the_others_burst(alternating):
    """B's first burst arrives at step 1,200 (within 50 steps): A, idle since its own
    burst, gives B what B asks for at once (the ledger) and the rest within a release
    delay (10 s: 400 steps), down to its one granule (the null block's)."""
    _, report, _ = alternating
    granule = report["settings"]["granule_blocks"] * BLOCK   # the product's own choice
    assert granule == 256 * BLOCK                            # 4 GiB: 8 granules of 512 MiB
    rows = report["results"]["elastic"]["memory_timeline"]
    at_min = [step for step, a, _ in rows if 1200 <= step < 2400 and a <= granule]
    assert at_min and at_min[0] <= 1200 + 50 + 400 + 50
    # and, the load over, both end at their minimum
    for engine in report["results"]["elastic"]["engines"].values():
        assert engine["final_mapped_bytes"] == granule
        assert engine["elastic"]["bytes_returned"] > 0


def test_the_plot_is_written(alternating):
    _, _, plot = alternating
    if plot is None:
        pytest.skip("matplotlib is not installed")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_elastic_ties_on_a_steady_load_started_at_the_static_split(tmp_path, capsys):
    """Both engines busy all the time, each with as many requests as its half holds:
    started with half the GPU mapped each (--kv-initial), elastic schedules as the static
    split does."""
    code, report = replay(tmp_path, "--workload", "steady", "--kv-initial", "2GiB")
    s, e = report["results"]["static"]["total"], report["results"]["elastic"]["total"]
    assert report["settings"]["in_flight_per_engine"] == 1024 // 144
    assert e["completed"] == s["completed"] == 48
    for key in ("queue_wait_p50_steps", "queue_wait_p99_steps", "ttft_p50_steps",
                "ttft_p99_steps", "finish_steps"):
        assert e[key] <= 1.02 * s[key], key
    assert code == 0 and all(report["checks"].values()), report["checks"]
    assert "comparison (elastic must tie (within 1.02x) the static split): passed" in \
        capsys.readouterr().out


def test_an_engine_started_above_its_minimum_yields_to_the_others_first_burst(tmp_path):
    """Both engines started with half the GPU mapped (--kv-initial), B with no request
    until step 1,200: B's connector keeps its engine stepping until its policy has looked
    at that memory, reads A's unmet demand in the ledger and gives it during A's first
    burst, not only once a request of its own comes."""
    code, report = replay(tmp_path, "--workload", "alternating-bursts", "--kv-initial", "2GiB")
    elastic = report["results"]["elastic"]
    first = [(step, a, b) for step, a, b in elastic["memory_timeline"] if step < 1200]
    assert list(first[0][1:]) == [GPU // 2, GPU // 2]          # the start: half each
    assert min(b for _, _, b in first) < GPU // 2              # B gave during A's burst...
    assert max(a for _, a, _ in first) > GPU // 2              # ...and A borrowed it
    assert elastic["engines"]["B"]["elastic"]["yields"] >= 1
    assert all(a + b <= GPU for _, a, b in elastic["memory_timeline"])
    assert code == 0 and all(report["checks"].values()), report["checks"]


@pytest.mark.parametrize("gpu, kept", [("4GiB", (11, 11)), ("1GiB", (9, 6))],
                         ids=["room", "crowded"])
def test_each_engine_keeps_twice_its_warm_up_after_start_up_where_the_gpu_has_room(
        tmp_path, gpu, kept):
    """No --kv-initial, granules of 64 MiB, 160 running at most: vLLM's warm-up maps 6
    granules per engine (ids 1..160) and each engine grows at start-up, before the first
    tick, to twice that (11 granules, ids up to 320) -- A first, then B beside it -- but
    only into what NVML's free memory says, less 5% of the GPU: on 4 GiB both keep 11; on
    1 GiB (16 granules, 12 of them warm-up's) A keeps 9 and B, beside it, 6 (its warm-up):
    nothing beyond the GPU, no failed start."""
    code, report = replay(tmp_path, "--workload", "steady", "--gpu-kv", gpu,
                          "--max-num-seqs", "160", "--granule-blocks", "32")
    elastic = report["results"]["elastic"]
    granule = 32 * BLOCK
    first = elastic["memory_timeline"][0]
    assert first[0] == 0 and [first[1] // granule, first[2] // granule] == list(kept)
    limit = int(gpu[:-3]) * GiB
    assert all(a + b <= limit for _, a, b in elastic["memory_timeline"])
    assert elastic["total"]["peak_mapped_bytes"] <= limit
    assert elastic["total"]["completed"] == 48


def test_elastic_ties_on_a_steady_load_from_a_cold_start(tmp_path):
    """No --kv-initial, the GPU's 16 GiB and 1,024 running at most: each engine grows at
    start-up to twice vLLM's warm-up (5 GiB), so its first steps, while the load's first
    grow maps, admit what the static split admits (started at its minimum, one granule,
    the first step admitted half a step's tokens and the cold burst's last requests waited
    a step more: queue wait p99 3 vs 2, TTFT p99 4 vs 3)."""
    code, report = replay(tmp_path, "--workload", "steady", "--max-num-seqs", "1024",
                          "--gpu-kv", "16GiB")
    s, e = report["results"]["static"]["total"], report["results"]["elastic"]["total"]
    for key in ("queue_wait_p99_steps", "ttft_p99_steps", "finish_steps"):
        assert e[key] <= 1.02 * s[key], (key, e[key], s[key])
    assert code == 0 and all(report["checks"].values()), report["checks"]


def test_memory_an_engine_unmaps_is_the_others_only_once_its_worker_is_done():
    """The shared GPU counts an unmap's granules as held until the worker has done it (a
    worker unmaps on its own thread, behind what it was doing): a map by the other engine
    at that moment fails, and succeeds once the unmap is done. Two stand-in workers on a
    GPU of 4 granules."""
    from proxima.memory.channel import ElasticChannel
    from proxima.memory.ops import Op, OpBatch
    from proxima.replay.shared_gpu import Gpu, GpuWorker

    gpu = Gpu(4, GiB)

    def worker():
        ch = ElasticChannel(4 * 512, 512)
        ch.state[:] = bytes([1]) * 4                 # all unmapped
        return GpuWorker(gpu, ch, GiB, map_gbps=100.0, unmap_gbps=10.0)

    a, b = worker(), worker()

    class Meta:
        def __init__(self, seq, *ops):
            self.batch = OpBatch(seq, ops)

    a.submit(Meta(0, Op.map(0, 4)), 0.0)             # a holds the whole GPU (done at 0.04 s)
    a.submit(Meta(1, Op.unmap(0, 2)), 1.0)           # gives 2 back: 0.2 s of unmapping
    b.submit(Meta(0, Op.map(0, 2)), 1.1)             # too early: a's worker is still at it
    assert len(b.mapped) == 0 and gpu.held() == 4
    assert b.report(2.0).report.entries()[0][1]      # its map failed
    b.submit(Meta(1, Op.map(0, 2)), 1.3)             # a's unmap done at 1.2 s: b gets it
    assert len(b.mapped) == 2 and gpu.held() == 4
    assert gpu.memory() == (0, 4 * GiB)
