"""Run ``proxima serve``'s gunicorn stage on a CPU machine (test helper, not a test).

    python tests/serve/boot_gunicorn.py PORT FAILURE_FILE

Parses options with vLLM's parser (CPU platform for the parser only), then runs the real
gunicorn arbiter with Proxima's worker; the worker's own pre-flight finds no GPU.
"""

import sys
from pathlib import Path

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

from proxima.serve import logs, vllm_args
from proxima.serve.cli import _run_gunicorn

port, failure_file = sys.argv[1], Path(sys.argv[2])
platforms._current_platform = CpuPlatform()
parser = vllm_args.build_parser()
platforms._current_platform = None
args = vllm_args.parse(["--host", "127.0.0.1", "--port", port], parser)
logs.setup()
sys.exit(_run_gunicorn(args, None, None, 0.0, failure_file))
