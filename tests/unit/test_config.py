"""proxima.config: the one parser of sizes and numbers, and the one check of the elastic
options, over the edge cases a user (or an attacker) would try."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from proxima import config
from proxima.config import MAX_BYTES, ConfigError, parse_count, parse_number, parse_size
from proxima.errors import UserError

GiB, TiB = 1 << 30, 1 << 40


@pytest.mark.parametrize("text, value", [
    ("80GiB", 80 * GiB), ("512 MiB", 512 << 20), ("8GB", 8 * 10**9), ("1048576", 1 << 20),
    (7, 7), ("1.5GiB", 3 << 29), ("8gib", 8 * GiB), ("8 gb", 8 * 10**9), ("8Gib", 8 * GiB),
    ("2KiB", 2048), ("2kb", 2000), ("3TB", 3 * 10**12), ("12B", 12), ("12 b", 12),
    ("1_000", 1000), (" 7 ", 7), ("\t7GiB\n", 7 * GiB), ("1e3KB", 10**6), (".5KiB", 512),
    ("5.", 5), ("+5", 5), ("-0", 0), ("0", 0), ("0GiB", 0), ("1.3GiB", 1395864371),
    ("0.5", 0), ("1e-999999999GiB", 0), (8e9, 8 * 10**9), (0.0, 0), ("1024TiB", MAX_BYTES),
    (MAX_BYTES, MAX_BYTES), ("1125899906842624.5", MAX_BYTES),     # rounded down: in range
])
def test_sizes_parse(text, value):
    assert parse_size(text, "--x") == value


@pytest.mark.parametrize("text, problem", [
    ("lots", "is not a size"), ("5 parsecs", "the unit 'parsecs' is not known"),
    ("", "is not a size"), ("   ", "is not a size"), ("GiB", "is not a size"),
    ("0x10", "is not a size"), ("0b101", "is not a size"), ("1 000", "is not a size"),
    ("1,000", "is not a size"), ("1__0", "is not a size"), ("_1", "is not a size"),
    ("1_", "is not a size"), ("\u0661\u0662", "is not a size"), ("8 G i B", "is not a size"),
    ("8G", "the unit 'G' is ambiguous (write GiB (2^30 bytes) or GB (10^9))"),
    ("8k", "the unit 'K' is ambiguous"), ("1m", "the unit 'M' is ambiguous"),
    ("2t", "the unit 'T' is ambiguous"),
    ("inf", "is not finite"), ("-inf", "is not finite"), ("+Infinity", "is not finite"),
    ("nan", "is not finite"), ("NaN", "is not finite"), ("infGiB", "is not finite"),
    (float("inf"), "is not finite"), (float("nan"), "is not finite"),
    ("-1GiB", "is negative"), (-3, "is negative"), ("-1e-9", "is negative"),
    ("1e400", "is above the bound of 1024TiB"), ("1e308TiB", "is above the bound of 1024TiB"),
    ("1e999999999", "is above the bound"), ("1025TiB", "is above the bound of 1024TiB"),
    (MAX_BYTES + 1, "is above the bound"), ("1125899906842625", "is above the bound"),
    (True, "is not a size"), (None, "is not a size"),
    ([1], "is not a size"),
])
def test_bad_sizes_are_one_line_naming_the_option_the_value_and_the_range(text, problem):
    with pytest.raises(ConfigError) as info:
        parse_size(text, "--kv-max")
    message = str(info.value)
    assert message.startswith("--kv-max: ") and problem in message, message
    assert "from 0 to 1024TiB" in message and "KiB, MiB, GiB, TiB" in message
    assert "\n" not in message and len(message) < 400
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_a_value_of_5000_digits_is_shown_short_and_refused_fast():
    text = "9" * 5000
    with pytest.raises(ConfigError, match=r"\(5000 characters\) is above the bound") as info:
        parse_size(text, "--max")
    assert len(str(info.value)) < 400
    with pytest.raises(ConfigError, match="is out of range"):
        parse_number(text, "--headroom", most=100, unit="a share")
    with pytest.raises(ConfigError, match="is out of range"):
        parse_count(text, "reserve_blocks")
    with pytest.raises(ConfigError, match="an integer of 16,610 bits is out of range"):
        parse_count(10**5000, "reserve_blocks")
    with pytest.raises(ConfigError, match="an integer of 16,610 bits is above the bound"):
        parse_size(10**5000, "--max")


def test_the_option_narrows_the_range():
    assert parse_size("1", "granule_bytes", least=1) == 1
    with pytest.raises(ConfigError, match="granule_bytes: '0' is below 1: give a size from 1 to"):
        parse_size("0", "granule_bytes", least=1)
    with pytest.raises(ConfigError, match="is above the bound of 8GiB"):
        parse_size("9GiB", "--x", most=8 * GiB)


@pytest.mark.parametrize("n", [0, 1, 1000, 4095, 2 << 20, 3 * GiB, 7 * TiB + 5, MAX_BYTES,
                               123456789012345])
def test_sizes_round_trip(n):
    assert parse_size(config.size_text(n)) == n
    assert parse_size(str(n)) == n
    assert parse_size(f"{n} B") == n and parse_size(f"{n:_}") == n
    assert parse_size(f"{n / 1000}KB") == n          # n / 1000 is exact in decimal digits


def test_size_text_uses_the_largest_binary_unit_that_divides():
    assert [config.size_text(n) for n in (0, 1000, 1024, 3 * GiB, MAX_BYTES, GiB + 1)] == \
        ["0", "1000", "1KiB", "3GiB", "1024TiB", str(GiB + 1)]


@pytest.mark.parametrize("value, expected", [
    ("0.1", 0.1), ("10", 10.0), ("2.5e-3", 0.0025), (" 1_0 ", 10.0), (0, 0), (0.5, 0.5),
    (100, 100), ("1e2", 100.0),
])
def test_numbers_parse_and_keep_a_given_number_as_it_is(value, expected):
    got = parse_number(value, "--headroom", most=100, unit="a share")
    assert got == expected and type(got) is (type(value) if not isinstance(value, str)
                                             else float)


@pytest.mark.parametrize("value, problem", [
    ("inf", "is not finite"), ("-inf", "is not finite"), ("nan", "is not finite"),
    (float("nan"), "is not finite"), (float("inf"), "is not finite"),
    ("1e400", "is out of range"), ("-1", "is out of range"), (-0.1, "is out of range"),
    ("100.0001", "is out of range"), ("10s", "is not a number"), ("0x1", "is not a number"),
    ("", "is not a number"), (True, "is not a number"), (None, "is not a number"),
])
def test_bad_numbers_name_the_unit_and_the_range(value, problem):
    with pytest.raises(ConfigError) as info:
        parse_number(value, "--headroom", most=100, unit="a share of the live blocks")
    message = str(info.value)
    assert message.startswith("--headroom: ") and problem in message, message
    assert "a share of the live blocks from 0 to 100 (a finite number)" in message


def test_above_excludes_the_least_value():
    assert parse_number("0.001", "--step-seconds", most=60, unit="seconds", above=True) == 0.001
    with pytest.raises(ConfigError, match="'0' is out of range: give seconds above 0 to 60"):
        parse_number("0", "--step-seconds", most=60, unit="seconds", above=True)


def test_a_bound_that_is_not_a_binary_fraction_is_inclusive_as_written():
    """`proxima kv --watch 0.1` was refused as "out of range: from 0.1 to 3600": the text
    0.1 was compared exactly with the float 0.1000000000000000055..."""
    assert parse_number("0.1", "--watch", least=0.1, most=3600, unit="seconds") == 0.1
    assert parse_number("0.3", "x", least=0, most=0.3, unit="seconds") == 0.3
    assert parse_number(0.1, "x", least=0, most=0.1, unit="seconds") == 0.1   # a float too
    with pytest.raises(ConfigError, match="'0.09' is out of range"):
        parse_number("0.09", "--watch", least=0.1, most=3600, unit="seconds")
    with pytest.raises(ConfigError, match="'0.1' is out of range"):
        parse_number("0.1", "x", least=0.1, most=1, unit="s", above=True)


@pytest.mark.parametrize("value, expected", [(3, 3), ("3", 3), ("1e3", 1000), ("1_000", 1000),
                                             (0, 0)])
def test_counts_parse(value, expected):
    assert parse_count(value, "reserve_blocks") == expected


@pytest.mark.parametrize("value, problem", [
    (3.0, "is not a whole number"), ("1.5", "is not a whole number"), (True, "is not a whole"),
    ("x", "is not a whole number"), (-1, "is out of range"), ("nan", "is not finite"),
    (config.MAX_COUNT + 1, "is out of range"),
])
def test_bad_counts(value, problem):
    with pytest.raises(ConfigError, match=problem):
        parse_count(value, "reserve_blocks", unit="blocks")


# ----------------------------------------------------------------------------- elastic

def test_the_table_is_every_elastic_option_and_their_defaults_pass_it():
    from proxima.vllm.elastic_v1 import ElasticOptions
    from proxima.memory.policy import PolicyOptions

    defaults = dataclasses.asdict(ElasticOptions())
    assert set(config.ELASTIC_OPTIONS) == set(defaults)
    assert config.elastic_options(defaults) == defaults
    policy = dataclasses.asdict(PolicyOptions())
    assert config.elastic_options(policy) == policy


def test_elastic_options_turn_sizes_into_bytes_and_keep_the_rest():
    got = config.elastic_options({"min_bytes": "2GiB", "max_bytes": None, "headroom": 0,
                                  "release_delay_s": "2.5", "eviction": "age:4",
                                  "granule_bytes": 2 << 20, "initial_granules": "3"})
    assert got == {"min_bytes": 2 * GiB, "max_bytes": None, "headroom": 0,
                   "release_delay_s": 2.5, "eviction": "age:4", "granule_bytes": 2 << 20,
                   "initial_granules": 3}


@pytest.mark.parametrize("extra, message", [
    ({"headroom": "nan"}, "src: headroom: 'nan' is not finite"),
    ({"headroom": float("nan")}, "src: headroom: nan is not finite"),
    ({"band": float("inf")}, "band: inf is not finite"),
    ({"release_delay_s": 1e300}, "release_delay_s: 1e+300 is out of range: give seconds from 0 "
                                 "to 86400"),
    ({"idle_sleep_s": 5}, "idle_sleep_s: 5 is out of range: give seconds from 0 to 1"),
    ({"retry_s": -1}, "retry_s: -1 is out of range"),
    ({"max_bytes": "1e400GiB"}, "max_bytes: '1e400GiB' is above the bound of 1024TiB"),
    ({"granule_bytes": 0}, "granule_bytes: 0 is below 1"),
    ({"reserve_blocks": 1.5}, "reserve_blocks: 1.5 is not a whole number"),
    ({"initial_granules": 0}, "0 is out of range: give a whole number of granules from 1 to "
                              "4,294,967,296 (granule 0 holds the null block)"),
    ({"min_bytes": "4GiB", "max_bytes": "1GiB"}, "max_bytes (1GiB) is below min_bytes (4GiB)"),
    ({"policy": "elastic"}, "policy must be auto or fixed or off, got 'elastic'"),
    ({"forecast": "yes"}, "forecast must be true or false, got 'yes'"),
    ({"eviction": "fifo"}, "eviction: eviction policy 'fifo'"),
    ({"compactor": "nocolon"}, "compactor must be 'module:factory'"),
    ({"compaction": "1"}, "compaction must be an object of compaction settings or null"),
    ({"compactor": "m:f", "policy": "off"}, "the compactor hook needs the pool"),
    ({"compactor": {"every": 3}}, "compactor must be 'module:factory', {"),
    ({"speed": 9, "zoom": 1}, "src: unknown option(s) speed, zoom; known: band, cache_hold_s, compaction"),
])
def test_bad_elastic_options_are_one_line(extra, message):
    with pytest.raises(ConfigError) as info:
        config.elastic_options(extra, "src")
    assert message in str(info.value) and str(info.value).startswith("src: ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("", {}), (" , ", {}), ("min_bytes=2GiB, release_delay_s=5 ,eviction=lru",
                            {"min_bytes": "2GiB", "release_delay_s": 5, "eviction": "lru"}),
    ("max_bytes=null,verify=false,headroom=0.5", {"max_bytes": None, "verify": False,
                                                   "headroom": 0.5}),
    ('{"min_bytes": "1GiB", "compaction": {"mode": "1"}}',
     {"min_bytes": "1GiB", "compaction": {"mode": "1"}}),
    # what JSON would read as inf, nan or a 5000-digit int stays text, refused by name later
    ("max_bytes=1e400,headroom=NaN,band=-Infinity", {"max_bytes": "1e400", "headroom": "NaN",
                                                      "band": "-Infinity"}),
    ('{"headroom": NaN, "max_bytes": 1e400}', {"headroom": "NaN", "max_bytes": "1e400"}),
    ("reserve_blocks=" + "9" * 5000, {"reserve_blocks": "9" * 5000}),
    ("compaction=" + "[" * 100_000, {"compaction": "[" * 100_000}),
])
def test_options_text_reads_key_value_or_json(text, expected):
    assert config.parse_options_text(text) == expected


@pytest.mark.parametrize("text, message", [
    ("garbage", "'garbage' is not key=value (e.g. min_bytes=2GiB,max_bytes=80GiB)"),
    ("=1", "'=1' is not key=value"),
    ("min_bytes=1GiB,min_bytes=2GiB", "min_bytes is given twice"),
    ("{not json", "not JSON"), ("[1, 2]", "[1, 2] is JSON but not an object"),
    ("null", "null is JSON but not an object"), ('{"a": [1}', "not JSON"),
    ("{" * 100_000, "not JSON"),
])
def test_bad_options_text(text, message):
    with pytest.raises(ConfigError, match="^--elastic-options: .*" + message.replace(
            "(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        config.parse_options_text(text, "--elastic-options")


@pytest.mark.parametrize("text, message", [
    ("headroom=nan", "headroom: 'nan' is not finite"),
    ("headroom=NaN", "headroom: 'NaN' is not finite"),
    ('{"release_delay_s": Infinity}', "release_delay_s: 'Infinity' is not finite"),
    ("max_bytes=1e400", "max_bytes: '1e400' is above the bound"),
    ("reserve_blocks=" + "9" * 5000, "(5000 characters) is out of range"),
    ("compaction=" + "[" * 100_000, "compaction must be an object"),
    ('{"min_bytes": 5}' + " " * 3, None),
])
def test_options_text_is_checked(text, message):
    if message is None:
        assert config.elastic_options_text(text, "E") == {"min_bytes": 5}
        return
    with pytest.raises(ConfigError) as info:
        config.elastic_options_text(text, "E")
    assert message in str(info.value) and len(str(info.value)) < 500


def test_proxima_elastic_options_is_checked_with_every_variable():
    from proxima.vllm import activation

    assert activation.read(activation.ELASTIC_OPTIONS_ENV, {}) == {}
    assert activation.read(activation.ELASTIC_OPTIONS_ENV,
                           {"PROXIMA_ELASTIC_OPTIONS": "min_bytes=2GiB"}) == {"min_bytes": "2GiB"}
    for bad, why in (("garbage", "'garbage' is not key=value"),
                     ("headroom=nan", "headroom: 'nan' is not finite"),
                     ('{"max_bytes": 1e400}', "max_bytes: '1e400' is above the bound")):
        with pytest.raises(activation.ActivationError) as info:
            activation.check_environment({"PROXIMA_ELASTIC_OPTIONS": bad})
        assert str(info.value).startswith("PROXIMA_ELASTIC_OPTIONS must be key=value")
        assert why in str(info.value) and "\n" not in str(info.value)


def test_the_config_module_imports_neither_torch_nor_vllm():
    code = ("import sys, proxima.config as c; c.elastic_options({'eviction': 'lru'}); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'vllm'))))")
    done = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                          text=True, check=True)
    assert json.loads(done.stdout) == []
