"""Every bad input to ``proxima serve`` ends in one line on stderr and a non-zero exit, fast,
before anything heavy starts. Each case runs the real command in a fresh interpreter."""

from __future__ import annotations

import socket

import pytest

from proxima.errors import UserError
from proxima.serve import validate

from .conftest import assert_one_line_error, free_port, proxima_env, run_proxima


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_proxima_allocator_value(value):
    done = run_proxima("serve", env=proxima_env(PROXIMA_ALLOCATOR=value))
    assert_one_line_error(done, "PROXIMA_ALLOCATOR must be 1 (Proxima on) or 0 / unset",
                          f"got {value!r}")


@pytest.mark.parametrize("name", ["PROXIMA_ALLOW_UNTESTED_VLLM", "PROXIMA_OBSERVE"])
def test_bad_value_of_any_proxima_switch(name):
    """PROXIMA_ALLOW_UNTESTED_VLLM=yes used to be silently treated as unset."""
    done = run_proxima("serve", env=proxima_env(**{name: "yes"}))
    assert_one_line_error(done, f"{name} must be 1 (", "or 0 / unset", "got 'yes'")


@pytest.mark.parametrize("value", ["0", ""])
def test_proxima_allocator_off_is_refused_with_the_alternative(value):
    done = run_proxima("serve", env=proxima_env(PROXIMA_ALLOCATOR=value))
    assert_one_line_error(done, f"PROXIMA_ALLOCATOR={value!r} switches Proxima off", "vllm serve")


def test_model_path_missing(tmp_path):
    missing = tmp_path / "no-such-model"
    done = run_proxima("serve", str(missing))
    assert_one_line_error(done, f"model path {str(missing)!r} does not exist")


def test_model_dir_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    done = run_proxima("serve", str(tmp_path), "--port", str(free_port()))
    assert_one_line_error(done, "is not a model directory", "no config.json", "weights.bin")


def test_model_path_is_a_plain_file(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("x")
    done = run_proxima("serve", "--model", str(path))
    assert_one_line_error(done, "is a file, not a model directory")


@pytest.mark.parametrize("argv, fragment", [
    (["--block-size", "17"], "--block-size 17 is not supported"),
    (["--block-size=8"], "--block-size 8 is not supported"),
    (["--block_size", "512"], "--block-size 512 is not supported"),
    (["--block-size", "abc"], "--block-size must be an integer, got 'abc'"),
])
def test_block_size_invalid(argv, fragment):
    done = run_proxima("serve", *argv)
    line = assert_one_line_error(done, fragment)
    assert "16, 32, 64, 128, 256" in line


def test_port_in_use():
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_proxima("serve", "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(done, f"port {port} on 127.0.0.1 is already in use", "--port")


@pytest.mark.parametrize("port, fragment", [("70000", "out of range"), ("http", "must be an integer")])
def test_port_invalid(port, fragment):
    assert_one_line_error(run_proxima("serve", "--port", port), fragment)


def env_with_vllm(tmp_path, version: str, torch: str | None = None, **overrides) -> dict:
    """An installed vLLM (and torch) of another version, as `importlib.metadata` sees it:
    its metadata first on the path."""
    for name, value in (("vllm", version), ("torch", torch)):
        if value is None:
            continue
        dist = tmp_path / f"{name}-{value}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {value}\n")
    env = proxima_env(**overrides)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    return env


def test_other_v0_vllm_follows_the_same_policy_as_any_other(tmp_path):
    """An untested 0.6.x is refused like any untested vLLM, and the override lets it through
    as it does in the engine (serve used to refuse it even then)."""
    done = run_proxima("serve", env=env_with_vllm(tmp_path, "0.6.2"))
    assert_one_line_error(done, "vLLM 0.6.2 with torch", "not a version Proxima was tested "
                          "with", "vllm 0.26.0 with torch", "vllm 0.6.3.post1 with torch",
                          "PROXIMA_ALLOW_UNTESTED_VLLM=1", "vllm serve")
    other = tmp_path / "allowed"
    other.mkdir()
    allowed = env_with_vllm(other, "0.6.2", PROXIMA_ALLOW_UNTESTED_VLLM="1")
    done = run_proxima("serve", "--block-size", "17", env=allowed)
    assert_one_line_error(done, "--block-size 17")  # past the version check


def test_card_stack_vllm_passes_the_version_check(tmp_path):
    done = run_proxima("serve", "--block-size", "17",
                       env=env_with_vllm(tmp_path, "0.6.3.post1", torch="2.4.0"))
    assert_one_line_error(done, "--block-size 17")  # past the version check


def test_a_tested_vllm_with_an_untested_torch_is_refused(tmp_path):
    done = run_proxima("serve", env=env_with_vllm(tmp_path, "0.6.3.post1", torch="2.11.0"))
    assert_one_line_error(done, "vLLM 0.6.3.post1 with torch 2.11.0 is not a version",
                          "PROXIMA_ALLOW_UNTESTED_VLLM=1")


def test_untested_vllm_is_refused_unless_allowed(tmp_path):
    done = run_proxima("serve", env=env_with_vllm(tmp_path, "0.25.1",
                                                  PROXIMA_ALLOW_UNTESTED_VLLM=None))
    assert_one_line_error(done, "vLLM 0.25.1 with torch", "PROXIMA_ALLOW_UNTESTED_VLLM=1")
    other = tmp_path / "allowed"
    other.mkdir()
    allowed = env_with_vllm(other, "0.25.1", PROXIMA_ALLOW_UNTESTED_VLLM="1")
    done = run_proxima("serve", "--block-size", "17", env=allowed)
    assert_one_line_error(done, "--block-size 17")  # past the version check


def test_no_gpu_stops_before_serving():
    """Valid options on a machine without a GPU: the pre-flight says so, nothing is served."""
    done = run_proxima("serve", "--host", "127.0.0.1", "--port", str(free_port()))
    line = assert_one_line_error(done, "self-check failed, not serving", "no NVIDIA GPU",
                                 "docker run --gpus all")
    assert line.count("\n") == 0
    assert "self-check versions: ok" in done.stderr  # the other pre-flight lines are logged


def test_help_lists_usage_and_demo():
    done = run_proxima("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: proxima serve [MODEL]")
    assert "proxima-demo-random-weights" in done.stdout and "RANDOM weights" in done.stdout


def test_vllm_plugins_without_proxima_is_refused():
    with pytest.raises(UserError, match="VLLM_PLUGINS='lora_filesystem_resolver' does not include 'proxima'"):
        validate.check_plugin({"VLLM_PLUGINS": "lora_filesystem_resolver"})


def test_stats_file_in_missing_directory(tmp_path):
    with pytest.raises(UserError, match="PROXIMA_STATS_FILE must be .* does not exist or is "
                                        "not writable"):
        validate.validate_environment(
            {"PROXIMA_STATS_FILE": str(tmp_path / "nope" / "s.json")})


def test_scan_reads_options_in_any_vllm_spelling():
    found = validate.scan(["m", "--max-model-len", "4k", "--block_size=32", "--port", "9000",
                           "--host=::1"])
    assert (found.model, found.block_size, found.port, found.host) == ("m", "32", "9000", "::1")
    assert validate.scan(["--port", "1", "--model", "x"]).model == "x"
    with pytest.raises(UserError, match="--port needs a value"):
        validate.scan(["--port"])
