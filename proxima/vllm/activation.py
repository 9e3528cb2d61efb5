"""Proxima's one policy: which vLLM versions it runs on, through which adapter, and what
every ``PROXIMA_*`` variable may say. Every caller asks this module: the plugin and both
engine adapters, ``proxima serve``'s checks and self-check, ``proxima replay``.

Versions
    :data:`TESTED` lists the tested releases, one :class:`Tested` entry each: the vLLM
    version, the engine generation its adapter drives (``"v1"``:
    :mod:`proxima.vllm.vllm_v1`, ``"v0"``: :mod:`proxima.vllm.vllm_v0`), the torch
    releases it was tested with and the ``proxima[...]`` extra that installs it. A release
    is added by adding one entry. A vLLM that is not listed (or a listed one with another
    torch) is refused unless ``PROXIMA_ALLOW_UNTESTED_VLLM=1``, and then it is tried with
    the adapter :func:`engine_for` names, with a warning.

Variables (:data:`VARIABLES`; a bad value of any of them is one :class:`ActivationError`
naming the variable, the value and what is accepted)
    ``PROXIMA_ALLOCATOR``  ``1``: Proxima's allocator; ``0`` / unset: stock vLLM.
    ``PROXIMA_OBSERVE``    ``1`` (with Proxima off): measure stock vLLM's contiguity without
                           changing its allocation (:mod:`proxima.vllm.observe_v1`).
    ``PROXIMA_ALLOW_UNTESTED_VLLM``  ``1``: try an untested vLLM anyway; ``0`` / unset: refuse.
    ``PROXIMA_ALLOW_UNPROVEN_ELASTIC``  ``1``: run elastic KV (and compaction) in an engine
                           on a tested vLLM whose worker side is tested on CPU only
                           (:class:`Support`, 0.33.0); ``0`` / unset: refuse it in one line.
    ``PROXIMA_ELASTIC``    ``1`` (with ``PROXIMA_ALLOCATOR=1``, V1 only): elastic KV memory
                           (:mod:`proxima.vllm.elastic_v1`); ``0`` / unset: a fixed pool.
    ``PROXIMA_ELASTIC_OPTIONS``  with ``PROXIMA_ELASTIC=1``: the elastic options,
                           ``key=value,...`` or a JSON object (checked by
                           :func:`proxima.config.elastic_options`); unset: defaults.
    ``PROXIMA_STATS_FILE`` a file path in a writable directory: where the engine writes its
                           status (:mod:`proxima.vllm.status`); unset: no status file.
    ``PROXIMA_COMPACTION`` ``1`` (with ``PROXIMA_ELASTIC=1``): KV compaction, live blocks
                           moved so that granules empty out (:mod:`proxima.vllm.
                           compaction_v1`); ``0`` / unset: off.

This module imports nothing of vLLM or torch: ``proxima serve`` asks it before anything
heavy is loaded.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from proxima import config
from proxima.errors import UserError
from proxima.memory.ledger import DIR_ENV as LEDGER_DIR_ENV

ENV = "PROXIMA_ALLOCATOR"
OBSERVE_ENV = "PROXIMA_OBSERVE"
ALLOW_UNTESTED_ENV = "PROXIMA_ALLOW_UNTESTED_VLLM"
ALLOW_UNPROVEN_ENV = "PROXIMA_ALLOW_UNPROVEN_ELASTIC"
STATS_ENV = "PROXIMA_STATS_FILE"
ELASTIC_ENV = "PROXIMA_ELASTIC"
ELASTIC_OPTIONS_ENV = "PROXIMA_ELASTIC_OPTIONS"
COMPACTION_ENV = "PROXIMA_COMPACTION"
LOG_LINE = "Using Proxima contiguous allocator"

logger = logging.getLogger("vllm.proxima")   # a child of vLLM's logger: its handler, its format


class ActivationError(UserError, RuntimeError):
    """Proxima was asked for but cannot be switched on as asked."""


# ----------------------------------------------------------------------------- versions

#: How far a feature is proven on a stack (:class:`Support`).
GPU = "proven on GPU"        #: run on a GPU (the proof drivers, tools/gpu) and on CPU
CPU_ONLY = "CPU-only"        #: tested on CPU only (vLLM's scheduler, fake or CPU tensors)
REFUSED = "refused"          #: refused in one line, no override

#: The features, in the order :meth:`Support.summary` says them.
FEATURES = (("allocator", "allocator"), ("elastic_scheduler", "elastic KV scheduler side"),
            ("elastic_worker", "elastic KV worker side"), ("compaction", "compaction"))


@dataclass(frozen=True)
class Support:
    """What one stack supports, feature by feature (:data:`GPU`, :data:`CPU_ONLY` or
    :data:`REFUSED`). The scheduler side of elastic KV and compaction runs in the CPU replay;
    the worker side (the VMM-backed KV tensors, the mover before the forward) only in a real
    engine, so a worker side that is :data:`CPU_ONLY` is refused in an engine unless
    ``PROXIMA_ALLOW_UNPROVEN_ELASTIC=1`` (:func:`unproven_refusal`). How each stack's vLLM
    differs is :mod:`proxima.vllm.vllm_v1_compat`; this says only how far each is proven."""

    allocator: str
    elastic_scheduler: str
    elastic_worker: str
    compaction: str

    def summary(self) -> str:
        """``allocator proven on GPU; elastic KV scheduler side CPU-only; ...``"""
        return "; ".join(f"{label} {getattr(self, name)}" for name, label in FEATURES)


@dataclass(frozen=True)
class Tested:
    """One tested vLLM release."""

    vllm: str                #: the exact release, as ``vllm.__version__`` spells it
    engine: str              #: "v1" or "v0": the engine generation, i.e. which adapter
    torch: tuple[str, ...]   #: torch releases it was tested with (without a +cuXXX tag)
    extra: str               #: ``pip install 'proxima[<extra>]'`` installs it
    stack: str               #: what the docs call it
    support: Support = Support(CPU_ONLY, REFUSED, REFUSED, REFUSED)   #: what it runs


#: The tested releases, newest first (add a release: add one entry, and its extra in
#: pyproject.toml; tests/unit/test_activation.py checks the two agree).
TESTED: tuple[Tested, ...] = (
    # 0.33.0 has not run on a GPU (the H200 host has torch 2.11, it pins 2.14:
    # docs/results/v033-staging/NOTES.md); its elastic and compaction scheduler sides pass
    # the replay's parity as 0.26.0 does (docs/results/replay-v033/NOTES.md).
    Tested("0.33.0", "v1", ("2.14.0",), extra="vllm", stack="the newest tested stack",
           support=Support(CPU_ONLY, CPU_ONLY, CPU_ONLY, CPU_ONLY)),
    Tested("0.26.0", "v1", ("2.11.0",), extra="vllm-0-26", stack="the tested stack",
           support=Support(GPU, GPU, GPU, GPU)),
    # The card stack: torch 2.4.0 is vLLM 0.6.3.post1's own pin; 2.5.1 is what the Nix
    # image builds it against (nixos-24.11's torch, nix/image.nix).
    Tested("0.6.3.post1", "v0", ("2.4.0", "2.5.1"), extra="vllm-cu121", stack="the card stack",
           support=Support(CPU_ONLY, REFUSED, REFUSED, REFUSED)),
)


def support(vllm: str | None) -> Support | None:
    """What the tested release ``vllm`` supports (None: not a tested release)."""
    entry = tested(vllm)
    return entry.support if entry is not None else None


def support_line(vllm: str, environ: Mapping[str, str] | None = None) -> str | None:
    """What the tested release ``vllm`` supports, for ``proxima selfcheck``:
    ``allocator proven on GPU; elastic KV scheduler side proven on GPU; ...``, the elastic
    worker side of a CPU-only stack saying whether an engine refuses it; None when untested."""
    entry = support(vllm)
    if entry is None:
        return None
    line = entry.summary()
    if entry.elastic_worker == CPU_ONLY:
        how = (f"allowed by {ALLOW_UNPROVEN_ENV}=1" if allow_unproven(environ) else
               f"refused in an engine unless {ALLOW_UNPROVEN_ENV}=1")
        line = line.replace(f"elastic KV worker side {CPU_ONLY}",
                            f"elastic KV worker side {CPU_ONLY} ({how})")
    return line


def unproven_refusal(vllm: str, what: str = f"{ELASTIC_ENV}=1",
                     environ: Mapping[str, str] | None = None) -> str | None:
    """The one line refusing ``what`` in an engine on vLLM ``vllm``, whose elastic worker side
    (VMM-backed KV tensors, the mover before the forward) has not run on a GPU; None when it
    has, or under ``PROXIMA_ALLOW_UNPROVEN_ELASTIC=1`` (an untested release is the
    ``PROXIMA_ALLOW_UNTESTED_VLLM`` policy's, not this one's)."""
    entry = support(vllm)
    if entry is None or entry.elastic_worker != CPU_ONLY or allow_unproven(environ):
        return None
    return (f"{what} on vLLM {vllm}: its elastic KV worker side (VMM-backed KV tensors, "
            f"the compaction mover) is tested on CPU only, never run on a GPU: run elastic KV "
            f"on vLLM 0.26.0, or set {ALLOW_UNPROVEN_ENV}=1 to try it anyway")

#: vLLM releases older than this run the V0 adapter, this one and later the V1 adapter:
#: 0.8.0 made V1 vLLM's default engine. It decides only which adapter an untested release
#: is tried with (under the override); a tested one says its own.
V1_SINCE = (0, 8)
ENGINE_NAMES = {"v1": "V1 engine", "v0": "V0 engine"}


def release(version: str) -> tuple[int, ...]:
    """``"0.6.3.post1"`` -> ``(0, 6, 3)``: the leading numeric parts."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):
            break
    return tuple(parts)


def tested(vllm: str | None) -> Tested | None:
    """The table's entry for this exact vLLM release, or None."""
    return next((t for t in TESTED if t.vllm == vllm), None)


def engine_for(vllm: str) -> str:
    """``"v1"`` or ``"v0"``: the engine generation (adapter) for this vLLM release."""
    entry = tested(vllm)
    if entry is not None:
        return entry.engine
    return "v1" if release(vllm) >= V1_SINCE else "v0"


def _base(torch: str) -> str:
    return torch.split("+")[0]


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (package metadata; nothing is imported)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tested_summary() -> str:
    """``vllm 0.26.0 with torch 2.11.0 (V1 engine, the tested stack); ...``"""
    return "; ".join(f"vllm {t.vllm} with torch {' or '.join(t.torch)} "
                     f"({ENGINE_NAMES[t.engine]}, {t.stack})" for t in TESTED)


def install_hint() -> str:
    """``install a tested vLLM: pip install 'proxima[vllm]' (vLLM 0.26.0) or ...``"""
    extras = " or ".join(f"pip install 'proxima[{t.extra}]' (vLLM {t.vllm})" for t in TESTED)
    return f"install a tested vLLM: {extras}; in a checkout, ./dev sets one up"


@dataclass(frozen=True)
class Verdict:
    """What the policy says about one vLLM (and torch) install."""

    vllm: str
    torch: str | None        #: None: torch not checked (unknown)
    engine: str              #: the adapter that runs it
    entry: Tested | None     #: the tested release, when vLLM's version is one
    tested: bool             #: vLLM and torch are a tested pair
    allowed: bool            #: tested, or untested with PROXIMA_ALLOW_UNTESTED_VLLM=1

    @property
    def seen(self) -> str:
        return f"vLLM {self.vllm}" + (f" with torch {self.torch}" if self.torch else "")

    def warning(self) -> str | None:
        """The line to log when an untested install is tried under the override."""
        if self.tested:
            return None
        return (f"{self.seen} is not a tested combination (tested: {tested_summary()}); "
                f"trying it anyway with Proxima's {ENGINE_NAMES[self.engine]} adapter "
                f"because {ALLOW_UNTESTED_ENV}=1")

    def refusal(self, stock_hint: str = f"unset {ENV} to run stock vLLM") -> str:
        """The one-line error for an untested install without the override."""
        return (f"{self.seen} is not a version Proxima was tested with (tested: "
                f"{tested_summary()}): {install_hint()}; {stock_hint}; or set "
                f"{ALLOW_UNTESTED_ENV}=1 to try it anyway")


def judge(vllm: str, torch: str | None = None,
          environ: Mapping[str, str] | None = None) -> Verdict:
    """The policy's verdict on vLLM ``vllm`` with torch ``torch`` (None: not checked).
    Raises ActivationError only for a bad ``PROXIMA_ALLOW_UNTESTED_VLLM`` value."""
    entry = tested(vllm)
    ok = entry is not None and (torch is None or _base(torch) in entry.torch)
    allowed = ok or allow_untested(environ)
    return Verdict(vllm, torch, engine_for(vllm), entry, ok, allowed)


_warned: set[tuple[str, str | None]] = set()


def require(engine: str, vllm: str, torch: str | None = None,
            environ: Mapping[str, str] | None = None) -> Verdict:
    """What an adapter asks before it patches vLLM: refuse a vLLM of another engine
    generation (no override) or an untested install without the override; under the
    override, log the warning once per process."""
    verdict = judge(vllm, torch, environ)
    if verdict.engine != engine:
        raise ActivationError(
            f"vLLM {vllm} runs the {ENGINE_NAMES[verdict.engine]}, but this is Proxima's "
            f"{ENGINE_NAMES[engine]} adapter: let the plugin pick the adapter "
            f"(proxima.vllm.plugin.adapter)")
    if not verdict.allowed:
        raise ActivationError(verdict.refusal())
    warning = verdict.warning()
    if warning and (vllm, torch) not in _warned:
        _warned.add((vllm, torch))
        logger.warning(warning)
    return verdict


# ---------------------------------------------------------------------------- variables

@dataclass(frozen=True)
class Variable:
    """One ``PROXIMA_*`` variable: ``parse`` turns a set, non-empty value into what it
    means, or raises ValueError (the reason, or "") for a bad one."""

    name: str
    accepted: str                       #: what the error message says is accepted
    parse: Callable[[str], object]
    unset: object = None                #: the meaning of unset or empty


def _switch(value: str) -> bool:
    if value == "1":
        return True
    if value == "0":
        return False
    raise ValueError("")


def _can_create_in(directory: Path) -> bool:
    """A file can be made in ``directory``: probed by making one (``os.access`` says yes
    to root, and to /proc or /sys, where the writes fail later, in a traceback)."""
    import tempfile

    if not directory.is_dir():
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".proxima-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _stats_file(value: str) -> Path:
    path = Path(value).expanduser()
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory")
    parent = path.resolve().parent
    if not _can_create_in(parent):
        raise ValueError(f"directory {str(parent)!r} does not exist or is not writable")
    return path


def _ledger_dir(value: str) -> Path:
    path = Path(value).expanduser()
    if not _can_create_in(path):
        raise ValueError(f"{str(path)!r} is not a writable directory")
    return path


@dataclass(frozen=True)
class CompactionMode:
    """``PROXIMA_COMPACTION``'s meaning when on: ``auto`` (the policy decides when and
    what to move; the one mode -- the tests' forced compaction lives in
    ``tests/support/forced.py``)."""

    kind: str = "auto"

    def __str__(self) -> str:
        """The spelling :func:`compaction_mode` reads back."""
        return "1"


def compaction_mode(value: str) -> CompactionMode | None:
    """``"1"`` -> auto, ``"0"`` -> None (off); else ValueError (the reason)."""
    value = value.strip()
    if value == "0":
        return None
    if value == "1":
        return CompactionMode("auto")
    raise ValueError("")


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable(ENV, "1 (Proxima on) or 0 / unset (stock vLLM)", _switch, False),
    Variable(OBSERVE_ENV, "1 (measure stock vLLM's contiguity) or 0 / unset (do not)",
             _switch, False),
    Variable(ALLOW_UNTESTED_ENV, "1 (try an untested vLLM anyway) or 0 / unset (refuse it)",
             _switch, False),
    Variable(ALLOW_UNPROVEN_ENV, "1 (run elastic KV and compaction in an engine on a vLLM "
             "whose worker side is tested on CPU only) or 0 / unset (refuse it)", _switch,
             False),
    Variable(ELASTIC_ENV, "1 (elastic KV memory, with PROXIMA_ALLOCATOR=1) or 0 / unset "
             "(a fixed KV pool)", _switch, False),
    Variable(ELASTIC_OPTIONS_ENV, "key=value,... or a JSON object of elastic KV options "
             "(see proxima serve --help), or unset (the defaults)",
             config.elastic_options_text, {}),
    Variable(STATS_ENV, "a file path in a writable directory, or unset (no status file)",
             _stats_file, None),
    Variable(COMPACTION_ENV, "1 (KV compaction, with PROXIMA_ELASTIC=1) or 0 / unset (off)",
             compaction_mode, None),
    Variable(LEDGER_DIR_ENV, "a writable directory for the per-GPU ledger of elastic engines "
             "(every engine of one GPU must use the same one: containers on one GPU mount it), or "
             "unset (/dev/shm)",
             _ledger_dir, None),
)}


def read(name: str, environ: Mapping[str, str] | None = None):
    """The meaning of variable ``name`` in ``environ`` (default: the process's)."""
    var = VARIABLES[name]
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return var.unset
    try:
        return var.parse(value.strip())
    except ValueError as exc:
        why = f" ({exc})" if str(exc) else ""
        raise ActivationError(f"{name} must be {var.accepted}, got {value!r}{why}") from None


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Every ``PROXIMA_*`` variable Proxima reads has a valid value (else ActivationError)."""
    for name in VARIABLES:
        read(name, environ)


def check_combination(environ: Mapping[str, str] | None = None) -> None:
    """The switches agree: ``PROXIMA_ELASTIC=1`` needs ``PROXIMA_ALLOCATOR=1``, and
    ``PROXIMA_COMPACTION`` needs ``PROXIMA_ELASTIC=1`` (else ActivationError, one line). The
    plugin asks in every vLLM process; a command that starts vLLM asks first, so the user
    reads this line and not vLLM's report of a child process that exited."""
    elastic_on = elastic(environ)
    if elastic_on and not enabled(environ):
        raise ActivationError(
            f"{ELASTIC_ENV}=1 needs {ENV}=1 (elastic KV memory is a mode of Proxima's "
            f"allocator); set both, or unset {ELASTIC_ENV}")
    if compaction(environ) is not None and not elastic_on:
        raise ActivationError(
            f"{COMPACTION_ENV} needs {ELASTIC_ENV}=1 and {ENV}=1 (block moves travel on the "
            f"elastic KV connector); set them, or unset {COMPACTION_ENV}")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """``PROXIMA_ALLOCATOR=1``."""
    return read(ENV, environ)


def observing(environ: Mapping[str, str] | None = None) -> bool:
    """``PROXIMA_OBSERVE=1``."""
    return read(OBSERVE_ENV, environ)


def allow_untested(environ: Mapping[str, str] | None = None) -> bool:
    """``PROXIMA_ALLOW_UNTESTED_VLLM=1``."""
    return read(ALLOW_UNTESTED_ENV, environ)


def allow_unproven(environ: Mapping[str, str] | None = None) -> bool:
    """``PROXIMA_ALLOW_UNPROVEN_ELASTIC=1``."""
    return read(ALLOW_UNPROVEN_ENV, environ)


def compaction(environ: Mapping[str, str] | None = None) -> CompactionMode | None:
    """``PROXIMA_COMPACTION``: None (off) or the :class:`CompactionMode`."""
    return read(COMPACTION_ENV, environ)


def elastic(environ: Mapping[str, str] | None = None) -> bool:
    """``PROXIMA_ELASTIC=1``."""
    return read(ELASTIC_ENV, environ)


def stats_file(environ: Mapping[str, str] | None = None) -> Path | None:
    """``PROXIMA_STATS_FILE``, checked: None when unset."""
    return read(STATS_ENV, environ)
