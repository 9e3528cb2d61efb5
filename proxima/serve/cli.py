"""``proxima serve [MODEL] [vllm serve options ...]``: vLLM's OpenAI server with Proxima on.

Order of work, cheapest first, so bad input fails in seconds with one line:
environment and install -> options on the raw command line (model path, block size, port)
-> GPU pre-flight (a child process) -> vLLM's own parser and engine config -> gunicorn.
Where the pre-flight finds no GPU, vLLM's parser still reads the options (under its CPU
platform, just before exiting), so that a bad option is reported, not only the GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from proxima.vllm.status import STATS_ENV
from proxima.errors import UserError
from proxima.models import DEMO_SERVED_MODEL_NAME
from proxima.serve import logs, validate
from proxima.serve.serve_flags import take_elastic_options

HELP = f"""\
usage: proxima serve [MODEL] [vllm serve options ...]
       proxima serve --model 'NAME=PATH [options]' [--model ...] [--models FILE]
                     [--host H] [--port P] [--compaction] [--gpu-memory-bytes SIZE]
                     [options for every model]

Serve vLLM's OpenAI-compatible API (same routes, same options as `vllm serve`; see
`vllm serve --help`) with Proxima's block allocator on (PROXIMA_ALLOCATOR=1 is set for the
engine), under gunicorn: one worker, restarted when its engine dies.

MODEL   a model directory (with config.json), a Hugging Face id, or nothing: then the
        embedded demo model is served as {DEMO_SERVED_MODEL_NAME!r} (a tiny Llama with
        RANDOM weights: its text is noise; for checking a machine, not for answers).

Before serving, a self-check runs (gpu, cuda, versions, engine, proxima-active,
allocator-invariants, canary); any failure stops the server with a non-zero exit.

Endpoints added: GET /proxima/selfcheck (the report as JSON). GET /health answers 503 until the
self-check passed and while the engine is down. Proxima's metrics (proxima_*) are on /metrics.

Elastic KV memory (vLLM 0.26.0): the KV pool is reserved at its maximum but backed by GPU
memory only as the load needs it, and unused memory is given back (another engine or job on
the GPU can take it). Proxima's options, taken out before vLLM sees the command line:
  --elastic               switch it on (sets PROXIMA_ELASTIC=1; default: off)
  --compaction            KV compaction too (sets PROXIMA_COMPACTION=1; needs --elastic;
                          default: off)
  --kv-min SIZE           least KV memory kept mapped (default 512MiB, less on a GPU
                          that has no more room)
  --kv-max SIZE           most KV memory mapped (default: the GPU's memory less this
                          model's weights and activations and the other engines' (on
                          the GPU's ledger) weights and minimums; at most what
                          --max-num-seqs sequences of --max-model-len tokens could use)
  --idle-release SECONDS  after this long with no request, give back ALL the KV memory
                          (the minimum too), regrown on the next request (default: never)
  --sleep-mode            start vLLM's sleep mode too (--enable-sleep-mode; needs
                          --idle-release): POST /proxima/sleep puts the weights in host
                          memory once the KV is given back, POST /proxima/wake_up brings
                          them back (default: off; with several models: --sleep-after)
  --gpu-memory-bytes SIZE size for a GPU of this many bytes (default: the GPU's memory):
                          leave the rest to other processes, or plan a fit on any machine
  --elastic-options K=V,...  any other option of proxima.vllm.elastic_v1.ElasticOptions
                          (release_delay_s=10, headroom=0.1, eviction=auto, policy=auto, ...;
                          finite numbers: headroom, band 0 to 100; gpu_free_low 0 to 1;
                          release_delay_s, retry_s, retry_max_s, cache_hold_s 0 to 86400
                          seconds; idle_sleep_s 0 to 1)
No sizing flag is needed: with --elastic the KV pool is reserved (virtual addresses) at
what the GPU could hold beside the weights (weights estimated from config.json as parameters
x dtype bytes, plus 2 GiB and 5% for activations and CUDA graphs), and
--gpu-memory-utilization is set to the share the engine needs at start-up (vLLM checks that
it is free); one log line says the sizes chosen ("elastic sizing: ..."). When the GPU's
free memory is short at start, the other Proxima engines on it are asked through the
ledger to give back what they hold above their minimums (up to 60 s). Given
--kv-cache-memory-bytes / --gpu-memory-utilization / --kv-min / --kv-max are kept.
On one GPU, --elastic runs vLLM's mp executor unless --distributed-executor-backend is
given: with vLLM's default there (uni) the model's worker runs on the scheduler's thread and
elastic mode's bookkeeping lengthens every step (0.95-0.97x of stock under a steady load on
an H200; 0.997x with mp).
SIZE: bytes, or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB
(powers of 1000), any case (gib = GiB); a bare K, M, G, T is refused (write GiB or GB); from 0
to 1024TiB (e.g. 8GiB, 512MiB). Read or change the bounds at run time: GET/POST /proxima/kv,
or `proxima kv --url URL --max SIZE`; every engine on the GPU: `proxima kv [--watch]`.

Several models, one endpoint: every --model 'NAME=PATH [options]' (one quoted argument)
or [[models]] table of --models FILE (TOML, or JSON; fields name, path, args, kv_min, kv_max,
idle_release, sleep_after, port; at the top host, port, compaction, args, gpu_memory_bytes) gets its
own supervised engine (`proxima serve PATH --elastic` on 127.0.0.1, on a free port unless
given one, restarted with backoff when it dies), and one OpenAI endpoint on --host/--port
(default: 0.0.0.0, port 8000) routes by the request's "model": /v1/models lists every
model, /health is 200 only when every engine is ready,
/metrics carries every engine's series labelled model="NAME", an unknown model is a 404, a
model whose engine is (re)starting a 503; /engines/NAME/... reaches one engine (e.g.
proxima kv --url http://HOST:PORT/engines/NAME). Options outside --model go to every engine.
Each engine is sized as above, counting the engines started before it (they start one
after another); models that cannot fit together even at their minimums (weights from each
config.json, plus activations and --kv-min) are refused before any starts (with
--gpu-memory-bytes, before the GPU is probed). Per model: idle_release in the file, or
--idle-release inside --model; sleep_after in the file, or --sleep-after SECONDS inside
--model (default: never): after that long without a request the model's weights go to
host memory (its KV given back first: it implies --idle-release, at most SECONDS); its
next request wakes it (a slower first token; 503 with Retry-After if the wake fails).
`proxima serve MODEL [options] --sleep-after SECONDS` is the endpoint of that one model, named
as vllm serve names it (MODEL, or the one --served-model-name).
With models that may sleep, more models than fit at once are served: only those that never
sleep plus the largest that may must fit; the least recently used idle one sleeps to make
room for a model that starts or wakes.
See docs/operations.md, "Several models behind one endpoint".

Environment: PROXIMA_ALLOCATOR (unset or 1), PROXIMA_ELASTIC, PROXIMA_ELASTIC_OPTIONS (the
same options as key=value,...), PROXIMA_STATS_FILE (where the engine writes its status;
default: a temporary file), VLLM_* as for vLLM.
"""

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every token after ``serve`` goes to vLLM's parser untouched (argparse would reject
    options it does not know, and vLLM's parser can only be built on a GPU machine)."""
    parser.usage = "proxima serve [MODEL] [vllm serve options ...]"
    parser.add_argument("serve_argv", nargs="*", metavar="...",
                        help="MODEL and `vllm serve` options")
    parse_defaults = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, _ = parse_defaults([], namespace)  # the subcommand's defaults (its runner)
        namespace.serve_argv = list(args or [])
        return namespace, []

    parser.parse_known_args = parse_known_args


def run(args: argparse.Namespace) -> int:
    argv = list(args.serve_argv)
    if any(token in ("-h", "--help") or token.startswith("--help=") for token in argv):
        print(HELP)
        return 0
    from proxima.serve import multi_config, serve_flags

    endpoint = argv if multi_config.wants_multi(argv) else multi_config.one_model_endpoint(argv)
    if endpoint is not None:
        from proxima.serve import multi

        return multi.run(endpoint)
    log = logs.setup()

    from proxima.serve import autosize

    argv, compaction = serve_flags.take_compaction(argv)
    argv, gpu_bytes = autosize.take_gpu_bytes(argv)
    argv, elastic = take_elastic_options(argv)
    if gpu_bytes is not None and elastic is None:
        raise UserError(f"{autosize.GPU_BYTES_FLAG} sizes elastic engines: add --elastic")
    serve_flags.apply_compaction(compaction, elastic is not None)
    if elastic is not None:
        import json

        from proxima.vllm import activation

        os.environ[activation.ELASTIC_ENV] = "1"
        serve_flags.check_bare_sleep_mode(argv, elastic)
        if elastic.get("sleep_mode") and "--enable-sleep-mode" not in argv:
            argv.append("--enable-sleep-mode")      # vLLM's, coordinated by Proxima
        if elastic:
            os.environ[activation.ELASTIC_OPTIONS_ENV] = json.dumps(elastic)
        log.info("elastic KV memory on%s", f": {elastic}" if elastic else "")
    validate.validate_environment()
    # Proxima is on for every process this one starts or imports vLLM in, from here: vLLM
    # loads its general plugins (Proxima's checks PROXIMA_ELASTIC against it) as soon as its
    # parser is built, and that happens on the no-GPU path below too.
    os.environ["PROXIMA_ALLOCATOR"] = "1"
    scanned = validate.scan(argv)
    validate.validate_options(scanned.model, scanned.block_size, scanned.host, scanned.port,
                              scanned.uds)
    if gpu_bytes is not None:
        autosize.check_alone(scanned.model, argv, elastic, gpu_bytes)

    from proxima.serve import gpuprobe
    from proxima.serve.preflight import run_preflight

    log.info("pre-flight: probing the GPU in a child process")
    facts = gpuprobe.probe()
    checks = run_preflight(facts)
    preflight_time = time.time()
    for check in checks:
        log.info("self-check %s", check.line())
    first = next((c for c in checks if c.failed), None)
    if first is not None:
        if first.name in ("gpu", "cuda"):
            # vLLM's parser needs a GPU platform: a bad option would otherwise hide behind
            # the missing GPU. Checked on the way out only (see vllm_args).
            from proxima.serve import vllm_args

            vllm_args.check_options_without_gpu(argv, f"{first.name} self-check failed too "
                                                        f"(see above)", multi_config.OWN_FLAGS)
        raise UserError(f"self-check failed, not serving: {first.line()}")
    validate.check_plugin()

    from proxima.serve import vllm_args

    if vllm_args.card_stack():
        # vLLM 0.6.3 (V0): `vllm serve` has no env set-up step; its API server spawns the
        # engine process itself (MQLLMEngine), and the engine's workers use spawn, as here.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    else:
        from proxima.vllm.vllm_v1_compat import cli_env_setup

        cli_env_setup()  # what `vllm serve` does: spawn, not fork, for engine processes
    if elastic is not None:
        if vllm_args.card_stack():
            raise UserError("--elastic needs vLLM's V1 engine (vLLM 0.26.0); this is the card "
                            "stack's vLLM 0.6: drop --elastic")
        from proxima.vllm import elastic_v1

        reason = elastic_v1.unsupported_reason()
        if reason:
            raise UserError(f"--elastic: {reason}")
        if elastic.get("sleep_mode"):
            from proxima.vllm.activation import installed_version

            serve_flags.check_sleep_mode_vllm(installed_version("vllm"))
    vargs = vllm_args.parse(argv, own_flags=multi_config.OWN_FLAGS)
    vllm_args.check_supported(vargs)
    chosen = serve_flags.default_executor(vargs, argv) if elastic is not None else None
    if chosen:
        log.info(chosen)
    demo = vllm_args.apply_demo_defaults(vargs, argv)
    validate.validate_options(None if demo else vargs.model, vargs.block_size, vargs.host,
                              vargs.port, getattr(vargs, "uds", None))  # vLLM 0.6: no --uds
    if elastic is not None:
        size_elastic(vargs, argv, elastic, facts, gpu_bytes, demo)
    if demo:
        log.warning("no MODEL given: serving the embedded demo model as %r: a tiny Llama with "
                    "RANDOM weights (load_format=dummy); its output is noise. Pass a MODEL to "
                    "serve a real one.", vargs.served_model_name[0])
    if importlib.util.find_spec("flashinfer") is None and \
            "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # vLLM's sampler needs it otherwise
        log.info("flashinfer is not installed: VLLM_USE_FLASHINFER_SAMPLER=0")

    rundir = Path(tempfile.mkdtemp(prefix="proxima-serve-"))
    owner = os.getpid()
    try:
        if not os.environ.get(STATS_ENV):
            os.environ[STATS_ENV] = str(rundir / "engine-status.json")
        log.info("engine status file: %s", os.environ[STATS_ENV])
        vllm_config = vllm_args.engine_config(vargs)
        return _run_gunicorn(vargs, vllm_config, checks, preflight_time, rundir / "failure.txt")
    finally:
        # gunicorn forks its workers from inside _run_gunicorn: a worker's exit unwinds this
        # same stack in the worker process, and must not delete what the arbiter still uses.
        if os.getpid() == owner:
            shutil.rmtree(rundir, ignore_errors=True)


def size_elastic(vargs, argv: list[str], elastic: dict, facts: dict,
                 gpu_bytes: int | None = None, demo: bool = False):
    """Size the elastic engine of ``vargs`` (:func:`proxima.serve.autosize.apply`) and put
    its elastic options, the sizing's among them, in ``PROXIMA_ELASTIC_OPTIONS``: vLLM's
    engine config, built next, gives them to the connector. Returns the sizing (None: the
    GPU's size is not known)."""
    import json

    from proxima.serve import autosize
    from proxima.vllm import activation

    sized = autosize.apply(vargs, argv, elastic, facts, gpu_bytes, demo)
    if sized is not None:
        logs.setup().info(sized.line())
    os.environ[activation.ELASTIC_OPTIONS_ENV] = json.dumps(elastic)
    return sized


def _run_gunicorn(vargs, vllm_config, checks, preflight_time, failure_file: Path) -> int:
    from proxima.serve.gunicorn_conf import ProximaApplication

    application = ProximaApplication(vargs, vllm_config=vllm_config, preflight=checks,
                                     preflight_time=preflight_time, failure_file=failure_file)
    arbiter_pid = os.getpid()
    try:
        application.run()
        code = 0
    except SystemExit as exc:
        if os.getpid() != arbiter_pid:
            raise  # a forked worker leaving through the arbiter's stack: its exit code is its own
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code == 0:
        return 0
    reason = failure_file.read_text().strip() if failure_file.is_file() else ""
    print(f"proxima serve: error: {reason or f'the server stopped with exit code {code} (see the log above)'}",
          file=sys.stderr)
    return 1
