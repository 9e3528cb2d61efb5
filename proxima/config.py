"""Proxima's configuration values, parsed and checked in one place.

Every size and number an option or a ``PROXIMA_*`` variable takes is read here, once:
``proxima kv --min/--max``; ``proxima replay --kv-min/--kv-max/--gpu-kv/--headroom/
--release-delay/--step-seconds/--eviction``; ``proxima bench --elastic-options``; ``proxima
serve --elastic --kv-min/--kv-max/--elastic-options``; ``PROXIMA_ELASTIC_OPTIONS``; the
elastic connector's options and its run-time limits (``POST /proxima/kv``). The elastic
options have one table (:data:`ELASTIC_OPTIONS`) and one check (:func:`elastic_options`),
which the connector's :class:`~proxima.vllm.elastic_v1.ElasticOptions`, the grow/shrink
:class:`~proxima.memory.policy.PolicyOptions` and every command use. A bad value is one
:class:`ConfigError` (a :class:`~proxima.errors.UserError`: a command prints it as one line
and exits 2; and a ``ValueError``) naming the option, the value seen and what is accepted.

Sizes (:func:`parse_size`)
    bytes (``1048576``), or a number with a unit: ``KiB MiB GiB TiB`` (powers of 1024) or
    ``KB MB GB TB`` (powers of 1000), ``B`` for bytes. The unit's case does not matter
    (``gib`` is ``GiB``, ``gb`` is ``GB``); a space may stand between number and unit. A bare
    ``K``, ``M``, ``G`` or ``T`` is refused: vLLM reads ``8G`` as 8 GiB, the SI as 8 GB --
    write which. A fraction and an exponent are read (``1.5GiB``, ``8e9``); the bytes are
    rounded down. From 0 to 1024TiB (2^50 bytes) unless the option says less.
Numbers (:func:`parse_number`, :func:`parse_count`)
    a finite decimal (``0.1``, ``10``, ``2.5e-3``; a count: a whole number) within the
    option's bounds, in the unit the option names (seconds, a share, blocks, steps).
Both refuse ``inf``, ``nan``, a negative value, hex (``0x10``), an empty value and any other
text; ``_`` is read between digits only (``1_000`` is 1000, as in Python). Values are
compared exactly, never through a float that overflows: ``1e400`` or a number of 5000
digits is out of range, one line, not a traceback.

This module imports nothing of vLLM or torch (and nothing of Proxima but its errors; the
eviction check asks :mod:`proxima.allocator.eviction` when it runs).
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any, Callable

from proxima.errors import UserError


class ConfigError(UserError, ValueError):
    """A bad configuration value: one line naming the option, the value seen and what is
    accepted."""


KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
MAX_BYTES = 1024 * TiB          #: the largest size any option takes (2^50 bytes)
MAX_COUNT = 1 << 32             #: the largest count of blocks, granules or steps
MAX_SHARE = 100                 #: the largest share (headroom, band: 100 = 100 times)
MAX_DELAY_S = 86_400            #: the longest delay (release_delay_s, retry_s): a day
MAX_IDLE_SLEEP_S = 1.0          #: the longest sleep of an idle engine's step
MAX_REPEAT = 1000               #: the most repeats (replay) or rounds/runs (bench) of a run

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_AMBIGUOUS = {"k": "KiB (2^10 bytes) or KB (10^3)", "m": "MiB (2^20 bytes) or MB (10^6)",
              "g": "GiB (2^30 bytes) or GB (10^9)", "t": "TiB (2^40 bytes) or TB (10^12)"}

#: how a size is written (for --help and error lines)
SIZE_FORMS = ("bytes, or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, "
              "GB, TB (powers of 1000), any case")

_DIGITS = r"\d(?:_?\d)*"
_NUMBER = re.compile(rf"\s*(?P<sign>[+-]?)(?P<mantissa>{_DIGITS}(?:\.(?:{_DIGITS})?)?|"
                     rf"\.{_DIGITS})(?P<exp>[eE][+-]?\d+)?\s*(?P<unit>[A-Za-z]*)\s*", re.ASCII)
_NOT_FINITE = re.compile(r"\s*[+-]?(inf|infinity|nan)\s*[A-Za-z]*\s*", re.IGNORECASE)


def size_text(n: int) -> str:
    """``1 << 50`` -> ``"1024TiB"``, ``3 << 30`` -> ``"3GiB"``, ``1000`` -> ``"1000"``: a
    size as :func:`parse_size` reads it back, in the largest binary unit that divides it."""
    for name, unit in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def _shown(value) -> str:
    """The value as the error line shows it: its repr (JSON's spelling for what JSON
    gave: true, null, a list or an object), cut short when long."""
    try:
        if value is None or isinstance(value, (bool, list, dict)):
            text = json.dumps(value, default=str)
        else:
            text = repr(value)
    except ValueError:               # an int beyond Python's 4300 digits of int -> str
        return f"an integer of {value.bit_length():,} bits"
    if len(text) <= 48:
        return text
    return f"{text[:24]}...{text[-8:]} ({len(str(value))} characters)"


def _prefixed(name: str, message: str) -> str:
    return f"{name}: {message}" if name else message


def _refuse(name: str, value, problem: str, accepted: str):
    raise ConfigError(_prefixed(name, f"{_shown(value)} {problem}: give {accepted}"))


def _decimal(value, name: str, accepted: str, what: str) -> tuple[Decimal, str]:
    """``value`` (an int, a float or a text) as an exact Decimal and the unit written after
    it (lower case; "" for none)."""
    if isinstance(value, bool):
        _refuse(name, value, f"is not {what}", accepted)
    if isinstance(value, int):
        return Decimal(value), ""
    if isinstance(value, float):
        if not math.isfinite(value):
            _refuse(name, value, "is not finite", accepted)
        return Decimal(value), ""
    if not isinstance(value, str):
        _refuse(name, value, f"is not {what}", accepted)
    match = _NUMBER.fullmatch(value)
    if match is None:
        if _NOT_FINITE.fullmatch(value):
            _refuse(name, value, "is not finite", accepted)
        _refuse(name, value, f"is not {what}", accepted)
    text = match["sign"] + match["mantissa"].replace("_", "") + (match["exp"] or "")
    return Decimal(text), match["unit"].lower()


def parse_size(value, name: str = "", *, least: int = 0, most: int = MAX_BYTES) -> int:
    """A size in bytes (see the module's doc) from ``least`` to ``most``; ConfigError
    naming ``name``, the value and the range otherwise. An int is taken as bytes."""
    accepted = f"a size from {size_text(least)} to {size_text(most)}: {SIZE_FORMS}; e.g. 80GiB"
    amount, unit = _decimal(value, name, accepted, "a size")
    if unit in _AMBIGUOUS:
        _refuse(name, value, f"is not a size: the unit {unit.upper()!r} is ambiguous "
                             f"(write {_AMBIGUOUS[unit]})", accepted)
    if unit not in UNITS and unit:
        _refuse(name, value, f"is not a size: the unit {unit!r} is not known", accepted)
    scale = UNITS.get(unit, 1)
    if amount < 0:
        _refuse(name, value, "is negative", accepted)
    if amount > most // scale + 1:              # exact (Decimal vs int): no overflow
        _refuse(name, value, f"is above the bound of {size_text(most)}", accepted)
    # |amount| is now at most 2^50: its exponent is bounded by the text's length (or it is
    # below 1e-40, a fraction of a byte), so the exact product is cheap.
    size = 0 if amount < Decimal("1e-40") else math.floor(Fraction(amount) * scale)
    if size > most:
        _refuse(name, value, f"is above the bound of {size_text(most)}", accepted)
    if size < least:
        _refuse(name, value, f"is below {size_text(least)}", accepted)
    return size


def _range(unit: str, least, most, above: bool) -> str:
    low = f"above {least:g}" if above else f"from {least:g}"
    return f"{unit} {low} to {most:g} (a finite number)"


def parse_number(value, name: str = "", *, least: float = 0, most: float, unit: str,
                 above: bool = False):
    """A finite number from ``least`` (``above``: excluded) to ``most``, in ``unit`` (named
    in the error); an int or float is returned as given, a text as a float."""
    accepted = _range(unit, least, most, above)
    amount, written = _decimal(value, name, accepted, "a number")
    if written:
        _refuse(name, value, "is not a number", accepted)
    # the bounds, and a float value, as written (0.1, not the binary 0.1000000000000000055...)
    least, most = Decimal(repr(least)), Decimal(repr(most))
    if isinstance(value, float):
        amount = Decimal(repr(value))
    if amount < least or amount > most or (above and amount == least):
        _refuse(name, value, "is out of range", accepted)
    return value if isinstance(value, (int, float)) else float(amount)


def parse_count(value, name: str = "", *, least: int = 0, most: int = MAX_COUNT,
                unit: str = "") -> int:
    """A whole number from ``least`` to ``most`` (of ``unit``: blocks, steps, ...)."""
    accepted = f"a whole number{' of ' + unit if unit else ''} from {least:,} to {most:,}"
    if isinstance(value, float) or isinstance(value, bool):
        _refuse(name, value, "is not a whole number", accepted)
    amount, written = _decimal(value, name, accepted, "a whole number")
    if written or amount != amount.to_integral_value():
        _refuse(name, value, "is not a whole number", accepted)
    if amount < least or amount > most:
        _refuse(name, value, "is out of range", accepted)
    return int(amount)


def parse_eviction(value, name: str = "eviction") -> str:
    """An eviction policy (:meth:`proxima.allocator.eviction.EvictionPolicy.parse`), as
    given."""
    from proxima.allocator.eviction import EvictionPolicy

    try:
        EvictionPolicy.parse(value)
    except ValueError as exc:
        raise ConfigError(_prefixed(name, str(exc))) from None
    return value


# ----------------------------------------------------------------------------- elastic

ELASTIC_POLICIES = ("auto", "fixed", "off")


def _size(least: int = 0, nullable: bool = False) -> Callable:
    def check(name, value):
        return None if value is None and nullable else parse_size(value, name, least=least)
    return check


def _number(most: float, unit: str) -> Callable:
    return lambda name, value: parse_number(value, name, least=0, most=most, unit=unit)


def _count(least: int, unit: str, nullable: bool = False, why: str = "") -> Callable:
    def check(name, value):
        if value is None and nullable:
            return None
        try:
            return parse_count(value, name, least=least, unit=unit)
        except ConfigError as exc:
            raise ConfigError(f"{exc}{why}") from None
    return check


def _must(what: str, ok: Callable[[Any], bool]) -> Callable:
    def check(name, value):
        if not ok(value):
            raise ConfigError(f"{name} must be {what}, got {_shown(value)}")
        return value
    return check


_BOOL = _must("true or false", lambda v: isinstance(v, bool))

#: The elastic KV options (:class:`proxima.vllm.elastic_v1.ElasticOptions` documents
#: them and holds their defaults): name -> ``check(name, value) -> value`` (sizes as bytes).
def _factory(hook) -> bool:
    """A compactor hook: ``module:factory``, or ``{"factory": "module:factory", ...}`` (its
    other keys are the factory's keyword arguments)."""
    factory = hook.get("factory") if isinstance(hook, dict) else hook
    return isinstance(factory, str) and ":" in factory


ELASTIC_OPTIONS: dict[str, Callable] = {
    "policy": _must(" or ".join(ELASTIC_POLICIES), lambda v: v in ELASTIC_POLICIES),
    "min_bytes": _size(),
    "max_bytes": _size(nullable=True),
    "initial_bytes": _size(nullable=True),
    "headroom": _number(MAX_SHARE, "a share of the live blocks"),
    "band": _number(MAX_SHARE, "a share of the mapped granules"),
    "reserve_blocks": _count(0, "blocks"),
    "release_delay_s": _number(MAX_DELAY_S, "seconds"),
    "retry_s": _number(MAX_DELAY_S, "seconds"),
    "retry_max_s": _number(MAX_DELAY_S, "seconds"),
    "cache_hold_s": _number(MAX_DELAY_S, "seconds"),
    "gpu_free_low": _number(1, "a share of the GPU's memory"),
    "ledger": _BOOL,
    "ledger_dir": _must("a directory or null",
                        lambda v: v is None or isinstance(v, str) and bool(v.strip())),
    "ledger_model": _must("a model name (at most 200 characters) or null",
                          lambda v: v is None or isinstance(v, str) and len(v) <= 200),
    "ledger_port": _must("a port from 1 to 65535 or null", lambda v: v is None or (
        type(v) is int and 1 <= v <= 65535)),
    "ledger_nonkv_bytes": _size(),
    "forecast": _BOOL,
    "eviction": lambda name, value: parse_eviction(value, name),
    "compactor": _must("'module:factory', {\"factory\": 'module:factory', ...} or null",
                       lambda v: v is None or _factory(v)),
    "idle_sleep_s": _number(MAX_IDLE_SLEEP_S, "seconds"),
    "idle_release_s": lambda name, value: None if value is None else parse_number(
        value, name, least=0, most=MAX_DELAY_S, unit="seconds (or null: never)"),
    "sleep_mode": _BOOL,
    "granule_bytes": _size(least=1, nullable=True),
    "zero_on_map": _BOOL,
    "initial_granules": _count(1, "granules", nullable=True,
                               why=" (granule 0 holds the null block)"),
    "map_in_background": _BOOL,
    "stats_file": _must("a file name or null", lambda v: v is None or isinstance(v, str)),
    "verify": _BOOL,
    "compaction": _must("an object of compaction settings or null",
                        lambda v: v is None or isinstance(v, dict)),
}


def elastic_options(extra, source: str = "") -> dict:
    """The elastic options ``extra`` checked, each value and together: a copy with sizes
    in bytes; ConfigError (prefixed with ``source``: the option or variable they came
    from) naming the first bad one."""
    if not isinstance(extra, dict):
        raise ConfigError(_prefixed(source, f"a JSON object of options is needed, got "
                                            f"{_shown(extra)}"))
    unknown = sorted(set(extra) - set(ELASTIC_OPTIONS), key=str)
    if unknown:
        raise ConfigError(_prefixed(source, f"unknown option(s) {', '.join(map(str, unknown))}; "
                                            f"known: {', '.join(sorted(ELASTIC_OPTIONS))}"))
    out = {}
    for name, value in extra.items():
        try:
            out[name] = ELASTIC_OPTIONS[name](name, value)
        except ConfigError as exc:
            raise ConfigError(_prefixed(source, str(exc))) from None
    least, most = out.get("min_bytes", 0), out.get("max_bytes")
    if most is not None and most < least:
        raise ConfigError(_prefixed(source, f"max_bytes ({size_text(most)}) is below min_bytes "
                                            f"({size_text(least)}): give a maximum at least "
                                            f"the minimum"))
    if out.get("sleep_mode") and (out.get("idle_release_s") is None
                                  or out.get("policy", "auto") != "auto"):
        raise ConfigError(_prefixed(source, "sleep_mode needs idle_release_s and policy auto "
                                            "(the engine gives back all its KV before its "
                                            "weights go to host memory): give both"))
    if out.get("compactor") is not None and out.get("policy") == "off":
        raise ConfigError(_prefixed(source, "the compactor hook needs the pool to place by "
                                            "granule: use policy fixed or auto, not off"))
    return out


def _number_or_text(text: str):
    """A JSON number when it is a finite one of sane length, else the text as written
    (checked later as such: ``1e400``, ``NaN``, 5000 digits are refused by name)."""
    value = float(text)
    return value if math.isfinite(value) else text


def _json(text: str):
    return json.loads(text, parse_float=_number_or_text, parse_constant=str,
                      parse_int=lambda t: int(t) if len(t) <= 1000 else t)


def parse_options_text(text: str, source: str = "") -> dict:
    """``key=value,key=value`` (each value JSON where it parses: numbers, true/false, null;
    else the text: sizes with units, names) or a JSON object, as a dict, unchecked; a key
    given twice or an item without ``=`` is a ConfigError."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = _json(text)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(_prefixed(source, f"not JSON ({getattr(exc, 'msg', exc)}): give "
                                                f"key=value,key=value or a JSON object")) from None
        if not isinstance(value, dict):
            raise ConfigError(_prefixed(source, "a JSON object is needed"))
        return value
    if text.startswith(("[", '"')) or text in ("null", "true", "false"):
        try:
            value = _json(text)
        except (ValueError, RecursionError):
            pass
        else:           # JSON, but not an object: '[1' was said not to be key=value
            raise ConfigError(_prefixed(source, f"{_shown(value)} is JSON but not an object: "
                                                f"give key=value,key=value or a JSON object "
                                                f"such as {{\"min_bytes\": \"2GiB\"}}"))
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key:
            raise ConfigError(_prefixed(source, f"{_shown(item)} is not key=value (e.g. "
                                                f"min_bytes=2GiB,max_bytes=80GiB)"))
        if key in out:
            raise ConfigError(_prefixed(source, f"{key} is given twice: give it once"))
        try:
            out[key] = _json(raw)
        except (ValueError, RecursionError):
            out[key] = raw
    return out


def elastic_options_text(text: str, source: str = "") -> dict:
    """:func:`parse_options_text` checked by :func:`elastic_options`; the dict as written
    (sizes as given), which the connector reads again."""
    options = parse_options_text(text, source)
    elastic_options(options, source)
    return options
