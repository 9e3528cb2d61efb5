"""vLLM's own ``vllm serve`` argument parser, and what ``proxima serve`` decides on top of it.

Options pass through exactly as ``vllm serve`` reads them (same parser, same ``--config``
files, same underscore/dash spelling). Building vLLM's parser needs a detected GPU platform, so
``proxima serve`` calls it only after the GPU pre-flight passed.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import logging
from typing import Iterable

from proxima.errors import UserError
from proxima.models import DEMO_SERVED_MODEL_NAME, TINY_LLAMA_DIR
from proxima.serve.argv import given

log = logging.getLogger("proxima.serve")

# The embedded demo: enough KV cache for demos and tests, little GPU memory, no weights.
DEMO_MAX_MODEL_LEN = 2048
DEMO_KV_CACHE_BYTES = 256 * 2**20
DEMO_GPU_MEMORY_UTILIZATION = 0.1
# vLLM 0.6 sizes the cache only by --gpu-memory-utilization or --num-gpu-blocks-override: the
# demo's 16,384 blocks of 16 tokens there too (the same 256 MiB as above for the tiny Llama).
DEMO_V0_NUM_GPU_BLOCKS = 16384


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text.removeprefix("Error: ")


def card_stack() -> bool:
    """vLLM 0.6.3.post1 (V0 engine) is installed: its parser, app and engine client differ."""
    from proxima.serve.preflight import installed_version, is_card_stack

    return is_card_stack(installed_version("vllm"))


def _v0_parser() -> argparse.ArgumentParser:
    """vLLM 0.6.3's ``vllm serve`` parser: make_arg_parser plus the positional model tag that
    its ``vllm/scripts.py`` adds (optional here: no MODEL serves the demo)."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="proxima serve"))
    parser.add_argument("model_tag", type=str, nargs="?", default=None,
                        help="the model to serve (as `vllm serve MODEL`)")
    return parser


def build_parser(own_flags: Iterable[str] = ()) -> argparse.ArgumentParser:
    """vLLM's ``vllm serve`` parser, whose errors are one line (with the closest option
    among its own and ``own_flags``, Proxima's, for an option it does not know)."""
    if card_stack():
        parser = _v0_parser()
        parser.set_defaults(model=None)
        parser.error = functools.partial(_parser_error, parser=parser, own_flags=own_flags)
        return parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from proxima.vllm.vllm_v1_compat import serve_cli_args

    try:
        parser = serve_cli_args().make_arg_parser(FlexibleArgumentParser(prog="proxima serve"))
    except RuntimeError as exc:  # "Failed to infer device type": vLLM found no GPU platform
        raise UserError(f"vLLM cannot start its option parser: {one_line(exc)} — run on a "
                        f"machine with an NVIDIA GPU") from None
    parser.set_defaults(model=None)  # None = no model given: serve the embedded demo
    # one line instead of argparse's usage dump and exit
    parser.error = functools.partial(_parser_error, parser=parser, own_flags=own_flags)
    return parser


def _parser_error(message: str, parser: argparse.ArgumentParser, own_flags: Iterable[str]):
    raise UserError(f"{message}{_closest(message, parser, own_flags)} (the options are those "
                    f"of `vllm serve --help`, and Proxima's in `proxima serve --help`)")


def _closest(message: str, parser: argparse.ArgumentParser, own_flags: Iterable[str]) -> str:
    """"; did you mean --X?" for the first unknown option of an "unrecognized arguments"
    message that is close to a known one, else ""."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return ""
    vllms = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    for token in message[len(prefix):].split():
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        for known in (list(own_flags), vllms):      # Proxima's few first, then vLLM's many
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def parse(argv: list[str], parser: argparse.ArgumentParser | None = None,
          own_flags: Iterable[str] = ()) -> argparse.Namespace:
    """vLLM's options in ``argv``; ``own_flags``: Proxima's, named in an error's hint."""
    from proxima.vllm.vllm_v1_compat import serve_cli_args

    validate_parsed_serve_args = serve_cli_args().validate_parsed_serve_args
    parser = parser or build_parser(own_flags)
    try:
        args = parser.parse_args(list(argv))
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        validate_parsed_serve_args(args)
    except UserError:
        raise
    except (TypeError, ValueError, KeyError, AssertionError, OSError) as exc:
        raise UserError(one_line(exc)) from None
    return args


def check_options_without_gpu(argv: list[str], also: str, own_flags: Iterable[str] = ()) -> None:
    """Raise the UserError of a bad option in ``argv`` on a machine where vLLM finds no GPU.

    vLLM builds its parser only under a detected platform; here its CPU platform stands in.
    Hundreds of vLLM modules bind ``current_platform`` when imported, so after this the
    process must not build an engine: call it only on the way out (the GPU check failed).
    Options that parse are left to the GPU error; anything else going wrong is ignored,
    a ``SystemExit`` included (a vLLM plugin refusing to load under the CPU platform: the
    GPU's refusal is the one to report)."""
    try:
        if not card_stack():           # vLLM 0.6 builds its parser on any machine
            import vllm.platforms as platforms
            from vllm.platforms.cpu import CpuPlatform

            platforms._current_platform = CpuPlatform()
        parse(argv, own_flags=own_flags)
    except UserError as exc:
        raise UserError(f"{exc}; the {also}") from None
    except (Exception, SystemExit):  # noqa: BLE001 - the GPU error is the one to report then
        return


def elastic_executor_hint(args: argparse.Namespace, argv: list[str]) -> str | None:
    """With ``--elastic`` on one GPU: a line advising vLLM's ``mp`` executor when the user
    chose none (vLLM's default there, ``uni``, runs the worker on the scheduler's thread, so
    elastic mode's scheduler work lengthens every step; with ``mp`` the worker has a
    process of its own and that work overlaps it: docs/benchmarks.md section 7.3, session
    19). None where nothing is to be said."""
    if given(argv, "--distributed-executor-backend"):
        return None
    gpus = (getattr(args, "tensor_parallel_size", 1) or 1) * \
        (getattr(args, "pipeline_parallel_size", 1) or 1)
    if gpus > 1:
        return None                     # vLLM picks mp itself for more than one GPU
    return ("--elastic on one GPU: add --distributed-executor-backend mp. Under a steady load "
            "on an H200 elastic mode ran at 0.95-0.97x of stock with vLLM's default executor "
            "(uni) and 0.997x with mp, both engines on the same executor (docs/benchmarks.md 7.3)")


def check_supported(args: argparse.Namespace) -> None:
    """Modes of ``vllm serve`` that do not fit one engine behind one gunicorn worker."""
    if getattr(args, "headless", False):
        raise UserError("--headless runs an engine without an API server: use `vllm serve "
                        "--headless` for that; proxima serve always serves HTTP")
    if getattr(args, "grpc", False):
        raise UserError("--grpc is not supported by proxima serve (HTTP only): drop --grpc")
    if getattr(args, "api_server_count", None) not in (None, 1):
        raise UserError(f"--api-server-count {args.api_server_count}: proxima serve runs exactly "
                        f"one API server process (the gunicorn worker) per engine: drop it")
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        raise UserError(f"--data-parallel-size {args.data_parallel_size}: proxima serve runs one "
                        f"engine; run one proxima serve per data-parallel rank instead (own "
                        f"--port, own GPUs via CUDA_VISIBLE_DEVICES)")


def apply_demo_defaults(args: argparse.Namespace, argv: list[str]) -> bool:
    """No MODEL: serve the embedded random-weights demo. Options the user gave are kept."""
    if args.model is not None:
        return False
    args.model = str(TINY_LLAMA_DIR)
    if not given(argv, "--load-format"):
        args.load_format = "dummy"
    if not args.served_model_name:
        args.served_model_name = [DEMO_SERVED_MODEL_NAME]
    if args.max_model_len is None:
        args.max_model_len = DEMO_MAX_MODEL_LEN
    if not given(argv, "--gpu-memory-utilization"):
        args.gpu_memory_utilization = DEMO_GPU_MEMORY_UTILIZATION
        if not hasattr(args, "kv_cache_memory_bytes"):  # vLLM 0.6 has no such option
            if getattr(args, "num_gpu_blocks_override", None) is None:
                args.num_gpu_blocks_override = DEMO_V0_NUM_GPU_BLOCKS
        elif args.kv_cache_memory_bytes is None:
            args.kv_cache_memory_bytes = DEMO_KV_CACHE_BYTES
    return True


def engine_config(args: argparse.Namespace):
    """vLLM's VllmConfig for these options, built where ``vllm serve`` builds it: in the API
    server process, before any engine starts. Errors become one line."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        if card_stack():  # vLLM 0.6's create_engine_config takes no usage context
            return engine_args.create_engine_config()
        from vllm.usage.usage_lib import UsageContext

        return engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    except Exception as exc:
        raise UserError(f"vLLM rejected the configuration ({type(exc).__name__}): "
                        f"{one_line(exc)}") from None
