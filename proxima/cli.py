"""`proxima` — one entry point: replay | bench | serve | kv | selfcheck | bundle.

Each subcommand lives in its own package and is imported only when chosen, so
`proxima --version` needs neither torch nor vllm. A subcommand module
exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import sys

from proxima import __version__
from proxima.errors import UserError
from proxima.interrupts import describe, exit_status, sigterm_as_interrupt

EXIT_STATUS = """\
exit status of every command: 0 done; 1 done, but a check failed or the results are
not trustworthy (the command says why; see its --help); 2 bad input or environment (one
line: what was wrong, the value, what to do; nothing was run or written); 130 interrupted
(Ctrl-C, SIGINT), 143 terminated (SIGTERM): replay and bench keep what was finished;
bundle leaves no partial copy; 141 stdout's reader went away (a closed pipe, e.g. | head)."""

#: exit status when stdout's reader went away (a closed pipe, e.g. ``| head``): a shell's
#: for a process that SIGPIPE ended, 128 + 13, without Python's traceback
EXIT_BROKEN_PIPE = 141

#: commands that stop on SIGTERM as on Ctrl-C (finished work kept, a partial bundle removed;
#: exit 143) instead of dying
SIGTERM_STOPS = ("replay", "bench", "bundle")

# name -> (module, one-line help). Modules import lazily.
SUBCOMMANDS = {
    "replay": ("proxima.replay.cli", "replay a workload through vLLM's real scheduler on CPU, stock vs Proxima"),
    "bench": ("proxima.bench.cli", "benchmark stock vLLM vs Proxima (online servers or offline LLM)"),
    "serve": ("proxima.serve.cli", "serve vLLM's OpenAI API with Proxima, supervised, self-checked"),
    "kv": ("proxima.serve.kv", "read or set a running proxima serve's elastic KV memory (mapped, used, reclaimable; min/max)"),
    "selfcheck": ("proxima.serve.selfcheck", "check GPU, versions and Proxima activation; exit non-zero on failure"),
    "bundle": ("proxima.bundle", "write an air-gapped bundle: image archives, wheelhouse, model, SHA256SUMS, README"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help says its default: ``(default: X)`` is added where the help text
    does not already say it (an on/off flag: ``default: off``). Epilogs keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or "required" in text or action.default is argparse.SUPPRESS
                or not action.option_strings):
            return text
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        if action.nargs == 0:                           # store_true / store_false
            shown = "off" if action.default in (False, None) else "on"
        elif action.default in (None, []):
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """argparse's errors as one line (what was wrong, where to look), not a usage block;
    an unknown option names the closest known one."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def unknown(self, extra: list[str]):
        known = [o for a in self._actions for o in a.option_strings]
        hints = []
        for token in extra:
            close = difflib.get_close_matches(token.partition("=")[0], known, n=1)
            if token.startswith("-") and close:
                hints.append(f"{token} (did you mean {close[0]}?)")
            else:
                hints.append(token)
        self.error(f"unrecognized arguments: {' '.join(hints)}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="proxima", description=__doc__.splitlines()[0],
                    epilog=EXIT_STATUS, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"proxima {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        if name == chosen:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                parser.exit(2, f"proxima {name}: not available: missing module {exc.name!r} "
                               f"(install the tested stack: ./dev, or pip install 'proxima[vllm-0-26]')\n")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = getattr(args, "command", None)
        subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
                    None)
        (subs.choices[chosen] if subs and chosen in subs.choices else parser).unknown(extra)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    stops = sigterm_as_interrupt() if args.command in SIGTERM_STOPS else contextlib.nullcontext()
    try:
        with stops:
            return int(args._run(args) or 0)
    except UserError as exc:
        print(f"proxima {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:          # Ctrl-C; SIGTERM too where SIGTERM_STOPS
        print(f"proxima {args.command}: {describe(exc)}", file=sys.stderr)
        return exit_status(exc)
    except BrokenPipeError:                   # the reader of stdout went away (| head)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing to flush
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
