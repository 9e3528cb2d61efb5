"""Words of a ``vllm serve``-style command line, read without vLLM: the option a word names,
whether an option is given, and a flag's value. Below every module of serve that reads a
command line (:mod:`proxima.serve.vllm_args`, :mod:`proxima.serve.serve_flags`,
:mod:`proxima.serve.multi_config`, ...)."""

from __future__ import annotations

from proxima.errors import UserError


def option_name(token: str) -> str:
    """The option a command-line word names, as vLLM spells it: ``--a_b=1`` -> ``--a-b``
    (argparse takes both spellings); a word that is no long option comes back as it is."""
    flag = token.partition("=")[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def given(argv: list[str], option: str) -> bool:
    """Whether ``option`` (``--dash-form``) is on the command line, in any vLLM spelling."""
    return option in map(option_name, argv)


def flag_value(argv: list[str], i: int, inline: str | None, missing: str) -> tuple[str, int]:
    """The value of the flag at ``argv[i]``: ``inline`` (written ``--flag=VALUE``) or the
    next token, and the index of the last token it took; UserError ``missing`` if none."""
    if inline is not None:
        return inline, i
    if i + 1 < len(argv):
        return argv[i + 1], i + 1
    raise UserError(missing)


def last_value(argv: list[str], option: str) -> str | None:
    """The value of the last ``option`` (``--dash-form``) in ``argv``, in any vLLM spelling
    (``--opt V``, ``--opt=V``, ``--o_pt V``): as argparse keeps the last; None where the
    option is absent or its value missing."""
    found = None
    for i, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if option_name(flag) == option:
            found = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found
