"""Cheap input checks for ``proxima serve``, run before anything heavy is imported or started.

Every check raises :class:`~proxima.errors.UserError` with one line: what was wrong, the value
seen, what to do. They run twice: first on a plain scan of the command line (so a typo fails in
a second, on any machine), then on the namespace vLLM's own parser produced (authoritative:
it also sees values from ``--config`` files and positional models given late).
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from proxima.vllm import activation
from proxima.vllm.activation import installed_version
from proxima.errors import UserError
from proxima.serve.argv import option_name
from proxima.serve.preflight import INSTALL_HINT

ALLOCATOR_ENV = activation.ENV
# Powers of two that vLLM's CUDA attention backends accept (FlashAttention and Triton need a
# multiple of 16 tokens per block); Proxima's runs are counted in these blocks.
ALLOWED_BLOCK_SIZES = (16, 32, 64, 128, 256)
#: a Hugging Face model id: NAME or ORG/NAME, of letters, digits, - _ .
HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
DEFAULT_PORT = 8000  # vLLM's default
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "proxima"


def check_allocator_env(environ=os.environ) -> None:
    """``PROXIMA_ALLOCATOR`` may be unset or 1 here; serve sets it to 1 for the engine.
    (A value that is not 0 or 1 at all is :func:`activation.check_environment`'s error.)"""
    value = environ.get(ALLOCATOR_ENV)
    if value is not None and not activation.enabled(environ):
        raise UserError(
            f"{ALLOCATOR_ENV}={value!r} switches Proxima off, but proxima serve always runs the "
            f"engine with Proxima on: unset {ALLOCATOR_ENV} (or set it to 1); for stock vLLM "
            f"run `vllm serve` instead")


def check_vllm_installed(environ=os.environ) -> str:
    """The installed vLLM, if the version policy accepts it with the installed torch
    (:func:`activation.judge`: tested, or untested with PROXIMA_ALLOW_UNTESTED_VLLM=1)."""
    version = installed_version("vllm")
    if version is None:
        raise UserError(f"vLLM is not installed: {INSTALL_HINT}")
    verdict = activation.judge(version, installed_version("torch"), environ)
    if not verdict.allowed:
        raise UserError(verdict.refusal(stock_hint="for stock vLLM run `vllm serve`"))
    return version  # untested but allowed: the versions self-check line says UNTESTED


def check_plugin(environ=os.environ) -> None:
    """vLLM must be able to find and load Proxima's plugin in the engine process."""
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        raise UserError(f"VLLM_PLUGINS={allowed!r} does not include {PLUGIN_NAME!r}, so vLLM "
                        f"would not load Proxima: add it (VLLM_PLUGINS={allowed},{PLUGIN_NAME}) "
                        f"or unset VLLM_PLUGINS")
    names = {ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
    if PLUGIN_NAME not in names:
        raise UserError(f"Proxima's vLLM plugin (entry point {PLUGIN_GROUP}:{PLUGIN_NAME}) is not "
                        f"installed, so the engine would run without Proxima: reinstall proxima "
                        f"(pip install --no-deps -e . in the checkout)")


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(model))


def check_model(model: str | None) -> None:
    """A local model must be a directory with config.json (or Mistral's params.json), or a
    .gguf file. Anything else that is not on disk is left to vLLM as a Hugging Face id."""
    hint = ("give a model directory (with config.json), a Hugging Face model id, or no MODEL "
            "for the embedded demo model")
    if model is not None and not model.strip():
        raise UserError(f"the model is empty ({model!r}): {hint}")
    if model is None:
        return
    if not _looks_like_path(model):
        if not HF_ID.fullmatch(model):      # vLLM would ask the Hub for it, after start-up
            raise UserError(f"model {model!r} is neither a path here (none exists) nor a "
                            f"Hugging Face model id (NAME or ORG/NAME: letters, digits, "
                            f"- _ .): {hint}")
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise UserError(f"model path {model!r} does not exist: {hint}")
    if path.is_file():
        if path.suffix == ".gguf":
            return
        raise UserError(f"model path {model!r} is a file, not a model directory: {hint}")
    if not (path / "config.json").is_file() and not (path / "params.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:6]
        raise UserError(f"{model!r} is not a model directory: it has no config.json (found: "
                        f"{', '.join(found) or 'nothing'}): {hint}")


def check_block_size(value) -> None:
    if value is None:
        return
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UserError(f"--block-size must be an integer, got {value!r}: use one of "
                        f"{', '.join(map(str, ALLOWED_BLOCK_SIZES))}") from None
    if size not in ALLOWED_BLOCK_SIZES:
        raise UserError(f"--block-size {size} is not supported: use a power of two from "
                        f"{ALLOWED_BLOCK_SIZES[0]} to {ALLOWED_BLOCK_SIZES[-1]} "
                        f"({', '.join(map(str, ALLOWED_BLOCK_SIZES))}); vLLM's CUDA attention "
                        f"kernels need a multiple of 16 tokens per block")


def parse_port(value) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise UserError(f"--port must be an integer, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is out of range: use 1-65535 (0, a random port, is not "
                        f"supported: the self-check and clients need to know it)")
    return port


def check_port(host: str | None, port: int) -> None:
    """Bind and release the address gunicorn will bind, to fail now rather than after loading."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn does
        sock.bind((host, port))
    except socket.gaierror as exc:
        raise UserError(f"--host {host!r} cannot be resolved ({exc.strerror}): give an address "
                        f"of this machine, e.g. 0.0.0.0") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another server is "
                            f"listening there): stop it, or pick another port with --port") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"no permission to listen on port {port}: ports below 1024 need "
                            f"root; pick another port with --port") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host!r} is not an address of this machine: use 0.0.0.0 "
                            f"(all interfaces) or one of its addresses") from None
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    finally:
        sock.close()


@dataclass
class Scanned:
    """The few options the cheap checks need, read from the raw command line."""

    model: str | None = None
    block_size: str | None = None
    host: str | None = None
    port: str | None = None
    uds: str | None = None


_SCANNED = {"--model": "model", "--block-size": "block_size", "--host": "host",
            "--port": "port", "--uds": "uds"}


def scan(argv: list[str]) -> Scanned:
    """Read MODEL (first token, as in ``vllm serve MODEL``) and a few named options.

    Option names are normalised the way vLLM's parser does (``--block_size`` ==
    ``--block-size``). Everything else is left for vLLM's parser.
    """
    found = Scanned()
    if argv and not argv[0].startswith("-"):
        found.model = argv[0]
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            break
        if token.startswith("--"):
            _, has_value, value = token.partition("=")
            name = option_name(token)
            if name in _SCANNED:
                if not has_value:
                    if i + 1 >= len(argv):
                        raise UserError(f"{name} needs a value")
                    value = argv[i + 1]
                    i += 1
                setattr(found, _SCANNED[name], value)
        i += 1
    return found


def validate_environment(environ=os.environ) -> str:
    """Environment and installation checks that need no GPU; returns the vLLM version."""
    activation.check_environment(environ)       # every PROXIMA_* value, as the engine does
    check_allocator_env(environ)
    # the switches agree, with the allocator on as serve runs the engine
    activation.check_combination({**environ, activation.ENV: "1"})
    return check_vllm_installed(environ)


def validate_options(model, block_size, host, port, uds) -> None:
    check_model(model)
    check_block_size(block_size)
    if uds is None:
        check_port(host, parse_port(DEFAULT_PORT if port is None else port))
