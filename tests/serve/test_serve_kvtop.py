"""``proxima kv`` without --url: every engine on the GPUs from the real per-GPU ledger
files, engines registered by real processes through the ledger's own API; a killed (-9)
engine's record is not shown; --watch redraws until Ctrl-C (exit 130)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

from proxima.memory.ledger import Ledger, ledger_path
from proxima.serve import kvtop

GiB = 1 << 30
ENGINE = textwrap.dedent("""
    import sys
    from proxima.memory.ledger import Ledger
    path, model, port, mapped, low, high, nonkv, unmet = sys.argv[1:]
    ledger = Ledger(path, model=model, port=int(port), nonkv=int(nonkv))
    ledger.post(int(mapped), int(low), int(unmet), maximum=int(high))
    print("ready", flush=True)
    sys.stdin.read()                     # until the test closes stdin or kills it
""")


def engine(path, model, port, mapped, low, high, nonkv, unmet=0):
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(path), model, str(port),
                             str(mapped), str(low), str(high), str(nonkv), str(unmet)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def cli(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "proxima.cli", "kv", *argv],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_every_engine_on_each_gpu_and_not_the_killed_one(tmp_path):
    gpu0, gpu1 = ledger_path("GPU-aaaa", tmp_path), ledger_path("GPU-bbbb", tmp_path)
    chat = engine(gpu0, "chat", 8101, 12 * GiB, GiB // 2, 40 * GiB, 17 * GiB)
    small = engine(gpu0, "small", 8102, 2 * GiB, GiB // 2, 9 * GiB, 3 * GiB, unmet=GiB)
    killed = engine(gpu1, "gone", 8103, 30 * GiB, 0, 60 * GiB, 17 * GiB)
    try:
        killed.kill()                    # SIGKILL: no close(), its record stays in the file
        killed.wait()
        assert "gone" in gpu1.read_text()
        done = cli("--ledger-dir", str(tmp_path))
        assert done.returncode == 0 and done.stderr == ""
        lines = done.stdout.splitlines()
        assert lines[0] == ("GPU GPU-aaaa: 2 engine(s), 14.00G of KV mapped, 1.00G wanted "
                            "and not given")
        assert lines[1].split() == ["PID", "MODEL", "PORT", "MAPPED", "MIN", "MAX", "NON-KV",
                                    "UNMET"]
        assert lines[2].split() == [str(chat.pid), "chat", "8101", "12.00G", "0.50G", "40.00G",
                                    "17.00G", "-"]
        assert lines[3].split() == [str(small.pid), "small", "8102", "2.00G", "0.50G", "9.00G",
                                    "3.00G", "1.00G"]
        assert len(lines) == 4 and "gone" not in done.stdout and "GPU-bbbb" not in done.stdout
        data = json.loads(cli("--json", env={"PROXIMA_LEDGER_DIR": str(tmp_path)}).stdout)
        assert [(g["gpu"], [e["model"] for e in g["engines"]]) for g in data] == \
            [("GPU-aaaa", ["chat", "small"]), ("GPU-bbbb", [])]
    finally:
        for proc in (chat, small):
            proc.stdin.close()
            proc.wait(timeout=60)
    done = cli("--ledger-dir", str(tmp_path))            # gone too: no live record anywhere
    assert done.returncode == 0
    assert done.stdout.startswith("no Proxima engine is running (no live record in the GPU "
                                  "ledgers of ")


def test_a_record_of_an_older_proxima_without_the_new_fields_is_shown(tmp_path):
    path = ledger_path(0, tmp_path)
    mine = Ledger(path, name="replay-A")                 # no model, port, non-KV: dashes
    mine.post(3 * GiB, GiB)
    try:
        text = kvtop.render(kvtop.snapshot(str(tmp_path)))
        assert text.splitlines()[2].split() == [str(os.getpid()), "(replay-A)", "-", "3.00G",
                                                "1.00G", "-", "-", "-"]
    finally:
        mine.close()


def test_watch_redraws_every_interval_until_stopped(tmp_path):
    path = ledger_path(0, tmp_path)
    mine = Ledger(path, model="m")
    mapped = iter([GiB, 2 * GiB, 3 * GiB])
    mine.post(next(mapped))
    out, waits = io.StringIO(), []

    def sleep(seconds):                  # between rounds: the engine grows
        waits.append(seconds)
        mine.post(next(mapped))

    try:
        assert kvtop.run(str(tmp_path), False, 0.5, out=out, sleep=sleep, rounds=3) == 0
    finally:
        mine.close()
    shown = [line.split()[3] for line in out.getvalue().splitlines() if " m " in f" {line} "]
    assert shown == ["1.00G", "2.00G", "3.00G"] and waits == [0.5, 0.5]


def test_watch_stops_on_ctrl_c_with_exit_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "kv", "--watch", "0.2",
                             "--ledger-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()           # the time stamp of the first round
        assert proc.stdout.readline().startswith("no Proxima engine is running")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr.read().strip() == "proxima kv: interrupted"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_fifo_in_the_ledgers_place_is_skipped_not_waited_on(tmp_path):
    """/dev/shm is everyone's: a FIFO named like a GPU's ledger made `proxima kv` (and an
    engine's sizing, which reads the same file) wait forever for a writer. It reads as no
    engine; a real ledger beside it is still shown. (The timeout only stops a hung run.)"""
    os.mkfifo(ledger_path("GPU-fifo", tmp_path))
    proc = engine(ledger_path("GPU-real", tmp_path), "m", 8000, GiB, GiB, 2 * GiB, 0)
    try:
        try:
            done = cli("--ledger-dir", str(tmp_path))
        except subprocess.TimeoutExpired:
            raise AssertionError("proxima kv hung on the FIFO") from None
    finally:
        proc.stdin.close()
        proc.wait()
    assert done.returncode == 0, done.stderr
    assert "GPU GPU-real: 1 engine(s)" in done.stdout and "GPU-fifo" not in done.stdout


def test_a_damaged_ledger_is_named_not_read_as_no_engine(tmp_path):
    """A ledger that is not JSON (or not a ledger) reads as empty for the engines, which
    rewrite it; `proxima kv` said "no Proxima engine is running" as if all was well."""
    ledger_path("GPU-aaaa", tmp_path).write_bytes(b"\x00garbage")
    ledger_path("GPU-bbbb", tmp_path).write_text("[1, 2]")
    ledger_path("GPU-cccc", tmp_path).write_text('{"engines": []}')       # empty: fine
    done = cli("--ledger-dir", str(tmp_path))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines() == [
        f"GPU GPU-aaaa: the ledger {ledger_path('GPU-aaaa', tmp_path)} is not JSON: its "
        f"engines cannot be shown (an engine's next update rewrites it)",
        f"GPU GPU-bbbb: the ledger {ledger_path('GPU-bbbb', tmp_path)} is not a ledger (no "
        f"list of engines): its engines cannot be shown (an engine's next update rewrites it)",
        f"no Proxima engine is running (no live record in the GPU ledgers of {tmp_path})"]
    shown = json.loads(cli("--ledger-dir", str(tmp_path), "--json").stdout)
    assert [g["damaged"] for g in shown] == ["is not JSON", "is not a ledger (no list of "
                                             "engines)", None]
