"""The batch rules of proxima.kernels.moves (pure Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxima.kernels.moves import MoveError, expand_moves, runs_of


def test_runs_expand_block_by_block_in_run_order():
    assert expand_moves([40, 7], [100, 3], [3, 1], 128) == ([40, 41, 42, 7], [100, 101, 102, 3])


def test_n_none_means_single_blocks_and_array_likes_are_accepted():
    np = pytest.importorskip("numpy")
    assert expand_moves(np.array([5, 9]), (1, 2), None, 10) == ([5, 9], [1, 2])
    assert expand_moves([np.int64(5)], [np.int32(1)], [np.int16(2)], 10) == ([5, 6], [1, 2])


def test_empty_batch_is_valid():
    assert expand_moves([], [], [], 4) == ([], [])


def test_a_source_may_be_copied_to_several_destinations():
    assert expand_moves([3, 3], [5, 6], None, 8) == ([3, 3], [5, 6])


@pytest.mark.parametrize("src, dst, n, needle", [
    ([1, 2], [5], None, "same length, got 2, 1 and 2"),
    ([1], [5], [0], "move 0 (src 1, dst 5, n 0): n must be >= 1"),
    ([1], [5], [-2], "n must be >= 1"),
    ([1], [5], [2.5], "n[0] must be an int, got 2.5"),
    ([True], [5], None, "src[0] must be an int, got the bool True"),
    (["1"], [5], None, "src[0] must be an int, got '1'"),
    ("12", [5], None, "src must be a sequence of block ids"),
    ([6], [0], [3], "move 0 (src 6, dst 0, n 3): blocks 6..8 are outside the cache's 8 blocks"),
    ([0], [-1], None, "blocks -1..-1 are outside"),
    ([0, 1], [4, 5], [2, 1], "move 1 (src 1, dst 5, n 1): destination block 5 is also written "
                             "by move 0"),
    ([0, 4], [4, 6], [1, 1], "move 0 (src 0, dst 4, n 1): destination block 4 is also a source"),
    ([0], [2], [4], "destination block 2 is also a source of this batch; split the batch"),
])
def test_invalid_batches_raise_one_clear_error(src, dst, n, needle):
    with pytest.raises(MoveError) as err:
        expand_moves(src, dst, n, 8)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)


def test_a_swap_is_not_one_batch_but_two_phases_with_a_spare_block_are():
    with pytest.raises(MoveError, match="also a source"):
        expand_moves([1, 2], [2, 1], None, 4)
    # the planner's form: 1 -> spare 3, then 2 -> 1, then 3 -> 2
    for phase in (([1], [3]), ([2], [1]), ([3], [2])):
        expand_moves(*phase, None, 4)


def test_runs_of_merges_continuing_blocks():
    s, d = expand_moves([40, 43, 7], [100, 103, 3], [3, 2, 1], 128)
    assert runs_of(s, d) == [(40, 100, 5), (7, 3, 1)]
    assert runs_of([], []) == []


def test_the_package_imports_neither_torch_nor_triton():
    code = ("import sys, proxima.kernels, proxima.kernels.moves; "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
