"""When Proxima is on: one variable, checked the same way in every process and engine.

``PROXIMA_ALLOCATOR``: unset or ``0`` -> stock vLLM, nothing patched; ``1`` -> Proxima;
anything else -> :class:`ActivationError` (the engine must not start half-configured).
``PROXIMA_ALLOW_UNTESTED_VLLM=1`` lets Proxima activate on a vLLM version it was not
tested with, with a warning.

``PROXIMA_OBSERVE``: with Proxima off, ``1`` measures stock vLLM's contiguity without
changing its allocation (:mod:`proxima.engines.observe_v1`; ``proxima bench`` uses it for
its stock runs). Same values as ``PROXIMA_ALLOCATOR``.
"""

from __future__ import annotations

import os

from proxima.errors import UserError

ENV = "PROXIMA_ALLOCATOR"
ALLOW_UNTESTED_ENV = "PROXIMA_ALLOW_UNTESTED_VLLM"
OBSERVE_ENV = "PROXIMA_OBSERVE"
LOG_LINE = "Using Proxima contiguous allocator"

#: engine generation -> the vLLM versions Proxima was tested with
TESTED_VLLM = {
    "v1": ("0.26.0",),
    "v0": ("0.6.3.post1",),
}


class ActivationError(UserError, RuntimeError):
    """Proxima was asked for but cannot be switched on as asked."""


def _flag(name: str, on: str, off: str, environ: dict | None) -> bool:
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value.strip() in ("", "0"):
        return False
    if value.strip() == "1":
        return True
    raise ActivationError(f"{name} must be 1 ({on}) or 0 / unset ({off}), got {value!r}")


def enabled(environ: dict | None = None) -> bool:
    """True when ``PROXIMA_ALLOCATOR=1``; raises ActivationError on any value but 0/1/unset."""
    return _flag(ENV, "Proxima on", "stock vLLM", environ)


def observing(environ: dict | None = None) -> bool:
    """True when ``PROXIMA_OBSERVE=1`` (same values as :func:`enabled`)."""
    return _flag(OBSERVE_ENV, "measure stock vLLM's contiguity", "do not", environ)


def check_version(engine: str, version: str, environ: dict | None = None) -> str | None:
    """Refuse an untested vLLM version unless explicitly allowed.

    Returns a warning message when the override was used, None when the version is tested.
    """
    tested = TESTED_VLLM[engine]
    if version in tested:
        return None
    env = os.environ if environ is None else environ
    if env.get(ALLOW_UNTESTED_ENV) == "1":
        return (f"Proxima was tested with vLLM {', '.join(tested)}, not {version}; "
                f"activating anyway because {ALLOW_UNTESTED_ENV}=1")
    raise ActivationError(
        f"Proxima supports vLLM {', '.join(tested)} ({engine} engine); this is vLLM {version}. "
        f"Install a tested version (pip install 'proxima[vllm]'), unset {ENV} to run "
        f"stock vLLM, or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")
