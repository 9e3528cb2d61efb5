"""The GPU proof drivers' orchestration, on CPU (--dry-run: stand-in children and servers).

What is checked is what the lead cannot afford to find out on the GPU: a driver finishes
within its budget, writes at most three files to $OUT (results JSON, log, children's logs
packed), prints one PASS/FAIL line per sub-proof, and kills a child that outlives its time.
Nothing here proves anything about elastic KV memory (tools/gpu/*.py on the H200 do).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROOF = REPO / "tools" / "gpu"


def free_ports(n: int = 4) -> int:
    """A base port with ``n`` free ports from it (fixed ports collided when two runs of
    these tests shared a machine: one driver's stand-ins answered the other's requests),
    below the kernel's ephemeral range: a port in it was free when checked and then taken
    by a stand-in engine's port 0 or an outgoing connection before the driver bound it."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        base, held = random.randrange(10000, max(10001, low - n)), []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports")


def run(script: str, out: Path, *args: str, ports: int | None = None) -> subprocess.CompletedProcess:
    """The driver's --dry-run; a ``--port`` given is replaced by the base of a run of free
    ports (returned as ``done.port``)."""
    args = list(args)
    base = None
    if "--port" in args:
        base = ports or free_ports()
        args[args.index("--port") + 1] = str(base)
    done = subprocess.run([sys.executable, str(PROOF / script), "--out", str(out), "--dry-run",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=180)
    done.port = base
    return done


def test_driver_a_dry_run_writes_three_files_and_a_line_per_subproof(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "620", "--only", "a,b,d,a2",
               "--a-modes", "elastic,proxima")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-logs.tgz", "elastic_proof.json", "elastic_proof.log"]
    data = json.loads((tmp_path / "elastic_proof.json").read_text())
    assert [line.split(" ")[0] + line.split(" ")[1] for line in data["summary_lines"]] == [
        "(a)PASS:", "(b)PASS:", "(d)PASS:", "(a2)INFO:"]
    assert set(data["subproofs"]) == {"a", "b", "d", "a2"}
    assert set(data["subproofs"]["a"]["compare"]) == {"elastic", "proxima"}
    # (d) ran the steady load by default: per-window tok/s of both engines, the warm-up
    # window apart, stock's spread, the ratio over the measurement windows and its target
    d = data["subproofs"]["d"]["summary"]
    assert d["load"] == "steady" and d["target"] == "ratio >= 0.99"
    assert d["stock_tok_s"] == [10000.0, 10100.0] and d["elastic_tok_s"] == [9950.0, 10050.0]
    assert d["stock_warmup_tok_s"] == 9000.0 and d["elastic_warmup_tok_s"] == 8500.0
    assert d["ratio"] == round(20000 / 20100, 4) and d["warmup_ratio"] == round(8500 / 9000, 4)
    assert d["stock_spread_pct"] == round(100 * 100 / 10050, 2)
    assert d["ratio_per_window"] == [0.995, round(10050 / 10100, 4)]
    assert d["warmup_and_window_s"] == [10.0, 20.0] and d["concurrency"] == 256
    assert d["requests_completed"] == [1500, 1480]
    line = data["summary_lines"][2]
    assert '"ratio": 0.995' in line and '"warmup_ratio": 0.9444' in line
    # (b) ran on (d)'s elastic engine: one child log for both, no separate burst engine
    logs = subprocess.run(["tar", "tzf", str(tmp_path / "elastic_proof-logs.tgz")],
                          capture_output=True, text=True).stdout
    assert "d-elastic.log" in logs and "b-engine" not in logs, logs


def test_driver_a_runs_b_alone_on_its_own_engine(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "60", "--only", "b")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "elastic_proof.json").read_text())
    assert set(data["subproofs"]) == {"b"} and data["subproofs"]["b"]["passed"]


def test_driver_a_d_can_still_run_the_held_passes(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "440", "--only", "d", "--d-load",
               "passes")
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]["d"]
    assert d["passed"] and d["summary"]["load"] == "passes"
    assert d["summary"]["ratio_mean"] == round(1995 / 2010, 4)


def test_driver_a_gives_every_engine_the_executor_asked_for(tmp_path):
    # (d) then (b) on (d)'s elastic engine (the taker's path), engines side by side in turns
    done = run("elastic_proof.py", tmp_path / "seq", "--budget", "440", "--only", "d,b",
               "--executor", "mp")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "seq" / "elastic_proof.json").read_text())
    assert data["executor"] == "mp"
    assert data["executors"] == {"d-elastic": "mp", "d-stock": "mp"}
    assert "executor mp" in (tmp_path / "seq" / "elastic_proof.log").read_text()
    done = run("elastic_proof.py", tmp_path / "turns", "--budget", "300", "--only", "d",
               "--d-turns", "1", "--executor", "mp")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "turns" / "elastic_proof.json").read_text())
    assert data["executors"] == {"d-elastic": "mp", "d-stock": "mp"}
    # without the flag the children are left to vLLM's choice, as before
    done = run("elastic_proof.py", tmp_path / "plain", "--budget", "60", "--only", "b")
    data = json.loads((tmp_path / "plain" / "elastic_proof.json").read_text())
    assert data["executor"] == "default" and set(data["executors"].values()) == {"default"}
    bad = run("elastic_proof.py", tmp_path / "bad", "--only", "d", "--executor", "ray")
    assert bad.returncode == 2 and "--executor: invalid choice: 'ray'" in bad.stderr


def _elastic_child():
    sys.path.insert(0, str(PROOF))
    import elastic_child

    return elastic_child


def test_driver_a_tp2_reaches_every_engines_build_as_tensor_parallel_over_mp(
        tmp_path, monkeypatch):
    done = run("elastic_proof.py", tmp_path / "tp", "--budget", "620", "--only", "a,d",
               "--tp", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "tp" / "elastic_proof.json").read_text())
    assert data["tp"] == 2 and data["executor"] == "mp"
    assert data["executors"] == {"a-stock": "mp", "a-elastic": "mp", "d-elastic": "mp",
                                 "d-stock": "mp"}
    import shlex
    import tarfile

    with tarfile.open(tmp_path / "tp" / "elastic_proof-logs.tgz") as tar:
        logs = {Path(m.name).stem: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    cmds = {name: shlex.split(text.splitlines()[0].removeprefix("[elastic_proof] "))
            for name, text in logs.items()}
    assert set(cmds) == set(data["executors"])
    assert all(c[c.index("--tp") + 1] == "2" and c[c.index("--executor") + 1] == "mp"
               for c in cmds.values()), cmds
    # the real child given a-stock's arguments: what its LLM is built with
    child = _elastic_child()
    seen = {}

    class Built(Exception):
        pass

    class LLM:
        def __init__(self, **kw):
            seen.update(kw)
            raise Built("stop before any engine")

    import vllm

    from proxima.vllm import plugin

    monkeypatch.setattr(vllm, "LLM", LLM)
    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.setattr(child.tempfile, "mkdtemp", lambda **kw: str(tmp_path))
    monkeypatch.setattr(child, "EXECUTOR", child.EXECUTOR)
    monkeypatch.setattr(child, "TP", child.TP)
    for key in ("PROXIMA_STATS_FILE", "PROXIMA_ALLOCATOR", "PROXIMA_ELASTIC", "PROXIMA_OBSERVE"):
        monkeypatch.setenv(key, os.environ.get(key, ""))       # build sets them: restored
    argv = cmds["a-stock"][2:]
    argv[argv.index("--out") + 1] = str(tmp_path / "child.json")
    monkeypatch.setattr(sys, "argv", ["elastic_child.py", *argv])
    assert child.main() == 1
    result = json.loads((tmp_path / "child.json").read_text())
    assert "Built: stop before any engine" in result["error"]
    assert result["tp"] == 2 and result["executor"] == "mp"
    assert seen["tensor_parallel_size"] == 2 and seen["distributed_executor_backend"] == "mp"
    # 30,720 tokens in all: each GPU holds half of every token's KV heads
    assert seen["kv_cache_memory_bytes"] == child.KV_30K // 2
    assert seen["gpu_memory_utilization"] == 0.3


def test_driver_a_refuses_tp_with_the_uni_executor_in_one_line(tmp_path, monkeypatch):
    bad = run("elastic_proof.py", tmp_path / "uni", "--only", "a", "--tp", "2",
              "--executor", "uni")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "Traceback" not in bad.stderr
    assert "--tp 2 needs the mp executor" in bad.stderr
    assert not (tmp_path / "uni").exists()                  # refused before $OUT was made
    zero = run("elastic_proof.py", tmp_path / "zero", "--only", "a", "--tp", "0")
    assert zero.returncode == 2 and zero.stderr.count("\n") == 1, zero.stderr
    assert "--tp wants a number of GPUs per engine, 1 or more, got 0" in zero.stderr
    # the child refuses it too (run by hand)
    child = _elastic_child()
    monkeypatch.setattr(sys, "argv", ["elastic_child.py", "identity", "--tp", "2",
                                      "--executor", "uni", "--out", str(tmp_path / "c.json")])
    with pytest.raises(SystemExit) as exc:
        child.main()
    assert exc.value.code == 2


FAKE_TORCH = '''"""torch for the taker's test: len(FREE) GPUs, each 10 GiB free at the engine's
peak (the taker's first measure of each), then FREE[d] free after its release."""
import json, os
GiB = 1 << 30
uint8 = "uint8"
FREE = json.loads(os.environ["FAKE_FREE_AFTER"])
measured, held = [0], {}


def _free(d):
    return (FREE[d] if measured[0] > len(FREE) else 10 * GiB) - held.get(d, 0)


class _Buf:
    def fill_(self, value):
        pass


def empty(n, dtype=None, device="cuda"):
    d = int(str(device).partition(":")[2] or 0)
    if n > _free(d):
        raise RuntimeError(f"CUDA out of memory on GPU {d}")
    held[d] = held.get(d, 0) + n
    return _Buf()


class cuda:
    @staticmethod
    def device_count():
        return len(FREE)

    @staticmethod
    def mem_get_info(d=0):
        measured[0] += 1
        return _free(d), 80 * GiB

    @staticmethod
    def synchronize(d=None):
        pass
'''


def test_b_needs_every_gpus_memory_back_and_taken_not_their_sum(tmp_path):
    """(b) with --tp 2: the taker (the real script, on a stand-in torch) measures and takes
    memory on each GPU; the engine's workers released 12 GiB each, so each GPU must see
    12 GiB come back. GPU 1 keeping its memory fails (b), though the two GPUs' sum would
    pass a check of the 12 GiB."""
    proof = _elastic_proof()
    GiB = 1 << 30
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "torch.py").write_text(FAKE_TORCH)
    progress = tmp_path / "progress.json"
    progress.write_text(json.dumps({"phase": "released", "released": 12 * GiB}))
    engine = {"rc": 0, "min_bytes": GiB, "burst1": {"peak_mapped_bytes": 13 * GiB},
              "released": {"mapped_bytes": GiB, "seconds_after_burst": 13.0},
              "burst2": {"peak_mapped_bytes": 13 * GiB}}

    def take(free_after, gpus=2):
        out = tmp_path / "taken.json"
        out.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "torch"),
               "FAKE_FREE_AFTER": json.dumps(free_after)}
        subprocess.run([sys.executable, "-c", proof.TAKER, str(progress), str(out), str(gpus)],
                       env=env, capture_output=True, timeout=60)
        return json.loads(out.read_text())

    def judge(taken, gpus=2):
        out = proof.kit.Out(tmp_path / f"out{len(list(tmp_path.glob('out*')))}", "elastic_proof")
        proof.judge_b(out, engine, taken, 12.0, gpus)
        return out.results["subproofs"]["b"]

    both = take([22 * GiB, 22 * GiB])
    assert [d["allocated"] for d in both["devices"]] == [int(0.95 * 12 * GiB)] * 2
    assert both["allocated"] == both["devices"][0]["allocated"]   # top level: GPU 0's
    b = judge(both)
    assert b["passed"], b
    assert b["summary"]["freed_seen_per_gpu"] == [12 * GiB, 12 * GiB]
    one = take([22 * GiB, 10 * GiB])                          # GPU 1 kept its memory
    came = [d["free_after_release"] - d["free_at_peak"] for d in one["devices"]]
    took = [d["allocated"] for d in one["devices"]]
    assert came == [12 * GiB, 0] and took == [int(0.95 * 12 * GiB), 0]
    assert sum(came) >= 0.9 * 12 * GiB and sum(took) >= 0.85 * 12 * GiB   # the sum passes
    b = judge(one)
    assert not b["passed"]
    assert b["summary"]["freed_seen_by_other_process_bytes"] == 0
    assert b["summary"]["allocated_per_gpu"] == took
    # a taker that saw fewer GPUs than the engine has: no verdict on the missing one
    assert not judge(take([22 * GiB]), gpus=2)["passed"]
    # one GPU, as before: the taker's fields at the top level, no devices needed
    single = take([22 * GiB], gpus=1)
    old = {k: v for k, v in single.items() if k != "devices"}
    for taken in (single, old):
        b = judge(taken, gpus=1)
        assert b["passed"], b
        assert b["summary"]["other_process_allocated_bytes"] == int(0.95 * 12 * GiB)
        assert "allocated_per_gpu" not in b["summary"]


def test_driver_a_d_also_runs_more_engines_against_stock(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "900", "--only", "d",
               "--d-also", "elastic-off,elastic-fixed,elastic-compacted,proxima")
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]["d"]
    also = d["summary"]["also"]
    assert also["elastic-off"]["tok_s"] == [9900.0, 10000.0]
    assert also["elastic-off"]["ratio_to_stock"] == round(19900 / 20100, 4)
    assert also["proxima"]["ratio_to_stock"] == round(20120 / 20100, 4)
    assert also["elastic-fixed"]["tok_s"] == [9850.0, 9950.0]
    assert also["elastic-compacted"]["ratio_to_stock"] == round(19700 / 20100, 4)
    assert d["passed"] and d["summary"]["ratio"] == round(20000 / 20100, 4)  # (d) unchanged
    bad = run("elastic_proof.py", tmp_path / "bad", "--only", "d", "--d-also", "fast")
    assert bad.returncode == 2 and "unknown engine(s) fast in --d-also" in bad.stderr


def test_driver_a_d_together_runs_the_engines_side_by_side_and_starts_their_loads_at_once(
        tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "300", "--only", "d,b",
               "--d-together", "40", "--d-also", "elastic-compacted")
    assert done.returncode == 1, done.stdout + done.stderr     # (b) is not run: FAIL
    sub = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]
    d = sub["d"]
    # side by side is informational: the ratio is there, the verdict is not a pass
    assert not d["passed"] and d["ratio_side_by_side_passed"]
    assert d["summary"]["ratio"] == round(20000 / 20100, 4) and "informational" in d
    assert d["together"] == {"kv_gib": 40.0, "gpu_memory_utilization": 0.3,
                             "engines": ["elastic-auto", "stock", "elastic-compacted"]}
    assert d["summary"]["also"]["elastic-compacted"]["ratio_to_stock"] == round(19700 / 20100, 4)
    assert "needs the GPU to itself" in sub["b"]["skipped"]
    log = (tmp_path / "elastic_proof.log").read_text()
    assert "3 of 3 engines ready" in log
    # the go and ready files are gone: $OUT keeps the results, the log and the logs
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-logs.tgz", "elastic_proof.json", "elastic_proof.log"]
    # one line for a bad value
    bad = run("elastic_proof.py", tmp_path / "bad", "--only", "d", "--d-together", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--d-together wants GiB of KV per engine (0: off), got -1" in bad.stderr


def test_driver_a_d_turns_alternates_the_engines_on_one_gpu_round_by_round(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "520", "--only", "d,b",
               "--d-turns", "3", "--d-cpus", "auto")
    assert done.returncode == 1, done.stdout + done.stderr     # (b) is not run: FAIL
    sub = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]
    d = sub["d"]
    assert d["passed"], d
    s = d["summary"]
    assert s["order"] == [["stock", "elastic-auto"], ["elastic-auto", "stock"],
                          ["stock", "elastic-auto"]]
    # one measured window of 20 s a turn: the stand-in's 10,000 and 9,950 tok/s
    assert s["stock_tok_s"] == [10000.0] * 3 and s["elastic_tok_s"] == [9950.0] * 3
    assert s["ratio"] == 0.995 and s["ratio_per_round"] == [0.995] * 3
    assert s["stock_spread_pct"] == 0.0 and s["kv_gib"] == 40.0
    mine = sorted(os.sched_getaffinity(0))
    assert s["cpus"] == ",".join(map(str, mine[:max(1, len(mine) // 2)]))
    # the turn and go files are gone: $OUT keeps the results, the log and the logs
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-logs.tgz", "elastic_proof.json", "elastic_proof.log"]
    assert [(r, m) for r, m, _ in s["turns_played"]] == [
        (r, m) for r, pair in enumerate(s["order"]) for m in pair]
    assert "needs the GPU to itself" in sub["b"]["skipped"]
    log = (tmp_path / "elastic_proof.log").read_text()
    assert "2 of 2 engines ready" in log and log.count("'s turn took") == 6
    # one line for a bad value
    bad = run("elastic_proof.py", tmp_path / "bad", "--only", "d", "--d-turns", "2",
              "--d-together", "40")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--d-turns wants a number of rounds" in bad.stderr
    bad = run("elastic_proof.py", tmp_path / "bad2", "--only", "d", "--d-turns", "2",
              "--d-cpus", "0-x")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--d-cpus '0-x': not a CPU list" in bad.stderr


def test_d_turns_summary_counts_every_round_and_fails_a_missing_turn():
    proof = _elastic_proof()
    order = proof.turn_order(2)
    assert order == [["stock", "elastic-auto"], ["elastic-auto", "stock"]]

    def turns(*rates):
        return {"turns": [{"turn": k, "steady": {
            "completed": 900, "preemptions": 0,
            "windows": [{"kind": "warmup", "start_s": 0.0, "end_s": 10.0,
                         "output_tokens_per_s": warm},
                        {"kind": "measure", "start_s": 10.0, "end_s": 30.0,
                         "output_tokens": int(rate * 20)}]}}
            for k, (warm, rate) in enumerate(rates)]}
    ok, s = proof.turns_summary(turns((8000.0, 10000.0), (8000.0, 11000.0)),
                                turns((6000.0, 9900.0), (7000.0, 10900.0)), order)
    assert ok and s["ratio"] == round(20800 / 21000, 4)
    assert s["ratio_per_round"] == [0.99, round(10900 / 11000, 4)]
    assert s["stock_spread_pct"] == round(100 * 1000 / 10500, 2)
    assert s["warmup_ratio"] == round(13000 / 16000, 4)
    ok, s = proof.turns_summary(turns((8000.0, 10000.0), (8000.0, 11000.0)),
                                turns((6000.0, 9000.0), (7000.0, 10000.0)), order)
    assert not ok and s["ratio"] < 0.99
    # elastic's second turn never ran: no ratio, FAIL
    ok, s = proof.turns_summary(turns((8000.0, 10000.0), (8000.0, 11000.0)),
                                turns((6000.0, 9900.0)), order)
    assert not ok and s["ratio"] is None and s["elastic_tok_s"] == [9900.0]


def test_driver_a_d_interleave_freezes_the_engine_not_running_and_counts_each_slice(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "300", "--only", "d",
               "--d-turns", "3", "--d-interleave", "1.2,1")
    assert done.returncode == 0, done.stdout + done.stderr
    d = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]["d"]
    assert d["passed"], d
    s = d["summary"]
    assert s["order"] == [["stock", "elastic-auto"], ["elastic-auto", "stock"],
                          ["stock", "elastic-auto"]]
    # the stand-ins step at 10,000 and 9,950 tok/s while they run; each counted only in its
    # own slices: the one stopped logged no step inside the other's (SIGSTOP of its group)
    assert s["frozen_leak_tokens"] == {"stock": 0, "elastic-auto": 0}
    assert s["stock_tok_s"] == pytest.approx([10000.0] * 3, rel=2e-3)
    assert s["elastic_tok_s"] == pytest.approx([9950.0] * 3, rel=2e-3)
    assert s["ratio"] == pytest.approx(0.995, abs=2e-3)
    assert (s["slice_s"], s["warmup_s"], s["settle_s"]) == (1.2, 1.0, 0.5)
    log = (tmp_path / "elastic_proof.log").read_text()
    assert "8 slices played (6 measured)" in log
    # who ran when, from the first slice on: the warm-ups, then the rounds in their order
    assert [(r, m) for r, m, _, _ in s["slices"]] == [(None, "stock"), (None, "elastic-auto")] \
        + [(r, m) for r, pair in enumerate(s["order"]) for m in pair]
    # the stand-in's one grow (at its 60th step) is placed in the slice that held it past
    # its settle, if one did: one of the elastic engine's own (it ran then)
    assert s["grows"] == 1 and len(s["elastic_events"]) == 1
    kind, n, at, where = s["elastic_events"][0]
    assert (kind, n) == ("grow", 4)
    held = [[r, m] for r, m, a, b in s["slices"] if a + 0.5 <= at <= b]
    assert where == (held[0] if held else None)
    assert where is None or where[1] == "elastic-auto"
    assert s["slices"][0][2] == 0.0 and all(
        a[3] <= b[2] + 0.05 and b[3] - b[2] >= 0.99 for a, b in zip(s["slices"], s["slices"][1:]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-logs.tgz", "elastic_proof.json", "elastic_proof.log"]
    # the step logs stay out of the record
    assert "step_log" not in (tmp_path / "elastic_proof.json").read_text()
    for bad_args, says in [(["--d-interleave", "5"], "without --d-turns"),
                           (["--d-turns", "2", "--d-interleave", "0.8"], "leaves nothing"),
                           (["--d-turns", "2", "--d-interleave", "5,x"], "got '5,x'"),
                           (["--d-turns", "2", "--d-interleave", "5", "--d-phases"],
                            "cannot time phases")]:
        bad = run("elastic_proof.py", tmp_path / "bad", "--only", "d", *bad_args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert says in bad.stderr


def test_d_interleave_summary_counts_whole_steps_and_fails_an_engine_that_was_not_frozen():
    proof = _elastic_proof()
    order = proof.turn_order(2)

    def steps(t0, t1, per_s):           # a step every 0.01 s, each with its own tokens
        n = round((t1 - t0) / 0.01)
        return [(round(t0 + 0.01 * (k + 1), 4), per_s * 0.01) for k in range(n)]

    plan = [(None, "stock", 0, 2), (None, "elastic-auto", 2, 4),
            (0, "stock", 4, 7), (0, "elastic-auto", 7, 10),
            (1, "elastic-auto", 10, 13), (1, "stock", 13, 16)]
    rates = {"stock": {0: 10000.0, 1: 8000.0}, "elastic-auto": {0: 9900.0, 1: 8000.0}}
    logs = {"stock": [], "elastic-auto": []}
    for r, m, a, b in plan:
        logs[m] += steps(a, b, 5000.0 if r is None else rates[m][r])
    ok, s = proof.interleave_summary(logs, plan, order, 0.5)
    assert s["stock_tok_s"] == [10000.0, 8000.0] and s["elastic_tok_s"] == [9900.0, 8000.0]
    assert s["ratio_per_round"] == [0.99, 1.0]
    # pooled by tokens over seconds: (9900 + 8000) / (10000 + 8000), equal slice lengths
    assert s["ratio"] == round(17900 / 18000, 4) and ok       # 0.9944 >= 0.99
    assert s["stock_spread_pct"] == round(100 * 2000 / 9000, 2)
    assert s["frozen_leak_tokens"] == {"stock": 0, "elastic-auto": 0}
    # a step of stock's inside elastic's slice: it was not stopped, the slices say nothing
    leaked = dict(logs, stock=sorted(logs["stock"] + [(8.5, 640.0)]))
    ok, s = proof.interleave_summary(leaked, plan, order, 0.5)
    assert not ok and s["frozen_leak_tokens"]["stock"] == 640 and "stopped" in s["error"]
    # elastic's round-1 slice never ran: no ratio
    ok, s = proof.interleave_summary(logs, plan[:4] + plan[5:], order, 0.5)
    assert not ok and s["ratio"] is None and s["elastic_tok_s"] == [9900.0, None]
    # the policy's events placed in the slices (settles and unreadable entries left out)
    events = [[5.0, "grow", 2], ["x"], [7.2, "grow", 1], [8.6, "shrink", 3]]
    assert proof.policy_events(events, plan, 0.5, 0.0) == [
        ["grow", 2, 5.0, [0, "stock"]], ["grow", 1, 7.2, None],
        ["shrink", 3, 8.6, [0, "elastic-auto"]]]


def test_driver_a_says_when_the_budget_cannot_hold_d(tmp_path):
    done = run("elastic_proof.py", tmp_path, "--budget", "200", "--only", "d,b")
    assert done.returncode == 1
    sub = json.loads((tmp_path / "elastic_proof.json").read_text())["subproofs"]
    assert "give --budget" in sub["d"]["skipped"] and not sub["d"]["passed"]
    assert "(d)'s elastic engine" in sub["b"]["skipped"] and not sub["b"]["passed"]
    logs = subprocess.run(["tar", "tzf", str(tmp_path / "elastic_proof-logs.tgz")],
                          capture_output=True, text=True).stdout
    assert "d-elastic" not in logs and "d-stock" not in logs, logs     # no engine started


def _elastic_proof():
    sys.path.insert(0, str(PROOF))
    import elastic_proof

    return elastic_proof


def _entry(rates, windows=None):
    return {"steady": {"concurrency": 256, "completed": 900, "preemptions": 3,
                       "drain": {"aborted": 200},
                       "windows": [{"start_s": 0.0 if i == 0 else 10.0 + 20 * (i - 1),
                                    "end_s": 10.0 + 20 * i, "output_tokens_per_s": r}
                                   for i, r in enumerate(rates)][:windows]}}


def test_d_steady_summary_passes_only_at_the_target_with_every_window_measured():
    proof = _elastic_proof()
    ok, s = proof.steady_summary(_entry([5000.0, 5400.0, 5300.0]),
                                 _entry([4000.0, 5350.0, 5250.0]), 2)
    assert ok and s["ratio"] == round(10600 / 10700, 4) and s["warmup_ratio"] == 0.8
    assert s["stock_spread_pct"] == round(100 * 100 / 5350, 2)
    assert s["preemptions"] == [3, 3] and s["aborted_at_drain"] == [200, 200]
    # a slow warm-up is shown, not counted; slow measured windows fail
    ok, s = proof.steady_summary(_entry([5000.0, 5400.0, 5300.0]),
                                 _entry([5000.0, 5300.0, 5200.0]), 2)
    assert not ok and s["ratio"] == round(10500 / 10700, 4) < 0.99
    # a child that timed out after its first window: no ratio, FAIL
    ok, s = proof.steady_summary(_entry([5000.0, 5400.0, 5300.0]),
                                 _entry([4000.0, 5350.0, 5250.0], windows=2), 2)
    assert not ok and s["ratio"] is None and s["elastic_tok_s"] == [5350.0]
    ok, s = proof.steady_summary({}, {}, 2)
    assert not ok and s["stock_tok_s"] == [] and s["stock_warmup_tok_s"] is None


def test_driver_b_dry_run(tmp_path):
    # what an engine killed while it wrote its stats file leaves (publish_text's temporary
    # file): the driver sweeps it with the live files
    (tmp_path / "..elastic-A-elastic.json.99999.tmp").write_text("{")
    done = run("two_engines.py", tmp_path, "--budget", "120", "--requests", "30",
               "--port", "8390")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "two_engines-logs.tgz", "two_engines.json", "two_engines.log"]
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    for setup in ("static", "elastic"):
        assert len(c[setup]["bursts"]) == 2 and c[setup]["errors"] == 0
        assert c[setup]["aggregate_output_tokens_per_s"] > 0


def test_driver_b_tail_requests_outlive_their_burst_and_are_counted(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "120", "--requests", "20",
               "--port", "8392", "--only", "elastic,compacted", "--tail", "3:16")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    for setup in ("elastic", "compacted"):
        assert c[setup]["tails"]["requests"] == 6 and c[setup]["tails"]["errors"] == 0
        assert c[setup]["tails"]["output_tokens"] == 6 * 16
    assert len(c["summary"]["compacted"]["idle_engine_mapped_bytes_per_burst"]) == 2
    bad = run("two_engines.py", tmp_path / "bad", "--tail", "three")
    assert bad.returncode == 2 and "--tail wants N:TOKENS" in bad.stderr


def test_driver_b_sizes_the_servers_context_to_its_longest_request(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "120", "--requests", "6",
               "--port", "8386", "--only", "elastic", "--prompt", "3072", "--output", "1024")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    settings = json.loads((tmp_path / "two_engines.json").read_text())["settings"]
    assert settings["max_model_len"] == 3072 * 3 // 2 + 1024
    short = run("two_engines.py", tmp_path / "short", "--budget", "120", "--requests", "6",
                "--port", "8386", "--only", "elastic")
    assert json.loads((tmp_path / "short" / "two_engines.json").read_text())[
        "settings"]["max_model_len"] == 2048, short.stderr
    bad = run("two_engines.py", tmp_path / "bad", "--prompt", "3072", "--max-model-len", "4096")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "--max-model-len 4096 is shorter than the longest " \
        "request (1.5 x --prompt 3072 + 512 output tokens = 5120): give at least 5120" in bad.stderr


def test_driver_b_reuse_bursts_ask_each_context_once_a_round():
    te = _two_engines()
    reqs = te.burst_requests(0, seed=3, prompt=16, output=8, contexts=(5, 64, 3))
    assert len(reqs) == 15 and all(out == 8 for _, out in reqs)
    docs = [tuple(p[:64]) for p, _ in reqs]
    assert len(set(docs)) == 5
    for r in range(3):          # every round asks each context once, rounds in their own order
        assert sorted(docs[5 * r:5 * r + 5]) == sorted(set(docs))
    assert docs[:5] != docs[5:10] or docs[5:10] != docs[10:]
    assert all(8 <= len(p) - 64 < 24 for p, _ in reqs)          # a question of 0.5-1.5 x 16
    other = te.burst_requests(0, seed=4, prompt=16, output=8, contexts=(5, 64, 3))
    assert not set(docs) & {tuple(p[:64]) for p, _ in other}    # no burst shares a context
    assert len(te.burst_requests(7, seed=3, prompt=16, output=8)) == 7


def test_driver_b_reports_each_setups_prefix_hits_on_a_reuse_workload(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "120", "--contexts", "4:64:3",
               "--prompt", "16", "--output", "8", "--port", "8394")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    data = json.loads((tmp_path / "two_engines.json").read_text())
    c, settings = data["subproofs"]["c"], data["settings"]
    assert settings["requests"] == 12 and settings["max_model_len"] == 2048
    te = _two_engines()
    for setup in ("static", "elastic"):
        for j, burst in enumerate(c[setup]["bursts"]):
            reqs = te.burst_requests(0, seed=j, prompt=16, output=8, contexts=(4, 64, 3))
            assert burst["requests"] == 12 and burst["output_tokens"] == 12 * 8
            # the stand-in caches everything: the second and third visits hit the context
            assert burst["prefix_cache_queries"] == sum(len(p) for p, _ in reqs)
            assert burst["prefix_cache_hits"] == 4 * 2 * 64
            # the work each burst made its engine do, from the engine's own counters (the
            # stand-in: one step a request): prompt tokens computed, generated, mean step
            work = burst["work"]
            assert work["prompt_tokens_computed"] == sum(len(p) for p, _ in reqs)
            assert work["generated_tokens"] == 12 * 8 and work["steps"] == 12
            assert work["step_tokens"] == work["prompt_tokens_computed"] + 12 * 8
            assert work["ms_per_step"] == round(1000 * burst["wall_s"] / 12, 2)
        assert c[setup]["work"]["steps"] == 12 * len(c[setup]["bursts"])
        assert c[setup]["work"]["prompt_tokens_computed"] == sum(
            b["work"]["prompt_tokens_computed"] for b in c[setup]["bursts"])
        assert c[setup]["prefix_hit_rate"] == round(
            2 * 512 / sum(b["prefix_cache_queries"] for b in c[setup]["bursts"]), 4)
    assert c["summary"]["prefix_hit_rate"] == [c["static"]["prefix_hit_rate"],
                                               c["elastic"]["prefix_hit_rate"]]
    bad = run("two_engines.py", tmp_path / "bad", "--contexts", "4:64:3", "--requests", "5")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--requests 5 and --contexts 4:64:3 disagree" in bad.stderr and "12" in bad.stderr
    bad = run("two_engines.py", tmp_path / "bad2", "--contexts", "4:64")
    assert bad.returncode == 2 and "--contexts wants COUNT:TOKENS:VISITS" in bad.stderr
    bad = run("two_engines.py", tmp_path / "bad3", "--contexts", "10:4096:2",
              "--max-model-len", "4096")
    assert bad.returncode == 2 and "a 4096-token context + 1.5 x --prompt 256 + 512 " \
        "output tokens = 4992" in bad.stderr


def test_driver_b_runs_several_reuse_workloads_one_a_round_each_with_its_ratio(tmp_path):
    done = run("two_engines.py", tmp_path, "--budget", "200", "--contexts", "2:64:2,4:32:3",
               "--rounds", "2", "--prompt", "16", "--output", "8", "--port", "8394")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    assert "after 2 contexts of 64 tokens, each asked 2 times, then 4 contexts of 32 " \
        "tokens, each asked 3 times (one workload a round, in turn)" in done.stdout
    data = json.loads((tmp_path / "two_engines.json").read_text())
    c = data["subproofs"]["c"]
    assert data["settings"]["requests"] is None
    for setup in ("static", "elastic"):
        bursts = c[setup]["bursts"]
        assert [(b["engine"], b["round"], b["contexts"], b["requests"]) for b in bursts] == [
            ("A", 0, "2:64:2", 4), ("B", 0, "2:64:2", 4), ("A", 1, "4:32:3", 12),
            ("B", 1, "4:32:3", 12)]
        assert [b["prefix_cache_hits"] for b in bursts] == [2 * 64] * 2 + [4 * 2 * 32] * 2
    rows = c["summary"]["per_workload"]
    assert [r["contexts"] for r in rows] == ["2:64:2", "4:32:3"]
    for row, (lo, hi) in zip(rows, ((0, 2), (2, 4))):
        for setup in ("static", "elastic"):
            bursts = c[setup]["bursts"][lo:hi]
            assert row[f"{setup}_tok_s"] == round(
                sum(b["output_tokens"] for b in bursts) / sum(b["wall_s"] for b in bursts), 1)
            assert row[f"{setup}_bursts"] == 2
        assert row["ratio"] == round(row["elastic_tok_s"] / row["static_tok_s"], 3)
        assert row["errors"] == [0, 0] and len(row["prefix_hit_rate"]) == 2
    bad = run("two_engines.py", tmp_path / "bad", "--contexts", "2:64:2,4:32:3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--contexts 2:64:2,4:32:3 gives 2 workloads, one a round, but --rounds is 1: " \
        "give --rounds 2" in bad.stderr
    bad = run("two_engines.py", tmp_path / "bad2", "--contexts", "2:64:2,4:32:3",
              "--rounds", "2", "--requests", "4")
    assert bad.returncode == 2 and "COUNT x VISITS = 4 or 12 requests" in bad.stderr
    bad = run("two_engines.py", tmp_path / "bad3", "--contexts", "2:64:2,4:32")
    assert bad.returncode == 2 and "--contexts wants COUNT:TOKENS:VISITS" in bad.stderr


def test_driver_b_four_engines_take_their_bursts_in_turn(tmp_path):
    done = run("two_engines.py", tmp_path, "--engines", "4", "--budget", "120",
               "--requests", "12", "--port", "8394", "--delay", "0.2")
    assert "(c) " in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "two_engines-logs.tgz", "two_engines.json", "two_engines.log"]
    data = json.loads((tmp_path / "two_engines.json").read_text())
    c = data["subproofs"]["c"]
    # 0.9/4 each, profiled KV (so one after the other), the elastic maximum from the plan
    assert data["settings"]["static_util"] == 0.225 and data["settings"]["static_kv_gib"] == 0
    assert data["settings"]["max_gib"] == 57.0
    assert c["static"]["start"] == "sequential" and c["elastic"]["start"] == "parallel"
    log = (tmp_path / "two_engines.log").read_text()
    assert "gpu_memory_utilization 0.225 each (0.9/4" in log
    assert f"ports {done.port}-{done.port + 3}" in log
    for setup in ("static", "elastic"):
        r = c[setup]
        assert all(f"start_{k}_s" in r for k in "ABCD")
        assert [(b["engine"], b["round"]) for b in r["bursts"]] == [
            ("A", 0), ("B", 0), ("C", 0), ("D", 0)]
        # the stand-in counts what it served as preemptions: each burst went to its engine
        assert [b["preemptions"] for b in r["bursts"]] == [12, 12, 12, 12]
        assert r["errors"] == 0 and r["output_tokens"] == 4 * 12 * 512
    for b in c["elastic"]["bursts"]:
        assert all(b[f"mapped_{k}_bytes"] >= 2 << 30 for k in "ABCD")
        assert set("ABCD") - {b["engine"]} <= set(b["mapped_during"])
    assert all(set(c["elastic"][f"elastic_{k}"]) >= {"grows", "mapped_bytes"} for k in "ABCD")
    s = c["summary"]
    assert s["engines"] == 4 and s["ratio"] > 0
    assert s["ratio"] == round(s["elastic_tok_s"] / s["static_tok_s"], 3)
    assert len(s["per_burst_tok_s"]["static"]) == len(s["per_burst_tok_s"]["elastic"]) == 4
    idle = s["idle_mapped_bytes_per_burst"]
    assert [sorted(row) for row in idle] == [list("BCD"), list("ACD"), list("ABD"), list("ABC")]
    # before its own burst an engine sits at its 2 GiB minimum
    assert idle[0] == {k: 2 << 30 for k in "BCD"}
    logs = subprocess.run(["tar", "tzf", str(tmp_path / "two_engines-logs.tgz")],
                          capture_output=True, text=True).stdout
    assert all(f"{setup}-{k}.log" in logs for setup in ("static", "elastic") for k in "ABCD")


def test_driver_b_refuses_bad_engine_counts_and_a_budget_too_small(tmp_path):
    for value in ("1", "9", "four", "2.5"):
        bad = run("two_engines.py", tmp_path / "bad", "--engines", value)
        assert bad.returncode == 2 and bad.stdout == "", bad.stdout + bad.stderr
        assert bad.stderr.count("\n") == 1 and "--engines wants a whole number of engines " \
            f"from 2 to 8, got '{value}'" in bad.stderr, bad.stderr
    small = run("two_engines.py", tmp_path / "small", "--engines", "4", "--budget", "10")
    assert small.returncode == 2 and small.stderr.count("\n") == 1, small.stderr
    assert "--budget 10s is too little for 2 setup(s) of 4 engines" in small.stderr
    assert "4 one after the other" in small.stderr and "give --budget" in small.stderr
    over = run("two_engines.py", tmp_path / "over", "--engines", "4", "--static-util", "0.45")
    assert over.returncode == 2 and "give at most 0.237" in over.stderr, over.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "small").exists()
    assert not (tmp_path / "over").exists()


def _two_engines(monkeypatch=None, gpu: str = "NVIDIA H200"):
    """The driver's module; with ``monkeypatch``, a stand-in ``nvidia-smi`` first on PATH
    (for this test only) that names ``gpu``: what a run without --dry-run reads."""
    sys.path.insert(0, str(PROOF))
    import two_engines

    if monkeypatch is not None:
        import tempfile

        where = Path(tempfile.mkdtemp(prefix="fake-nvidia-smi-"))
        smi = where / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{where}{os.pathsep}{os.environ.get('PATH', '')}")
    return two_engines


def test_driver_b_takes_the_gpus_size_from_its_name_and_refuses_one_not_measured(
        monkeypatch):
    """Without --gpu-gib / --static-kv-gib a GPU run plans for the GPU nvidia-smi names
    (session 24 gave --gpu-gib 79.2 --static-kv-gib 17 by hand on every H100 call; an H200
    plan on an H100 would start static engines that cannot fit)."""
    for name, want in (("NVIDIA H100 80GB HBM3", (79.2, 17.0)), ("NVIDIA H200", (139.8, 46.6))):
        te = _two_engines(monkeypatch, name)
        args = te.parse([])
        assert te.resolve(args, ["static", "elastic"])[0] is None
        assert (args.gpu_gib, args.static_kv_gib) == want
        args = te.parse(["--gpu-gib", "80", "--static-kv-gib", "16"])    # given: kept
        assert te.resolve(args, ["static", "elastic"])[0] is None
        assert (args.gpu_gib, args.static_kv_gib) == (80.0, 16.0)
    te = _two_engines(monkeypatch, "NVIDIA A100-SXM4-40GB")
    error = te.resolve(te.parse([]), ["static", "elastic"])[0]
    assert error == ("the GPU is neither an H200 nor an H100 80GB (nvidia-smi: NVIDIA "
                     "A100-SXM4-40GB): give --gpu-gib and --static-kv-gib")
    args = te.parse(["--dry-run"])                          # a dry run asks no GPU
    assert te.resolve(args, ["static", "elastic"])[0] is None and args.gpu_gib == 139.8


def test_driver_b_plans_four_engines_on_an_h200(monkeypatch):
    """The GPU run's plan (no --dry-run): fixed static KV starts side by side, what does not
    fit on the GPU is refused, and two engines keep their defaults."""
    te = _two_engines(monkeypatch)
    args = te.parse(["--engines", "4", "--static-kv-gib", "15", "--requests", "300",
                     "--budget", "560"])
    error, notes = te.resolve(args, ["static", "elastic"])
    assert error is None and args.static_util == 0.225 and args.max_gib == 57.0
    assert "static 4 x (18.0 + 15.0 KV, fixed) = 132.0 GiB" in notes[-2]
    assert "4 x 18.0 + 3 x 2 + 57 = 135.0 GiB" in notes[-1]
    need = [te.setup_seconds(n, args)[0] for n in ("static", "elastic")]
    # an elastic start-up also spawns its `mp` worker and probes the GPU: 25 s more
    assert need == [80 + 2 * 10 + 4 * 15 + 15, 105 + 2 * 10 + 4 * 15 + 15]
    assert sum(need) <= args.budget
    args = te.parse(["--engines", "4", "--static-kv-gib", "20"])
    error, _ = te.resolve(args, ["static", "elastic"])
    assert "needs about 152 GiB" in error and "give at most 16.9" in error
    args = te.parse(["--engines", "7"])
    error, _ = te.resolve(args, ["elastic"])
    assert "not above the 2 GiB minimum" in error
    args = te.parse([])
    assert te.resolve(args, ["static", "elastic"])[0] is None
    assert (args.static_util, args.static_kv_gib, args.max_gib) == (0.45, 46.6, 72.0)
    assert te.setup_seconds("static", args)[0] == 80 + 2 * 15 + 15
    # a host with no torch.compile cache yet: every start-up compiles, 50 s more, and says so
    total, line = te.setup_seconds("static", args, cold=True)
    assert total == 130 + 2 * 15 + 15 and "no compile cache yet" in line


def test_driver_b_plans_cold_start_ups_until_the_compile_cache_has_a_file(tmp_path):
    te = _two_engines()
    assert te.compile_cache_cold(tmp_path)
    (tmp_path / "torch_compile_cache" / "abc" / "rank_0_0").mkdir(parents=True)
    assert te.compile_cache_cold(tmp_path)   # directories alone: nothing compiled yet
    (tmp_path / "torch_compile_cache" / "abc" / "rank_0_0" / "graph.py").write_text("x")
    assert not te.compile_cache_cold(tmp_path)


def test_driver_b_refuses_up_front_a_budget_a_cold_host_cannot_meet(tmp_path, monkeypatch, capsys):
    """Session 30's first call on a fresh H100 gave 369 s to elastic then static: elastic
    took 155 s to start, and static was cut off mid start-up. With an empty compile cache
    the driver now says so before it starts anything."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    te = _two_engines(monkeypatch, gpu="NVIDIA H100 80GB HBM3")
    argv = ["two_engines.py", "--out", str(tmp_path / "o"), "--budget", "369", "--user-path",
            "--only", "elastic,static", "--shapes", "512:256:1000"]
    monkeypatch.setattr(sys, "argv", argv)
    assert te.main() == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "--budget 369s is too little" in said, said
    assert "elastic 200s (155s of start-up, 2 side by side, no compile cache yet" in said, said
    assert not (tmp_path / "o").exists()
    (tmp_path / "cache" / "torch_compile_cache" / "x").mkdir(parents=True)
    (tmp_path / "cache" / "torch_compile_cache" / "x" / "graph.py").write_text("x")
    args = te.parse(argv[1:])
    assert te.resolve(args, ["elastic", "static"])[0] is None
    plan = [te.setup_seconds(n, args, te.compile_cache_cold(tmp_path / "cache"))[0]
            for n in ("elastic", "static")]
    assert plan == [105 + 2 * 15 + 15, 80 + 2 * 15 + 15] and sum(plan) <= 369


def test_a_child_that_outlives_its_time_is_killed_with_its_group(tmp_path):
    sys.path.insert(0, str(PROOF))
    import proofkit

    started = time.monotonic()
    code = proofkit.run([sys.executable, "-c",
                         "import subprocess, sys, time; "
                         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                         "time.sleep(60)"], {"PATH": "/usr/bin:/bin"}, tmp_path / "c.log", 2)
    assert code == 124 and time.monotonic() - started < 20


def test_a_childs_result_is_read_once_and_nothing_of_it_stays_in_out(tmp_path):
    # a child killed while it saved leaves its temporary copy (elastic_child.save): it goes
    # with the result, so $OUT keeps at most the driver's three files
    proof = _elastic_proof()
    out = proof.kit.Out(tmp_path, "elastic_proof")
    path = tmp_path / ".stock.json"
    path.write_text('{"completed": 3}')
    (tmp_path / ".stock.json.tmp").write_text('{"compl')
    result = proof._collect(out, "stock", path, 124, time.monotonic())
    assert result["completed"] == 3 and result["rc"] == 124
    assert "timed out" in result["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elastic_proof-children", "elastic_proof.json", "elastic_proof.log"]


def _compaction_proof():
    sys.path.insert(0, str(PROOF))
    import compaction_proof

    return compaction_proof


def test_compaction_throughput_summary_uses_means_spread_and_drops_the_first_call():
    proof = _compaction_proof()
    rounds = [
        {"mode": "off", "rate": 3400.0, "sched_ms_per_step": 4.0, "gc_ms": 10.0},
        {"mode": "auto", "rate": 3350.0, "gpu_ms": [50.0, 0.1, 0.2], "plan_ms": [0.3, 0.2],
         "sched_ms_per_step": 4.5, "gc_ms": 12.0},
        {"mode": "off", "rate": 3500.0, "sched_ms_per_step": 4.2, "gc_ms": 9.0},
        {"mode": "auto", "rate": 3450.0, "gpu_ms": [0.3, 0.4], "plan_ms": [0.1],
         "sched_ms_per_step": 4.7, "gc_ms": 11.0},
    ]
    ok, s = proof.summarize_throughput(rounds)
    assert ok and s["ratio"] == round(3400 / 3450, 4)
    assert s["off_spread"] == round(100 / 3450, 4) and s["off_rel_stdev"] > 0
    assert s["stall_gpu_ms_first_call"] == 50.0
    assert s["stall_gpu_ms"]["n"] == 4 and s["stall_gpu_ms"]["max"] == 0.4   # JIT left out
    assert s["plan_ms"]["n"] == 3
    assert s["auto_over_neighbouring_off"] == [round(3350 / 3450, 4), round(3450 / 3500, 4)]
    assert s["sched_ms_per_step"] == {"off": 4.1, "auto": 4.6}
    # below target, and a single round of each is never conclusive
    ok, s = proof.summarize_throughput([dict(rounds[0]), dict(rounds[1], rate=3000.0)])
    assert not ok and s["ratio"] == round(3000 / 3400, 4) and s["off_spread"] is None
    ok, s = proof.summarize_throughput(rounds[:1] + rounds[2:3])
    assert not ok and s["ratio"] is None
    ok, _ = proof.summarize_throughput(rounds[:2])
    assert not ok and "not conclusive" in _["verdict"]


def test_compaction_throughput_rounds_interleave_and_stop_on_the_budget(tmp_path, monkeypatch):
    """The throughput sub-proof's orchestration with a stand-in engine (vLLM's own
    SamplingParams and Scheduler are imported, nothing runs on a GPU): rounds alternate
    off/auto, every round is reported, a round starts only if both its runs fit."""
    import pytest

    pytest.importorskip("vllm")
    from collections import deque
    from types import SimpleNamespace

    proof = _compaction_proof()
    p = proof.Proof(tmp_path, total=100.0)
    clock = [0.0]
    monkeypatch.setattr(proof.time, "monotonic", lambda: clock[0])
    p.t0 = 0.0

    class LLM:
        def generate(self, prompts, params, use_tqdm=False):
            clock[0] += 20.0                      # each run: 20 s of the 100
            out = SimpleNamespace(token_ids=[1] * params.max_tokens)
            return [SimpleNamespace(outputs=[out], num_cached_tokens=3) for _ in prompts]

    class Compactor:
        modes: list = []
        interval, pack_gate = 1, None

        def set_enabled(self, on):
            self.modes.append(on)

        def reset_metrics(self):
            self.gpu_ms = SimpleNamespace(steps=deque([0.5, 0.1]))
            self.plan_ms = SimpleNamespace(steps=deque([0.2]))

        def stats(self):
            return {"steps_with_moves": 1, "bytes_moved": 2 << 20, "pack_skipped": 0}

    probe = proof._Probe()
    try:
        entry = {}
        ok, details = proof.throughput(LLM(), Compactor(), p, 5, probe)(entry)
    finally:
        probe.close()
    modes = [r["mode"] for r in entry["rounds"]]
    assert modes == ["off", "auto", "off", "auto"]     # a third pair would not fit
    assert Compactor.modes[:2] == [False, True]                # off, then the policy
    s = details["summary"]
    assert s["ratio"] == 1.0 and s["stall_gpu_ms_first_call"] == 0.5 and ok
    from proxima.vllm import compaction_worker
    from vllm.v1.core.sched.scheduler import Scheduler

    assert Scheduler.schedule.__name__ == "schedule"          # the probe put them back
    assert compaction_worker.apply_on_worker.__name__ == "apply_on_worker"


def test_three_models_dry_run_gives_both_setups_three_models_each_and_a_ratio(tmp_path):
    # the proxima setup runs the real multi-model endpoint (uvicorn + router + supervisor)
    # over stand-in engines: requests routed by "model", KV read through /engines/NAME/...
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    done = run("three_models.py", tmp_path, "--budget", "120", "--requests", "6",
               "--background", "2", "--port", "8590")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "three_models-logs.tgz", "three_models.json", "three_models.log"]
    sub = json.loads((tmp_path / "three_models.json").read_text())["subproofs"]
    models = {"big", "mid", "small"}
    for name in ("proxima", "stock"):
        setup = sub["setups"][name]
        assert len(setup["bursts"]) == 6 and setup["errors"] == 0
        assert [b["busy"] for b in setup["bursts"][:3]] == ["big", "mid", "small"]
        assert set(setup["per_model"]) == models
        for m in setup["per_model"].values():       # 2 rounds: 6 + 2 + 2 requests each
            assert m["requests"] == 20 and m["output_tokens"] > 0 and m["ttft_p50_s"] > 0
        assert set(sub["summary"][name]["per_model_tok_s"]) == models
    # the endpoint reached each model's own engine for its KV state
    idle = sub["setups"]["proxima"]["idle"]["kv"]
    assert set(idle) == models and all(kv["mapped_bytes"] > 0 for kv in idle.values())
    for burst in sub["setups"]["proxima"]["bursts"]:    # memory per model over time
        for m in burst["mapped_during"].values():
            assert len(m["series_s_gib"]) == m["n"] >= 1
            assert [t for t, _ in m["series_s_gib"]] == sorted(t for t, _ in m["series_s_gib"])
            assert max(g for _, g in m["series_s_gib"]) == round(m["max"] / 2**30, 3)
    matched = sub["summary"]["matched"]
    assert sub["summary"]["ratio"] > 0 and matched["bursts"] == 6 and set(matched["busy"]) == models
    assert sub["summary"]["complete"] is True and matched["errors"] == {"proxima": 0, "stock": 0}
    for busy in matched["busy"].values():           # from each burst's own TTFTs, both rounds
        assert busy["bursts"] == 2 and 0 < busy["proxima_ttft_p50_s"] <= busy["proxima_ttft_p99_s"]


def test_three_models_refuses_a_budget_too_small_and_merges_an_earlier_setup(tmp_path):
    short = run("three_models.py", tmp_path / "short", "--budget", "5")
    assert short.returncode == 2 and short.stderr.count("\n") == 1
    assert "--budget 5s is too little" in short.stderr
    assert not (tmp_path / "short").exists()
    pytest.importorskip("uvicorn")
    first = run("three_models.py", tmp_path / "a", "--only", "stock", "--rounds", "1",
                "--requests", "3", "--background", "1", "--port", "8594")
    assert first.returncode == 1, first.stdout + first.stderr     # no ratio with one setup
    a = json.loads((tmp_path / "a" / "three_models.json").read_text())["subproofs"]
    assert a["summary"]["ratio"] is None
    second = run("three_models.py", tmp_path / "b", "--only", "proxima", "--rounds", "1",
                 "--requests", "3", "--background", "1", "--port", "8598",
                 "--with", str(tmp_path / "a" / "three_models.json"))
    assert second.returncode == 0, second.stdout + second.stderr
    b = json.loads((tmp_path / "b" / "three_models.json").read_text())["subproofs"]
    assert b["setups"]["stock"] == a["setups"]["stock"] and b["summary"]["ratio"] > 0


def test_three_models_gpu_plan_counts_the_measured_start_ups_and_asks_for_two_calls(tmp_path):
    """On a GPU (no --dry-run) both setups eager, two rounds, in one 540 s call are refused
    before anything starts: proxima serve's checks (25 s) then its three engines side by
    side (130 s: not ready after 120 s on a fresh H100), stock's servers one after another
    (53 s each), a burst 20 s on proxima and 33 s on stock (measured on an H100); the line
    does not suggest --enforce-eager when it is given."""
    done = subprocess.run([sys.executable, str(PROOF / "three_models.py"), "--out",
                           str(tmp_path / "o"), "--enforce-eager", "--budget", "540"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "proxima 295s (155s of start-up, 6 bursts x 20s" in done.stderr
    assert "stock 377s (159s of start-up, 6 bursts x 33s" in done.stderr
    assert "--enforce-eager" not in done.stderr and "one setup in --only" in done.stderr
    assert not (tmp_path / "o").exists()


def test_driver_b_user_path_starts_proxima_serve_elastic_with_no_sizing_flag(tmp_path, monkeypatch):
    """--user-path: the elastic servers are `proxima serve MODEL --elastic` as the docs tell a
    user, vLLM's options as given, no KV sizing flag, and the driver's stats file through
    --elastic-options (which serve's own parser must take); the static side is unchanged."""
    from proxima.config import elastic_options_text

    te = _two_engines(monkeypatch)
    args = te.parse(["--user-path", "--prompt", "4000", "--output", "512", "--requests", "160"])
    assert te.resolve(args, ["static", "elastic"])[0] is None
    stats = tmp_path / "a dir" / ".elastic-A.json"
    cmd = te.server_cmd(8300, False, args, stats)
    assert cmd[1:5] == ["-m", "proxima.cli", "serve", args.model] and "--elastic" in cmd
    sizing = {"--kv-cache-memory-bytes", "--gpu-memory-utilization", "--kv-min", "--kv-max",
              "--kv-transfer-config", "--distributed-executor-backend"}
    assert not sizing & set(cmd)
    assert cmd[cmd.index("--max-model-len") + 1] == "6512"      # 1.5 x 4000 + 512
    assert elastic_options_text(cmd[cmd.index("--elastic-options") + 1]) == {
        "stats_file": str(stats)}
    static = te.server_cmd(8300, True, args, stats)
    assert "vllm.entrypoints.openai.api_server" in static and "--elastic" not in static
    done = run("two_engines.py", tmp_path / "dry", "--budget", "120", "--requests", "8",
               "--user-path", "--dry-run")
    assert done.returncode in (0, 1), done.stderr
    assert "proxima serve --elastic" in (tmp_path / "dry" / "two_engines.log").read_text()
    bursts = json.loads((tmp_path / "dry" / "two_engines.json").read_text())[
        "subproofs"]["c"]["elastic"]["bursts"]
    # each burst carries the engines' grows/shrinks around it, in seconds from its start:
    # the busy engine grew during its own burst (none of it before the burst's start - 5 s)
    assert any(kind == "grow" and 0 <= t for t, kind, _ in bursts[0]["events_A"])
    assert all(t >= -5 for b in bursts for k in "AB" for t, _, _ in b[f"events_{k}"])


def _user_path_runs_do_not_pool(tmp_path, extras: dict, said: str) -> list:
    """A dry --user-path run per ``extras`` (name -> more arguments), in that order; --pool of
    the first two is refused, saying ``said``. The runs' json files."""
    runs = []
    for name, extra in extras.items():
        done = run("two_engines.py", tmp_path / name, "--budget", "120", "--requests", "8",
                   "--user-path", "--dry-run", *extra)
        assert done.returncode in (0, 1), done.stderr
        runs.append(tmp_path / name / "two_engines.json")
    done = run("two_engines.py", tmp_path / "pool", "--pool", str(runs[0]), "--pool",
               str(runs[1]))
    assert done.returncode != 0
    assert said in done.stdout + done.stderr
    return runs


def test_driver_b_user_path_max_gib_caps_each_engine_and_does_not_pool_with_uncapped(
        tmp_path, monkeypatch):
    """--user-path --max-gib G: each `proxima serve --elastic` gets --kv-max G GiB (a capped
    engine, to tell elastic mode's own cost from what more memory does to a load); without
    --max-gib no cap is given. A capped run is another load to --pool."""
    from proxima.config import parse_size

    te = _two_engines(monkeypatch)
    capped = te.parse(["--user-path", "--max-gib", "17", "--requests", "8"])
    assert te.resolve(capped, ["static", "elastic"])[0] is None
    cmd = te.server_cmd(8300, False, capped, tmp_path / ".e.json")
    assert parse_size(cmd[cmd.index("--kv-max") + 1]) == 17 * 2**30
    free = te.parse(["--user-path", "--requests", "8"])
    assert te.resolve(free, ["static", "elastic"])[0] is None
    assert "--kv-max" not in te.server_cmd(8300, False, free, tmp_path / ".e.json")
    runs = _user_path_runs_do_not_pool(tmp_path, {"free": [], "capped": ["--max-gib", "17"]},
                                       "user_kv_max_gib 17.0 there, None before")
    # nor does a single engine of another KV size pool with the profiled one
    for name, kv in (("s0", "0"), ("s17", "17")):
        done = run("two_engines.py", tmp_path / name, "--budget", "120", "--requests", "8",
                   "--only", "single", "--single-kv-gib", kv)
        assert done.returncode in (0, 1), done.stderr
    done = run("two_engines.py", tmp_path / "pool2", "--pool", str(runs[0]), "--pool",
               str(tmp_path / "s17" / "two_engines.json"))
    assert done.returncode != 0 and "single_kv_gib 17.0 there, 0.0 before" in done.stderr
    done = run("two_engines.py", tmp_path / "pool3", "--pool", str(runs[0]), "--pool",
               str(tmp_path / "s0" / "two_engines.json"))
    assert done.returncode == 0, done.stderr


def test_driver_b_single_is_one_engine_serving_every_engines_bursts(tmp_path, monkeypatch):
    """--only ...,single: the upper bound of any sharing (issue 33), ONE stock server at
    --single-util with every engine's bursts sent to it in turn; the summary gives elastic's
    and static's throughput against it."""
    te = _two_engines(monkeypatch)
    args = te.parse(["--only", "single"])
    assert te.resolve(args, ["single"])[0] is None
    cmd = te.server_cmd(8300, True, args, tmp_path / "s.json", single=True)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--kv-cache-memory-bytes" not in cmd and "--kv-transfer-config" not in cmd
    assert "1 side by side" not in te.setup_seconds("single", args)[1]
    done = run("two_engines.py", tmp_path, "--budget", "200", "--requests", "12",
               "--only", "static,elastic,single")
    assert done.returncode in (0, 1), done.stderr
    log = (tmp_path / "two_engines.log").read_text()
    assert "single: starting server A" in log and "single: starting server B" not in log
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    assert [b["engine"] for b in c["single"]["bursts"]] == ["A", "B"]
    one = c["summary"]["single"]
    assert one["errors"] == 0 and one["elastic_to_single"] == round(
        c["elastic"]["aggregate_output_tokens_per_s"] / one["tok_s"], 3)
    bad = run("two_engines.py", tmp_path / "bad", "--only", "single", "--single-util", "1.5")
    assert bad.returncode == 2 and "--single-util" in bad.stderr


def test_driver_b_shapes_take_turns_and_each_gets_its_own_ratio_and_ttft(tmp_path, monkeypatch):
    """--shapes P:O:N,...: issue 33's burst shapes on the same servers, one a round in turn;
    each burst is its shape's (requests, prompt lengths, output tokens), and the summary gives
    each shape its throughput ratio and both setups' TTFT."""
    te = _two_engines(monkeypatch)
    args = te.parse(["--shapes", "4000:512:160,512:256:1000", "--rounds", "2"])
    assert te.resolve(args, ["static", "elastic"])[0] is None
    assert args.max_model_len == 6512                       # the longest shape's request
    for argv, why in ((["--shapes", "64:8:4,32:8:4"], "--rounds 2"),
                      (["--shapes", "64:8:4", "--requests", "9"], "leave out --requests")):
        assert why in te.resolve(te.parse(argv), ["static"])[0]
    done = run("two_engines.py", tmp_path, "--budget", "200", "--shapes", "64:16:6,16:8:10",
               "--rounds", "2")
    assert done.returncode in (0, 1), done.stderr
    c = json.loads((tmp_path / "two_engines.json").read_text())["subproofs"]["c"]
    bursts = c["elastic"]["bursts"]
    assert [(b["shape"], b["requests"]) for b in bursts] == [
        ("64:16:6", 6), ("64:16:6", 6), ("16:8:10", 10), ("16:8:10", 10)]
    assert all(b["output_tokens"] == b["requests"] * int(b["shape"].split(":")[1])
               for b in bursts)
    rows = {r["shape"]: r for r in c["summary"]["per_workload"]}
    assert set(rows) == {"64:16:6", "16:8:10"}
    for r in rows.values():
        assert r["static_bursts"] == r["elastic_bursts"] == 2
        assert r["ratio"] == round(r["elastic_tok_s"] / r["static_tok_s"], 3)
        assert r["elastic_ttft"]["ttft_p50_s"] <= r["elastic_ttft"]["ttft_p99_s"]
    bad = run("two_engines.py", tmp_path / "bad", "--shapes", "4000:0:10")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--shapes" in bad.stderr


def test_three_models_says_which_engines_were_ready_when_the_start_up_budget_ran_out():
    """The H100 run's case: the budget ran out while the third engine started; the line names
    the ready engines (from the endpoint's log) instead of the tail of its health polls."""
    sys.path.insert(0, str(PROOF))
    import three_models

    log = ("proxima INFO the engines start one after another (a model may sleep)\n"
           "proxima INFO model big: ready\n[small] GET /health 503\n"
           "proxima INFO model mid: ready\n[small] GET /health 503\n")
    line = three_models.not_ready(log, None, 468.4)
    assert line == ("proxima serve --models not ready after 468s (the setup's start-up budget; "
                    "its engines started one after another); ready: big, mid; not ready: small")
    # s28: side by side, none ready when the budget ran out; the line says how they started
    side = three_models.not_ready("proxima INFO the engines start side by side (the models "
                                  "need 31.91 GiB ...)\n", None, 120.2)
    assert "its engines started side by side); ready: none" in side
    died = three_models.not_ready("", 1, 3.0, "Error: no config.json")
    assert died.startswith("proxima serve --models exited with 1: Error: no config.json")
    assert died.endswith("ready: none; not ready: big, mid, small")


def _burst(busy, wall, tokens=300, ttfts=(1.0, 2.0), timed_out=0, **extra):
    """A row of three_models.json's bursts: each model's tokens, TTFTs, requests timed out."""
    models = {n: {"output_tokens": tokens, "errors": timed_out if n == busy else 0,
                  "timed_out": timed_out if n == busy else 0, "ttfts": list(ttfts),
                  "ttft_p50_s": ttfts[0], "ttft_p99_s": ttfts[-1]}
              for n in ("big", "mid", "small")}
    return {"busy": busy, "wall_s": wall, "models": models, **extra}


def test_three_models_compares_the_bursts_both_setups_ran_in_full():
    """The H100 run of 2026-12-06: stock's budget ran out in its 4th burst of 6 (7 requests
    unfinished, counted as 7 errors) and the summary divided proxima's tok/s over 6 bursts by
    stock's over 4, the cut one included. The ratio is now over the bursts both ran in full,
    pair by pair; a burst with a request still running when it ended is compared with none."""
    sys.path.insert(0, str(PROOF))
    import three_models

    proxima = {"bursts": [_burst("big", 10.0, ttfts=(1.0, 3.0)), _burst("mid", 5.0),
                          _burst("small", 5.0), _burst("big", 10.0)]}
    stock = {"bursts": [_burst("big", 30.0, ttfts=(4.0, 9.0)), _burst("mid", 5.0),
                        _burst("small", 10.0),
                        _burst("big", 30.0, timed_out=3, cut_by_budget=True)],
             "cut_short": "the budget ended burst 4 before all its requests did"}
    s = three_models.summarize({"proxima": proxima, "stock": stock}, planned=6)
    m = s["matched"]
    assert m["bursts"] == 3 and m["left_out"] == [4] and s["complete"] is False
    # 900 tokens a burst: 2,700 in 20 s against 2,700 in 45 s
    assert m["tok_s"] == {"proxima": 135.0, "stock": 60.0} and s["ratio"] == 2.25
    assert m["busy"]["big"]["ratio"] == 3.0 and m["busy"]["mid"]["ratio"] == 1.0
    assert m["busy"]["big"]["proxima_ttft_p99_s"] == 3.0
    assert m["busy"]["big"]["stock_ttft_p50_s"] == 6.5        # the median of (4, 9), as
    assert m["busy"]["big"]["stock_ttft_p99_s"] == 9.0        # two_engines.percentiles
    assert m["errors"] == {"proxima": 0, "stock": 0}
    # a request timed out at the burst timeout (not the budget): that burst is left out too
    stock["bursts"][1] = _burst("mid", 60.0, timed_out=1)
    assert three_models.summarize({"proxima": proxima, "stock": stock})["matched"]["left_out"] == [2, 4]
    # rows of the run before (no "timed_out", the message in first_errors) read the same
    old = _burst("big", 30.0)
    old["models"]["big"] = {"output_tokens": 300, "errors": 7, "first_errors": [three_models.TIMED_OUT]}
    assert not three_models.comparable(old)
    assert three_models.summarize({"proxima": proxima, "stock": {"bursts": []}})["ratio"] is None


def test_three_models_summarizes_earlier_runs_and_refuses_another_trace(tmp_path):
    pytest.importorskip("uvicorn")
    a = run("three_models.py", tmp_path / "a", "--only", "stock", "--rounds", "1",
            "--requests", "3", "--background", "1", "--port", "8594")
    b = run("three_models.py", tmp_path / "b", "--only", "proxima", "--rounds", "1",
            "--requests", "3", "--background", "1", "--port", "8598")
    assert a.returncode == b.returncode == 1, a.stderr + b.stderr     # one setup: no ratio
    files = [str(tmp_path / d / "three_models.json") for d in ("a", "b")]
    both = run("three_models.py", tmp_path / "c", "--only", "none", "--with", files[0],
               "--with", files[1])
    assert both.returncode == 0, both.stdout + both.stderr
    c = json.loads((tmp_path / "c" / "three_models.json").read_text())["subproofs"]
    assert c["summary"]["matched"]["bursts"] == 3 and c["summary"]["complete"] is True
    assert c["summary"]["ratio"] > 0 and c["setups"]["stock"]["bursts"]
    other = run("three_models.py", tmp_path / "d", "--only", "proxima", "--rounds", "1",
                "--requests", "4", "--background", "1", "--with", files[0])
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "another trace (requests 3 there, 4 here)" in other.stderr
    assert not (tmp_path / "d").exists()
    nothing = run("three_models.py", tmp_path / "e", "--only", "none")
    assert nothing.returncode == 2 and "--with FILE" in nothing.stderr


def _tm_file(path, only, rounds, setups, **settings):
    """A three_models.json as the driver writes it: the setups it holds and what it ran."""
    path.write_text(json.dumps({"settings": {"only": only, "rounds": rounds, "requests": 64,
                                             "background": 4, "prompt": [2000, 6000],
                                             "output": [256, 512], "seed": 36, **settings},
                                "subproofs": {"setups": setups}}))
    return str(path)


def test_three_models_pools_runs_in_abba_order_over_calls(tmp_path):
    """Two H100 sessions of 2026-12-06: proxima (two rounds), stock (cut in its 4th burst,
    written with proxima's file as --with), then stock, a proxima that never started, proxima
    (one round), and a stock cut in its first burst. The pooled ratio is over every burst run
    in full at a key both setups ran in full (round 1: big, mid, small), each run counted
    once (not again as the --with setup of a later file); each pair of runs and each setup's
    runs against each other give the spread; a run's cut bursts are named."""
    def r(round_, busy, wall, **kw):
        return {**_burst(busy, wall, **kw), "round": round_}

    a1 = {"bursts": [r(0, "big", 10.0), r(0, "mid", 5.0), r(0, "small", 5.0),
                     r(1, "big", 8.0), r(1, "mid", 4.0), r(1, "small", 5.0)]}
    b1 = {"bursts": [r(0, "big", 30.0), r(0, "mid", 10.0), r(0, "small", 5.0),
                     r(1, "big", 30.0, timed_out=3, cut_by_budget=True)]}
    b2 = {"bursts": [r(0, "big", 20.0), r(0, "mid", 10.0), r(0, "small", 5.0)]}
    a2 = {"bursts": [r(0, "big", 10.0), r(0, "mid", 5.0), r(0, "small", 5.0)]}
    b3 = {"bursts": [r(0, "big", 20.0, timed_out=3, cut_by_budget=True)]}
    files = [_tm_file(tmp_path / "a1.json", "proxima", 2, {"proxima": a1}),
             _tm_file(tmp_path / "b1.json", "stock", 2, {"proxima": a1, "stock": b1}),
             _tm_file(tmp_path / "b2.json", "proxima,stock", 1, {"proxima": {}, "stock": b2}),
             _tm_file(tmp_path / "a2.json", "proxima", 1, {"proxima": a2}),
             _tm_file(tmp_path / "b3.json", "stock", 1, {"stock": b3})]
    done = run("three_models.py", tmp_path / "sum", "--only", "none",
               *[x for f in files for x in ("--with", f)])
    assert done.returncode == 0, done.stdout + done.stderr
    p = json.loads((tmp_path / "sum" / "three_models.json").read_text())["subproofs"]["summary"]["pooled"]
    assert [x["run"] for x in p["runs"]["proxima"]] == [files[0], files[2], files[3]]
    assert [x["full_bursts"] for x in p["runs"]["stock"]] == [3, 3, 0]
    assert p["runs"]["stock"][0]["not_full"] == [4] and p["runs"]["stock"][2]["not_full"] == [1]
    assert p["keys"] == ["round 1 big", "round 1 mid", "round 1 small"]
    # 900 tokens a burst: proxima 6 bursts in 40 s, stock 6 in 80 s
    assert p["bursts"] == {"proxima": 6, "stock": 6}
    assert p["tok_s"] == {"proxima": 135.0, "stock": 67.5} and p["ratio"] == 2.0
    assert [x["ratio"] for x in p["pairs"]] == [2.25, 1.75, 2.25, 1.75]
    assert p["spread"]["stock"] == [{"runs": [files[1], files[2]], "bursts": 3,
                                     "ratio": round(35 / 45, 3)}]
    assert p["spread"]["proxima"][0]["ratio"] == 1.0
    assert p["busy"]["big"]["ratio"] == 2.5 and p["busy"]["small"]["ratio"] == 1.0
    # a trace that differs in more than its rounds is still refused
    other = _tm_file(tmp_path / "o.json", "stock", 1, {"stock": b2}, requests=32)
    refused = run("three_models.py", tmp_path / "x", "--only", "none", "--with", files[0],
                  "--with", other)
    assert refused.returncode == 2 and "another trace (requests 32 there, 64 here)" in refused.stderr


def _te_burst(round_, engine, wall, shape="4000:1024:96", tokens=1000, ttfts=(1.0, 3.0), **kw):
    return {"round": round_, "engine": engine, "shape": shape, "wall_s": wall,
            "output_tokens": tokens, "errors": 0, "first_errors": [], "preemptions": 1,
            "ttfts": list(ttfts), "ttft_p50_s": ttfts[0], "ttft_p99_s": ttfts[-1], **kw}


def _te_file(path, c, **settings):
    load = {"engines": 2, "requests": None, "prompt": 256, "output": 512,
            "shapes": [[4000, 1024, 96]], "contexts": None, "tail": [0, 0],
            "enforce_eager": False, "model": "m", **settings}
    path.write_text(json.dumps({"settings": load, "subproofs": {"c": c}}))
    return str(path)


def test_driver_b_compares_a_cut_setup_on_the_bursts_both_served():
    """s41: static's short bursts did not fit the call; the endpoint's summary then said 1.967x
    static, its four bursts (two of them short, fast ones) over static's two prefill-heavy
    ones. A ratio against a cut setup is taken on the bursts both served in full."""
    te = _two_engines()
    prefill = [_te_burst(0, "A", 40.0, tokens=80000), _te_burst(0, "B", 40.0, tokens=80000)]
    short = [_te_burst(1, "A", 10.0, tokens=100000), _te_burst(1, "B", 10.0, tokens=100000)]
    endpoint = {"bursts": prefill + short, "aggregate_output_tokens_per_s": 3600.0}
    static = {"bursts": [dict(b, wall_s=50.0) for b in prefill],
              "aggregate_output_tokens_per_s": 1600.0, "cut_short": "only 46s left"}
    assert te.paired(endpoint, static) == (1.25, 2)            # not 3600 / 1600
    whole = {"bursts": [dict(b, wall_s=b["wall_s"] * 2) for b in prefill + short],
             "aggregate_output_tokens_per_s": 1800.0}
    assert te.paired(endpoint, whole) == (2.0, None)           # both whole: the schedules
    running = dict(whole, bursts=[dict(whole["bursts"][0], cut_by_budget=True),
                                  *whole["bursts"][1:]])
    assert te.paired(endpoint, running) == (None, 0)           # the first burst cut: none
    assert te.paired(endpoint, None) == (None, 0)


def test_driver_b_tells_a_burst_the_budget_cut_from_a_servers_errors():
    """s40: stock's last burst ran into the call's budget with 66 requests still running,
    and the run said "errors in static". Requests still running when the budget (not
    --burst-timeout) ended their burst are the driver's cut, not the server's failures."""
    te = _two_engines()
    cut = {"errors": 66, "timed_out": 66}
    assert te.budget_cut(cut, left=36.2, burst_timeout=150.0)
    assert not te.budget_cut(cut, left=150.0, burst_timeout=150.0)   # its own timeout: errors
    assert not te.budget_cut({"errors": 2, "timed_out": 0}, left=36.2, burst_timeout=150.0)
    assert te.served_errors({**cut, "cut_by_budget": True}) == 0
    assert te.served_errors({"errors": 5, "timed_out": 3, "cut_by_budget": True}) == 2
    assert te.served_errors(cut) == 66
    assert not te.full_burst({**cut, "cut_by_budget": True, "requests": 160,
                              "output_tokens": 48128, "shape": "4000:512:160"})


def test_driver_b_pools_abba_runs_over_calls(tmp_path):
    """Issue 33's protocol: static then elastic in one call, elastic then static in the next
    (and single, the upper bound, in a third). The pool is over the (round, engine) bursts
    both setups ran in full: a burst that timed out is named and left out; each pair of runs
    and static's spread against itself are given; TTFTs pool over every request."""
    s1 = {"bursts": [_te_burst(0, "A", 10.0), _te_burst(0, "B", 10.0)]}
    e1 = {"bursts": [_te_burst(0, "A", 5.0, ttfts=(0.5, 1.0)), _te_burst(0, "B", 5.0)]}
    e2 = {"bursts": [_te_burst(0, "A", 5.0), _te_burst(0, "B", 10.0)]}
    s2 = {"bursts": [_te_burst(0, "A", 8.0),
                     _te_burst(0, "B", 30.0, timed_out=3,
                               first_errors=["burst timed out"])],
          "cut_short": "only 12s left before burst 3"}
    one = {"bursts": [_te_burst(0, "A", 4.0), _te_burst(0, "B", 4.0)]}
    files = [_te_file(tmp_path / "1.json", {"static": s1, "elastic": e1}),
             _te_file(tmp_path / "2.json", {"elastic": e2, "static": s2}),
             _te_file(tmp_path / "3.json", {"single": one})]
    done = subprocess.run([sys.executable, str(PROOF / "two_engines.py"), "--out",
                           str(tmp_path / "p"), *[x for f in files for x in ("--pool", f)]],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    p = json.loads((tmp_path / "p" / "two_engines-pooled.json").read_text())["subproofs"]["pooled"]
    # nothing ran, so no children's logs: the summary and its log, not an empty .tgz
    assert sorted(x.name for x in (tmp_path / "p").iterdir()) == [
        "two_engines-pooled.json", "two_engines-pooled.log"]
    assert p["runs"]["static"][1]["not_full"] == [2] and "cut_short" in p["runs"]["static"][1]
    (w,) = p["workloads"]
    assert w["workload"] == "4000:1024:96"
    # static: 3 full bursts, 3,000 tokens in 28 s; elastic: 4 bursts, 4,000 in 25 s
    assert w["static"]["bursts"] == 3 and w["static"]["tok_s"] == round(3000 / 28, 1)
    assert w["elastic"]["tok_s"] == 160.0 and w["ratio"] == round(160.0 / round(3000 / 28, 1), 3)
    assert w["single"]["tok_s"] == 250.0 and w["elastic_to_single"] == 0.64
    # e1/s1 both bursts; e1/s2 and e2/s2 only A (s2's B timed out); e2/s1 both
    assert [x["ratio"] for x in w["pairs"]] == [2.0, 1.6, 1.333, 1.6]
    assert w["spread"]["static"] == [{"runs": [files[0], files[1]], "bursts": 1, "ratio": 0.8}]
    assert w["elastic"]["ttft_p50_s"] == 1.0 and w["elastic"]["ttft_p99_s"] == 3.0
    assert "elastic / static" in done.stdout
    # the engines' work pools too, where every burst pooled has it (runs before it had none)
    assert "work" not in w["elastic"] and "work" not in w["static"]
    for c in (s1, s2):
        for b in c["bursts"]:
            b["work"] = {"steps": 100, "step_tokens": 5000, "prompt_tokens_computed": 4000,
                         "generated_tokens": 1000}
    files[:2] = [_te_file(tmp_path / "1.json", {"static": s1, "elastic": e1}),
                 _te_file(tmp_path / "2.json", {"elastic": e2, "static": s2})]
    done = subprocess.run([sys.executable, str(PROOF / "two_engines.py"), "--out",
                           str(tmp_path / "p2"), *[x for f in files for x in ("--pool", f)]],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    (w,) = json.loads((tmp_path / "p2" / "two_engines-pooled.json").read_text())[
        "subproofs"]["pooled"]["workloads"]
    # static's 3 full bursts (28 s): 300 steps, 15,000 tokens
    assert w["static"]["work"] == {"steps": 300, "step_tokens": 15000,
                                   "prompt_tokens_computed": 12000, "generated_tokens": 3000,
                                   "ms_per_step": round(28000 / 300, 2), "tokens_per_step": 50.0}
    assert "work" not in w["elastic"]
    assert f"; static {round(28000 / 300, 2)} ms and 50.0 tokens a step" in done.stdout
    # s24 call 2: B's engine died mid-burst and the driver of the day counted its 96 cut
    # answers (185 tokens of 98,304) as no error: short of its tokens, a burst is not full
    sys.path.insert(0, str(PROOF))
    import two_engines

    assert not two_engines.full_burst(_te_burst(0, "B", 40.0, tokens=185, requests=96))
    assert two_engines.full_burst(_te_burst(0, "B", 40.0, tokens=96 * 1024, requests=96))
    assert not two_engines.full_burst({**_te_burst(0, "A", 9.0, tokens=99, requests=1),
                                       "shape": None}, output=100)
    other = _te_file(tmp_path / "o.json", {"static": s1}, output=256)
    refused = subprocess.run([sys.executable, str(PROOF / "two_engines.py"), "--out",
                              str(tmp_path / "q"), "--pool", files[0], "--pool", other],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "another load (output 256 there, 512 before)" in refused.stderr


def test_driver_b_counts_an_answer_cut_by_a_dead_engine_as_an_error():
    """H100, 2026-12-05: an engine died mid-burst (out of memory); vLLM ended each stream
    with an error chunk and [DONE], and the driver counted 96 short answers as 0 errors
    (its only sign: 90 tok/s). An error chunk, or fewer tokens than asked with ignore_eos,
    is now an error of that request."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(PROOF))
    try:
        import two_engines
    finally:
        sys.path.remove(str(PROOF))
    answers = {
        "error": [{"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}},
                  {"error": {"message": "EngineCore encountered an issue", "code": 500}}],
        "short": [{"choices": [{"text": "x"}], "usage": {"completion_tokens": 3}}],
        "whole": [{"choices": [{"text": "x"}], "usage": {"completion_tokens": 8}}],
    }

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for chunk in answers[body["model"]]:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        got = {m: asyncio.run(two_engines.run_burst(port, m, [([1, 2, 3], 8)] * 2, 30))
               for m in answers}
    finally:
        server.shutdown()
    assert got["error"]["errors"] == 2 and "EngineCore" in got["error"]["first_errors"][0]
    assert got["short"]["errors"] == 2 and got["short"]["first_errors"][0] == "3 of 8 tokens"
    assert got["whole"]["errors"] == 0 and got["whole"]["output_tokens"] == 16


def test_run_sh_packs_every_file_under_out_folders_too_into_one_tgz(tmp_path):
    """A device call brings back 8 files: several runs into OUT=$OUT/NAME folders in one call
    (session 30: 4 and 5 files) are packed by `run.sh pack`, folders and all, into one tgz."""
    out = tmp_path / "out"
    for sub in ("s17", "s38"):
        (out / sub).mkdir(parents=True)
        for name in ("two_engines.json", "two_engines.log", "two_engines-logs.tgz", "run.log",
                     "call-run.txt"):
            (out / sub / name).write_text(f"{sub}/{name}")
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run(["bash", "tools/gpu/run.sh", "pack"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["call-pack.txt", "results-pack.tgz"]
    listed = subprocess.run(["tar", "tzf", str(out / "results-pack.tgz")], capture_output=True,
                            text=True).stdout.split()
    assert sorted(listed) == sorted(f"{s}/{n}" for s in ("s17", "s38") for n in (
        "two_engines.json", "two_engines.log", "two_engines-logs.tgz", "run.log", "call-run.txt"))
    few = tmp_path / "few"
    (few / "s17").mkdir(parents=True)
    (few / "s17" / "two_engines.json").write_text("{}")
    subprocess.run(["bash", "tools/gpu/run.sh", "pack"], cwd=REPO, env={**env, "OUT": str(few)},
                   capture_output=True, text=True, timeout=60)
    assert (few / "s17" / "two_engines.json").read_text() == "{}"
    assert not (few / "results-pack.tgz").exists()


def test_gpu_clocks_summarises_each_gpu_under_load_with_the_reasons_its_clocks_were_held():
    """run.sh's clock samples (tools/gpu/gpu_clocks.py): per GPU, only samples above 200 W
    count; the reasons' bits are named and counted, idle is not; a GPU never under load
    says so; a sample without the reasons' field (an older driver) still counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_clocks", REPO / "tools/gpu/gpu_clocks.py")
    clocks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(clocks)
    rows = [
        "2026/12/06 17:10:00.000, 0, 345, 2619, 70.1, 700.00, 31, 0x0000000000000001",
        "2026/12/06 17:10:02.000, 0, 1980, 2619, 650.5, 700.00, 55, 0x0000000000000000",
        "2026/12/06 17:10:04.000, 0, 1500, 2619, 699.5, 700.00, 71, 0x0000000000000004",
        "2026/12/06 17:10:06.000, 0, 1620, 2619, 690.0, 700.00, 69, 0x0000000000000024",
        "2026/12/06 17:10:06.000, 1, 345, 2619, 69.0, 700.00, 30, 0x0000000000000001",
        "2026/12/06 17:10:08.000, 0, 1700, 2619, 500.0, 700.00, 60",
        "not a sample",
    ]
    lines = clocks.summary(rows)
    assert lines == [
        "GPU 0 under load (4 of 5 samples above 200 W): SM clock mean 1700 MHz, power mean "
        "635 W of a 700 W limit, temperature max 71 C, clocks held down: sw-power-cap in 2, "
        "sw-thermal in 1",
        "GPU 1: 1 samples, none under load (power above 200 W)"]
    assert clocks.summary([]) == []


def test_driver_b_user_path_elastic_options_reach_every_elastic_server_and_do_not_pool(
        tmp_path, monkeypatch):
    """--user-path --elastic-options K=V,...: serve's --elastic-options of every elastic
    server get them after the driver's stats_file (to measure, e.g., what the 5 % reserve
    costs); what serve would refuse (serve's own check) or the driver's own key is refused
    in one line, before any server starts; without --user-path
    it is refused; a run with them is another load to --pool (older runs, without the
    setting, still pool with runs that give none)."""
    te = _two_engines(monkeypatch)
    args = te.parse(["--user-path", "--elastic-options", "gpu_free_low=0.02,band=0.1"])
    assert te.resolve(args, ["static", "elastic"])[0] is None
    cmd = te.server_cmd(8300, False, args, tmp_path / ".e.json")
    assert cmd[cmd.index("--elastic-options") + 1] == (
        f"stats_file={tmp_path / '.e.json'},gpu_free_low=0.02,band=0.1")
    plain = te.parse(["--user-path"])
    assert te.resolve(plain, ["static", "elastic"])[0] is None
    assert te.server_cmd(8300, False, plain, tmp_path / ".e.json")[-1] == (
        f"stats_file={tmp_path / '.e.json'}")
    for bad, said in ((["--user-path", "--elastic-options", "gpu_free_low"],
                       "--elastic-options: 'gpu_free_low' is not key=value"),
                      (["--user-path", "--elastic-options", "gpu_free_low=2"],
                       "--elastic-options: gpu_free_low: 2 is out of range"),
                      (["--user-path", "--elastic-options", "stats_file=x"],
                       "stats_file is the driver's"),
                      (["--elastic-options", "band=0.1"], "--user-path")):
        why = te.resolve(te.parse(bad), ["static", "elastic"])[0]
        assert why and said in why
    _user_path_runs_do_not_pool(
        tmp_path, {"plain": [], "reserve": ["--elastic-options", "gpu_free_low=0.02"]},
        "elastic_options gpu_free_low=0.02 there, None before")


def test_driver_b_endpoint_setup_is_one_proxima_serve_whose_idle_models_sleep(
        tmp_path, monkeypatch):
    """--only ...,endpoint: ONE `proxima serve --models FILE` with the engines as models A, B
    of the same path, each sleep_after --sleep-after (the file is read by the product's own
    loader: a mistake in it would cost a device call), bursts sent to the one port with
    "model": A or B; it pools against static (ABBA) as elastic does."""
    from proxima.serve import multi_config

    te = _two_engines(monkeypatch)
    args = te.parse(["--shapes", "4000:1024:96", "--sleep-after", "3"])
    assert te.resolve(args, ["static", "endpoint"])[0] is None
    stats = {k: tmp_path / f".endpoint-{k}-elastic.json" for k in "AB"}
    out = sys.modules["proofkit"].Out(tmp_path / "o", "two_engines")
    cmd = te.endpoint_cmd(out, args, stats)
    assert cmd[1:5] == ["-m", "proxima.cli", "serve", "--host"]
    plan = multi_config.load_models_file(cmd[cmd.index("--models") + 1])
    assert [(m.name, m.path, m.sleep_after, m.port) for m in plan.models] == [
        ("A", args.model, 3.0, 8310), ("B", args.model, 3.0, 8311)]
    assert "--idle-release" in plan.models[0].elastic_args()      # the KV before the weights
    assert plan.common[plan.common.index("--max-model-len") + 1] == "7024"
    assert te.sleep_events(
        "[x] model B: asleep in 2.31 s (idle 3 s; weights ~14.96 GiB in host memory)\n"
        "model B: awake in 0.91 s (room 0.50 s, wake 0.41 s)\n") == [
            ["B", "asleep", 2.31], ["B", "awake", 0.91]]
    bad = run("two_engines.py", tmp_path / "bad", "--only", "endpoint", "--sleep-after",
              "0.5")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--sleep-after wants seconds from 1 to 86400" in bad.stderr and "0.5" in bad.stderr
    assert not (tmp_path / "bad").exists()
    done = run("two_engines.py", tmp_path / "dry", "--budget", "120", "--requests", "8",
               "--only", "static,endpoint", "--port", "0")
    assert done.returncode in (0, 1), done.stderr
    c = json.loads((tmp_path / "dry" / "two_engines.json").read_text())["subproofs"]["c"]
    ep = c["endpoint"]
    assert "--models" in ep["command"] and ep["sleep_after"] == 5.0
    assert [(b["engine"], b["errors"], b["output_tokens"]) for b in ep["bursts"]] == [
        ("A", 0, 8 * 512), ("B", 0, 8 * 512)]
    assert c["summary"]["endpoint"]["to_static"] == round(
        ep["aggregate_output_tokens_per_s"] / c["static"]["aggregate_output_tokens_per_s"], 3)
    # pooled with static, ABBA, with no elastic run at all
    s = {"bursts": [_te_burst(0, "A", 10.0), _te_burst(0, "B", 10.0)]}
    e = {"bursts": [_te_burst(0, "A", 4.0), _te_burst(0, "B", 6.0)], "sleep_after": 5.0}
    files = [_te_file(tmp_path / "1.json", {"static": s, "endpoint": e}),
             _te_file(tmp_path / "2.json", {"endpoint": e, "static": s})]
    pooled = run("two_engines.py", tmp_path / "p", *[x for f in files for x in ("--pool", f)])
    assert pooled.returncode == 0, pooled.stderr
    (w,) = json.loads((tmp_path / "p" / "two_engines-pooled.json").read_text())[
        "subproofs"]["pooled"]["workloads"]
    assert w["endpoint_ratio"] == 2.0 and w["ratio"] is None
    assert [p["ratio"] for p in w["endpoint_pairs"]] == [2.0] * 4
    assert "endpoint / static 2.0" in pooled.stdout
    other = _te_file(tmp_path / "3.json", {"endpoint": {**e, "sleep_after": 9.0}, "static": s})
    refused = run("two_engines.py", tmp_path / "q", "--pool", files[0], "--pool", other)
    assert refused.returncode == 2 and "--sleep-after differ (5, 9)" in refused.stderr


def test_driver_b_separate_endpoints_are_one_proxima_serve_per_engine(tmp_path, monkeypatch):
    """--endpoints separate: one `proxima serve --models FILE` of ONE model per engine, on
    --port + i (the models files read by the product's loader), bursts sent to each
    engine's own endpoint; such runs pool with static but not with one-endpoint runs."""
    from proxima.serve import multi_config

    te = _two_engines(monkeypatch)
    args = te.parse(["--shapes", "4000:1024:96", "--sleep-after", "600", "--endpoints",
                     "separate"])
    error, notes = te.resolve(args, ["static", "endpoint"])
    assert error is None
    assert any("2 separate `proxima serve --models FILE` of one model each" in n
               for n in notes)
    stats = {k: tmp_path / f".endpoint-{k}-elastic.json" for k in "AB"}
    out = sys.modules["proofkit"].Out(tmp_path / "o", "two_engines")
    for i, key in enumerate("AB"):
        cmd = te.endpoint_cmd(out, args, stats, key, args.port + i)
        assert cmd[cmd.index("--port") + 1] == str(args.port + i)
        plan = multi_config.load_models_file(cmd[cmd.index("--models") + 1])
        assert [(m.name, m.sleep_after, m.port) for m in plan.models] == [
            (key, 600.0, args.port + 10 + i)]
    assert "2 side by side" in te.setup_seconds("endpoint", args)[1]
    # s40: two endpoints (each copying 8B's weights to host memory) were healthy after 171 s;
    # after static, 224 s of the budget was left, and the plan's 205 s let them start
    args.rounds = 2
    need, line = te.setup_seconds("endpoint", args)
    assert need > 224 and "170s of start-up, 2 side by side" in line, line
    args.start = "sequential"
    assert "2 one after the other" in te.setup_seconds("endpoint", args)[1]
    done = run("two_engines.py", tmp_path / "dry", "--budget", "150", "--requests", "8",
               "--only", "endpoint", "--endpoints", "separate", "--port", "0")
    # every setup asked for finished, and there is no static to judge against: no FAIL
    assert done.returncode == 0, done.stderr
    assert "(c) DONE: " in done.stdout + done.stderr and \
        "no elastic-against-static verdict: --only endpoint" in done.stdout + done.stderr
    c = json.loads((tmp_path / "dry" / "two_engines.json").read_text())["subproofs"]["c"]
    ep = c["endpoint"]
    assert ep["endpoints"] == "separate" and ep["start"] == "parallel"
    assert ep["vllm_port_A"] != ep["vllm_port_B"]       # started side by side: no collision
    assert f"--port {done.port} " in ep["command_A"] and \
        f"--port {done.port + 1} " in ep["command_B"]
    assert [(b["engine"], b["errors"], b["output_tokens"]) for b in ep["bursts"]] == [
        ("A", 0, 8 * 512), ("B", 0, 8 * 512)]
    s = {"bursts": [_te_burst(0, "A", 10.0), _te_burst(0, "B", 10.0)]}
    e = {"bursts": [_te_burst(0, "A", 4.0), _te_burst(0, "B", 6.0)], "sleep_after": 5.0}
    one = _te_file(tmp_path / "1.json", {"static": s, "endpoint": e})
    apart = _te_file(tmp_path / "2.json", {"endpoint": {**e, "endpoints": "separate"},
                                           "static": s})
    refused = run("two_engines.py", tmp_path / "q", "--pool", one, "--pool", apart)
    assert refused.returncode == 2 and "--endpoints differ (one, separate)" in refused.stderr
    # --endpoint-direct: the bursts go to each engine's own port (the models file's), a
    # 1-token request through the router first; such runs do not pool with routed ones
    direct = run("two_engines.py", tmp_path / "direct", "--budget", "150", "--requests", "8",
                 "--only", "endpoint", "--endpoints", "separate", "--endpoint-direct",
                 "--port", "0")
    assert direct.returncode == 0, direct.stderr
    assert "--endpoint-direct: each burst sent to the model's engine" in direct.stdout
    ep = json.loads((tmp_path / "direct" / "two_engines.json").read_text())[
        "subproofs"]["c"]["endpoint"]
    assert ep["direct"] is True and [(b["engine"], b["errors"], b["output_tokens"])
                                     for b in ep["bursts"]] == [("A", 0, 8 * 512),
                                                                ("B", 0, 8 * 512)]
    routed = _te_file(tmp_path / "3.json", {"endpoint": {**e, "endpoints": "separate"},
                                            "static": s})
    straight = _te_file(tmp_path / "4.json", {"endpoint": {**e, "endpoints": "separate",
                                                           "direct": True}, "static": s})
    refused = run("two_engines.py", tmp_path / "q2", "--pool", routed, "--pool", straight)
    assert refused.returncode == 2 and "--endpoint-direct" in refused.stderr
    # the sleeps and wakes summed over both endpoints' logs (and a run that kept one list)
    by = {"A": [["B", "asleep", 2.3]], "B": [["A", "asleep", 2.1], ["A", "awake", 0.9]]}
    assert te.endpoint_events({"sleep_events_by": by}) == by["A"] + by["B"]
    assert te.endpoint_events({"sleep_events": by["B"]}) == by["B"]
    assert te.endpoint_events({"sleep_events_by": {"A": [], "B": []}}) == []
