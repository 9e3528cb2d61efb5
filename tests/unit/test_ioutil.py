"""proxima.ioutil.publish_text: the live files other processes sample (an engine's stats
and status files); check_distinct_paths: outputs that would overwrite each other."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from proxima.errors import UserError
from proxima.ioutil import flush_live_files, publish_text, publish_text_later


def test_a_reader_sees_the_old_text_or_the_new_never_part_of_one(tmp_path):
    path = tmp_path / "stats.json"
    texts = ["a" * 200_000, "b" * 300_000]
    publish_text(path, texts[0])
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            publish_text(path, texts[i % 2])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        seen = {path.read_text() for _ in range(300)}
    finally:
        stop.set()
        thread.join()
    assert seen <= set(texts) and seen
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]


def test_a_failed_publish_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "stats.json"
    publish_text(path, "old")
    with pytest.raises(TypeError):
        publish_text(path, None)                # the write itself fails
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        publish_text(tmp_path / "dir", "new")   # the rename fails (a directory is there)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "stats.json"]


def test_a_later_publish_is_written_by_a_thread_and_the_newest_text_wins(tmp_path):
    path = tmp_path / "status.json"
    for i in range(200):
        publish_text_later(path, str(i))
    flush_live_files()
    assert path.read_text() == "199"
    # a waited publish is on disk at return, and no older text written later replaces it
    for i in range(200):
        publish_text_later(path, str(i))
    publish_text_later(path, "last", wait=True)
    assert path.read_text() == "last"
    flush_live_files()
    assert path.read_text() == "last"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_later_publish_returns_before_the_file_is_written(tmp_path, monkeypatch):
    # the caller (an engine's scheduler) does not wait for the disk: held here by a gate
    from proxima import ioutil

    gate, entered = threading.Event(), threading.Event()
    real = ioutil.publish_text

    def slow(path, text):
        entered.set()
        gate.wait(10)
        real(path, text)

    monkeypatch.setattr(ioutil, "publish_text", slow)
    path = tmp_path / "stats.json"
    publish_text_later(path, "one")
    assert entered.wait(10) and not path.exists()
    gate.set()
    flush_live_files()
    assert path.read_text() == "one"


def test_a_failed_background_write_is_logged_once_and_does_not_raise(tmp_path, log_records):
    gone = tmp_path / "gone" / "stats.json"          # its directory does not exist
    records = log_records("proxima.ioutil", logging.WARNING)
    for text in ("a", "b", "c"):
        publish_text_later(gone, text)
        flush_live_files()
    assert [r.getMessage() for r in records] == [
        f"cannot write {gone}: No such file or directory (later snapshots are tried and "
        f"dropped silently)"]
    with pytest.raises(OSError):
        publish_text_later(gone, "d", wait=True)     # a waited one says so to its caller


def test_a_forked_child_writes_its_own_files(tmp_path):
    import os

    path = tmp_path / "child.json"
    publish_text_later(tmp_path / "parent.json", "p")
    pid = os.fork()
    if pid == 0:            # the child: a thread of its own writes it (none is inherited)
        ok = False
        try:
            publish_text_later(path, "c")
            deadline = time.monotonic() + 10
            while not ok and time.monotonic() < deadline:
                ok = path.exists() and path.read_text() == "c"
                time.sleep(0.01)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    flush_live_files()
    assert (tmp_path / "parent.json").read_text() == "p"


def test_two_outputs_naming_one_file_are_refused_however_spelt(tmp_path, monkeypatch):
    """The same name, ``./name``, ``dir/../name``, a symlink (even to a file not there yet)
    and a hard link are one file; names that differ only there are not."""
    from proxima.ioutil import check_distinct_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.png").write_bytes(b"x")
    os.link(tmp_path / "a.png", tmp_path / "hard.png")
    (tmp_path / "soft.json").symlink_to("later.png")           # dangling for now
    same = [("a.png", "./a.png"), ("a.png", "sub/../a.png"), ("a.png", str(tmp_path / "a.png")),
            ("hard.png", "a.png"), ("soft.json", "later.png")]
    for first, second in same:
        with pytest.raises(UserError, match="are the same file"):
            check_distinct_paths({"--json": first, "--plot": second})
    check_distinct_paths({"--json": "a.json", "--plot": "a.png"})     # distinct: no error
    check_distinct_paths({"--json": None, "--plot": "a.png"})
    with pytest.raises(UserError, match=r"--json \./t\.jsonl would overwrite the trace "
                                        r"\(--trace t\.jsonl\)"):
        check_distinct_paths({"--json": "./t.jsonl"}, inputs={"--trace": "t.jsonl"})
