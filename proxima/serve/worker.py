"""gunicorn worker class: uvicorn-worker's UvicornWorker, plus an exit code chosen by the app.

gunicorn's arbiter reads a worker's exit code: 3 (WORKER_BOOT_ERROR) halts the whole server,
anything else gets a fresh worker. The supervisor picks: a failed self-check halts
(``proxima serve`` exits non-zero before serving), a dead engine restarts.
"""

from __future__ import annotations

import sys

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

# Share of gunicorn's graceful_timeout that uvicorn gives in-flight requests on shutdown; the
# rest is for stopping the engine before the arbiter's SIGKILL.
REQUEST_SHARE_OF_GRACEFUL_TIMEOUT = 0.5


class ProximaWorker(UvicornWorker):
    # lifespan "on": a failing start-up must fail the worker, not be ignored ("auto" would).
    CONFIG_KWARGS = {"loop": "auto", "http": "auto", "lifespan": "on"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config.timeout_graceful_shutdown = max(
            1, int(self.cfg.graceful_timeout * REQUEST_SHARE_OF_GRACEFUL_TIMEOUT))
        self.exit_code = 0
        self._server: Server | None = None

    def request_exit(self, code: int) -> None:
        """Graceful stop (uvicorn finishes in-flight requests, runs the lifespan shutdown),
        then exit with ``code``."""
        self.exit_code = code
        if self._server is not None:
            self._server.should_exit = True

    async def _serve(self) -> None:
        self.config.app = self.wsgi
        server = Server(config=self.config)
        self._server = server
        supervisor = getattr(self.wsgi, "supervisor", None)
        if supervisor is not None:
            supervisor.request_exit = self.request_exit
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started or self.exit_code == Arbiter.WORKER_BOOT_ERROR:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
        if self.exit_code:
            sys.exit(self.exit_code)
