"""The engine's invariant verdict: renewed at most once a minute, carried in every snapshot."""

from proxima.allocator import RunAllocator
from proxima.vllm import status


def test_verdict_is_renewed_once_per_interval(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(status.time, "monotonic", lambda: clock[0])
    calls = []
    real_check = RunAllocator.check

    def counted(self):
        calls.append(1)
        return real_check(self)

    monkeypatch.setattr(RunAllocator, "check", counted)
    buddy = RunAllocator(64, reserved=(0,))
    watch = status.InvariantWatch()
    first = watch.current(buddy)
    assert first["invariants_ok"] is True and len(calls) == 1
    clock[0] += status.INVARIANTS_INTERVAL_S - 1
    assert watch.current(buddy) is first and len(calls) == 1      # same verdict, no check
    assert watch.current(buddy, force=True)["invariants_ok"] and len(calls) == 2
    clock[0] += status.INVARIANTS_INTERVAL_S
    watch.current(buddy)
    assert len(calls) == 3
