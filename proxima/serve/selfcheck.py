"""``proxima selfcheck``: is this machine ready to serve with Proxima? One line per check.

    proxima selfcheck               gpu, cuda, versions, then a small engine with the embedded
                                    demo model: engine, proxima-active, allocator-invariants
    proxima selfcheck --no-engine   only gpu, cuda, versions (seconds)
    proxima selfcheck --url URL     the report of a running `proxima serve` (its canary too)

Exit status: 0 when no check failed; 1 when one failed, or (``--url``) the server failed,
answered what is not a self-check report, or gave no whole answer in ``URL_TIMEOUT_S``;
2 for bad input (``--url`` malformed or nothing listening there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from proxima.vllm.status import STATS_ENV, read_status
from proxima.errors import UserError
from proxima.serve.report import Check, Report, failed, ok, skipped

EXIT_STATUS = """\
exit status:
  0  no check failed (skipped ones are not failures)
  1  a check failed (with --url also a server whose self-check has not passed yet: still
     starting, its phase is printed); or with --url, a runtime failure of the server: it
     answered an error, what is not a self-check report, or no whole answer within 10 s
     (one line on stderr)
  2  bad input: a malformed --url or --model, an option that does not apply, or nothing
     listening at --url (one line on stderr)"""
#: seconds the whole GET URL/proxima/selfcheck may take
URL_TIMEOUT_S = 10.0
ENGINE_CHECKS = ("engine", "proxima-active", "allocator-invariants", "elastic-kv")
CANARY_NOTE = "runs only when serving (proxima serve sends one request through HTTP)"





def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument("--no-engine", action="store_true",
                        help="only the checks that need no engine: gpu, cuda, versions")
    parser.add_argument("--model", default=None,
                        help="model for the engine checks (default: the embedded demo model, "
                             "random weights, tiny)")
    parser.add_argument("--url", default=None,
                        help="print the self-check of a running `proxima serve` at URL "
                             "(GET URL/proxima/selfcheck) instead of checking this machine")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _validate(args: argparse.Namespace) -> None:
    """Bad input in one line before any check runs (the GPU probe takes seconds)."""
    if args.url is not None:
        from proxima.serve.remote import server_url

        server_url(args.url)
        if args.no_engine or args.model is not None:
            raise UserError("--url reads a running server's report: --no-engine and --model "
                            "do not apply with it")
    if args.model is not None:
        if args.no_engine:
            raise UserError(f"--model {args.model} is for the engine checks, which --no-engine "
                            f"skips: drop one of them")
        from proxima.serve.validate import check_model

        check_model(args.model)


def run(args: argparse.Namespace) -> int:
    _validate(args)
    if args.url is not None:
        from proxima.serve.remote import ServerFailure

        try:
            data = fetch_remote(args.url)
        except ServerFailure as exc:
            print(f"proxima selfcheck: error: {exc}", file=sys.stderr)
            return 1
        checks = [Check(**c) for c in data["checks"]]
        _print(checks, data, args.json)
        if data.get("passed") is None:
            print(f"(the server is still in phase {data.get('phase')!r})")
        return 0 if data.get("passed") is True else 1

    from proxima.vllm.activation import check_environment
    from proxima.serve.preflight import run_preflight
    from proxima.serve.validate import check_allocator_env

    check_environment()          # every PROXIMA_* value (the engine's plugin asks the same)
    check_allocator_env()
    report = Report()
    report.extend(run_preflight())
    if args.no_engine:
        for name in ENGINE_CHECKS:
            report.add(skipped(name, "--no-engine"))
    elif report.any_failed:
        for name in ENGINE_CHECKS:
            report.add(skipped(name, f"not run: {report.first_failure().name} failed"))
    else:
        report.extend(engine_checks(args.model))
    report.add(skipped("canary", CANARY_NOTE))
    report.finish()
    _print(report.checks, report.to_json(), args.json)
    return 1 if report.any_failed else 0


def _print(checks: list[Check], data: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        for check in checks:
            print(check.line(), flush=True)


def fetch_remote(url: str, timeout: float = URL_TIMEOUT_S) -> dict:
    """A running server's report, checked to be one (ServerFailure otherwise; UserError for a
    malformed URL or nothing listening)."""
    from proxima.serve.remote import json_body, refusal, request, server_url

    answer = request(server_url(url) + "/proxima/selfcheck", timeout, timeout_flag=None)
    if answer.status != 200:
        raise refusal(answer, "is this a proxima serve? GET /proxima/selfcheck is its route")
    return check_report(json_body(answer))


def check_report(data) -> dict:
    """``{"passed": true|false|null, "phase": str?, "checks": [{"name", "status", "detail",
    "fix"?: str}, ...]}`` or ServerFailure naming what is not."""
    from proxima.serve.remote import ServerFailure, one_line

    where = "the server's answer is not a self-check report"
    if not isinstance(data, dict):
        raise ServerFailure(f"{where}: it is {one_line(json.dumps(data), 60)!r}, not a JSON "
                            f"object: is this a proxima serve?")
    if data.get("passed") not in (True, False, None):
        raise ServerFailure(f"{where}: passed is {one_line(json.dumps(data['passed']), 40)}, "
                            f"expected true, false or null")
    if not isinstance(data.get("phase", ""), (str, type(None))):
        raise ServerFailure(f"{where}: phase is {one_line(json.dumps(data['phase']), 40)}, "
                            f"expected a string")
    checks = data.get("checks")
    if not isinstance(checks, list):
        raise ServerFailure(f"{where}: checks is {one_line(json.dumps(checks), 40)}, expected a "
                            f"list of checks: is this a proxima serve?")
    for i, check in enumerate(checks):
        fields = ("name", "status", "detail")
        if (not isinstance(check, dict) or not set(check) <= {*fields, "fix"}
                or not all(isinstance(check.get(k), str) for k in fields)
                or not isinstance(check.get("fix", ""), str)):
            raise ServerFailure(f"{where}: checks[{i}] is {one_line(json.dumps(check), 60)}, "
                                f"expected {{\"name\", \"status\", \"detail\", \"fix\"}} strings")
        for key in check:               # one line each: no terminal escapes from the server
            check[key] = one_line(check[key], 2000)
    return data


def engine_checks(model: str | None) -> list[Check]:
    """Start a small engine in a child process (as vLLM does), read its status, generate once."""
    from proxima.models import TINY_LLAMA_DIR
    from proxima.serve import startup_errors
    from proxima.vllm import activation
    from proxima.serve.engine_checks import (check_active, check_elastic, check_invariants,
                                             pick_invariants_status)
    from proxima.serve.tee import OutputTee

    os.environ["PROXIMA_ALLOCATOR"] = "1"
    # As `vllm serve` does: the engine process starts fresh and loads Proxima's plugin itself
    # (a forked one would inherit this process's patched classes, proving less).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if not os.environ.get(STATS_ENV):
        os.environ[STATS_ENV] = str(Path(tempfile.mkdtemp(prefix="proxima-selfcheck-"))
                                    / "engine-status.json")
    path = Path(os.environ[STATS_ENV])
    path.unlink(missing_ok=True)
    if model is None:
        kwargs = dict(model=str(TINY_LLAMA_DIR), load_format="dummy", max_model_len=512,
                      gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 * 2**20)
    else:
        kwargs = dict(model=model)
    kwargs.update(enforce_eager=True, disable_log_stats=True)
    from proxima.serve.vllm_args import card_stack

    v0 = card_stack()
    if v0 and "kv_cache_memory_bytes" in kwargs:
        # vLLM 0.6 has no kv_cache_memory_bytes: the same 64 MiB of the tiny Llama as blocks.
        kwargs["num_gpu_blocks_override"] = 4096
        del kwargs["kv_cache_memory_bytes"]

    from vllm import LLM, SamplingParams

    started = time.time()
    tee = OutputTee()
    try:
        with tee:
            llm = LLM(**kwargs)
    except Exception as exc:
        why = startup_errors.explain(f"{tee.text()}\n{type(exc).__name__}: {exc}",
                                     gpu_memory_utilization=kwargs.get("gpu_memory_utilization"),
                                     max_model_len=kwargs.get("max_model_len"),
                                     kv_cache_memory_bytes=kwargs.get("kv_cache_memory_bytes"))
        return [failed("engine", why.why, why.fix)] + [
            skipped(name, "not run: engine failed") for name in ENGINE_CHECKS[1:]]
    checks = [ok("engine", f"started in {time.time() - started:.1f} s: {kwargs['model']}")]
    try:
        pids = [p.pid for p in llm.llm_engine.engine_core.resources.engine_manager.processes]
    except AttributeError:
        pids = []
    at_activation = _wait_status(path, started)
    # vLLM 0.6's LLM runs its engine in this process (no engine-core process): there the
    # status comes from this pid, and that is the engine's.
    checks.append(check_active(at_activation, server_pid=os.getpid(), engine_pids=pids,
                               since=started, path=path, in_process=v0))
    generated = time.time()
    llm.generate(["Proxima self-check"], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    latest = _wait_status(path, generated, timeout=3)
    checks.append(check_invariants(pick_invariants_status(latest, at_activation)))
    checks.append(check_elastic(latest or at_activation, activation.elastic()))
    return checks


def _wait_status(path: Path, newer_than: float, timeout: float = 30.0) -> dict | None:
    deadline = time.monotonic() + timeout
    while True:
        status = read_status(path)
        if status and float(status.get("time", 0)) >= newer_than:
            return status
        if time.monotonic() >= deadline:
            return status
        time.sleep(0.2)
