"""Bad input to `proxima bench`: one clear line on stderr, exit 2, no traceback, no load."""

from __future__ import annotations

import sys

import pytest

from proxima.cli import main


def run_cli(capsys, *argv):
    rc = main(["bench", "--no-progress", *argv])
    captured = capsys.readouterr()
    return rc, captured.err


def assert_one_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("proxima bench: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_unreachable_server(capsys, closed_port_url):
    rc, err = run_cli(capsys, "--base-url", closed_port_url, "--model", "m", "--requests", "2")
    assert rc == 2
    assert_one_line(err, "cannot reach server A", closed_port_url, "check --base-url")


def test_wrong_model_lists_what_is_served(capsys, fake_server):
    server = fake_server(models=("llama-8b", "other"))
    rc, err = run_cli(capsys, "--base-url", server.url, "--model", "gpt", "--requests", "2")
    assert rc == 2
    assert_one_line(err, "does not serve model 'gpt'", "llama-8b, other")
    assert server.state.bodies == []


@pytest.mark.parametrize("argv, fragment", [
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--requests", "-3"], "--requests must be >= 1, got -3"),
    (["--concurrency", "0"], "--concurrency must be from 1 to 100,000 (requests in flight), got 0"),
    (["--request-rate", "0"], "--request-rate must be above 0"),
    (["--timeout", "0"], "--timeout must be from 0.01 to 86,400 seconds"),
    (["--label", "x", "--label", "y"], "got 2 --label for 1 --base-url"),
    (["--repeat", "0"], "--repeat must be from 1 to 1,000, got 0"),
    (["--kv-cache-memory-bytes", "100"], "--kv-cache-memory-bytes only applies with --offline"),
    (["--json", "/nonexistent-dir/x.json"], "directory /nonexistent-dir does not exist"),
    (["--trace", "/nonexistent.jsonl"], "cannot read trace /nonexistent.jsonl"),
])
def test_bad_arguments_touch_no_server(capsys, fake_server, argv, fragment):
    server = fake_server()
    rc, err = run_cli(capsys, "--base-url", server.url, "--model", "tiny", *argv)
    assert rc == 2
    assert_one_line(err, fragment)
    assert server.state.bodies == []


def test_no_server_and_not_offline(capsys):
    rc, err = run_cli(capsys, "--model", "m")
    assert rc == 2
    assert_one_line(err, "give --base-url URL")


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h:1", "http://"])
def test_malformed_base_url(capsys, url):
    rc, err = run_cli(capsys, "--base-url", url, "--model", "m")
    assert rc == 2
    assert_one_line(err, "--base-url must look like http://HOST:PORT", repr(url))


def test_duplicate_labels(capsys, fake_server):
    a, b = fake_server(), fake_server()
    rc, err = run_cli(capsys, "--base-url", a.url, "--label", "x", "--base-url", b.url,
                      "--label", "x", "--model", "tiny")
    assert rc == 2
    assert_one_line(err, "--label values must differ")


def test_server_that_is_not_openai(capsys, fake_server):
    server = fake_server()
    rc, err = run_cli(capsys, "--base-url", server.url + "/nothing", "--model", "tiny")
    assert rc == 2
    assert_one_line(err, "answered HTTP 404 to GET /v1/models")


def test_offline_refuses_online_flags(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    rc, err = run_cli(capsys, "--offline", "--model", str(tmp_path), "--base-url", "http://x:1",
                      "--concurrency", "3")
    assert rc == 2
    assert_one_line(err, "--base-url, --concurrency do not apply with --offline")


@pytest.mark.parametrize("argv, fragment", [
    (["--repeat", "0"], "--repeat must be from 1 to 1,000, got 0"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes: '0' is below 1"),
    (["--kv-cache-memory-bytes", "1e400"], "--kv-cache-memory-bytes: '1e400' is above the "
                                           "bound of 1024TiB"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
])
def test_offline_bad_numbers(capsys, tmp_path, argv, fragment):
    (tmp_path / "config.json").write_text("{}")
    rc, err = run_cli(capsys, "--offline", "--model", str(tmp_path), *argv)
    assert rc == 2
    assert_one_line(err, fragment)


def test_offline_model_dir_without_config(capsys, tmp_path):
    rc, err = run_cli(capsys, "--offline", "--model", str(tmp_path), "--load-format", "dummy")
    assert rc == 2
    assert_one_line(err, "no config.json")
    rc, err = run_cli(capsys, "--offline", "--model", str(tmp_path / "missing"))
    assert rc == 2
    assert_one_line(err, "no such directory")


def test_offline_refuses_in_process_engine_core(capsys, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rc, err = run_cli(capsys, "--offline", "--model", str(tmp_path))
    assert rc == 2
    assert_one_line(err, "VLLM_ENABLE_V1_MULTIPROCESSING=0")


@pytest.mark.parametrize("mode", [[], ["--offline", "--model", "x"]])
def test_plot_without_matplotlib_is_refused_before_any_load(capsys, fake_server, monkeypatch,
                                                            tmp_path, mode):
    """Without matplotlib, --plot failed once the whole bench had run (after the JSON was
    written): now one line before any request is sent."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib fails
    server = fake_server()
    urls = [] if mode else ["--base-url", server.url, "--model", "tiny"]
    rc, err = run_cli(capsys, *urls, *mode, "--plot", str(tmp_path / "p.png"))
    assert rc == 2
    assert_one_line(err, "--plot needs matplotlib: pip install 'proxima[plot]'")
    assert server.state.bodies == [] and list(tmp_path.iterdir()) == []


def test_a_server_that_never_answers_is_not_called_unreachable(capsys, monkeypatch):
    """A server that takes the connection and never answers GET /v1/models (starting,
    stuck) was reported as "cannot reach server A (TimeoutError): is it running?"."""
    import socket

    from proxima.bench import online

    monkeypatch.setattr(online, "PREFLIGHT_TIMEOUT_S", 0.5)
    with socket.socket() as silent:             # listens, never accepts nor answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        rc, err = run_cli(capsys, "--base-url", url, "--requests", "2")
    assert rc == 2
    assert_one_line(err, f"server A ({url}) did not answer GET /v1/models within 0.5 s",
                    "still starting, overloaded or stuck")
