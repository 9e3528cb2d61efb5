"""proxima.ioutil.publish_text: the live files other processes sample (an engine's stats
and status files)."""

from __future__ import annotations

import threading

import pytest

from proxima.ioutil import publish_text


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
