"""The one version and variable policy (proxima/vllm/activation.py), without vLLM: the
tested table, the version-to-engine mapping, the override, every PROXIMA_* variable."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from proxima.vllm import activation
from proxima.vllm.activation import ActivationError

REPO = Path(__file__).resolve().parents[2]
ALLOW = {activation.ALLOW_UNTESTED_ENV: "1"}


# ----------------------------------------------------------------------------- the table

def test_every_tested_release_maps_to_an_adapter_and_agrees_with_the_series_rule():
    assert activation.TESTED, "no tested release"
    for entry in activation.TESTED:
        assert entry.engine in activation.ENGINE_NAMES
        assert activation.engine_for(entry.vllm) == entry.engine
        # the rule an untested release of the same series would be tried with
        assert ("v1" if activation.release(entry.vllm) >= activation.V1_SINCE else "v0") \
            == entry.engine, entry
        assert entry.torch and all("+" not in t for t in entry.torch)
    assert len({t.vllm for t in activation.TESTED}) == len(activation.TESTED)


def test_each_tested_release_has_its_extra_in_pyproject():
    """`pip install 'proxima[<extra>]'` installs exactly the tested vLLM (and nothing else
    pins vLLM there)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    pinned = {name: [d for d in deps if re.match(r"vllm\b", d)] for name, deps in extras.items()}
    for entry in activation.TESTED:
        assert pinned.get(entry.extra) == [f"vllm=={entry.vllm}"], entry
    assert {n for n, deps in pinned.items() if deps} == {t.extra for t in activation.TESTED}


@pytest.mark.parametrize("version, engine", [
    ("0.6.2", "v0"), ("0.6.3.post1", "v0"), ("0.7.3", "v0"),
    ("0.8.0", "v1"), ("0.25.1", "v1"), ("0.26.0", "v1"), ("0.27.1", "v1"),
    ("0.33.0", "v1"), ("1.0.0rc1", "v1"), ("0.26.0+cu130", "v1"),
])
def test_version_to_engine(version, engine):
    assert activation.engine_for(version) == engine


def test_release_parts():
    assert activation.release("0.6.3.post1") == (0, 6, 3)
    assert activation.release("0.26.0+cu130") == (0, 26, 0)
    assert activation.release("1.0.0rc1") == (1, 0, 0)


# ------------------------------------------------------------------------------ verdicts

def test_tested_pairs_pass_with_or_without_torch():
    for entry in activation.TESTED:
        for torch in (None, *entry.torch, f"{entry.torch[0]}+cu121"):
            verdict = activation.judge(entry.vllm, torch, {})
            assert verdict.tested and verdict.allowed and verdict.entry is entry
            assert verdict.warning() is None


@pytest.mark.parametrize("vllm, torch", [
    ("0.25.1", "2.10.0"),       # an untested V1 release
    ("0.6.2", "2.4.0"),         # an untested V0 release: the same rule as any other
    ("0.6.3.post1", "2.11.0"),  # a tested vLLM with another torch
    ("0.26.0", "2.4.0"),
])
def test_untested_is_refused_unless_the_override_says_1(vllm, torch):
    refused = activation.judge(vllm, torch, {})
    assert not refused.tested and not refused.allowed
    line = refused.refusal()
    assert f"vLLM {vllm} with torch {torch}" in line
    assert "PROXIMA_ALLOW_UNTESTED_VLLM=1" in line and "pip install 'proxima[vllm]'" in line
    for entry in activation.TESTED:
        assert entry.vllm in line
    for off in ({activation.ALLOW_UNTESTED_ENV: "0"}, {activation.ALLOW_UNTESTED_ENV: ""}):
        assert not activation.judge(vllm, torch, off).allowed
    allowed = activation.judge(vllm, torch, ALLOW)
    assert allowed.allowed and not allowed.tested
    assert "PROXIMA_ALLOW_UNTESTED_VLLM=1" in allowed.warning()


@pytest.mark.parametrize("value", ["yes", "true", "on", "2", "01"])
def test_a_bad_override_is_an_error_not_a_no(value):
    """PROXIMA_ALLOW_UNTESTED_VLLM=yes used to be silently read as unset."""
    with pytest.raises(ActivationError, match=f"PROXIMA_ALLOW_UNTESTED_VLLM must be 1 .*"
                                              f"got '{value}'"):
        activation.judge("0.25.1", None, {activation.ALLOW_UNTESTED_ENV: value})


def test_require_refuses_the_other_generation_even_with_the_override():
    with pytest.raises(ActivationError, match="vLLM 0.6.3.post1 runs the V0 engine"):
        activation.require("v1", "0.6.3.post1", None, ALLOW)
    with pytest.raises(ActivationError, match="vLLM 0.26.0 runs the V1 engine"):
        activation.require("v0", "0.26.0", None, ALLOW)


def test_require_warns_once_per_process(monkeypatch, proxima_log):
    monkeypatch.setattr(activation, "_warned", set())
    with pytest.raises(ActivationError, match="not a version Proxima was tested with"):
        activation.require("v1", "0.27.1", "2.11.0", {})
    for _ in range(3):
        assert activation.require("v1", "0.27.1", "2.11.0", ALLOW).allowed
    warnings = [r.getMessage() for r in proxima_log if "0.27.1" in r.getMessage()]
    assert len(warnings) == 1 and "trying it anyway" in warnings[0]


# ----------------------------------------------------------------------------- variables

SWITCHES = (activation.ENV, activation.OBSERVE_ENV, activation.ALLOW_UNTESTED_ENV)


@pytest.mark.parametrize("name", SWITCHES)
def test_switches(name):
    assert activation.read(name, {}) is False
    for off in ("0", "", "  ", " 0 "):
        assert activation.read(name, {name: off}) is False
    assert activation.read(name, {name: "1"}) is True
    assert activation.read(name, {name: " 1\n"}) is True


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["yes", "true", "2", "-1", "on"])
def test_every_switch_refuses_other_values_with_one_line(name, value):
    with pytest.raises(ActivationError) as info:
        activation.check_environment({name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be 1 (") and f"got {value!r}" in message
    assert "0 / unset" in message and "\n" not in message


def test_stats_file(tmp_path):
    name = activation.STATS_ENV
    assert activation.stats_file({}) is None and activation.stats_file({name: ""}) is None
    assert activation.stats_file({name: str(tmp_path / "s.json")}) == tmp_path / "s.json"
    with pytest.raises(ActivationError, match="does not exist or is not writable"):
        activation.check_environment({name: str(tmp_path / "nope" / "s.json")})
    with pytest.raises(ActivationError, match="is a directory"):
        activation.check_environment({name: str(tmp_path)})


def test_every_variable_the_code_reads_is_in_the_policy():
    """A PROXIMA_* variable read anywhere in the package is one of the policy's (so its
    bad values are errors), except the names that are not engine settings."""
    not_settings = {"PROXIMA_VERSION"}      # a Python constant, not a variable
    seen = set()
    for path in (REPO / "proxima").rglob("*.py"):
        seen |= set(re.findall(r'"(PROXIMA_[A-Z_]+)"', path.read_text()))
    assert seen - not_settings <= set(activation.VARIABLES), seen - set(activation.VARIABLES)


def test_both_adapters_expose_the_same_activation_interface():
    """The plugin treats both engine generations alike: activate() (asks the policy,
    patches, idempotent), deactivate(), is_active(), all without arguments."""
    import inspect

    from proxima.vllm.plugin import adapter

    for engine in activation.ENGINE_NAMES:
        module = adapter(engine)
        for name in ("activate", "deactivate", "is_active"):
            fn = getattr(module, name)
            assert not inspect.signature(fn).parameters, (engine, name)
    with pytest.raises(ValueError, match="no engine generation 'v2'"):
        adapter("v2")
