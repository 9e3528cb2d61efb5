"""The per-GPU ledger with real processes: records seen across processes, an engine killed
with SIGKILL (mid-life and mid-write) leaves no claim, pid reuse, concurrent writers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from proxima.memory.ledger import Ledger, LedgerError, ledger_path, process_start

CHILD = textwrap.dedent("""
    import sys, time
    from proxima.memory.ledger import Ledger
    ledger = Ledger(sys.argv[1])
    mode = sys.argv[2]
    if mode == "post":
        ledger.post(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        print("ready", flush=True)
        sys.stdin.read()                 # until the parent closes stdin (or kills us)
        if len(sys.argv) > 6:
            ledger.close()
    elif mode == "spin":                 # post changing records for ever
        print("ready", flush=True)
        i = 0
        while True:
            i += 1
            ledger.post(i, 1, i % 3)
    elif mode == "count":                # post n distinct records, then leave the last
        for i in range(int(sys.argv[3])):
            ledger.post(i + 1, 0, 0)
        print("done", flush=True)
        sys.stdin.read()
""")


def spawn(path, *args):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line in ("ready", "done"), f"child said {line!r}"
    return proc


def finish(proc):
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def test_path_is_keyed_by_gpu(tmp_path, monkeypatch):
    assert ledger_path("GPU-8c3e-01", tmp_path) == tmp_path / "proxima-ledger-GPU-8c3e-01.json"
    assert ledger_path(0, tmp_path).name == "proxima-ledger-0.json"
    assert ledger_path("a/../b", tmp_path).parent == tmp_path      # no way out of the dir
    monkeypatch.setenv("PROXIMA_LEDGER_DIR", str(tmp_path))
    assert ledger_path(1).parent == tmp_path
    with pytest.raises(ValueError, match="UUID or an index"):
        ledger_path("  ")
    with pytest.raises(LedgerError, match="does not exist"):
        Ledger(tmp_path / "missing" / "x.json")


def test_records_cross_processes_and_clean_exit_removes(tmp_path):
    path = tmp_path / "l.json"
    a = spawn(path, "post", 100, 10, 0)
    b = spawn(path, "post", 200, 20, 50, "close")
    mine = Ledger(path)
    mine.post(300, 30, 7)
    view = mine.read()
    assert sorted(r.mapped for r in view.records) == [100, 200, 300]
    assert view.others_unmet_bytes == 50            # my own unmet demand is not counted
    assert view.others_mapped_bytes == 300
    assert Ledger(path, pid=a.pid).read().others_unmet_bytes == 57
    finish(b)                                       # closes: its record is gone from the file
    raw = json.loads(path.read_text())
    assert sorted(e["mapped"] for e in raw["engines"]) == [100, 300]
    finish(a)                                       # exits without close: readers drop it
    assert [r.mapped for r in mine.read().records] == [300]


def test_other_writers_keep_what_a_record_says_besides_kv(tmp_path):
    """Every write replaces the file whole: another engine's post (another process) and a
    starting engine's demand (``autosize.ask_others``' record) keep an engine's non-KV
    bytes, model and port, which the next engine's sizing reads."""
    from proxima.memory.ledger import live_records

    path = ledger_path("GPU-x", tmp_path)
    big = Ledger(path, name="big", model="big", port=8301, nonkv=19011032269)
    big.post(1 << 30, 1 << 30, maximum=62 << 30)
    starting = Ledger(path, name="starting")
    starting.post(0, 0, 3 << 30)
    starting.close()
    other = spawn(path, "post", 5, 1, 0)
    try:
        records = {r.name: r for r in live_records(path)}
        assert set(records) == {"big", ""}
        assert (records["big"].nonkv, records["big"].model, records["big"].port,
                records["big"].min) == (19011032269, "big", 8301, 1 << 30)
    finally:
        finish(other)
        big.close()


def test_sigkill_leaves_no_claim(tmp_path):
    path = tmp_path / "l.json"
    victim = spawn(path, "post", 5 << 30, 1 << 30, 3 << 30)
    mine = Ledger(path)
    assert mine.read().others_unmet_bytes == 3 << 30
    victim.send_signal(signal.SIGKILL)
    # not reaped yet: a zombie, whose /proc entry is still there -- already gone for readers
    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{victim.pid}/stat", "rb") as f:
        assert f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    assert mine.read().others_unmet_bytes == 0
    victim.wait(timeout=60)
    assert mine.read().records == ()
    mine.post(1, 0, 0)                              # the next write drops the dead record
    assert [e["pid"] for e in json.loads(path.read_text())["engines"]] == [os.getpid()]


def test_killed_mid_write_never_tears_the_file(tmp_path):
    path = tmp_path / "l.json"
    mine = Ledger(path)
    for _ in range(8):
        spinner = spawn(path, "spin")
        for _ in range(3):
            mine.post(7, 0, 0, force=True)          # contend for the lock too
        spinner.send_signal(signal.SIGKILL)
        spinner.wait(timeout=60)
        raw = json.loads(path.read_text())          # whole JSON every time
        assert isinstance(raw["engines"], list)
        view = mine.read()
        assert [r.pid for r in view.records] == [os.getpid()]
        assert view.others_unmet_bytes == 0
    mine.post(8, 0, 0)
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert leftovers == []                          # killed writers' temporaries swept


def test_pid_reuse_is_not_a_live_claim(tmp_path):
    path = tmp_path / "l.json"
    me = os.getpid()
    start = process_start(me)
    # a record for this pid with another start time: an earlier process with the same pid
    path.write_text(json.dumps({"version": 1, "engines": [
        {"pid": me, "start": start + 1, "mapped": 9, "min": 0, "unmet": 9, "updated": 0}]}))
    other = Ledger(path, pid=os.getppid())
    assert other.read().records == ()


def test_concurrent_writers_lose_no_record(tmp_path):
    path = tmp_path / "l.json"
    procs = [spawn(path, "count", 40) for _ in range(4)]
    view = Ledger(path).read()
    assert sorted(r.pid for r in view.records) == sorted(p.pid for p in procs)
    assert all(r.mapped == 40 for r in view.records)
    for p in procs:
        finish(p)


def test_damaged_file_reads_empty_and_is_replaced(tmp_path):
    path = tmp_path / "l.json"
    path.write_bytes(b'{"engines": [{"pid": 1, "sta')
    mine = Ledger(path)
    assert mine.read().records == ()
    assert mine.post(3, 1, 0)
    assert not mine.post(3, 1, 0)                   # unchanged: not written again
    assert [r.mapped for r in mine.read().records] == [3]
    with pytest.raises(ValueError, match="unmet must be an integer"):
        mine.post(1, 0, -1)
