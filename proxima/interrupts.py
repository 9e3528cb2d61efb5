"""SIGTERM handled as Ctrl-C is: the command stops where it is, keeps what it finished,
and exits with its own status (130 for SIGINT, 143 = 128 + 15 for SIGTERM).

Python turns SIGINT into :class:`KeyboardInterrupt`; SIGTERM (``kill``, ``docker stop``, a
batch system's time limit) kills the process at once by default, losing what a long
command finished but had not yet written. Within :func:`sigterm_as_interrupt`, SIGTERM
raises :class:`Terminated` in the main thread instead: a ``KeyboardInterrupt``, so every
``except KeyboardInterrupt`` that keeps finished work keeps it on SIGTERM too. Standard
library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

#: exit status of a command stopped by SIGINT (Ctrl-C) / SIGTERM: 128 + the signal number
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (raised by the handler of :func:`sigterm_as_interrupt`)."""


def describe(exc: BaseException) -> str:
    """How a stop is named on stderr: ``terminated (SIGTERM)`` or ``interrupted``."""
    return "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"


def exit_status(exc: BaseException) -> int:
    return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises :class:`Terminated` in the main thread; the previous
    handler is restored on the way out. A process forked inside (which inherits the
    handler) is not this command: there SIGTERM keeps its default action, to die."""
    if threading.current_thread() is not threading.main_thread():
        yield                   # signal handlers can only be set from the main thread
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
