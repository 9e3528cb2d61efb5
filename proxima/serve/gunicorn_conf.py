"""gunicorn configuration for ``proxima serve``: one worker, long timeouts, our worker class.

One worker per engine: a vLLM engine per worker would load the model once per worker. The
arbiter restarts the worker when it exits (the supervisor ends it when the engine dies) and
halts when it fails to boot (a failed self-check).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from gunicorn.app.base import BaseApplication

WORKER_CLASS = "proxima.serve.worker.ProximaWorker"
# Heartbeat timeout. The event loop stays free while the engine starts (a background thread),
# so this only has to cover slow imports when a worker boots and long event-loop stalls.
WORKER_TIMEOUT_S = 300
# SIGTERM: in-flight requests, then the engine's shutdown, get this long before SIGKILL.
GRACEFUL_TIMEOUT_S = 60


def bind_address(args: argparse.Namespace) -> str:
    if getattr(args, "uds", None):
        return f"unix:{args.uds}"
    host = args.host or "0.0.0.0"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{args.port}"


def gunicorn_options(args: argparse.Namespace) -> dict:
    """gunicorn settings from vLLM's parsed ``serve`` options."""
    options = {
        "bind": [bind_address(args)],
        "workers": 1,
        "worker_class": WORKER_CLASS,
        "timeout": WORKER_TIMEOUT_S,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "keepalive": int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")),
        "preload_app": False,  # the app (and so the engine) is created in the worker
        "max_requests": 0,     # never recycle a worker that holds a loaded model
        "proc_name": "proxima-serve",
        "control_socket_disable": True,
        "loglevel": getattr(args, "uvicorn_log_level", "info") or "info",
        "errorlog": "-",
        "accesslog": None if getattr(args, "disable_uvicorn_access_log", False) else "-",
    }
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        options["worker_tmp_dir"] = "/dev/shm"  # heartbeat file off a possibly slow disk
    for ours, theirs in (("ssl_keyfile", "keyfile"), ("ssl_certfile", "certfile"),
                         ("ssl_ca_certs", "ca_certs"), ("ssl_ciphers", "ciphers")):
        if getattr(args, ours, None):
            options[theirs] = getattr(args, ours)
    if getattr(args, "ssl_certfile", None) and getattr(args, "ssl_cert_reqs", None):
        options["cert_reqs"] = int(args.ssl_cert_reqs)
    return options


class ProximaApplication(BaseApplication):
    """gunicorn application whose ``load()`` is :func:`proxima.serve.app.create_app`."""

    def __init__(self, args: argparse.Namespace, options: dict | None = None, **app_kwargs):
        self.args = args
        self.options = gunicorn_options(args) if options is None else options
        self.app_kwargs = app_kwargs
        super().__init__(prog="proxima serve")

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        from proxima.serve.app import create_app

        return create_app(self.args, **self.app_kwargs)
