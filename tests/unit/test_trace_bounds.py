"""A trace file read within bounds (proxima.workloads): what Python's reader would turn
into a RecursionError, a ValueError, a MemoryError or a wait forever is one UserError
naming the file, the line and the bound. The CLI's rows (tests/test_cli_bad_input.py)
run the same files through `proxima replay` and `proxima bench`."""

from __future__ import annotations

import os
import threading

import pytest

from proxima import workloads
from proxima.errors import UserError
from proxima.workloads import load_trace

GOOD = '{"prompt_len": 10, "output_len": 5}\n'


def refused(path) -> str:
    with pytest.raises(UserError) as info:
        load_trace(path)
    return str(info.value)


def test_nesting_numbers_and_line_length_are_bounded(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text(GOOD + '{"prompt_len": 10, "output_len": 5, "prefix_id": '
                    + "[" * 5000 + "]" * 5000 + "}\n")
    assert refused(deep) == (f"{deep}:2: JSON nested 5,001 deep, past the bound of 8: a trace "
                             f'line looks like {{"prompt_len": 100, "output_len": 50}}')
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt_len": 1' + "0" * 4999 + ', "output_len": 5}\n')
    assert refused(big).startswith(f"{big}:1: a number of 5,000 characters (100000000000...) "
                                   f"is longer than the bound of 20")
    long_line = tmp_path / "long.jsonl"
    long_line.write_text(GOOD * 2 + '{"prompt_len": 10, "output_len": 5, "prefix_id": "'
                         + "x" * 70_000 + '"}\n')
    assert refused(long_line).startswith(f"{long_line}:3: the line is longer than the bound "
                                         f"of 65,536 bytes")


def test_brackets_inside_strings_are_no_nesting(tmp_path):
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt_len": 10, "output_len": 5, "prefix_id": "[[[[[[[[[[{{{{{{{{"}\n')
    assert len(load_trace(ok).requests) == 1


def test_the_file_is_bounded_in_bytes(tmp_path, monkeypatch):
    """Blank lines cost nothing to parse but still fill the disk: the bytes read are
    bounded too (lowered here to keep the file small)."""
    monkeypatch.setattr(workloads, "TRACE_MAX_BYTES", 4096)
    flood = tmp_path / "flood.jsonl"
    flood.write_text(GOOD + "\n" * 5000)
    assert refused(flood).startswith(f"{flood}:4062: the file passes the bound of 4,096 "
                                     f"bytes read")              # 36 + 4,061 newlines


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    result = {}
    reader = threading.Thread(target=lambda: result.setdefault("error", refused(fifo)),
                              daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():                       # unblock the reader before failing
        with open(fifo, "w"):
            pass
        pytest.fail("load_trace waited for a writer on a FIFO")
    assert result["error"] == (f"cannot read trace {fifo}: it is a FIFO (named pipe), not a "
                               f"regular file: a trace is a JSON Lines file on disk (copy the "
                               f"stream to a file first)")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_devices_are_refused_by_file_type(device):
    assert refused(device).startswith(f"cannot read trace {device}: it is a character device")
