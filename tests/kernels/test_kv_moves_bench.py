"""`python3 -m proxima.bench.kv_moves` end to end on CPU (its --device cpu dry run: the
kernel in Triton's interpreter), and its argument errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from proxima.bench import kv_moves  # noqa: E402


def test_dry_run_writes_every_row_and_checks_the_kernel(tmp_path, capsys):
    out = tmp_path / "moves.json"
    rc = kv_moves.main(["--device", "cpu", "--layers", "2", "--kv-heads", "1",
                        "--head-size", "8", "--run-blocks", "4", "--runs", "1,3",
                        "--singles", "5", "--peak-mib", "1", "--budget-s", "0.001",
                        "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["checks_ok"] is True
    assert set(report["checks"]) == {"1 x 4-block runs", "3 x 4-block runs", "5 scattered blocks"}
    rows = report["rows"]
    assert [(r["batch"], r["method"]) for r in rows][:3] == [
        ("1 x 4-block runs", "triton"), ("1 x 4-block runs", "index"), ("1 x 4-block runs", "runs")]
    page = 16 * 1 * 2 * 8 * 2
    for r in rows:
        assert r["bytes_moved"] == r["blocks"] * 2 * page
        assert r["gbps_call"] == pytest.approx(2 * r["bytes_moved"] / r["call_s"] / 1e9)
        assert r["of_peak_call"] == pytest.approx(r["gbps_call"] / report["peak"]["gbps"])
        assert ("vs_best_torch_call" in r) == (r["method"] == "triton")
        assert "graph_s" not in r                     # no CUDA graphs on CPU
    singles = [r for r in rows if r["batch"] == "5 scattered blocks"]
    assert {r["runs"] for r in singles} == {5}          # no two scattered blocks merge
    assert "correctness (destination == source after the Triton move): all ok" in \
        capsys.readouterr().out


def test_cases_are_valid_batches_of_the_sizes_asked_for():
    from proxima.kernels.moves import expand_moves
    cases, num_blocks = kv_moves.make_cases([1, 4, 256], [16, 1024], 16, seed=3)
    assert num_blocks >= 2 * 256 * 16
    for name, src, dst, n in cases:
        s, d = expand_moves(src, dst, n, num_blocks)
        assert len(s) == sum(n)
    assert [sum(c[3]) for c in cases] == [16, 64, 4096, 16, 1024]


@pytest.mark.parametrize("argv, needle", [
    (["--runs", "1,x"], "--runs must be comma-separated integers, got '1,x'"),
    (["--singles", "0"], "--singles values must be >= 1"),
    (["--methods", "triton,cupy"], "--methods takes triton, index, runs; got 'triton,cupy'"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--budget-s", "0"], "--budget-s must be > 0"),
    (["--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, needle, capsys):
    assert kv_moves.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err
