"""`proxima replay`: one workload through vLLM's real scheduler on CPU, stock vs Proxima.

Both runs see the identical request list. With ``--repeat K`` the two allocators run
alternately K times each; counts must agree between repeats (the scheduler is
deterministic) and the scheduler time is the median of the K runs. Interrupted (Ctrl-C,
SIGINT; or SIGTERM: :mod:`proxima.interrupts`), the repeats already finished are kept:
their table is printed and, with --json / --plot, written (``"partial": true``); --json
is also rewritten after every finished repeat. A failed parity check is exit status 1.

Every input is checked before the first scheduler is built (the flags and their checks:
:mod:`proxima.replay.options`). Results are written to a temporary name and renamed when
complete.

The driver is the one of the installed vLLM's engine generation (``driver_v1``,
``driver_v0``: the version policy of :mod:`proxima.vllm.activation` picks it); both
return one :class:`~proxima.replay.result.ReplayResult` per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import sys

from proxima import interrupts
from proxima.errors import UserError
from proxima.ioutil import logs_to_stderr, print_table, write_text_atomic
from proxima.replay.elastic import auto_granule_blocks, check_runs_here, resolve_rates
from proxima.replay.options import DEFAULT_NUM_BLOCKS, PRESSURE_NUM_BLOCKS, validate
from proxima.replay.options import add_arguments  # noqa: F401 - the command's flags (proxima.cli)
from proxima.replay.result import ReplayResult, combine
from proxima.replay.table import format_table, parity_checks
from proxima.workloads import load_trace, make_workload

TIMELINE_POINTS = 100                 # free-space samples wanted per run (--plot)


def _engine():
    """The replay driver for the installed vLLM's engine generation, once the version
    policy accepted it (:mod:`proxima.vllm.activation`: tested, or untested with
    ``PROXIMA_ALLOW_UNTESTED_VLLM=1``)."""
    from proxima.vllm import activation

    activation.check_environment()
    activation.check_combination()      # vLLM's child processes load the plugin with this env
    version = activation.installed_version("vllm")
    if version is None:
        raise UserError("vLLM is not installed: run ./dev proxima replay ..., or "
                        "pip install 'proxima[vllm]'")
    verdict = activation.judge(version, activation.installed_version("torch"))
    if not verdict.allowed:
        raise UserError(verdict.refusal(stock_hint="replay needs both allocators"))
    # vLLM's INFO lines (one set per scheduler built) would drown the table, and its log
    # goes to stdout unless told otherwise: warnings go to stderr, the table alone to
    # stdout. A user's own VLLM_LOGGING_LEVEL / VLLM_LOGGING_STREAM win.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with contextlib.redirect_stdout(sys.stderr):   # vLLM 0.6 logs to stdout on import
        import vllm  # noqa: F401
    logs_to_stderr("vllm")
    if verdict.engine == "v0":
        from proxima.replay import driver_v0 as driver
    else:
        from proxima.replay import driver_v1 as driver
    return driver, version


def run(args) -> int:
    validate(args)
    if args.engines == 2:
        from proxima.replay import two_engines

        driver, version = _engine()
        return two_engines.run(args, driver, version, _progress)
    if args.trace:
        workload = load_trace(args.trace, seed=args.seed, max_model_len=args.max_model_len,
                              limit=args.requests)
    else:
        workload = make_workload(args.workload, args.requests, seed=args.seed,
                                 max_model_len=args.max_model_len)
    num_blocks = args.num_blocks or (PRESSURE_NUM_BLOCKS if args.workload == "pressure"
                                     and not args.trace else DEFAULT_NUM_BLOCKS)
    too_long = [r for r in workload.requests
                if -(-(r.prompt_len + r.max_tokens) // args.block_size) > num_blocks - 1]
    if too_long:
        raise UserError(f"request {too_long[0].request_id} needs more blocks than the pool "
                        f"has ({num_blocks} - 1 null block): raise --num-blocks")
    if args.granule_blocks is None:
        args.granule_blocks = 32 if args.elastic_spec is None else \
            auto_granule_blocks(num_blocks, args.block_size)
    if args.elastic_spec is not None:
        resolve_rates(args.elastic_spec, args.granule_blocks, args.block_size)
    driver, version = _engine()
    params = inspect.signature(driver.run_replay).parameters
    engine_settings = _engine_settings(args, driver, version)
    settings = dict(num_blocks=num_blocks, block_size=args.block_size,
                    max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=not args.no_prefix_caching,
                    max_model_len=args.max_model_len, **engine_settings)
    extra = {}
    if args.plot and "timeline_every" in params:
        extra["timeline_every"] = timeline_every(workload, args.max_num_seqs)
    if "granule_blocks" in params:
        settings["granule_blocks"] = args.granule_blocks
    print(f"proxima replay: {workload.name}, {len(workload.requests)} requests, "
          f"{num_blocks} blocks of {args.block_size} tokens, vLLM {version} "
          f"(scheduler on CPU, no model)", file=sys.stderr)
    elastic = {}
    if args.elastic_spec is not None:
        check_runs_here("--elastic", driver, version, hint=": drop --elastic")
        elastic = {"elastic": args.elastic_spec}
    runs: dict[str, list[ReplayResult]] = {"stock": [], "proxima": []}
    done = 0
    try:
        for rep in range(args.repeat):
            for label in ("stock", "proxima"):
                bar = _progress(f"{label} {rep + 1}/{args.repeat}", len(workload.requests),
                                disabled=args.no_progress)
                mine = settings if label == "proxima" else {
                    k: v for k, v in settings.items() if not k.startswith("compaction")}
                try:
                    result = driver.run_replay(workload, proxima=label == "proxima",
                                               progress=bar.update_to if bar else None,
                                               **mine, **extra, **elastic)
                except ValueError as exc:
                    refused = _config_refusal(exc)
                    if refused is None or done or label != "stock":
                        raise
                    raise UserError(f"vLLM refused the settings: {refused}") from None
                finally:
                    if bar:
                        bar.close()
                runs[label].append(result)
            done = rep + 1
            if args.json and done < args.repeat:     # a replay cut short keeps these
                write_text_atomic(args.json, _json_text(
                    _report(workload, args, version, settings, runs, done)))
            if done < args.repeat:
                print(f"proxima replay: repeat {done}/{args.repeat} done", file=sys.stderr,
                      flush=True)
    except KeyboardInterrupt as exc:       # Ctrl-C, or SIGTERM (proxima.interrupts)
        if not done:
            raise
        print(f"proxima replay: {interrupts.describe(exc)} during repeat {done + 1} of "
              f"{args.repeat}: keeping the {done} finished", file=sys.stderr, flush=True)
        _emit(_report(workload, args, version, settings, runs, done), args, runs, workload,
              done)
        raise
    report = _report(workload, args, version, settings, runs, done)
    _emit(report, args, runs, workload, done)
    failed = [k for k, v in report["checks"].items() if v is False]
    if failed:
        print(f"proxima replay: parity checks FAILED: {', '.join(failed)} (the figures "
              f"above; exit status 1)", file=sys.stderr)
        return 1
    return 0


def _config_refusal(exc: ValueError) -> str | None:
    """The one-line reason of vLLM's config validation (a pydantic ValidationError, or the
    ValueError of vLLM 0.6's configs) when building the first scheduler; None otherwise."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return " ".join(str(first.get("msg", exc)).removeprefix("Value error, ").split())
        except (IndexError, TypeError, AttributeError):
            return None
    text = " ".join(str(exc).split())
    return text if "max_num" in text or "max_model_len" in text else None


def timeline_every(workload, max_num_seqs: int) -> int:
    """Steps between free-space samples, so that even a short run gets ~TIMELINE_POINTS of
    them and a long one no more than needed (each sample walks the whole free queue).

    The run's length is not known before it ends; its lower bound is: the longest request
    (arrival + output tokens), and all output tokens spread over the requests that can
    run at once."""
    in_flight = min(max_num_seqs, workload.concurrency or len(workload.requests)) or 1
    longest = max((r.arrival_step + r.max_tokens for r in workload.requests), default=1)
    output_tokens = sum(r.max_tokens for r in workload.requests)
    steps = max(longest, output_tokens // in_flight, 1)
    return max(1, min(25, steps // TIMELINE_POINTS))


def _report(workload, args, version: str, settings: dict, runs: dict, done: int) -> dict:
    """The report of the first ``done`` repeats (both allocators finished in each)."""
    kept = {label: rs[:done] for label, rs in runs.items()}
    results = {label: combine(rs) for label, rs in kept.items()}
    report = {"workload": workload.name, "requests": len(workload.requests), "seed": args.seed,
              "vllm_version": version,
              "settings": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                           for k, v in settings.items()},      # a compaction mode as spelt
              "repeat": args.repeat,
              "results": results, "checks": parity_checks(results)}
    if getattr(args, "elastic_spec", None) is not None:
        report["elastic"] = dataclasses.asdict(args.elastic_spec)
    report["partial"] = done < args.repeat
    if report["partial"]:
        report["repeats_done"] = done
    return report


def _json_text(report: dict) -> str:
    return json.dumps(report, indent=2) + "\n"


def _emit(report: dict, args, runs: dict, workload, done: int) -> None:
    """The table on stdout; --json and --plot written whole (temporary name, then renamed)."""
    closed = print_table(format_table(report))
    if args.json:
        write_text_atomic(args.json, _json_text(report))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from proxima.replay.plot import write_plot

        largest = max(-(-(r.prompt_len + r.max_tokens) // args.block_size)
                      for r in workload.requests)
        write_plot(report, {label: [r.as_dict() for r in rs[:done]]
                            for label, rs in runs.items()}, args.plot,
                   largest_request_blocks=largest)
        print(f"wrote {args.plot}", file=sys.stderr)
    if closed:
        raise closed


#: options only one engine generation's driver has: args name -> (flag, the generation,
#: the driver's ``ENGINE``); checked against the driver that runs, not its parameter names
ENGINE_OPTIONS = {"async_scheduling": ("--async-scheduling", "v1"),
                  "preemption_mode": ("--preemption-mode", "v0"),
                  "compaction": ("--compaction", "v1"),
                  "compaction_budget_mib": ("--compaction-budget-mib", "v1")}


def _engine_settings(args, driver, version: str) -> dict:
    """The engine-specific options given, refused (one line) where this vLLM runs the
    other engine generation."""
    settings = {}
    for name, (flag, needs) in ENGINE_OPTIONS.items():
        value = getattr(args, name, None)
        if value in (None, False):
            continue
        if driver.ENGINE != needs:
            raise UserError(f"{flag} needs vLLM's {needs.upper()} engine; vLLM {version} runs "
                            f"the {driver.ENGINE.upper()} one: drop {flag}")
        settings[name] = value
    mib = settings.pop("compaction_budget_mib", None)
    if mib is not None:
        settings["compaction_budget_bytes"] = mib << 20
    return settings


class _Bar:
    """A tqdm bar that appears with the first finished request: vLLM's imports and the
    pool's construction happen before it, so its rate (and ETA) measure the replay only."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self._bar = label, total, None

    def update_to(self, done: int, total: int) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, desc=self.label, unit="req",
                             file=sys.stderr, leave=False, mininterval=0.5)
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _progress(label: str, total: int, disabled: bool):
    if disabled:
        return None
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return None
    return _Bar(label, total)
