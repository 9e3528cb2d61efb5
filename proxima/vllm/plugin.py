"""vLLM general-plugin entry point (``vllm.general_plugins``: ``proxima``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
It checks every ``PROXIMA_*`` variable, then does nothing unless ``PROXIMA_ALLOCATOR=1``;
then it activates the adapter that :func:`proxima.vllm.activation.engine_for` names for
the installed vLLM (the adapter asks the version policy first), and with ``PROXIMA_ELASTIC=1``
as well (V1 only) routes the engine through Proxima's elastic-KV connector
(:mod:`proxima.vllm.elastic_v1`), which also carries KV compaction's moves with
``PROXIMA_COMPACTION`` (:mod:`proxima.vllm.compaction_v1`). With Proxima off,
``PROXIMA_OBSERVE=1`` installs the read-only observer of stock contiguity instead (V1 only).

A bad value of any variable or an untested vLLM must stop vLLM's start: the refusal is
raised as ``SystemExit`` carrying the message, because vLLM 0.6's plugin loader logs and
swallows any ``Exception`` (0.26's does not).
"""

from __future__ import annotations

import logging

from proxima.vllm import activation

logger = logging.getLogger("vllm.proxima")  # a child of vLLM's logger: same handler, same format


def adapter(engine: str):
    """The adapter module of an engine generation. Both expose ``activate()`` (patch vLLM,
    after :func:`proxima.vllm.activation.require`; idempotent), ``deactivate()`` (undo)
    and ``is_active()``. (Here, not in :mod:`~proxima.vllm.activation`: the adapters
    import the policy, the policy imports no adapter.)"""
    if engine == "v1":
        from proxima.vllm import vllm_v1 as module
    elif engine == "v0":
        from proxima.vllm import vllm_v0 as module
    else:
        raise ValueError(f"no engine generation {engine!r}: "
                         f"{', '.join(activation.ENGINE_NAMES)}")
    return module


def register() -> None:
    try:
        _register()
    except activation.ActivationError as exc:
        raise SystemExit(f"proxima: {exc}") from None


def _register() -> None:
    activation.check_environment()
    activation.check_combination()
    proxima_on = activation.enabled()
    elastic = activation.elastic()
    if not proxima_on and not activation.observing():
        return
    import vllm

    engine = activation.engine_for(vllm.__version__)
    if elastic and engine != "v1":
        raise activation.ActivationError(
            f"{activation.ELASTIC_ENV}=1 needs vLLM's V1 engine; this is vLLM "
            f"{vllm.__version__}")
    if proxima_on:          # Proxima's pool writes its own status: nothing to observe
        adapter(engine).activate()          # the version policy first: an untested vLLM stops here
        if elastic:
            from proxima.vllm import elastic_v1
            elastic_v1.activate()
    elif engine == "v1":
        from proxima.vllm import observe_v1
        observe_v1.activate()
    else:
        logger.warning("%s=1 is not supported on the V0 engine (vLLM %s): stock contiguity "
                       "is not measured", activation.OBSERVE_ENV, vllm.__version__)
