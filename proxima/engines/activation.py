"""When Proxima is on: one variable, checked the same way in every process and engine.

``PROXIMA_ALLOCATOR``: unset or ``0`` -> stock vLLM, nothing patched; ``1`` -> Proxima;
anything else -> :class:`ActivationError` (the engine must not start half-configured).
``PROXIMA_ALLOW_UNTESTED_VLLM=1`` lets Proxima activate on a vLLM version it was not
tested with, with a warning.
"""

from __future__ import annotations

import os

from proxima.errors import UserError

ENV = "PROXIMA_ALLOCATOR"
ALLOW_UNTESTED_ENV = "PROXIMA_ALLOW_UNTESTED_VLLM"
LOG_LINE = "Using Proxima contiguous allocator"

#: engine generation -> the vLLM versions Proxima was tested with
TESTED_VLLM = {
    "v1": ("0.26.0",),
    "v0": ("0.6.3.post1",),
}


class ActivationError(UserError, RuntimeError):
    """Proxima was asked for but cannot be switched on as asked."""


def enabled(environ: dict | None = None) -> bool:
    """True when ``PROXIMA_ALLOCATOR=1``; raises ActivationError on any value but 0/1/unset."""
    value = (os.environ if environ is None else environ).get(ENV)
    if value is None or value.strip() in ("", "0"):
        return False
    if value.strip() == "1":
        return True
    raise ActivationError(
        f"{ENV} must be 1 (Proxima on) or 0 / unset (stock vLLM), got {value!r}")


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
