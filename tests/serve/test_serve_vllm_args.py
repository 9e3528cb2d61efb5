"""Options pass through vLLM's own ``vllm serve`` parser; proxima serve adds only its defaults
for the embedded demo model and refuses modes that need more than one engine."""

from __future__ import annotations

import pytest

from proxima.errors import UserError
from proxima.models import DEMO_SERVED_MODEL_NAME, TINY_LLAMA_DIR
from proxima.serve import argv, vllm_args

from .conftest import v1_only

pytestmark = v1_only  # vLLM 0.26's options; the card stack's are in test_serve_card_stack.py


def test_vllm_options_pass_through(serve_args):
    args = serve_args("/models/llama", "--max-model-len", "4k", "--enforce-eager",
                      "--gpu_memory_utilization=0.5", "-tp", "2", "--block-size", "32")
    assert args.model == "/models/llama"
    assert (args.max_model_len, args.enforce_eager, args.gpu_memory_utilization) == (4000, True, 0.5)
    assert (args.tensor_parallel_size, args.block_size) == (2, 32)
    assert vllm_args.apply_demo_defaults(args, []) is False


def test_model_option_and_config_file(serve_args, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9100\nmax-model-len: 1024\n")
    args = serve_args("--model", "org/name", "--config", str(config))
    assert (args.model, args.port, args.max_model_len) == ("org/name", 9100, 1024)


def test_unknown_option_is_one_line(serve_args):
    with pytest.raises(UserError) as info:
        serve_args("--max-modle-len", "10")
    assert "unrecognized arguments: --max-modle-len" in str(info.value)
    assert "did you mean --max-model-len?" in str(info.value)
    assert "\n" not in str(info.value)


def test_an_unknown_option_close_to_proximas_own_names_it():
    with pytest.raises(UserError) as info:
        vllm_args.parse(["--kv-mx", "1GiB"], own_flags=("--kv-max", "--kv-min"))
    assert "unrecognized arguments: --kv-mx; did you mean --kv-max?" in str(info.value)
    with pytest.raises(UserError) as info:
        vllm_args.parse(["--no-such-flag"], own_flags=("--kv-max",))
    assert "did you mean" not in str(info.value)


def test_vllms_own_validation_errors_become_user_errors(serve_args):
    with pytest.raises(UserError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        serve_args("--enable-auto-tool-choice")


@pytest.mark.parametrize("argv, fragment", [
    (["--api-server-count", "2"], "--api-server-count 2"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2"),
    (["--headless"], "--headless"),
])
def test_modes_needing_more_than_one_engine_are_refused(serve_args, argv, fragment):
    with pytest.raises(UserError, match=fragment):
        vllm_args.check_supported(serve_args(*argv))


def test_no_model_serves_the_embedded_demo(serve_args):
    argv = ["--port", "9000"]
    args = serve_args(*argv)
    assert vllm_args.apply_demo_defaults(args, argv) is True
    assert args.model == str(TINY_LLAMA_DIR)
    assert args.load_format == "dummy"
    assert args.served_model_name == [DEMO_SERVED_MODEL_NAME]
    assert args.max_model_len == 2048
    assert args.kv_cache_memory_bytes == 256 * 2**20
    assert args.gpu_memory_utilization == 0.1


def test_demo_keeps_what_the_user_chose(serve_args):
    argv = ["--served-model-name", "demo", "--gpu-memory-utilization", "0.5", "--max-model-len", "512"]
    args = serve_args(*argv)
    vllm_args.apply_demo_defaults(args, argv)
    assert args.served_model_name == ["demo"]
    assert (args.gpu_memory_utilization, args.max_model_len) == (0.5, 512)
    assert args.kv_cache_memory_bytes is None  # sized by the utilization the user asked for


@pytest.mark.parametrize("argv, advised", [
    ([], True),                                              # vLLM's one-GPU default: uni
    (["--max-model-len", "4096"], True),
    (["--distributed-executor-backend", "mp"], False),       # chosen: nothing to advise
    (["--distributed_executor_backend=uni"], False),         # uni asked for on purpose
    (["-tp", "2"], False),                                   # vLLM takes mp itself
    (["--pipeline-parallel-size", "2"], False),
])
def test_elastic_on_one_gpu_advises_the_mp_executor_unless_one_was_chosen(serve_args, argv,
                                                                         advised):
    hint = vllm_args.elastic_executor_hint(serve_args(*argv), argv)
    assert (hint is not None) == advised
    if advised:
        assert "--distributed-executor-backend mp" in hint and "\n" not in hint


@pytest.mark.parametrize("token, name", [
    ("--gpu_memory_utilization=0.5", "--gpu-memory-utilization"),
    ("--max-model-len", "--max-model-len"),
    ("-tp", "-tp"),
    ("/models/some_model", "/models/some_model"),
])
def test_an_option_is_named_as_vllm_spells_it(token, name):
    assert argv.option_name(token) == name
    assert argv.given(["x", token], "--gpu-memory-utilization") is (
        name == "--gpu-memory-utilization")


@pytest.mark.parametrize("words, value", [
    (["m", "--dtype", "half"], "half"),
    (["m", "--dtype=half", "--dtype", "bfloat16"], "bfloat16"),   # argparse keeps the last
    (["m", "--dtype", "bfloat16", "--dtype=half"], "half"),
    (["m", "--max-model-len", "512"], None),
    (["m", "--dtype"], None),                                       # its value missing
])
def test_the_last_value_of_an_option_in_any_spelling(words, value):
    assert argv.last_value(words, "--dtype") == value
    assert argv.last_value([w.replace("--dtype", "--d_type") for w in words],
                           "--d-type") == value
