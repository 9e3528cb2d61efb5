"""Offline mode's orchestration and report on CPU, with a stand-in for vLLM's ``LLM``.

The stand-in does what the real engine does at the boundary bench relies on: it reads
PROXIMA_ALLOCATOR when built (as the engine-core child does), writes the status file
only when Proxima is on, counts preemptions in ``get_metrics``, and returns token ids in
request order. Real vLLM runs in tests/gpu/test_bench_offline_gpu.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from proxima.bench import offline, offline_engine, offline_status, report
from proxima.bench.cli import offline_report
from proxima.vllm.status import write_status
from proxima.workloads import make_workload


class StandInCore:
    """The engine-core client's side that bench touches: shutdown, and the utility calls
    ``pause_scheduler`` / ``resume_scheduler``. Requests sent while paused are queued; the
    core records how many the first step saw (all queued ones, or just the first)."""

    def __init__(self, llm, utilities=True):
        self.llm, self.paused, self.queued, self.first_step = llm, False, 0, None
        if not utilities:
            self.call_utility = None

    def shutdown(self):
        StandInLLM.events.append(f"shutdown:{self.llm.allocator}")

    def call_utility(self, method, *args):
        StandInLLM.events.append(f"{method}{args}")
        if method == "pause_scheduler":
            self.paused = True
        elif method == "resume_scheduler":
            self.paused = False
        else:
            raise RuntimeError(f"Invalid method {method}")

    def add(self):
        self.queued += 1
        if self.first_step is None and not self.paused:
            self.first_step = 1                     # the engine starts on the first one


class StandInLLM:
    """Greedy 'model': output token i of a request is (sum of its prompt + i) % 1000.
    Shaped like vLLM's ``LLM``: generate() sends the requests, then runs ``_run_engine``."""

    built: list = []            # (allocator env, stats path) per construction, in order
    mp_methods: list = []       # VLLM_WORKER_MULTIPROC_METHOD seen at each construction
    observe_flags: list = []    # (PROXIMA_ALLOCATOR, PROXIMA_OBSERVE) at each construction
    events: list = []           # "build:<alloc>" / "shutdown:<alloc>" / utility calls in order
    first_steps: list = []      # requests the engine's first step saw, per run
    corrupt_index = -1          # proxima runs alter this request's last token (-1: none)
    blocks = {"0": 1000, "1": 1000}

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.allocator = os.environ["PROXIMA_ALLOCATOR"]
        self.observed = os.environ.get("PROXIMA_OBSERVE")
        StandInLLM.observe_flags.append((self.allocator, self.observed))
        self.mp_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        StandInLLM.mp_methods.append(self.mp_method)
        self.stats_path = os.environ["PROXIMA_STATS_FILE"]
        StandInLLM.built.append((self.allocator, self.stats_path))
        StandInLLM.events.append(f"build:{self.allocator}")
        self.preempted = 0
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(cache_config=SimpleNamespace(
                num_gpu_blocks=self.blocks[self.allocator])),
            engine_core=StandInCore(self))

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:num_preemptions", labels={"engine": "0"},
                                value=self.preempted),
                SimpleNamespace(name="vllm:num_requests_running", labels={}, value=3.0)]

    def generate(self, prompts, params, use_tqdm=False):
        assert len(prompts) == len(params)
        for _ in prompts:
            self.llm_engine.engine_core.add()
        return self._run_engine(prompts, params)

    def _run_engine(self, prompts, params):
        core = self.llm_engine.engine_core
        assert not core.paused, "a paused engine would never finish"
        if core.first_step is None:
            core.first_step = core.queued
        StandInLLM.first_steps.append(core.first_step)
        if self.allocator == "1":
            write_status({"active": True, "running_blocks_per_run": [4.0, 8.0],
                          "allocator": {"largest_free_run": 512, "fragmentation": 0.1},
                          "invariants_ok": True}, path=Path(self.stats_path))
        elif self.observed == "1":     # what proxima.vllm.observe_v1 writes for stock
            write_status({"active": False, "observer": True,
                          "running_blocks_per_run": [1.0, 2.0]}, path=Path(self.stats_path))
        self.preempted += 7 if self.allocator == "0" else 5
        outs = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            ids = p["prompt_token_ids"]
            tokens = [(sum(ids) + k) % 1000 for k in range(sp["max_tokens"])]
            if self.allocator == "1" and i == self.corrupt_index:
                tokens[-1] += 1
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens)]))
        return outs


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(StandInLLM, "built", [])
    monkeypatch.setattr(StandInLLM, "events", [])
    monkeypatch.setattr(StandInLLM, "first_steps", [])
    monkeypatch.setattr(StandInLLM, "mp_methods", [])
    monkeypatch.setattr(StandInLLM, "observe_flags", [])
    monkeypatch.setattr(StandInLLM, "corrupt_index", -1)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "outer")
    monkeypatch.delenv("PROXIMA_STATS_FILE", raising=False)
    return StandInLLM


def config(tmp_path, **kw):
    (tmp_path / "config.json").write_text("{}")
    return offline.OfflineConfig(model=str(tmp_path), load_format="dummy", progress=False, **kw)


def run(tmp_path, stand_in, specs, **kw):
    return offline.run_offline(config(tmp_path, **kw), specs, build_llm=stand_in,
                               sampling_params=lambda n: {"max_tokens": n})


def test_runs_alternate_with_the_flag_set_for_each_engine(tmp_path, stand_in):
    specs = make_workload("chat", 6).requests
    measured = run(tmp_path, stand_in, specs, repeat=2)
    assert [a for a, _ in stand_in.built] == ["0", "1", "0", "1"]
    assert len({p for _, p in stand_in.built}) == 4          # a fresh status file per run
    # each engine is shut down before the next one is built; arrivals are held in every run
    hold = ["pause_scheduler('keep', False)", "resume_scheduler()"]
    assert stand_in.events == ["build:0", *hold, "shutdown:0", "build:1", *hold,
                               "shutdown:1"] * 2
    assert stand_in.first_steps == [6] * 4                  # every request in the first step
    assert [r["arrivals"] for r in measured["runs"]] == ["held"] * 4
    # engine cores are spawned: a forked one would inherit this process's loaded plugin
    assert stand_in.mp_methods == ["spawn"] * 4
    assert os.environ["PROXIMA_ALLOCATOR"] == "outer"       # restored
    assert "PROXIMA_STATS_FILE" not in os.environ
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert [(r["allocator"], r["rep"]) for r in measured["runs"]] == [
        ("stock", 1), ("proxima", 1), ("stock", 2), ("proxima", 2)]


def test_llm_settings_are_identical_for_both_allocators(tmp_path, stand_in):
    seen = []

    class Recorder(StandInLLM):
        def __init__(self, kwargs):
            seen.append(dict(kwargs))
            super().__init__(kwargs)

    offline.run_offline(config(tmp_path, kv_cache_memory_bytes=4096, seed=3),
                        make_workload("chat", 2).requests, build_llm=Recorder,
                        sampling_params=lambda n: {"max_tokens": n})
    assert seen[0] == seen[1]
    assert seen[0]["kv_cache_memory_bytes"] == 4096 and seen[0]["load_format"] == "dummy"
    assert seen[0]["skip_tokenizer_init"] is True and seen[0]["disable_log_stats"] is False
    assert "gpu_memory_utilization" not in seen[0]           # vLLM's default unless given


def test_figures_per_run_and_summary(tmp_path, stand_in):
    specs = make_workload("pressure", 5, seed=1).requests
    measured = run(tmp_path, stand_in, specs, repeat=3)
    want_out = sum(s.max_tokens for s in specs)
    for r in measured["runs"]:
        assert r["output_tokens"] == want_out and r["short_outputs"] == 0
        assert r["output_tokens_per_s"] == pytest.approx(want_out / r["elapsed_s"])
        assert r["requests_per_s"] == pytest.approx(len(specs) / r["elapsed_s"])
        assert r["preemptions"] == (7 if r["allocator"] == "stock" else 5)
        assert r["kv_blocks"] == 1000
    stock, prox = measured["results"]["stock"], measured["results"]["proxima"]
    assert stock["runs"] == prox["runs"] == 3
    assert stock["preemptions_per_run"] == [7, 7, 7] and prox["preemptions"] == 5
    tps = sorted(r["output_tokens_per_s"] for r in measured["runs"] if r["allocator"] == "stock")
    assert stock["output_tokens_per_s"] == tps[1]
    assert stock["output_tokens_per_s_spread"]["spread_pct"] == pytest.approx(
        (tps[2] - tps[0]) / tps[1] * 100)
    # contiguity: from Proxima's status file, and for stock from the observer's (asked for
    # with PROXIMA_OBSERVE=1 in stock runs only; it reports Proxima inactive)
    assert stand_in.observe_flags == [("0", "1"), ("1", "0")] * 3
    assert prox["blocks_per_run"] == 6.0 and prox["largest_free_run"] == 512
    assert prox["proxima_active"] is True
    assert stock["blocks_per_run"] == 1.5 and stock["proxima_active"] is False
    assert stock["largest_free_run"] is None
    assert measured["check_outputs"] is None


def test_check_outputs_counts_identical_and_differing(tmp_path, stand_in):
    specs = make_workload("sharegpt", 8, seed=2).requests
    stand_in.corrupt_index = 3
    measured = run(tmp_path, stand_in, specs, repeat=2, check_outputs=True)
    check = measured["check_outputs"]
    assert check["reference"] == "stock#1" and check["requests"] == 8
    assert check["runs"]["proxima#1"] == {"identical": 7, "differing": 1,
                                          "first_differing": [specs[3].request_id]}
    assert check["runs"]["stock#2"] == {"identical": 8, "differing": 0, "first_differing": []}
    assert check["runs"]["proxima#2"]["differing"] == 1


def test_differing_kv_block_counts_are_not_hidden(tmp_path, stand_in, monkeypatch):
    monkeypatch.setattr(StandInLLM, "blocks", {"0": 1000, "1": 998})
    specs = make_workload("chat", 2).requests
    cfg = config(tmp_path)
    measured = offline.run_offline(cfg, specs, build_llm=stand_in,
                                   sampling_params=lambda n: {"max_tokens": n})
    assert measured["results"]["stock"]["kv_blocks"] == 1000
    assert measured["results"]["proxima"]["kv_blocks"] == 998
    rep = offline_report(SimpleNamespace(seed=0, trace=None, model=cfg.model), cfg,
                         make_workload("chat", 2), specs, measured)
    assert rep["notes"] == ["KV-cache block counts differ: stock [1000], proxima [998]"]
    assert "note: KV-cache block counts differ" in report.format_table(rep)
    assert ", arrivals held (every request in the first step), " in report.format_table(rep)


def test_a_proxima_run_without_proxima_is_called_out(tmp_path, stand_in, monkeypatch):
    monkeypatch.setattr(StandInLLM, "generate", _generate_without_status)
    specs = make_workload("chat", 2).requests
    cfg = config(tmp_path)
    measured = offline.run_offline(cfg, specs, build_llm=stand_in,
                                   sampling_params=lambda n: {"max_tokens": n})
    assert measured["results"]["proxima"]["proxima_active"] is None
    rep = offline_report(SimpleNamespace(seed=0, trace=None, model=cfg.model), cfg,
                         make_workload("chat", 2), specs, measured)
    assert any("plugin did not activate" in n for n in rep["notes"])
    row = next(l for l in report.format_table(rep).splitlines() if l.startswith("Proxima active"))
    assert row.split()[-2:] == ["n/a", "n/a"]


def _generate_without_status(self, prompts, params, use_tqdm=False):
    return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * sp["max_tokens"])])
            for sp in params]


def test_offline_report_table_json_and_plot(tmp_path, stand_in):
    specs = make_workload("chat", 4).requests
    stand_in.corrupt_index = 0
    cfg = config(tmp_path, repeat=2, check_outputs=True)
    measured = offline.run_offline(cfg, specs, build_llm=stand_in,
                                   sampling_params=lambda n: {"max_tokens": n})
    args = SimpleNamespace(seed=0, trace=None, model=cfg.model)
    rep = offline_report(args, cfg, make_workload("chat", 4), specs, measured)
    assert list(rep["ratios"]) == ["proxima/stock"]
    ratio = rep["ratios"]["proxima/stock"]
    res = rep["results"]
    assert ratio["output_tokens_per_s"] == pytest.approx(
        res["proxima"]["output_tokens_per_s"] / res["stock"]["output_tokens_per_s"])
    assert ratio["blocks_per_run"] == pytest.approx(4.0)
    table = report.format_table(rep)
    row = next(line for line in table.splitlines() if line.startswith("blocks per run"))
    assert row.split()[-3:] == ["1.50", "6.00", "4.000"]
    assert "proxima#1: 3 identical, 1 differing; first differing: chat-0" in table
    assert "run-to-run spread (%)" in table
    assert rep["notes"] == []
    row = next(l for l in table.splitlines() if l.startswith("Proxima active"))
    assert row.split()[-2:] == ["no", "yes"]
    path = tmp_path / "r.json"
    report.write_json(rep, str(path))
    back = json.loads(path.read_text())
    assert back["mode"] == "offline" and len(back["runs"]) == 4
    assert back["workload"]["settings"]["repeat"] == 2
    report.write_plot(rep, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_contiguity_pools_every_snapshot():
    snaps = [{"time": 1, "active": True, "running_blocks_per_run": [1.0, 3.0],
              "allocator": {"largest_free_run": 10}},
             {"time": 2, "active": True, "running_blocks_per_run": [],
              "allocator": {"largest_free_run": 40, "fragmentation": 0.5},
              "invariants_ok": True},
             {"time": 3, "running_blocks_per_run": [5.0, "x", True]}]
    c = offline_status.contiguity(snaps)
    assert c["blocks_per_run"] == 3.0 and c["blocks_per_run_samples"] == 3
    assert c["blocks_per_run_source"] == "running"
    assert c["largest_free_run"] == 40 and c["fragmentation"] == 0.5
    assert c["active"] is True and c["snapshots"] == 3 and c["invariants_ok"] is True
    assert offline_status.contiguity([])["blocks_per_run"] is None
    assert offline_status.contiguity([])["active"] is None


def test_metric_total_sums_label_sets_and_tells_absent():
    m = [SimpleNamespace(name="vllm:num_preemptions", value=3),
         SimpleNamespace(name="vllm:num_preemptions", value=4),
         SimpleNamespace(name="vllm:other", value=100)]
    assert offline_engine.metric_total(m, "vllm:num_preemptions") == 7
    assert offline_engine.metric_total(m[2:], "vllm:num_preemptions") is None


def test_compare_tokens_refuses_mismatched_lengths():
    with pytest.raises(ValueError):
        offline.compare_tokens([[1]], [[1], [2]], ["a"])


def test_plan_runs():
    assert offline.plan_runs(1) == [("stock", 1), ("proxima", 1)]
    assert offline.plan_runs(2)[2:] == [("stock", 2), ("proxima", 2)]


def test_cli_offline_end_to_end_exit_status(tmp_path, stand_in, monkeypatch, capsys):
    """Through `proxima bench --offline`: table, JSON, and exit 1 on differing tokens."""
    from proxima.cli import main
    monkeypatch.setattr(offline, "default_build_llm", stand_in)
    monkeypatch.setattr(offline, "default_sampling_params", lambda n: {"max_tokens": n})
    (tmp_path / "config.json").write_text("{}")
    argv = ["bench", "--offline", "--no-progress", "--model", str(tmp_path), "--workload",
            "multiturn", "--requests", "9", "--check-outputs", "--json", str(tmp_path / "o.json")]
    assert main(argv) == 0
    rep = json.loads((tmp_path / "o.json").read_text())
    assert rep["check_outputs"]["runs"]["proxima#1"]["identical"] == 9
    assert rep["workload"]["requests"] == 9 and rep["workload"]["name"] == "multiturn"
    assert "proxima/stock" in capsys.readouterr().out
    stand_in.corrupt_index = 4
    assert main(argv) == 1
    assert "generated tokens differ" in capsys.readouterr().err


def test_a_bench_cut_short_keeps_the_runs_it_measured(tmp_path, stand_in, monkeypatch, capsys):
    """After every run the JSON holds the runs so far: a third engine that fails to start
    (or a time limit, or Ctrl-C) loses nothing already measured."""
    from proxima.cli import main
    from proxima.errors import UserError

    def build(kwargs):
        if len(stand_in.built) == 2:
            raise UserError("vLLM refused the settings: out of memory")
        return stand_in(kwargs)

    monkeypatch.setattr(offline, "default_build_llm", build)
    monkeypatch.setattr(offline, "default_sampling_params", lambda n: {"max_tokens": n})
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o.json"
    argv = ["bench", "--offline", "--no-progress", "--model", str(tmp_path), "--workload",
            "chat", "--requests", "3", "--repeat", "2", "--check-outputs", "--json", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "proxima run 1/2 done" in err
    partial = json.loads(out.read_text())
    assert partial["partial"] is True
    assert (partial["runs_done"], partial["runs_planned"]) == (2, 4)
    assert [r["allocator"] for r in partial["runs"]] == ["stock", "proxima"]
    assert partial["check_outputs"]["runs"]["proxima#1"]["identical"] == 3
    assert partial["workload"]["requests"] == 3
    monkeypatch.setattr(offline, "default_build_llm", stand_in)
    assert main(argv) == 0
    assert json.loads(out.read_text())["partial"] is False


def test_a_users_multiproc_method_is_kept(tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    run(tmp_path, stand_in, make_workload("chat", 2).requests)
    assert stand_in.mp_methods == ["fork", "fork"]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_contiguity_prefers_the_tally_of_finished_requests():
    snaps = [{"time": 1, "running_blocks_per_run": [1.0],
              "finished_blocks_per_run": {"count": 2, "mean": 9.0}},
             {"time": 2, "running_blocks_per_run": [3.0],
              "finished_blocks_per_run": {"count": 5, "mean": 12.5}},
             {"time": 3, "running_blocks_per_run": []}]       # an older writer: no tally
    c = offline_status.contiguity(snaps)
    assert (c["blocks_per_run"], c["blocks_per_run_samples"], c["blocks_per_run_source"]) \
        == (12.5, 5, "finished")
    none_finished = [{"time": 1, "running_blocks_per_run": [2.0],
                      "finished_blocks_per_run": {"count": 0, "mean": None}}]
    assert offline_status.contiguity(none_finished)["blocks_per_run_source"] == "running"
    assert offline_status.contiguity([])["blocks_per_run_source"] is None


def test_the_sampler_waits_for_a_last_snapshot_written_just_after_the_run(tmp_path, monkeypatch):
    import threading
    import time

    monkeypatch.setattr(offline_status, "STATUS_POLL_S", 0.05)
    path = tmp_path / "status.json"
    with offline_status.StatusSampler(path) as sampler:
        write_status({"n": 1}, path=path)
        time.sleep(0.3)
        late = threading.Timer(0.3, lambda: write_status({"n": 2}, path=path))
        late.start()                   # the engine's last write, after generate() returned
    late.join()
    assert [s["n"] for s in sampler.snapshots] == [1, 2]


def test_arrivals_as_sent_leave_the_engine_alone(tmp_path, stand_in):
    measured = run(tmp_path, stand_in, make_workload("chat", 6).requests, arrivals="as-sent")
    assert stand_in.events == ["build:0", "shutdown:0", "build:1", "shutdown:1"]
    assert stand_in.first_steps == [1, 1]                   # the engine starts on the first
    assert [r["arrivals"] for r in measured["runs"]] == ["as-sent"] * 2


def test_hold_arrivals_holds_one_generate_only(stand_in, monkeypatch):
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "0")
    monkeypatch.setenv("PROXIMA_STATS_FILE", "/nonexistent/status.json")
    llm = StandInLLM({})
    prompts = [{"prompt_token_ids": [1, 2]}] * 3
    params = [{"max_tokens": 2}] * 3
    assert offline_engine.hold_arrivals(llm) is True
    llm.generate(prompts, params)
    assert "_run_engine" not in vars(llm)                    # LLM's own method again
    llm.generate(prompts, params)
    assert stand_in.first_steps == [3, 3]
    assert stand_in.events == ["build:0", "pause_scheduler('keep', False)",
                               "resume_scheduler()"]


@pytest.mark.parametrize("utilities", [False, "raises"])
def test_without_the_pause_utility_requests_go_as_sent(stand_in, monkeypatch, capsys,
                                                      utilities):
    monkeypatch.setenv("PROXIMA_ALLOCATOR", "0")
    monkeypatch.setenv("PROXIMA_STATS_FILE", "/nonexistent/status.json")
    llm = StandInLLM({})
    if utilities is False:
        llm.llm_engine.engine_core = StandInCore(llm, utilities=False)
    else:
        def refuse(method, *args):
            raise RuntimeError(f"Call to {method} method failed: no such method")
        llm.llm_engine.engine_core.call_utility = refuse
    assert offline_engine.hold_arrivals(llm) is False
    assert "_run_engine" not in vars(llm)
    if utilities == "raises":
        assert "cannot hold arrivals (Call to pause_scheduler method failed" in \
            capsys.readouterr().err


def test_arrivals_not_held_are_noted_in_the_report(tmp_path, stand_in, monkeypatch):
    monkeypatch.setattr(offline, "hold_arrivals", lambda llm: False)
    specs = make_workload("chat", 4).requests
    cfg = config(tmp_path)
    measured = offline.run_offline(cfg, specs, build_llm=stand_in,
                                   sampling_params=lambda n: {"max_tokens": n})
    rep = offline_report(SimpleNamespace(seed=0, trace=None, model=cfg.model), cfg,
                         make_workload("chat", 4), specs, measured)
    assert any(n.startswith("arrivals could not be held in stock#1, proxima#1") for n in rep["notes"])
    assert "note: arrivals could not be held" in report.format_table(rep)


def test_an_in_process_engine_holds_arrivals_by_itself():
    """vLLM 0.6's V0 LLMEngine is stepped by generate() itself, after every request is
    queued: nothing to pause, and the run counts as held."""
    class V0ShapedLLM:
        def __init__(self):
            self.llm_engine = SimpleNamespace(step=lambda: [])

        def _run_engine(self, *args):
            raise AssertionError("not called here")

    llm = V0ShapedLLM()
    assert offline_engine.hold_arrivals(llm) is True
    assert "_run_engine" not in vars(llm)


def test_elastic_runs_only_the_proxima_side_with_the_connector_and_the_flag(tmp_path, stand_in):
    seen = []

    class Recorder(StandInLLM):
        def __init__(self, kwargs):
            seen.append((os.environ.get("PROXIMA_ELASTIC"), kwargs.get("kv_transfer_config")))
            super().__init__(kwargs)

    offline.run_offline(config(tmp_path, elastic=True,
                               elastic_options={"release_delay_s": 5}),
                        make_workload("chat", 2).requests, build_llm=Recorder,
                        sampling_params=lambda n: {"max_tokens": n})
    (stock_flag, stock_ktc), (prox_flag, prox_ktc) = seen
    assert stock_flag == "0" and stock_ktc is None
    assert prox_flag == "1" and prox_ktc["kv_connector"] == "ProximaElasticConnector"
    assert prox_ktc["kv_connector_extra_config"] == {"release_delay_s": 5}
    assert "PROXIMA_ELASTIC" not in os.environ                    # restored


def test_elastic_figures_come_from_the_status_snapshots():
    snaps = [{"elastic": {"mapped_bytes": 2, "pool_bytes": 10, "grows": 1}},
             {"time": 1}, {"elastic": {"mapped_bytes": 6, "pool_bytes": 10, "grows": 2,
                                       "shrinks": 1}}]
    figures = offline_status.elastic_figures(snaps)
    assert figures["mapped_bytes_mean"] == 4 and figures["mapped_bytes_peak"] == 6
    assert figures["grows"] == 2 and figures["shrinks"] == 1
    assert offline_status.elastic_figures([{"time": 1}]) is None


def test_stock_runs_reporting_proxima_active_are_exit_1(tmp_path, stand_in, monkeypatch,
                                                        capsys):
    """The report already called such a comparison invalid (a note); the exit status said
    0. Now it says 1, as for the other reasons the figures cannot be trusted."""
    from proxima.cli import main

    real = StandInLLM._run_engine

    def both_active(self, prompts, params):
        outputs = real(self, prompts, params)
        if self.allocator == "0":               # PROXIMA_ALLOCATOR leaked into the stock engine
            write_status({"active": True, "running_blocks_per_run": [4.0]},
                         path=Path(self.stats_path))
        return outputs

    monkeypatch.setattr(StandInLLM, "_run_engine", both_active)
    monkeypatch.setattr(offline, "default_build_llm", stand_in)
    monkeypatch.setattr(offline, "default_sampling_params", lambda n: {"max_tokens": n})
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "o.json"
    assert main(["bench", "--offline", "--no-progress", "--model", str(tmp_path), "--workload",
                 "chat", "--requests", "3", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "proxima bench: not trustworthy: the 'stock' runs reported Proxima active" in err
    assert any("comparison is invalid" in n for n in json.loads(out.read_text())["notes"])
