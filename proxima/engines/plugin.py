"""vLLM general-plugin entry point (``vllm.general_plugins``: ``proxima``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
It checks every ``PROXIMA_*`` variable, then does nothing unless ``PROXIMA_ALLOCATOR=1``;
then it activates the adapter that :func:`proxima.engines.activation.engine_for` names for
the installed vLLM (the adapter asks the version policy first). With Proxima off,
``PROXIMA_OBSERVE=1`` installs the read-only observer of stock contiguity instead (V1 only).

A bad value of any variable or an untested vLLM must stop vLLM's start: the refusal is
raised as ``SystemExit`` carrying the message, because vLLM 0.6's plugin loader logs and
swallows any ``Exception`` (0.26's does not).
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
    activation.check_environment()
    proxima_on = activation.enabled()
    if not proxima_on and not activation.observing():
        return
    import vllm

    engine = activation.engine_for(vllm.__version__)
    if proxima_on:          # Proxima's pool writes its own status: nothing to observe
        activation.adapter(engine).activate()
    elif engine == "v1":
        from proxima.engines import observe_v1
        observe_v1.activate()
    else:
        logger.warning("%s=1 is not supported on the V0 engine (vLLM %s): stock contiguity "
                       "is not measured", activation.OBSERVE_ENV, vllm.__version__)
