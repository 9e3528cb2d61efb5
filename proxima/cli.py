"""`proxima` — one entry point: replay | bench | serve | selfcheck | bundle.

Each subcommand lives in its own package and is imported only when chosen, so
`proxima --version` needs neither torch nor vllm. A subcommand module
exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from proxima import __version__
from proxima.errors import UserError

# name -> (module, one-line help). Modules import lazily.
SUBCOMMANDS = {
    "replay": ("proxima.replay.cli", "replay a workload through vLLM's real scheduler on CPU, stock vs Proxima"),
    "bench": ("proxima.bench.cli", "benchmark stock vLLM vs Proxima (online servers or offline LLM)"),
    "serve": ("proxima.serve.cli", "serve vLLM's OpenAI API with Proxima, supervised, self-checked"),
    "selfcheck": ("proxima.serve.selfcheck", "check GPU, versions and Proxima activation; exit non-zero on failure"),
    "bundle": ("proxima.bundle", "write an air-gapped bundle: image archives, wheelhouse, model, SHA256SUMS, README"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="proxima", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"proxima {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                parser.exit(2, f"proxima {name}: not available: missing module {exc.name!r} "
                               f"(install the tested stack: ./dev, or pip install 'proxima[vllm]')\n")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"proxima {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"proxima {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
