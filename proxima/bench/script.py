"""The ``main`` of the bench modules run as ``python3 -m proxima.bench.<name>``."""

from __future__ import annotations

import argparse
import sys

from proxima.errors import UserError


def script_main(module: str, doc: str, add_arguments, run, argv: list[str] | None) -> int:
    """Parse ``argv`` (``--help`` shows the defaults), run; a :class:`UserError` is one line
    on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog=f"python3 -m {module}",
                                     description=doc.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as exc:
        print(f"{module}: error: {exc}", file=sys.stderr)
        return 2
