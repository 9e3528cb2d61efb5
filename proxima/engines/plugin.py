"""vLLM general-plugin entry point (``vllm.general_plugins``: ``proxima``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
It does nothing unless ``PROXIMA_ALLOCATOR=1``; then it picks the adapter for the
installed vLLM generation, and with ``PROXIMA_ELASTIC=1`` as well (V1 only) routes the
engine through Proxima's elastic-KV connector (:mod:`proxima.engines.elastic_v1`). With Proxima off, ``PROXIMA_OBSERVE=1`` installs the read-only
observer of stock contiguity instead (V1 only). A bad value of either variable or an
untested vLLM version must stop vLLM's start: the refusal is raised as ``SystemExit`` carrying the message,
because vLLM 0.6's plugin loader logs and swallows any ``Exception`` (0.26's does not).
"""

from __future__ import annotations

import logging

from proxima.engines import activation, elastic_v1

logger = logging.getLogger("vllm.proxima")  # a child of vLLM's logger: same handler, same format


def register() -> None:
    try:
        _register()
    except activation.ActivationError as exc:
        raise SystemExit(f"proxima: {exc}") from None


def _register() -> None:
    proxima_on = activation.enabled()
    observe = activation.observing()
    elastic = elastic_v1.enabled()
    if elastic and not proxima_on:
        raise activation.ActivationError(
            f"{elastic_v1.ENV}=1 needs {activation.ENV}=1 (elastic KV memory is a mode of "
            f"Proxima's allocator); set both, or unset {elastic_v1.ENV}")
    if not proxima_on and not observe:
        return
    import vllm

    version = vllm.__version__
    engine = "v0" if version.startswith("0.6.") else "v1"
    warning = activation.check_version(engine, version)
    if warning:
        logger.warning(warning)
    if elastic and engine == "v0":
        raise activation.ActivationError(
            f"{elastic_v1.ENV}=1 needs vLLM 0.26's V1 engine; this is vLLM {version}")
    if proxima_on:          # Proxima's pool writes its own status: nothing to observe
        if elastic:
            elastic_v1.activate()
        if engine == "v0":
            from proxima.engines import vllm_v0 as adapter
        else:
            from proxima.engines import vllm_v1 as adapter
        adapter.activate()
    elif engine == "v1":
        from proxima.engines import observe_v1
        observe_v1.activate()
    else:
        logger.warning("%s=1 is not supported on the V0 engine (vLLM %s): stock contiguity "
                       "is not measured", activation.OBSERVE_ENV, version)
