"""``--sleep-after SECONDS`` (issue 36, item 3): read per model from ``--model`` and the
models file, checked before anything starts (one line), and turned into the engine's
``--idle-release`` + ``--sleep-mode`` (vLLM's ``--enable-sleep-mode`` beside elastic KV)."""

from __future__ import annotations

import pytest

from proxima import config
from proxima.errors import UserError
from proxima.serve import multi, multi_config, serve_flags, validate
from proxima.serve.multi_config import check_plan, parse_command_line

from .conftest import assert_one_line_error, free_port, run_proxima
from .test_serve_multi_config import TINY


def plan_of(*argv):
    plan = parse_command_line(list(argv))
    check_plan(plan, validate.check_model)
    return plan


def test_sleep_after_from_the_command_line_and_the_file_implies_the_idle_release(tmp_path,
                                                                                 monkeypatch):
    file = tmp_path / "models.toml"
    file.write_text(f'[[models]]\nname = "chat"\npath = "{TINY}"\nsleep_after = 600\n'
                    f'idle_release = 120\n')
    plan = plan_of("--models", str(file), "--model", f"small={TINY} --sleep-after 90",
                   "--model", f"other={TINY}")
    chat, small, other = plan.models
    assert (chat.sleep_after, small.sleep_after, other.sleep_after) == (600.0, 90.0, None)
    # the idle release given is kept; else it is the sleep_after (the KV goes first)
    assert chat.elastic_args() == ["--idle-release", "120", "--sleep-mode"]
    assert small.elastic_args() == ["--idle-release", "90", "--sleep-mode"]
    assert other.elastic_args() == []
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    _, _, _, engines = multi.prepare(["--models", str(file), "--port", str(free_port()),
                                      "--model", f"small={TINY} --sleep-after 90"])
    assert [e.backend.sleep_after for e in engines] == [600.0, 90.0]
    assert engines[1].command[-3:] == ["--idle-release", "90", "--sleep-mode"]


@pytest.mark.parametrize("argv, message", [
    (["--model", f"a={TINY} --sleep-after 30 --idle-release 60"],
     "model 'a': --sleep-after 30 is below its --idle-release 60"),
    (["--model", f"a={TINY} --sleep-after -5"], "--sleep-after: '-5' is out of range"),
    (["--model", f"a={TINY} --sleep-after nan"], "is not finite"),
    (["--model", f"a={TINY} --sleep-after soon"], "is not a number"),
    (["--model", f"a={TINY} --sleep-after 0.5"], "is out of range"),
    (["--model", f"a={TINY} --sleep-after"], "--sleep-after needs a value"),
    (["--model", f"a={TINY} --sleep-after 60 --elastic-options policy=off"],
     "needs elastic KV with policy auto"),
    (["--model", f"a={TINY} --sleep-after 60", "--elastic-options", "policy=fixed"],
     "needs elastic KV with policy auto"),
    (["--model", f"a={TINY} --sleep-after 60 --elastic-options idle_release_s=10"],
     "give the idle release as --idle-release"),
])
def test_bad_sleep_after_is_refused_in_one_line(argv, message):
    with pytest.raises(UserError) as caught:
        plan_of(*argv)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("value, message", [
    ("-1", "is out of range"), ("true", "must be seconds"), ('"x"', "is not a number")])
def test_bad_sleep_after_in_the_models_file_names_the_field(tmp_path, value, message):
    file = tmp_path / "models.toml"
    file.write_text(f'[[models]]\nname = "chat"\npath = "{TINY}"\nsleep_after = {value}\n')
    with pytest.raises(UserError) as caught:
        plan_of("--models", str(file))
    assert "models[1].sleep_after" in str(caught.value) and message in str(caught.value)


def test_sleep_mode_needs_the_idle_release_and_policy_auto():
    rest, options = serve_flags.take_elastic_options(
        ["m", "--elastic", "--idle-release", "30", "--sleep-mode"])
    assert rest == ["m"] and options["sleep_mode"] is True and options["idle_release_s"] == 30
    with pytest.raises(UserError, match="--sleep-mode needs --idle-release"):
        serve_flags.take_elastic_options(["m", "--elastic", "--sleep-mode"])
    with pytest.raises(UserError, match="--sleep-mode needs --elastic"):
        serve_flags.take_elastic_options(["m", "--sleep-mode"])
    with pytest.raises(UserError, match="--sleep-mode takes no value"):
        serve_flags.take_elastic_options(["m", "--elastic", "--sleep-mode=1"])
    with pytest.raises(config.ConfigError, match="sleep_mode needs idle_release_s and policy auto"):
        config.elastic_options({"sleep_mode": True, "idle_release_s": 5, "policy": "fixed"})


def test_one_model_with_sleep_after_is_the_endpoint_of_that_model(monkeypatch):
    """``proxima serve MODEL --sleep-after S``: the endpoint of one model, served under the
    name vllm serve gives it (the path, or the one --served-model-name); --host/--port stay
    the endpoint's, every other option goes to the engine."""
    port = free_port()
    argv = multi_config.one_model_endpoint(
        [TINY, "--port", str(port), "--max-model-len", "512", "--sleep-after", "90"])
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    plan, _, _, engines = multi.prepare(argv)
    (engine,) = engines
    assert plan.port == port and engine.backend.name == TINY and engine.backend.sleep_after == 90
    command = engine.command
    assert command[command.index("--served-model-name") + 1] == TINY
    assert command[command.index("--max-model-len") + 1] == "512"
    assert command[-3:] == ["--idle-release", "90", "--sleep-mode"]
    assert "--sleep-after" not in command              # the engine itself never sleeps alone
    named = multi_config.one_model_endpoint(
        ["--model", TINY, "--served-model-name=chat", "--sleep-after=600", "--host", "::1"])
    assert named == ["--model", f"chat={TINY} --sleep-after=600", "--host", "::1"]
    assert multi_config.one_model_endpoint([TINY, "--elastic"]) is None


@pytest.mark.parametrize("argv, message", [
    (["--elastic", "--sleep-after", "60"], "--sleep-after needs the model: proxima serve MODEL"),
    ([TINY, "--served-model-name", "a", "b", "--sleep-after", "60"],
     "--served-model-name with --sleep-after takes one name, got 2 (a b)"),
    (["./m", "--sleep-after", "60"], "would be served as './m', not a name"),
    ([TINY, "--model", TINY, "--sleep-after", "60"], "the model was given twice"),
])
def test_one_model_with_sleep_after_refuses_bad_input_in_one_line(argv, message):
    with pytest.raises(UserError) as caught:
        multi_config.one_model_endpoint(argv)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_one_model_with_sleep_after_is_checked_by_the_command_as_an_endpoint_model():
    done = run_proxima("serve", TINY, "--elastic", "--sleep-after", "10", "--idle-release", "20",
                       "--port", str(free_port()), timeout=60)
    assert_one_line_error(done, "--sleep-after 10 is below its --idle-release 20")
    # beside several models it is per model: one line, not an option for every engine
    done = run_proxima("serve", "--model", f"a={TINY}", "--sleep-after", "10", timeout=60)
    assert_one_line_error(done, "--sleep-after is per model: give it inside --model")


def test_sleep_after_below_the_idle_release_is_refused_by_the_command(tmp_path):
    done = run_proxima("serve", "--model", f"a={TINY} --sleep-after 10 --idle-release 20",
                       "--port", str(free_port()), timeout=60)
    assert_one_line_error(done, "--sleep-after 10 is below its --idle-release 20")


def test_sleep_mode_is_refused_on_a_vllm_whose_sleep_mode_was_not_read_beside_elastic_kv():
    serve_flags.check_sleep_mode_vllm("0.26.0")
    for version in ("0.33.0", "0.6.3.post1", None):
        with pytest.raises(UserError, match="--sleep-after / --sleep-mode need vLLM 0.26"):
            serve_flags.check_sleep_mode_vllm(version)


def test_a_bare_enable_sleep_mode_with_elastic_is_refused_before_anything_starts(monkeypatch):
    done = run_proxima("serve", TINY, "--elastic", "--enable-sleep-mode", timeout=60)
    assert_one_line_error(done, "--enable-sleep-mode with --elastic",
                          "--idle-release S --sleep-mode instead")
    monkeypatch.setattr(validate, "validate_environment", lambda *a: "0.26.0")
    with pytest.raises(UserError, match="model 'a': --enable-sleep-mode with --elastic"):
        multi.prepare(["--model", f"a={TINY} --enable-sleep-mode", "--port", str(free_port())])
    # with --sleep-after the engine gets it, with Proxima's --sleep-mode
    _, _, _, engines = multi.prepare(["--model", f"a={TINY} --sleep-after 60",
                                      "--port", str(free_port())])
    assert "--sleep-mode" in engines[0].command


def test_a_wake_leaves_free_the_largest_share_any_model_keeps_free():
    """A wake's margin is each engine's ``gpu_free_low`` (the share its KV map leaves free):
    the policy's 5 % where no model gives one, else the largest any model gives, the
    options for every model counted for each."""
    assert multi.wake_margin(plan_of("--model", f"a={TINY}", "--model", f"b={TINY}")) == 0.05
    one = plan_of("--model", f"a={TINY} --elastic-options gpu_free_low=0.12",
                  "--model", f"b={TINY}")
    assert multi.wake_margin(one) == 0.12
    lower = plan_of("--model", f"a={TINY}", "--model", f"b={TINY}",
                    "--elastic-options", "gpu_free_low=0.02")
    assert multi.wake_margin(lower) == 0.02
