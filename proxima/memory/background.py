"""Maps and unmaps of KV granules off the step's path: one thread per worker applies them.

Mapping a grow of 22 GiB is ~10,800 ``cuMemCreate`` + ``cuMemMap`` calls for 2 MiB pages
and their zero-fill; unmapping waits for the device and gives each page back. Applied in
the worker before the step's forward (:meth:`proxima.memory.kv.KvMemory.apply`), every
running request waited for them: on the H200 a step carrying such a grow took 0.6-0.9 s
and one carrying a release 0.4 s (docs/benchmarks.md section 7.3). Here the forward goes
on while a thread of the worker makes the same calls (ctypes lets go of the GIL in each).

Why this is safe, op by op (the scheduler's side, :mod:`proxima.memory.channel`, already
assumes a map lands some steps later, since async scheduling plans a step ahead):

* ``MAP``: the granule's blocks are not allocatable until a report confirms the map, and a
  batch is reported only once its maps are done *and* its zero-fill (on this thread's own
  stream) has finished, so no forward is even launched on a granule before it is backed.
  With several workers the scheduler waits for every worker's report of the batch.
* ``UNMAP``: the sender guarantees that no block of the granule is in use or cached, so
  no step scheduled from now on reads it; the thread waits for the device (every kernel
  launched before it) before it unmaps.

Batches are applied in order, one at a time. A driver error other than lack of memory
stops the thread; the next :meth:`BackgroundOps.poll` raises it on the worker's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

from proxima.memory.ops import MAP, Op, validate


class BackgroundOps:
    """Applies the ``MAP``/``UNMAP`` ops of a :class:`~proxima.memory.kv.KvMemory`'s batches
    on a thread of its own; :meth:`poll` hands back what is done as ``(seq, failed)``."""

    def __init__(self, memory) -> None:
        self.memory = memory
        self._jobs: queue.Queue = queue.Queue()
        self._done: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._lock = threading.Lock()
        self._queued = 0                   # batches handed to the thread, not yet done
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ caller's thread
    def submit(self, seq: int, ops: Sequence[Op]) -> None:
        """Apply batch ``seq``: its maps and unmaps on the thread, in order."""
        self._raise()
        memory = self.memory
        validate(ops, memory.num_granules, memory.num_blocks)
        todo = tuple(ops)
        if not todo:
            with self._lock:
                self._done.append((seq, ()))
        else:
            self._start()
            with self._lock:
                self._queued += 1
            self._jobs.put((seq, todo))

    def poll(self) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
        """The batches done since the last call, in order, each with the ``(first,
        count)`` granule ranges the GPU could not back."""
        self._raise()
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def busy(self) -> bool:
        """Batches handed over and not yet done."""
        with self._lock:
            return self._queued > 0

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every batch handed over is done (True) or ``timeout`` passed."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.busy and self._error is None:
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.001)
        return not self.busy

    def close(self) -> None:
        """Finish what was handed over, then stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"mapping KV memory in the background failed: "
                               f"{self._error}") from self._error

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="proxima-kv-mapper",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        driver = self.memory.arena.driver
        stream = None
        try:
            driver.use_device()                 # the thread's context: the primary one
            stream = driver.new_stream()
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                seq, ops = job
                failed = self.memory.apply(ops, stream=stream)
                if any(op.code == MAP for op in ops):
                    driver.stream_synchronize(stream)     # zero-filled before reported
                with self._lock:
                    self._done.append((seq, tuple(failed)))
                    self._queued -= 1
        except BaseException as exc:    # noqa: BLE001 - raised again by poll()/submit()
            self._error = exc
        finally:
            if stream is not None:
                try:
                    driver.destroy_stream(stream)
                except Exception:       # noqa: BLE001 - the error that stopped us matters
                    pass
