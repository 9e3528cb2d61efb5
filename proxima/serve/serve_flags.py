"""Two of ``proxima serve``'s switches beside ``--elastic``, kept out of cli.py's parsing:

- ``--compaction``: KV compaction (sets ``PROXIMA_COMPACTION=1`` for the engine; needs
  ``--elastic``). A value already in the environment (``every:K``) is kept.
- with ``--elastic`` on one GPU, vLLM's ``mp`` executor is the default unless the user chose
  one (``--distributed-executor-backend``): with ``uni`` the model's worker runs on the
  scheduler's thread and elastic mode's bookkeeping lengthens every step
  (docs/benchmarks.md 7.3).
"""

from __future__ import annotations

import argparse
import os

from proxima.errors import UserError
from proxima.serve.argv import flag_value, given


def take_compaction(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--compaction``, and whether it was there."""
    rest, found = [], False
    for token in argv:
        flag, eq, _ = token.partition("=")
        if flag == "--compaction":
            if eq:
                raise UserError(f"--compaction takes no value, got {token!r}")
            found = True
            continue
        rest.append(token)
    return rest, found


def apply_compaction(found: bool, elastic_on: bool, environ=os.environ) -> None:
    """``--compaction`` -> ``PROXIMA_COMPACTION=1`` (an ``every:K`` already set is kept)."""
    if not found:
        return
    from proxima.vllm import activation

    if not elastic_on:
        raise UserError("--compaction needs --elastic (block moves travel on the elastic KV "
                        "connector): add --elastic")
    current = environ.get(activation.COMPACTION_ENV, "").strip()
    if current in ("", "0"):
        environ[activation.COMPACTION_ENV] = "1"


def default_executor(args: argparse.Namespace, argv: list[str]) -> str | None:
    """With ``--elastic``: set vLLM's ``mp`` executor where the user chose none on one GPU
    (vLLM picks mp itself for more). Returns the log line saying so, or None."""
    from proxima.serve import vllm_args

    if vllm_args.elastic_executor_hint(args, argv) is None:
        return None
    args.distributed_executor_backend = "mp"
    return ("--elastic on one GPU: vLLM's mp executor (--distributed-executor-backend mp, the "
            "default with --elastic; give --distributed-executor-backend uni for vLLM's own)")


#: Proxima's own serve options (taken out of the command line): flag -> takes a value
ELASTIC_FLAGS = {"--elastic": False, "--kv-min": True, "--kv-max": True,
                 "--elastic-options": True, "--idle-release": True, "--sleep-mode": False}


def take_elastic_options(argv: list[str]) -> tuple[list[str], dict | None]:
    """``argv`` without Proxima's elastic flags, and the elastic options they give (None:
    ``--elastic`` absent). A bad value is one UserError naming the flag."""
    rest, given, i = [], {}, 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        if flag in ELASTIC_FLAGS:
            if ELASTIC_FLAGS[flag]:
                given[flag], i = flag_value(argv, i, inline if eq else None,
                                            f"{flag} needs a value (e.g. {flag} 8GiB)")
            else:
                if eq:
                    raise UserError(f"{flag} takes no value, got {token!r}")
                given[flag] = True
            i += 1
            continue
        rest.append(token)
        i += 1
    if not given:
        return rest, None
    if "--elastic" not in given:
        raise UserError(f"{next(iter(given))} needs --elastic (elastic KV memory)")
    from proxima import config

    options = {}
    if "--elastic-options" in given:
        options.update(config.elastic_options_text(given["--elastic-options"],
                                                   "--elastic-options"))
    for flag, key in (("--kv-min", "min_bytes"), ("--kv-max", "max_bytes"),
                      ("--idle-release", "idle_release_s")):
        if flag in given and key in options:
            raise UserError(f"{flag} {given[flag]} and --elastic-options' {key} both set "
                            f"{key}: give one of them")
    for flag, key in (("--kv-min", "min_bytes"), ("--kv-max", "max_bytes")):
        if flag in given:
            config.parse_size(given[flag], flag)
            options[key] = given[flag]
    least, most = given.get("--kv-min"), given.get("--kv-max")
    if least is not None and most is not None and \
            config.parse_size(most, "--kv-max") < config.parse_size(least, "--kv-min"):
        raise UserError(f"--kv-max {most} is below --kv-min {least}: "
                        f"give a maximum at least the minimum")
    if "--idle-release" in given:
        options["idle_release_s"] = config.ELASTIC_OPTIONS["idle_release_s"](
            "--idle-release", given["--idle-release"])
    if "--sleep-mode" in given:
        options["sleep_mode"] = True
        if options.get("idle_release_s") is None:
            raise UserError("--sleep-mode needs --idle-release SECONDS (the engine gives back "
                            "all its KV before its weights go to host memory): add it")
    config.elastic_options(options, "proxima serve --elastic")
    return rest, options


#: the vLLM releases whose sleep mode was read beside elastic KV (sleep-mode NOTES.md)
SLEEP_MODE_RELEASES = ("0.26.",)


def check_sleep_mode_vllm(version: str | None) -> None:
    """``--sleep-mode`` / ``--sleep-after`` on this vLLM: one UserError line where its sleep
    mode was not read beside elastic KV (0.33's wake restores a KV connector's caches
    through calls Proxima's connector does not implement)."""
    if version is None or not version.startswith(SLEEP_MODE_RELEASES):
        raise UserError(f"--sleep-after / --sleep-mode need vLLM 0.26 (its sleep mode is the "
                        f"one read beside elastic KV: docs/results/sleep-mode/NOTES.md); this "
                        f"is vLLM {version or 'not installed'}: drop them (--idle-release "
                        f"still gives back an idle model's KV)")


def check_bare_sleep_mode(argv: list[str], elastic: dict, where: str = "") -> None:
    """vLLM's ``--enable-sleep-mode`` with elastic KV only as ``--sleep-mode`` sets it up
    (the connector refuses it otherwise, but only once the engine starts): one line now."""
    if elastic.get("sleep_mode"):
        return
    if given(argv, "--enable-sleep-mode"):
        raise UserError(f"{where}--enable-sleep-mode with --elastic: vLLM's sleep would not give "
                        f"back the elastic KV, and its wake is not coordinated with the GPU's "
                        f"other engines: give --idle-release S --sleep-mode instead (several "
                        f"models: --sleep-after S inside --model), or drop --enable-sleep-mode")
