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
  launched before it, including any ``MOVE`` out of that granule) before it unmaps.
* ``MOVE``: applied at once, on the caller's (the forward's) stream, in op order: a move
  only touches confirmed, mapped granules, which no queued map or unmap can concern.

Batches are applied in order, one at a time. A driver error other than lack of memory
stops the thread; the next :meth:`BackgroundOps.poll` raises it on the worker's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

from proxima.memory.channel import WHOLE
from proxima.memory.ops import MAP, MOVE, UNMAP, Op, validate


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
        self._reached = (-1, 0)     # (batch, ops applied: WHOLE when all) so far

    # ------------------------------------------------------------------ caller's thread
    def submit(self, seq: int, ops: Sequence[Op], *, stream: int = 0,
               mover: Callable[[int, int, int], None] | None = None, lead: int = 0) -> None:
        """Apply batch ``seq``: its moves now, on ``stream``, and its maps and unmaps on the
        thread, in order. ``lead``: its first ``lead`` ops are maps a step may wait for
        (:meth:`wait_lead`): the thread says when they are done, before the rest."""
        self._raise()
        memory = self.memory
        validate(ops, memory.num_granules, memory.num_blocks)
        moves = [op for op in ops if op.code == MOVE]
        if moves:
            memory.apply(moves, stream=stream, mover=mover)
        lead = sum(1 for op in ops[:lead] if op.code in (MAP, UNMAP))
        todo = tuple(op for op in ops if op.code in (MAP, UNMAP))
        if not todo:
            with self._lock:
                self._done.append((seq, ()))
        else:
            self._start()
            with self._lock:
                self._queued += 1
            self._jobs.put((seq, todo, lead))

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

    def wait_lead(self, seq: int, ops: int = 1, timeout: float | None = None) -> bool:
        """Wait until the first ``ops`` ops of batch ``seq`` (its lead ops at most; a
        larger count: the whole batch) and every batch before it are applied (True);
        False when ``timeout`` passed or the thread stopped on an error (:meth:`poll`
        raises it)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._error is None:
            with self._lock:
                if self._reached >= (seq, ops) or self._queued == 0:
                    return True
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.0002)
        return False

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
                seq, ops, lead = job
                failed = []
                if lead:                      # maps a step waits for: first, and said so
                    failed += self.memory.apply(ops[:lead], stream=stream)
                    driver.stream_synchronize(stream)
                    with self._lock:
                        self._reached = (seq, lead)
                failed += self.memory.apply(ops[lead:], stream=stream)
                if any(op.code == MAP for op in ops[lead:]):
                    driver.stream_synchronize(stream)     # zero-filled before reported
                with self._lock:
                    self._reached = (seq, WHOLE)
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
