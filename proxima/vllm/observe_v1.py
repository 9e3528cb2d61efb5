"""Stock vLLM's contiguity, measured and not changed: ``PROXIMA_OBSERVE=1`` (V1 engine).

``proxima bench`` reports blocks per run for stock and Proxima side by side. Proxima's pool
writes its status file itself; the stock pool writes none. With Proxima off,
``PROXIMA_OBSERVE=1`` and ``PROXIMA_STATS_FILE`` set, the plugin wraps two methods of
``KVCacheManager``, reading vLLM's own block tables and writing snapshots with
``"active": false, "observer": true`` and the same contiguity fields Proxima's pool writes:

* ``new_step_starts`` (once per scheduler step): at most once a second, the blocks per run
  of every request holding blocks (``running_blocks_per_run``);
* ``free``: a finishing request's blocks per run just before vLLM frees them
  (``finished_blocks_per_run``), and a snapshot at once when no request holds blocks.

Nothing that allocates, frees, evicts or admits changes; between snapshots the step wrapper
costs one clock read, as Proxima's own status writing does. The measurement itself is
:mod:`proxima.vllm.contiguity`, shared with Proxima's pool; this module does not import
the Proxima adapter.
"""

from __future__ import annotations

from proxima.vllm import patches
from proxima.vllm.contiguity import FinishedTally, idle, running_blocks_per_run
from proxima.vllm.status import STATUS_INTERVAL_S, StatusWriter

PATCHES = "observe"     # the name of this module's patch set (proxima.vllm.patches)


def snapshot(manager, steps: int, finished: FinishedTally) -> dict:
    """The status payload for one stock ``KVCacheManager``."""
    import vllm

    pool = manager.block_pool
    return {
        "active": False, "observer": True, "engine": "vllm-v1",
        "vllm_version": vllm.__version__, "num_blocks": pool.num_gpu_blocks,
        "block_size": pool.hash_block_size, "num_free_blocks": pool.get_num_free_blocks(),
        "running_blocks_per_run": running_blocks_per_run(
            manager.coordinator.single_type_managers),
        "finished_blocks_per_run": finished.as_status(),
        "steps": steps,
    }


class _Observer:
    """Per-process state: steps seen, the finished tally, the status writer."""

    def __init__(self) -> None:
        self.steps = 0
        self.finished = FinishedTally()
        self.status = StatusWriter(STATUS_INTERVAL_S)

    def publish(self, manager, force: bool = False) -> None:
        self.status.publish(lambda: snapshot(manager, self.steps, self.finished), force=force)


def _wrap(name: str, original, observer: _Observer):
    if name == "new_step_starts":
        def wrapper(self) -> None:
            observer.steps += 1
            if observer.status.due():
                observer.publish(self)
            return original(self)
    else:
        def wrapper(self, request) -> None:
            if not request.is_finished():
                return original(self, request)      # preemption: the request comes back
            managers = self.coordinator.single_type_managers
            observer.finished.add(managers, request.request_id)
            original(self, request)
            if idle(managers):
                observer.publish(self, force=True)
    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    return wrapper


def is_active() -> bool:
    return patches.is_applied(PATCHES)


def activate() -> None:
    """Start observing (idempotent). Engines running or built afterwards are observed.
    Asks the version policy first, as the adapters do (the observer reads vLLM's
    internals too)."""
    if patches.is_applied(PATCHES):
        return
    patches.apply(patches.PatchSet(PATCHES, "v1", _patches))


def _patches() -> list:
    import vllm.v1.core.kv_cache_manager as kv_cache_manager

    cls = kv_cache_manager.KVCacheManager
    observer = _Observer()
    return [patches.Patch(cls, name, _wrap(name, cls.__dict__[name], observer))
            for name in ("new_step_starts", "free")]


def deactivate() -> None:
    patches.restore(PATCHES)
