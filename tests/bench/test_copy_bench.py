"""`python3 -m proxima.bench.copy` (issue 12 item 1): the layouts and descriptors it submits
to vLLM's swap_blocks_batch, checked on CPU; its errors without a GPU. The GPU run itself:
tests/gpu/test_copy_gpu.py."""

from __future__ import annotations

import random

import pytest

from proxima.bench import copy as copy_bench

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("name, runs, mean", [
    ("scattered", 128, 1.0), ("stock-like", 54, 2.37), ("proxima-like", 11, 11.64),
    ("one run", 1, 128.0)])
def test_layouts_have_the_run_lengths_of_the_issue(name, runs, mean):
    lengths = copy_bench.run_lengths(128, copy_bench.LAYOUTS[name][0])
    assert sum(lengths) == 128 and len(lengths) == runs
    assert 128 / len(lengths) == pytest.approx(mean, abs=0.01)


def test_runs_are_placed_apart_inside_the_pool():
    lengths = copy_bench.run_lengths(128, (2, 3, 2, 3, 2))
    runs = copy_bench.place_runs(lengths, 1024, random.Random(1))
    assert [c for c, _, _ in runs] == [sum(lengths[:i]) for i in range(len(lengths))]
    spans = sorted((g, g + k) for _, g, k in runs)
    assert spans[-1][1] <= 1024
    assert all(b_end < a_start for (_, b_end), (a_start, _) in zip(spans, spans[1:]))


def test_a_pool_too_small_is_one_clear_error():
    with pytest.raises(Exception, match="--gpu-blocks 200 is too small .* give at least"):
        copy_bench.place_runs([1] * 128, 200, random.Random(0))


@pytest.mark.parametrize("per_run", [True, False])
def test_descriptors_cover_every_page_of_every_layer_once(per_run):
    page, gpu_bases, cpu_bases = 65536, [1 << 40, 3 << 40], [5 << 40, 7 << 40]
    runs = copy_bench.place_runs(copy_bench.run_lengths(128, (12,)), 1024, random.Random(2))
    src, dst, size = copy_bench.descriptors(np, runs, gpu_bases, cpu_bases, page, per_run)
    assert len(src) == 2 * (len(runs) if per_run else 128)
    assert int(size.sum()) == 2 * 128 * page
    pages = set()
    for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist()):
        layer = next(i for i, b in enumerate(gpu_bases) if b <= s < b + (1 << 40))
        for j in range(n // page):
            gpu_block = (s - gpu_bases[layer]) // page + j
            cpu_block = (d - cpu_bases[layer]) // page + j
            pages.add((layer, cpu_block))
            c, g, k = next(r for r in runs if r[0] <= cpu_block < r[0] + r[2])
            assert gpu_block == g + cpu_block - c       # request page -> its GPU block
    assert pages == {(la, b) for la in range(2) for b in range(128)}


def test_without_a_gpu_it_says_so_in_one_line(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert copy_bench.main(["--reps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "proxima.bench.copy: error: needs an NVIDIA GPU: torch.cuda.is_available() is False here"


@pytest.mark.parametrize("argv, needle", [
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--page-kib", "-1"], "--page-kib must be >= 1"),
    (["--json", "/nonexistent/x.json"], "directory /nonexistent does not exist"),
])
def test_bad_arguments_exit_2_before_any_work(argv, needle, capsys):
    assert copy_bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
