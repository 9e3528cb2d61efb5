"""`proxima bench`: each mode's checks, its runs and its report (the flags:
:mod:`proxima.bench.options`).

Every check on the arguments happens before any load is sent or engine built, and ends
in a UserError (one line, exit 2). The exit status of a finished run says whether its
figures can be trusted (the rule is in --help, :data:`proxima.bench.options.TABLE`, and in
docs/operations.md): 0 when every request of every run completed; 1 when the report is
printed (and written) but is not trustworthy: a request failed or its stream was cut, a
server completed nothing, ``--check-outputs`` found differing outputs, or the Proxima runs
did not report Proxima active. Online mode also takes the flag names of ``vllm bench
serve`` (:func:`proxima.bench.options.resolve_aliases`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import proxima
from proxima.bench import report as report_mod
from proxima.bench.options import OFFLINE_ONLY, ONLINE_ONLY, check_arrival_span, \
    check_online_numbers, check_repeat, given, resolve_aliases
from proxima.bench.options import add_arguments  # noqa: F401 - the command's flags (proxima.cli)
from proxima.bench.stats import ratios
from proxima.errors import UserError
from proxima.interrupts import describe
from proxima.ioutil import check_distinct_paths, logs_to_stderr, print_table
from proxima.workloads import RequestSpec, Workload, check_sizes, load_trace, make_workload


def _save_result_path(args, model: str, concurrency: int | None) -> str:
    """Where --save-result writes, named as vllm bench serve names it."""
    if args.result_filename:
        name = args.result_filename
    else:
        rate = "inf" if args.request_rate is None else f"{args.request_rate:g}"
        conc = f"-concurrency{concurrency}" if concurrency is not None else ""
        base = model.rstrip("/").split("/")[-1] or "model"
        name = f"proxima-{rate}qps{conc}-{base}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if args.result_dir:
        try:
            os.makedirs(args.result_dir, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--result-dir {args.result_dir}: cannot create it "
                            f"({exc.strerror or exc})") from None
        name = os.path.join(args.result_dir, name)
    return name


def request_list(args, seed: int | None = None) -> tuple[Workload, list[RequestSpec]]:
    """The workload and its requests in dispatch order (``seed``: default ``--seed``).

    Requests are sent in ``arrival_step`` order (stable), so later turns of a conversation
    follow earlier ones; beyond that order, pacing comes from the concurrency or rate
    (online) or from vLLM's scheduler (offline, all submitted at once)."""
    check_sizes(args.requests, args.max_model_len)
    seed = args.seed if seed is None else seed
    max_len = args.max_model_len or 8192
    if args.trace:
        workload = load_trace(args.trace, seed=seed, max_model_len=max_len, limit=args.requests)
        specs = workload.requests
    else:
        workload = make_workload(args.workload or "chat", args.requests, seed=seed,
                                 max_model_len=max_len)
        specs = workload.requests
    return workload, sorted(specs, key=lambda s: s.arrival_step)


MAX_LABEL = 40     #: --label's longest name (a column heading)


def _targets(args):
    from proxima.bench.online import Target, normalize_base_url
    urls = [normalize_base_url(u) for u in args.base_url]
    labels = args.label
    if labels is None:
        labels = ["A", "B", "C", "D"][: len(urls)] if len(urls) <= 4 else \
            [f"S{i + 1}" for i in range(len(urls))]
    if len(labels) != len(urls):
        raise UserError(f"got {len(labels)} --label for {len(urls)} --base-url: give one "
                        f"label per server, in the same order")
    for label in labels:
        if not label.strip():
            raise UserError(f"--label needs a name, got {label!r}: it names its server in the "
                            f"table and the JSON")
        if not label.isprintable() or len(label) > MAX_LABEL:     # a column heading
            raise UserError(f"--label {label[:MAX_LABEL]!r}{'...' if len(label) > MAX_LABEL else ''}"
                            f": give a name of at most {MAX_LABEL} printable characters "
                            f"(no newline or tab: it heads a column of the table)")
    if len(set(labels)) != len(labels):
        raise UserError(f"--label values must differ, got {', '.join(labels)}")
    return [Target(label, url) for label, url in zip(labels, urls)]


def environment(offline: bool) -> dict:
    """Where the numbers came from: versions, commit, host (best effort, never fails)."""
    env = {"proxima": proxima.__version__, "python": platform.python_version(),
           "host": platform.node(), "commit": None, "dirty": None}
    root = Path(proxima.__file__).resolve().parent.parent
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                       text=True, timeout=5).stdout.strip() or None
        if env["commit"]:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=root, capture_output=True, text=True, timeout=5)
            env["dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    if offline:
        for name in ("vllm", "torch"):
            module = sys.modules.get(name)
            env[name] = getattr(module, "__version__", None)
        torch = sys.modules.get("torch")
        try:  # after all runs: initialising CUDA here can no longer harm a forked engine
            env["gpu"] = torch.cuda.get_device_name(0) if torch and torch.cuda.is_available() else None
            env["gpu_count"] = torch.cuda.device_count() if torch else None
        except Exception:  # noqa: BLE001 - informative only
            env["gpu"] = None
    return env


def _workload_info(args, workload: Workload, specs, mode: str) -> dict:
    return {"name": workload.name, "requests": len(specs), "seed": args.seed,
            "trace": args.trace, "model": args.model,
            "prompt_tokens": sum(s.prompt_len for s in specs),
            "max_tokens_total": sum(s.max_tokens for s in specs), "mode": mode}


def run_online_mode(args) -> int:
    stray = given(args, OFFLINE_ONLY)
    if stray:
        raise UserError(f"{', '.join(stray)} only {'applies' if len(stray) == 1 else 'apply'} "
                        f"with --offline")
    if not args.base_url:
        raise UserError("give --base-url URL (a server to load, e.g. http://127.0.0.1:8000) "
                        "or --offline")
    timeout, repeat = check_online_numbers(args)
    report_mod.check_writable(args.json, "--json")
    report_mod.check_plot(args.plot)
    check_distinct_paths({"--json": args.json, "--plot": args.plot},
                         inputs={"--trace": args.trace})
    if args.save_result and args.result_filename:
        named = _save_result_path(args, "", None)
        report_mod.check_writable(named, "--result-filename")
        check_distinct_paths({"--result-filename": named, "--plot": args.plot},
                             inputs={"--trace": args.trace})
    targets = _targets(args)
    workload, specs = request_list(args)
    check_arrival_span(args.request_rate, len(specs))
    try:
        from proxima.bench.online import check_servers, run_online
    except ModuleNotFoundError as exc:
        raise UserError(f"online mode needs {exc.name!r}: pip install aiohttp tqdm") from None
    concurrency = args.concurrency
    if args.request_rate is None:
        concurrency = args.concurrency or workload.concurrency or len(specs)
    endpoint = args.endpoint or "completions"
    model = check_servers(targets, args.model)      # every server, before any load
    if args.save_result:
        args.json = _save_result_path(args, model, args.concurrency)
        report_mod.check_writable(args.json, "--save-result")
        check_distinct_paths({"--save-result": args.json, "--plot": args.plot},
                             inputs={"--trace": args.trace})
    info = _workload_info(args, workload, specs, "online")
    info.update(model=model, endpoint=endpoint, concurrency=concurrency,
                request_rate=args.request_rate, timeout_s=timeout, repeat=repeat)
    rounds = []
    try:
        for r in range(repeat):
            # Round r sends the workload made with seed + r (prompts the servers' prefix caches
            # have not seen), to every server; even rounds go in reverse server order.
            _, round_specs = request_list(args, seed=args.seed + r) if r else (workload, specs)
            order = targets if r % 2 == 0 else targets[::-1]
            if repeat > 1:
                print(f"proxima bench: round {r + 1}/{repeat} (seed {args.seed + r}): "
                      f"{', '.join(t.label for t in order)}", file=sys.stderr, flush=True)
            result = run_online(order, round_specs, model, endpoint=endpoint,
                                concurrency=concurrency, rate=args.request_rate,
                                seed=args.seed + r, timeout_s=timeout,
                                progress=not args.no_progress)
            rounds.append({t.label: result[t.label] for t in targets})
            if args.json and r + 1 < repeat:     # a bench cut short keeps these rounds
                report_mod.write_json(_online_report(rounds, info, partial=(r + 1, repeat)),
                                      args.json)
    except KeyboardInterrupt as exc:       # Ctrl-C, or SIGTERM (proxima.interrupts)
        if not rounds:
            raise
        print(f"proxima bench: {describe(exc)} during round {len(rounds) + 1} of {repeat}: "
              f"keeping the {len(rounds)} finished", file=sys.stderr, flush=True)
        _emit(_online_report(rounds, info, partial=(len(rounds), repeat)), args)
        raise
    rep = _online_report(rounds, info)
    untrusted = rep["notes"]
    _emit(rep, args)
    for reason in untrusted:
        print(f"proxima bench: not trustworthy: {reason}", file=sys.stderr)
    return 1 if untrusted else 0


def _online_report(rounds: list, info: dict, partial: tuple[int, int] | None = None) -> dict:
    """The online report of the rounds measured; ``partial``: (rounds done, planned) of a
    bench cut short (Ctrl-C, SIGTERM), or of the JSON written after each round of --repeat
    (what a bench killed outright leaves), which keeps each round's figures too."""
    from proxima.bench.online_summary import merge_rounds

    results = merge_rounds(rounds)
    untrusted = untrustworthy(results)
    rep = {"mode": "online", "partial": partial is not None, "workload": info,
           "environment": environment(False), "trustworthy": not untrusted,
           "notes": untrusted,
           "results": results, "ratios": ratios(results, report_mod.RATIO_KEYS["online"])}
    if partial is not None:
        rep.update(rounds_done=partial[0], rounds_planned=partial[1], per_round=rounds)
    return rep


def untrustworthy(results: dict) -> list[str]:
    """Why an online report cannot be trusted (empty: every request completed): the rule
    behind exit status 1."""
    reasons = []
    for label, result in results.items():
        if result["completed"] == 0:
            reasons.append(f"server {label} completed no request of {result['requests']}")
        elif result["errors"]:
            reasons.append(f"server {label}: {result['errors']} of {result['requests']} "
                           f"requests failed (left out of its figures)")
    return reasons


def _elastic_options(args) -> dict | None:
    """``--elastic-options`` checked (one line for a bad one); needs ``--elastic``."""
    if args.elastic_options is not None and not args.elastic:
        raise UserError("--elastic-options needs --elastic")
    if not args.elastic:
        return None
    from proxima import config

    return config.elastic_options_text(args.elastic_options or "", "--elastic-options")


def run_offline_mode(args) -> int:
    stray = given(args, ONLINE_ONLY)
    if stray:
        raise UserError(f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply "
                        f"with --offline (no server is used)")
    if not args.model:
        raise UserError("--offline needs --model DIR (a model directory, or a config.json "
                        "directory with --load-format dummy)")
    from proxima.bench.offline import OfflineConfig, run_offline, validate
    from proxima.config import parse_size
    config = OfflineConfig(
        model=args.model, load_format=args.load_format,
        kv_cache_memory_bytes=None if args.kv_cache_memory_bytes is None else parse_size(
            args.kv_cache_memory_bytes, "--kv-cache-memory-bytes", least=1),
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        tensor_parallel_size=1 if args.tensor_parallel_size is None else args.tensor_parallel_size,
        enforce_eager=bool(args.enforce_eager), repeat=check_repeat(args.repeat),
        seed=args.seed, check_outputs=bool(args.check_outputs), progress=not args.no_progress,
        arrivals=args.arrivals or "held", elastic=bool(args.elastic),
        elastic_options=_elastic_options(args))
    validate(config)
    report_mod.check_writable(args.json, "--json")
    report_mod.check_plot(args.plot)
    check_distinct_paths({"--json": args.json, "--plot": args.plot},
                         inputs={"--trace": args.trace})
    workload, specs = request_list(args)
    # vLLM logs to stdout by default: its lines go to stderr, the table alone to stdout
    # (the engine-core processes inherit it). A user's own setting wins.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        with contextlib.redirect_stdout(sys.stderr):   # vLLM 0.6 logs to stdout on import
            import vllm  # noqa: F401 - fail here, in one line, not inside the first run
    except ModuleNotFoundError:
        raise UserError("--offline needs vLLM: pip install 'proxima[vllm]' (or use ./dev)") from None
    logs_to_stderr("vllm")
    from proxima.bench.offline_engine import check_load_format

    check_load_format(config.load_format)
    measured = run_offline(config, specs, after_run=_checkpoint(args, config, workload, specs))
    rep = offline_report(args, config, workload, specs, measured)
    _emit(rep, args)
    status = 0
    check = measured["check_outputs"]
    if check and any(c["differing"] for c in check["runs"].values()):
        print("proxima bench: not trustworthy: generated tokens differ between runs (see "
              "the table)", file=sys.stderr)
        status = 1
    if measured["results"]["proxima"]["proxima_active"] is not True:
        print("proxima bench: not trustworthy: Proxima did not report itself active in the "
              "'proxima' runs", file=sys.stderr)
        status = 1
    if measured["results"]["stock"]["proxima_active"]:
        print("proxima bench: not trustworthy: the 'stock' runs reported Proxima active, so "
              "the comparison is invalid (is PROXIMA_ALLOCATOR set where vLLM's engine "
              "starts?)", file=sys.stderr)
        status = 1
    return status


def _checkpoint(args, config, workload: Workload, specs):
    """With --json: after every run, save the runs so far (``"partial": true``), so a bench
    stopped by a time limit, a crash or Ctrl-C keeps what it measured. The full report
    replaces it at the end."""
    if not args.json:
        return None

    def save(runs: list, check: dict | None, planned: int) -> None:
        report_mod.write_json({"mode": "offline", "partial": True, "runs_done": len(runs),
                               "runs_planned": planned,
                               "workload": _offline_info(args, config, workload, specs),
                               "environment": environment(True), "runs": runs,
                               "check_outputs": check}, args.json)

    return save


def _offline_info(args, config, workload: Workload, specs) -> dict:
    info = _workload_info(args, workload, specs, "offline")
    if config.elastic:
        info["elastic"] = {"proxima_runs": True, "options": config.elastic_options or {}}
    info.update(settings={k: v for k, v in vars(config).items() if k != "progress"})
    return info


def offline_report(args, config, workload: Workload, specs, measured: dict) -> dict:
    """The offline report dict from what :func:`run_offline` measured."""
    info = _offline_info(args, config, workload, specs)
    results = measured["results"]
    notes = []
    if results["proxima"]["proxima_active"] is not True:
        notes.append("the 'proxima' runs wrote no active Proxima status: the plugin did not "
                     "activate (is proxima installed where vLLM finds its entry point?), so "
                     "they may have run the stock pool")
    if results["stock"]["proxima_active"]:
        notes.append("the 'stock' runs reported Proxima active: the comparison is invalid")
    not_held = [f"{r['allocator']}#{r['rep']}" for r in measured["runs"]
                if config.arrivals == "held" and r.get("arrivals") != "held"]
    if not_held:
        notes.append(f"arrivals could not be held in {', '.join(not_held)} (this vLLM has no "
                     "pause_scheduler utility): those runs took requests as sent")
    if results["stock"]["kv_blocks_per_run"] != results["proxima"]["kv_blocks_per_run"]:
        notes.append(f"KV-cache block counts differ: stock {results['stock']['kv_blocks_per_run']}, "
                     f"proxima {results['proxima']['kv_blocks_per_run']}")
    return {"mode": "offline", "partial": False, "notes": notes, "workload": info,
            "environment": environment(True),
            "results": measured["results"],
            "ratios": ratios(measured["results"], report_mod.RATIO_KEYS["offline"]),
            "check_outputs": measured["check_outputs"], "runs": measured["runs"]}


def _emit(rep: dict, args) -> int:
    closed = print_table(report_mod.format_table(rep))
    if args.json:
        report_mod.write_json(rep, args.json)
        print(f"proxima bench: wrote {args.json}", file=sys.stderr)
    if args.plot:
        report_mod.write_plot(rep, args.plot)
        print(f"proxima bench: wrote {args.plot}", file=sys.stderr)
    if closed:
        raise closed
    return 0


def run(args) -> int:
    resolve_aliases(args)
    return run_offline_mode(args) if args.offline else run_online_mode(args)
