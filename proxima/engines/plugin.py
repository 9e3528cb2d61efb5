"""vLLM general-plugin entry point (``vllm.general_plugins``: ``proxima``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
It does nothing unless ``PROXIMA_ALLOCATOR=1``; then it picks the adapter for the
installed vLLM generation. A bad ``PROXIMA_ALLOCATOR`` value or an untested vLLM version
must stop vLLM's start: the refusal is raised as ``SystemExit`` carrying the message,
because vLLM 0.6's plugin loader logs and swallows any ``Exception`` (0.26's does not).
"""

from __future__ import annotations

import logging

from proxima.engines import activation

logger = logging.getLogger("vllm.proxima")  # a child of vLLM's logger: same handler, same format


def register() -> None:
    try:
        _register()
    except activation.ActivationError as exc:
        raise SystemExit(f"proxima: {exc}") from None


def _register() -> None:
    if not activation.enabled():
        return
    import vllm

    version = vllm.__version__
    if version.startswith("0.6."):
        from proxima.engines import vllm_v0 as adapter
        engine = "v0"
    else:
        from proxima.engines import vllm_v1 as adapter
        engine = "v1"
    warning = activation.check_version(engine, version)
    if warning:
        logger.warning(warning)
    adapter.activate()
