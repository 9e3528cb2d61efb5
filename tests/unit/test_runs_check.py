"""RunAllocator.check(): a real error for every kind of broken structure, also under
``python -O`` (no ``assert``), and how the engine's status reports it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxima.allocator import AllocationHint, InvariantError, RunAllocator
from proxima.allocator.free_runs import ALLOCATED, FREE
from proxima.vllm.status import invariants_verdict


def busy_pool() -> RunAllocator:
    """Runs, claims and a reserved id: every structure has something in it."""
    a = RunAllocator(200, reserved=(0,))
    runs = [a.allocate(5, AllocationHint(room=20)) for _ in range(6)]
    a.free(runs[2])
    a.take(150)
    a.allocate(3, AllocationHint(after=runs[0][-1]))
    a.check()
    assert a.claims() and a.num_free_runs > 2
    return a


def first_free(a):
    return next(i for i in range(a.num_blocks) if a._state[i] == FREE)


CORRUPTIONS = {
    "num_free": lambda a: setattr(a, "num_free", a.num_free + 1),
    "state": lambda a: a._state.__setitem__(first_free(a), ALLOCATED),
    "bad state value": lambda a: a._state.__setitem__(first_free(a), 7),
    "reserved id freed": lambda a: a._state.__setitem__(0, FREE),
    "run end": lambda a: a._run_end.__setitem__(a.free_runs()[0][0], a.free_runs()[0][1] - 1),
    "stray run end": lambda a: a._run_end.__setitem__(a.free_runs()[0][0] + 1, 3),
    "run start": lambda a: a._run_start.__setitem__(a.free_runs()[0][1] - 1, 1),
    "order index": lambda a: next(s for s in a._free_area if s).pop(),
    "claimed index": lambda a: a._claimed_area[0].add(12345),
    "run count": lambda a: setattr(a, "_num_runs", a._num_runs + 1),
    "claim on an allocated id": lambda a: a._claim.__setitem__(1, 50),
    "claim beyond the pool": lambda a: a._claim.__setitem__(a.free_runs()[0][1] - 1, 10 ** 6),
    "structure unreadable": lambda a: a._run_start.__setitem__(a.free_runs()[0][1] - 1, None),
}


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_each_broken_structure_is_an_invariant_error(what):
    a = busy_pool()
    CORRUPTIONS[what](a)
    with pytest.raises(InvariantError):
        a.check()
    verdict = invariants_verdict(a)
    assert verdict["invariants_ok"] is False and verdict["invariants_error"]


def test_a_sound_pool_passes_and_the_verdict_says_so():
    a = busy_pool()
    a.check()
    assert invariants_verdict(a) == {"invariants_ok": True}


def test_check_fails_under_python_O():
    """Built on real errors, not ``assert``: under -O a corrupted pool still fails."""
    code = (
        "from proxima.allocator import RunAllocator, InvariantError\n"
        "from proxima.vllm.status import invariants_verdict\n"
        "assert False, 'asserts are on: not running under -O'\n"
    )
    probe = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr            # -O really strips asserts
    code = (
        "from proxima.allocator import RunAllocator, InvariantError\n"
        "from proxima.vllm.status import invariants_verdict\n"
        "a = RunAllocator(64, reserved=(0,))\n"
        "a.allocate(10)\n"
        "a._state[40] = 1            # allocated behind the allocator's back\n"
        "print(invariants_verdict(a))\n"
        "try:\n"
        "    a.check()\n"
        "except InvariantError as exc:\n"
        "    print('InvariantError:', exc)\n"
        "else:\n"
        "    print('check passed')\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "'invariants_ok': False" in out and "num_free" in out
    assert "InvariantError: num_free is 53 but 52 ids are FREE" in out
