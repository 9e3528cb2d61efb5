"""tools/vllm_tests.py, the runner of vLLM's own tests against Proxima's pool: its
comparison, its reading of a run cut short, and its answer to bad input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "vllm_tests.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("vllm_tests", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def entry(outcome: str, message: str = "", pools: int = 0) -> dict:
    return {"outcome": outcome, "message": message, "pools": pools}


def test_compare_lists_what_passes_with_stock_only(tool):
    stock = {"a": entry("passed"), "b": entry("passed"), "c": entry("failed", "no model"),
             "d": entry("skipped")}
    proxima = {"a": entry("passed", pools=1), "b": entry("failed", "ids differ", pools=2),
               "c": entry("failed", "no model"), "d": entry("passed", pools=1)}
    text, worse = tool.compare("9.9", stock, proxima)
    assert worse == 1
    assert "4 tests finished in both runs." in text
    assert "| stock | 2 | 1 | 0 | 1 | 0 | 0 | - |" in text
    assert "| Proxima | 2 | 2 | 0 | 0 | 0 | 0 | 3 |" in text
    assert "- `b`: stock passed, Proxima failed: ids differ" in text
    assert "- `d`: stock skipped, Proxima passed" in text
    assert "`c`" not in text                    # fails alike: not a difference


def test_compare_of_a_run_cut_short_counts_the_tests_both_finished(tool):
    stock = {"a": entry("passed"), "b": entry("passed"), "c": entry("passed")}
    proxima = {"a": entry("passed", pools=1)}
    text, worse = tool.compare("9.9", stock, proxima)
    assert worse == 0
    assert "1 tests finished in both runs (2 more in one run only" in text
    assert "| stock | 1 | 0 |" in text


def test_a_partial_report_is_read_line_by_line_and_a_finished_one_wins(tool, tmp_path,
                                                                       capsys):
    report = tmp_path / "9.9-stock.json"
    partial = tmp_path / "9.9-stock.json.partial"
    partial.write_text(json.dumps({"a": entry("passed")}) + "\n"
                       + json.dumps({"b": entry("failed", "x")}) + "\n")
    assert tool.read_report(report, tmp_path / "log") == {"a": entry("passed"),
                                                          "b": entry("failed", "x")}
    assert "a run cut short, 2 tests" in capsys.readouterr().err
    report.write_text(json.dumps({"a": entry("passed")}))
    assert tool.read_report(report, tmp_path / "log") == {"a": entry("passed")}


def test_a_missing_sdist_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "vllm-0.0.0.tar.gz"
    run = subprocess.run([sys.executable, str(TOOL), "--sdist", str(missing), "--work",
                          str(tmp_path / "work")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr == f"vllm_tests: {missing} does not exist\n"
    assert not (tmp_path / "work").exists()
