"""Copy what the engine writes to stdout/stderr, while still showing it.

The engine core is a child process: its stdout and stderr are whatever file descriptors 1 and
2 were when it started. For that moment the supervisor points them at pipes; a thread per pipe
passes every byte on to the original descriptor and keeps the last bytes in memory, so a
failed start can be explained (:mod:`proxima.serve.startup_errors`). The children keep the
pipes for life, so the threads keep forwarding after the descriptors are put back.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque

KEEP_BYTES = 64 * 1024


class OutputTee:
    def __init__(self, fds=(1, 2), keep: int = KEEP_BYTES):
        self._fds = fds
        self._keep = keep
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()
        self._saved: dict[int, int] = {}

    def __enter__(self) -> "OutputTee":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in self._fds:
            read_end, write_end = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)  # fd itself is now the write end
            out = os.dup(self._saved[fd])  # the thread's own copy, closed at EOF
            threading.Thread(target=self._forward, args=(read_end, out),
                             daemon=True, name=f"proxima-tee-{fd}").start()
        return self

    def __exit__(self, *exc) -> None:
        """Put the original descriptors back; the forwarding threads run until EOF."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved = {}

    def _forward(self, read_end: int, out: int) -> None:
        # Never stop reading before EOF: a full pipe would block the engine's writes.
        while True:
            try:
                data = os.read(read_end, 65536)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
            except OSError:
                pass
            with self._lock:
                self._chunks.append(data)
                self._size += len(data)
                while self._size - len(self._chunks[0]) >= self._keep:
                    self._size -= len(self._chunks.popleft())
        os.close(read_end)
        os.close(out)

    def text(self) -> str:
        with self._lock:
            return b"".join(self._chunks).decode("utf-8", errors="replace")
