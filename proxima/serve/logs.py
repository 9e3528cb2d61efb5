"""The ``proxima`` logger: one handler on stderr, shared by the arbiter and its worker."""

from __future__ import annotations

import logging
import sys


def setup() -> logging.Logger:
    logger = logging.getLogger("proxima")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            "%(asctime)s [%(process)d] proxima %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
