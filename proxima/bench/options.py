"""`proxima bench`'s flags: ``add_arguments`` (the --help text: the table, the exit
status, vllm bench serve's spellings), :func:`resolve_aliases`, which turns vllm bench
serve's flag names into proxima bench's own (a one-line error where it cannot), and the
flags that only apply to one mode. The checks of each mode's values and the runs are
:mod:`proxima.bench.cli`'s.
"""

from __future__ import annotations

import argparse
import math

from proxima.bench.offline import ARRIVALS, MAX_SEED_OFFLINE
from proxima.config import MAX_DELAY_S, MAX_REPEAT
from proxima.errors import UserError
from proxima.workloads import MAX_MODEL_LEN, MAX_REQUESTS, WORKLOADS

# Bounds of the online flags (checked before any load is sent; shown in --help).
MAX_RATE = 1_000_000.0          #: --request-rate, requests/s
MAX_ARRIVAL_SPAN_S = MAX_DELAY_S  #: --requests / --request-rate: the arrivals span a day at most
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.01, float(MAX_DELAY_S)   #: --timeout, seconds
DEFAULT_TIMEOUT_S = 600.0

ONLINE_ONLY = ("base_url", "label", "concurrency", "request_rate", "endpoint", "timeout",
               "save_result", "result_filename", "result_dir")
OFFLINE_ONLY = ("load_format", "kv_cache_memory_bytes", "check_outputs",
                "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "arrivals",
                "elastic", "elastic_options")


ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# `vllm bench serve`'s datasets that proxima bench does not generate (it builds its own,
# seeded, and never downloads one).
VLLM_DATASETS = ("burstgpt", "sonnet", "random", "random-mm", "random-rerank", "hf", "custom",
                 "custom_audio", "prefix_repetition", "spec_bench", "timed_trace")

TABLE = """\
the table (one column per server or allocator, then each one's ratio to the first):
  online:  requests/s, output and total (prompt + output) tokens/s over the wall time of
           the run; TTFT (time to first token), ITL (gap between tokens), E2E (whole
           request) percentiles in ms over the completed requests; completed, errors
           (failed or cut streams: left out of every figure above), short outputs
           (completed with fewer tokens than asked), preemptions (the server's counter)
  offline: per allocator, medians over the runs: elapsed s, requests/s, tokens/s with
           the min-max and spread % of the runs, preemptions, KV-cache blocks, blocks
           per run (KV blocks per contiguous run of block ids: 1.0 = scattered, higher
           = more contiguous), largest free run of the pool, short outputs, Proxima active
  --repeat K > 1 (online) adds the rounds and their min/max/spread rows.

exit status:
  0    every request of every run completed: the figures stand
  1    the report is printed (and written) but is NOT trustworthy: a request failed or
       its stream was cut before [DONE] (a server that died), a server completed no
       request, --check-outputs found differing tokens, or the Proxima runs did not
       report Proxima active (offline: or the stock runs did)
  2    bad input or environment (one line), nothing measured
  130  interrupted (Ctrl-C, SIGINT), 143 terminated (SIGTERM): with --json, what was
       measured so far is kept ("partial": true: the runs or rounds finished); online
       with --repeat K, the finished rounds' table is printed (and --plot written) too

vllm bench serve's flag names work too: --num-prompts N (= --requests), --max-concurrency C
(= --concurrency; with --request-rate it caps the requests in flight), --request-rate inf
(no rate, as without it), --dataset-name W (one of the workloads above), --save-result
[--result-filename F] [--result-dir D] (= --json), --disable-tqdm, --endpoint PATH.

online:  proxima bench --base-url http://127.0.0.1:8000 --label stock \\
           --base-url http://127.0.0.1:8001 --label proxima --workload chat
offline: proxima bench --offline --model CONFIG_DIR --load-format dummy \\
           --workload pressure --kv-cache-memory-bytes 4026531840 --repeat 3 --check-outputs"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = TABLE
    src = parser.add_argument_group("requests (shared with `proxima replay`)")
    which = src.add_mutually_exclusive_group()
    which.add_argument("--workload", choices=WORKLOADS, default=None,
                       help="synthetic workload (default: chat)")
    which.add_argument("--dataset-name", metavar="W", default=None,
                       help="vllm bench serve's name for --workload (default: chat)")
    which.add_argument("--trace", metavar="FILE",
                       help="JSON Lines trace (see proxima.workloads; default: none)")
    src.add_argument("--requests", "-n", "--num-prompts", dest="requests", type=int, metavar="N",
                     help=f"number of requests (default: the workload's: chat 100, sharegpt "
                          f"1000, multiturn 400, pressure 500, bursts 800; with --trace: all its lines; "
                          f"at most {MAX_REQUESTS:,})")
    src.add_argument("--seed", type=int, default=0,
                     help=f"seed of prompts and arrivals (offline: also vLLM's, from 0 to "
                          f"{MAX_SEED_OFFLINE:,})")
    src.add_argument("--max-model-len", type=int, metavar="TOKENS",
                     help=f"longest prompt+output the workload may build (default 8192; at "
                          f"most {MAX_MODEL_LEN:,}); offline: also passed to LLM")
    src.add_argument("--model", default=None,
                     help="online: the served model name (default: the first server's first "
                          "model, as vllm bench serve does); offline: a model path or config "
                          "dir (required)")

    on = parser.add_argument_group("online mode (OpenAI-compatible servers)")
    on.add_argument("--base-url", action="append", metavar="URL",
                    help="server to load, e.g. http://127.0.0.1:8000; give twice to compare "
                         "(the first is the baseline of the ratio; required online)")
    on.add_argument("--label", action="append", metavar="NAME",
                    help="name of each --base-url in the report, in the same order "
                         "(default: A, B, ...)")
    on.add_argument("--concurrency", "-c", "--max-concurrency", dest="concurrency", type=int,
                    metavar="C",
                    help=f"at most C requests in flight: a closed loop, or with --request-rate "
                         f"a cap; 1 to {MAX_REQUESTS:,} (default: the workload's, else all at "
                         f"once)")
    on.add_argument("--request-rate", type=float, metavar="R",
                    help=f"open loop: Poisson arrivals at R requests/s, seeded; inf = no rate, "
                         f"as without it; above 0 to {MAX_RATE:,.0f}, and at least requests / "
                         f"{MAX_ARRIVAL_SPAN_S:,} (the arrivals span a day at most) (default: "
                         f"closed loop)")
    on.add_argument("--endpoint", metavar="E",
                    help="completions (prompt as token ids; default) or chat (prompt as text); "
                         "or vllm bench serve's /v1/completions, /v1/chat/completions")
    on.add_argument("--timeout", type=float, metavar="S",
                    help=f"per-request timeout in seconds, {MIN_TIMEOUT_S:g} to "
                         f"{MAX_TIMEOUT_S:,.0f} (a day) (default {DEFAULT_TIMEOUT_S:g})")

    off = parser.add_argument_group("offline mode (vLLM LLM in this process, stock vs Proxima)")
    off.add_argument("--offline", action="store_true",
                     help="run vLLM in-process instead (needs a GPU; default: online)")
    off.add_argument("--load-format", help="e.g. dummy: random weights, config.json only "
                                           "(default: vLLM's, auto)")
    off.add_argument("--kv-cache-memory-bytes", metavar="SIZE",
                     help="fix the KV cache size, e.g. to force preemption: bytes, or KiB MiB "
                          "GiB TiB / KB MB GB TB, any case, not a bare G (default: vLLM "
                          "sizes it from --gpu-memory-utilization)")
    off.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                     help="share of GPU memory for vLLM (default: vLLM's, 0.9)")
    off.add_argument("--tensor-parallel-size", type=int, metavar="TP", help="GPUs (default 1)")
    off.add_argument("--enforce-eager", action="store_true", default=None,
                     help="no torch.compile / CUDA graphs (default: off)")
    off.add_argument("--elastic", action="store_true", default=None,
                     help="the Proxima runs with elastic KV memory (vLLM 0.26: PROXIMA_ELASTIC=1, "
                          "Proxima's connector; stock runs unchanged) (default: off)")
    off.add_argument("--elastic-options", metavar="K=V,...",
                     help="with --elastic: elastic KV options, e.g. min_bytes=2GiB,"
                          "release_delay_s=5 (sizes: bytes or KiB MiB GiB TiB, KB MB GB TB; "
                          "see proxima serve --help; default: none)")
    off.add_argument("--check-outputs", action="store_true", default=None,
                     help="compare generated token ids of every run with the first stock run "
                          "(default: off)")
    off.add_argument("--arrivals", choices=ARRIVALS, default=None, help=(
        "held (default): vLLM's scheduler is paused while generate() queues the requests, so "
        "the engine's first step sees all of them in every run; as-sent: the engine starts "
        "on the first request to arrive, as a plain LLM.generate does (how many the first "
        "steps see then depends on timing, and with it the preemption count)"))

    parser.add_argument("--repeat", type=int, metavar="K", help=(
        f"offline: run each allocator K times, alternating; online: K rounds over all "
        f"servers, round r with seed + r - 1, every other round in reverse server order; "
        f"medians and the run-to-run spread are reported; 1 to {MAX_REPEAT:,} (default 1)"))

    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="write the results as JSON (default: none)")
    out.add_argument("--save-result", action="store_true",
                     help="vllm bench serve's way to write the JSON: to --result-filename, "
                          "else proxima-{rate}qps[-concurrency{C}]-{model}-{date}.json, in "
                          "--result-dir (default: off)")
    out.add_argument("--result-filename", metavar="NAME", help="with --save-result (default: "
                                                                "the name above)")
    out.add_argument("--result-dir", metavar="DIR", help="with --save-result (default: the "
                                                         "current directory)")
    out.add_argument("--plot", metavar="PATH.png", help="write a PNG (needs matplotlib; "
                                                        "default: none)")
    out.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                     help="no progress bar (default: a bar per server on stderr)")


def resolve_aliases(args) -> None:
    """vllm bench serve's spellings -> proxima bench's own (one-line errors otherwise)."""
    if args.trace is not None and not args.trace.strip():
        raise UserError(f"--trace needs a file name, got {args.trace!r}")
    for flag, value in (("--result-filename", getattr(args, "result_filename", None)),
                        ("--result-dir", getattr(args, "result_dir", None))):
        if value is not None and not value.strip():
            raise UserError(f"{flag} needs a name, got {value!r}")
    if args.dataset_name is not None:
        name = args.dataset_name
        if name in WORKLOADS:
            args.workload = name
        elif name in VLLM_DATASETS:
            raise UserError(f"--dataset-name {name}: proxima bench does not build vLLM's "
                            f"{name!r} dataset; it generates {', '.join(WORKLOADS)} (seeded, "
                            f"nothing downloaded) or reads --trace FILE (JSON Lines of "
                            f"prompt_len/output_len)")
        else:
            raise UserError(f"--dataset-name {name!r} is not a workload: choose one of "
                            f"{', '.join(WORKLOADS)}, or pass --trace FILE")
    if args.endpoint is not None:
        endpoint = ENDPOINT_PATHS.get(args.endpoint.rstrip("/"), args.endpoint)
        if endpoint not in ("completions", "chat"):
            raise UserError(f"--endpoint must be completions or chat (or /v1/completions, "
                            f"/v1/chat/completions), got {args.endpoint!r}")
        args.endpoint = endpoint
    if args.request_rate is not None and math.isinf(args.request_rate) and args.request_rate > 0:
        args.request_rate = None        # vllm bench serve's default: no pacing
    if (args.result_filename or args.result_dir) and not args.save_result:
        raise UserError("--result-filename / --result-dir only apply with --save-result "
                        "(as in vllm bench serve); or use --json PATH")
    if args.save_result and args.json:
        raise UserError("give --json PATH or --save-result, not both (they write the same file)")


def given(args, names) -> list[str]:
    """The flags among ``names`` (args attribute names) that were given, as spelt."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) not in (None, False)]


def check_repeat(repeat: int | None) -> int:
    """--repeat (default 1), from 1 to MAX_REPEAT."""
    repeat = 1 if repeat is None else repeat
    if not 1 <= repeat <= MAX_REPEAT:
        raise UserError(f"--repeat must be from 1 to {MAX_REPEAT:,}, got {repeat}")
    return repeat


def check_online_numbers(args) -> tuple[float, int]:
    """--concurrency, --request-rate, --timeout, --repeat within their bounds (one line
    each: the flag, the bounds, the value); returns (timeout, repeat)."""
    if args.concurrency is not None and not 1 <= args.concurrency <= MAX_REQUESTS:
        raise UserError(f"--concurrency must be from 1 to {MAX_REQUESTS:,} (requests in "
                        f"flight), got {args.concurrency}")
    if args.request_rate is not None and not (0 < args.request_rate <= MAX_RATE):
        raise UserError(f"--request-rate must be above 0 and at most {MAX_RATE:,.0f} "
                        f"requests/s (or inf: no rate), got {args.request_rate:g}")
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    if not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:     # False for nan
        raise UserError(f"--timeout must be from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:,.0f} "
                        f"seconds (a day), got {args.timeout:g}")
    return timeout, check_repeat(args.repeat)


def check_arrival_span(rate: float | None, requests: int) -> None:
    """With --request-rate R, N requests arrive over about N / R seconds: at most a day."""
    if rate is None or requests / rate <= MAX_ARRIVAL_SPAN_S:
        return
    raise UserError(f"--request-rate {rate:g} spreads {requests:,} requests over about "
                    f"{requests / rate:,.0f} s (requests / rate), above the bound of "
                    f"{MAX_ARRIVAL_SPAN_S:,} s (a day): give --request-rate "
                    f"{_rounded_up(requests / MAX_ARRIVAL_SPAN_S)} or more (or inf: no rate), "
                    f"or fewer --requests")


def _rounded_up(x: float) -> str:
    """``x`` > 0 in 3 significant digits, never below ``x`` (a bound to give back)."""
    text = f"{x:.3g}"
    if float(text) < x:
        digits = 2 - math.floor(math.log10(x))
        text = f"{math.ceil(x * 10**digits) / 10**digits:.3g}"
    return text
