"""Several models (issue 36): the command line and the models file, parsed and checked before
anything starts; and serve's --compaction flag and mp executor default (issue 36, item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxima.errors import UserError
from proxima.serve import multi, multi_config, serve_flags, validate
from proxima.serve.multi_config import (check_plan, load_models_file, parse_command_line,
                                        wants_multi)

TINY = str(Path(__file__).resolve().parents[2] / "proxima" / "models" / "tiny-llama")


@pytest.mark.parametrize("argv, multi_wanted", [
    ([TINY], False),
    (["--model", TINY], False),                                 # vLLM's own --model PATH
    (["--model", "chat=/m"], True),
    (["--model=chat=/m --max-model-len 8"], True),
    (["--models", "x.toml"], True),
    ([TINY, "--port", "8001", "--elastic"], False),
])
def test_several_models_are_asked_for_by_name_equals_path_or_a_models_file(argv, multi_wanted):
    assert wants_multi(argv) is multi_wanted


def test_the_command_line_gives_each_model_its_own_options_and_the_rest_to_all():
    plan = parse_command_line([
        "--model", f"chat={TINY} --max-model-len 4096 --kv-max 8GiB --port 9101",
        "--model", f"small={TINY} --kv_min=1GiB --elastic",
        "--enforce-eager", "--host", "127.0.0.1", "--port", "9000", "--compaction"])
    chat, small = plan.models
    assert (chat.name, chat.path, chat.args, chat.kv_max, chat.port) == \
        ("chat", TINY, ["--max-model-len", "4096"], "8GiB", 9101)
    assert (small.args, small.kv_min, small.port) == ([], "1GiB", None)
    assert (plan.host, plan.port, plan.compaction, plan.common) == \
        ("127.0.0.1", 9000, True, ["--enforce-eager"])
    command = multi_config.engine_command(chat, 9101, plan)
    assert command[2:] == ["proxima.cli", "serve", TINY, "--host", "127.0.0.1", "--port", "9101",
                           "--served-model-name", "chat", "--elastic", "--compaction",
                           "--enforce-eager", "--max-model-len", "4096", "--kv-max", "8GiB"]


TOML = f"""
port = 9000
args = "--enforce-eager"

[[models]]
name = "chat"
path = "{TINY}"
args = ["--max-model-len", "4096"]
kv_min = "2GiB"
kv_max = 21474836480
port = 9101

[[models]]
name = "embed"
path = "{TINY}"
args = "--task embed"
"""


def test_a_toml_models_file_and_the_command_line_together(tmp_path):
    file = tmp_path / "models.toml"
    file.write_text(TOML)
    plan = parse_command_line(["--models", str(file), "--model", f"third={TINY}", "--port", "9500"])
    assert [m.name for m in plan.models] == ["chat", "embed", "third"]
    chat, embed, _ = plan.models
    assert (chat.args, chat.kv_min, chat.kv_max, chat.port) == \
        (["--max-model-len", "4096"], "2GiB", "21474836480", 9101)
    assert embed.args == ["--task", "embed"]
    assert (plan.port, plan.common) == (9500, ["--enforce-eager"])   # the command line wins
    check_plan(plan, validate.check_model)


def test_a_json_models_file(tmp_path):
    file = tmp_path / "models.json"
    file.write_text(json.dumps({"models": [{"name": "a", "path": TINY, "kv_max": "4GiB"}]}))
    plan = load_models_file(str(file))
    assert [(m.name, m.kv_max) for m in plan.models] == [("a", "4GiB")]


@pytest.mark.parametrize("text, suffix, message", [
    ('[[models]]\nname = "a"\npath = "/m"\nkv_maxx = "1GiB"\n', ".toml",
     "models[1]: unknown field 'kv_maxx': did you mean 'kv_max'?"),
    ('[[models]]\nname = "a"\npath = \n', ".toml", "m.toml:3: not valid TOML"),
    ('[[models]]\nname = "a"\nargs = [\n', ".toml", "m.toml:3: not valid TOML (Invalid value "
                                                     "(at end of document))"),
    ('{"models": [\n  {"name": "a",}\n]}', ".json", "m.json:2: not valid JSON"),
    ('[[models]]\nname = "a"\n', ".toml", "models[1]: missing 'path'"),
    ('[[models]]\nname = "a"\npath = "/m"\nport = "x"\n', ".toml",
     "models[1].port: the port must be an integer, got 'x'"),
    ('[[models]]\nname = true\npath = "/m"\n', ".toml",      # "got True": Python's spelling
     "models[1].name: must be a string, got true"),
    ('{"models": [{"name": "a", "path": "/m", "port": null}]}', ".json",
     "models[1].port: the port must be an integer, got null"),
    ('[[models]]\nname = "a"\npath = "/m"\nargs = [1, true]\n', ".toml",
     "models[1].args: must be a list of strings"),
    ('[[models]]\nname = "a b"\npath = "/m"\n', ".toml", "model name 'a b' is not a valid name"),
    ('[[models]]\nname = "a"\npath = "/m"\nargs = "--host 0.0.0.0"\n', ".toml",
     "models[1].args: --host cannot be given for one model"),
    ('prot = 9000\n', ".toml", "unknown field 'prot': did you mean 'port'?"),
    ('port = 9000\n', ".toml", "no models: add one [[models]] table"),
    ('models = "a"\n', ".toml", "models must be a list of tables"),
    ('compaction = "yes"\n[[models]]\nname = "a"\npath = "/m"\n', ".toml",
     "compaction must be true or false"),
])
def test_a_malformed_models_file_is_refused_naming_the_line_or_the_field(tmp_path, text, suffix,
                                                                       message):
    file = tmp_path / f"m{suffix}"
    file.write_text(text)
    with pytest.raises(UserError) as caught:
        load_models_file(str(file))
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv, message", [
    (["--model", f"a={TINY}", "--model", f"a={TINY}"], "model name 'a' is given twice"),
    (["--model", "a=/no/such/dir"], "model 'a': model path '/no/such/dir' does not exist"),
    (["--model", f"a={TINY} --port 9100", "--model", f"b={TINY} --port 9100"],
     "models 'a' and 'b' are both given port 9100"),
    (["--model", f"a={TINY} --port 9000", "--port", "9000"], "port 9000 is the endpoint's port"),
    (["--model", f"a={TINY} --port 8000"], "port 8000 is the endpoint's port"),
    (["--model", f"a={TINY} --served-model-name x"], "the NAME in NAME=PATH is the served name"),
    (["--model", f"a={TINY}", "--served-model-name", "x"], "--served-model-name cannot be given"),
    (["--model", f"a={TINY} --port 0"], "port 0 is out of range"),
    (["--model", "=/m"], "model name '' is not a valid name"),
    (["--model", "a="], "model 'a' has no path"),
    (["--model", "a=/m 'unclosed"], "cannot split it into words"),
    ([TINY, "--model", f"a={TINY}"], "give each as --model NAME=PATH"),
    (["--model", f"a={TINY}", "--compaction=1"], "--compaction takes no value"),
])
def test_bad_several_models_input_is_one_line(argv, message):
    with pytest.raises(UserError) as caught:
        check_plan(parse_command_line(argv), validate.check_model)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_two_models_files_are_refused(tmp_path):
    with pytest.raises(UserError, match="--models was given 2 times"):
        parse_command_line(["--models", "a.toml", "--models", "b.toml"])


def test_an_engine_gets_a_free_port_distinct_from_the_others_and_no_shared_status_file(
        monkeypatch):
    monkeypatch.setenv("PROXIMA_STATS_FILE", "/tmp/shared.json")
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    plan, host, port, engines = multi.prepare(["--model", f"a={TINY}", "--model", f"b={TINY}",
                                               "--host", "127.0.0.1", "--port", str(_free())])
    ports = {int(e.backend.url.rsplit(":", 1)[1]) for e in engines}
    assert len(ports) == 2 and port not in ports
    assert all("PROXIMA_STATS_FILE" not in e.env for e in engines)
    assert [e.backend.name for e in engines] == ["a", "b"]


def test_engines_started_side_by_side_do_not_pick_the_same_distributed_port(monkeypatch):
    """vLLM takes its workers' port as the first free one from VLLM_PORT up; engines that all
    look before any binds took the same one (H100, EADDRINUSE). Each engine's own environment,
    given to vLLM's own port search with nothing bound yet, must give distinct ports."""
    network_utils = pytest.importorskip("vllm.utils.network_utils")
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    monkeypatch.setenv("VLLM_PORT", str(_free()))
    _, _, _, engines = multi.prepare(["--model", f"a={TINY}", "--model", f"b={TINY}",
                                      "--model", f"c={TINY}", "--host", "127.0.0.1",
                                      "--port", str(_free())])
    picked = []
    for engine in engines:
        monkeypatch.setenv("VLLM_PORT", engine.env["VLLM_PORT"])
        picked.append(network_utils.get_open_port())
    assert len(set(picked)) == 3, picked


@pytest.mark.parametrize("value, says", [
    ("abc", "got 'abc'"), ("65500", "each of the 2 models (from 1 to 65335), got '65500'"),
    ("0", "got '0'")])
def test_a_vllm_port_that_cannot_serve_every_model_is_refused_in_one_line(monkeypatch, value,
                                                                         says):
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    monkeypatch.setenv("VLLM_PORT", value)
    with pytest.raises(UserError) as exc:
        multi.prepare(["--model", f"a={TINY}", "--model", f"b={TINY}", "--host", "127.0.0.1",
                       "--port", str(_free())])
    assert "VLLM_PORT" in str(exc.value) and says in str(exc.value)
    assert "\n" not in str(exc.value)


def test_compaction_in_the_environment_is_checked_as_the_elastic_engines_see_it(monkeypatch):
    """Every engine runs elastic: PROXIMA_COMPACTION=1 is not refused for want of
    PROXIMA_ELASTIC=1 in the endpoint's own environment."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("PROXIMA_COMPACTION", "1")
    monkeypatch.delenv("PROXIMA_ELASTIC", raising=False)
    _, _, _, engines = multi.prepare(["--model", f"a={TINY}", "--host", "127.0.0.1",
                                      "--port", str(_free())])
    assert engines[0].env["PROXIMA_COMPACTION"] == "1"


def test_the_endpoint_knows_every_api_key_the_engines_take():
    plan = parse_command_line(["--model", f"a={TINY} --api-key=k2", "--model", f"b={TINY}",
                               "--api-key", "k1"])
    assert multi.api_keys(plan, {"VLLM_API_KEY": "k3"}) == {"k1", "k2", "k3"}
    assert multi.api_keys(parse_command_line(["--model", f"a={TINY}"]), {}) == set()


def test_every_option_the_endpoint_reads_is_read_in_either_spelling():
    """vLLM's parser takes ``--a_b`` for ``--a-b``; so does what the endpoint reads itself."""
    plan = parse_command_line(["--model", f"a={TINY} --api_key=k2", "--model", f"b={TINY}",
                               "--api_key", "k1"])
    assert multi.api_keys(plan, {}) == {"k1", "k2"}
    for flag, said in (("--sleep_after", "--sleep-after is per model"),
                       ("--served_model_name", "--served_model_name cannot be given with "
                                               "several models")):
        with pytest.raises(UserError, match=said):
            parse_command_line(["--model", f"a={TINY}", "--model", f"b={TINY}", flag, "5"])
    with pytest.raises(UserError, match="--served-model-name cannot be given for one model"):
        parse_command_line(["--model", f"a={TINY} --served_model_name=x"])


def _free() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- item 1's small flags ---------------------------------------------------------------
def test_compaction_flag_sets_the_environment_and_needs_elastic():
    rest, found = serve_flags.take_compaction(["m", "--compaction", "--elastic"])
    assert (rest, found) == (["m", "--elastic"], True)
    env = {}
    serve_flags.apply_compaction(True, True, env)
    assert env == {"PROXIMA_COMPACTION": "1"}
    env = {"PROXIMA_COMPACTION": "every:2"}
    serve_flags.apply_compaction(True, True, env)
    assert env["PROXIMA_COMPACTION"] == "every:2"           # a forced mode already set is kept
    with pytest.raises(UserError, match="--compaction needs --elastic"):
        serve_flags.apply_compaction(True, False, {})
    env = {}
    serve_flags.apply_compaction(False, True, env)
    assert env == {}


@pytest.mark.parametrize("argv, backend", [
    ([], "mp"),                                             # one GPU, nothing chosen: mp
    (["--max-model-len", "4096"], "mp"),
    (["--distributed-executor-backend", "uni"], "uni"),     # the user's choice stays
    (["--distributed_executor_backend=ray"], "ray"),
    (["-tp", "2"], None),                                   # vLLM picks for several GPUs
])
def test_elastic_on_one_gpu_runs_the_mp_executor_unless_one_was_chosen(serve_args, argv, backend):
    import vllm

    if backend == "uni" and vllm.__version__.startswith("0.6."):
        pytest.skip("vLLM 0.6 (the card stack, V0: no elastic KV) has no uni executor")
    args = serve_args(*argv)
    line = serve_flags.default_executor(args, argv)
    assert (line is not None) == (backend == "mp" and "--distributed" not in " ".join(argv))
    assert args.distributed_executor_backend == backend


def test_idle_release_and_the_gpus_size_from_the_file_and_the_command_line(tmp_path,
                                                                           monkeypatch):
    file = tmp_path / "models.toml"
    file.write_text(f'gpu_memory_bytes = "80GiB"\n[[models]]\nname = "chat"\npath = "{TINY}"\n'
                    f'idle_release = 300\n')
    plan = parse_command_line(["--models", str(file),
                               "--model", f"small={TINY} --idle-release 60"])
    chat, small = plan.models
    assert (chat.idle_release, small.idle_release, plan.gpu_bytes) == ("300", "60", 80 << 30)
    assert parse_command_line(["--models", str(file), "--gpu-memory-bytes", "141GB"]
                              ).gpu_bytes == 141 * 10**9           # the command line wins
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    _, _, _, engines = multi.prepare(["--models", str(file), "--port", str(_free())])
    command = engines[0].command
    assert command[command.index("--idle-release") + 1] == "300"
    assert command[command.index("--gpu-memory-bytes") + 1] == str(80 << 30)


def test_the_fit_counts_every_model_and_the_engines_already_on_the_gpu(tmp_path, monkeypatch):
    from proxima.memory.ledger import Ledger, ledger_path

    plan = parse_command_line(["--model", f"a={TINY}", "--model", f"b={TINY} --kv-min 1GiB"])
    assert multi.check_fit(plan) is None                   # no GPU size known yet
    facts = {"devices": [{"total_memory": 8 << 30, "uuid": "GPU-fit"}]}
    need = multi.check_fit(plan, facts)
    assert 5.5 * 2**30 < need < 5.6 * 2**30                # 2 x ~2 GiB + 0.5 GiB + 1 GiB
    monkeypatch.setenv("PROXIMA_LEDGER_DIR", str(tmp_path))
    other = Ledger(ledger_path("GPU-fit"), model="big", nonkv=2 << 30)
    other.post(1 << 30, 1 << 30)                           # an engine already there: 3 GiB
    try:
        with pytest.raises(UserError, match=r"a 2.50 GiB \+ b 3.00 GiB \+ 1 engine\(s\) "
                                            r"already on it 3.00 GiB = 8.51 GiB > the GPU's "
                                            r"8.00 GiB"):
            multi.check_fit(plan, facts)
    finally:
        other.close()
