"""The self-check lines that need a running engine: proxima-active, allocator-invariants,
elastic-kv, canary. The first two read the engine's status file (:mod:`proxima.vllm.status`), the
only window the API server has into the engine-core process."""

from __future__ import annotations

import time

from proxima.serve.report import Check, failed, ok

CANARY_HEADER = "x-proxima-canary"
PLUGIN_FIX = ("make sure the engine loads Proxima's plugin: proxima installed in the engine's "
              "environment (entry point vllm.general_plugins:proxima), VLLM_PLUGINS unset or "
              "listing proxima, PROXIMA_ALLOCATOR=1")


def check_active(status: dict | None, *, server_pid: int, engine_pids: list[int],
                 since: float, path, in_process: bool = False) -> Check:
    """Proxima must be active in the engine process: a fresh status, written by another pid.

    ``in_process``: vLLM 0.6 (V0) runs this engine in the server's own process (its ``LLM``
    class always, ``vllm serve`` with --disable-frontend-multiprocessing). There the only
    engine pid is the server's, so a status written by that same pid is the engine's."""
    if status is None:
        return failed("proxima-active", f"the engine wrote no status file ({path})", PLUGIN_FIX)
    written = float(status.get("time", 0))
    if written < since:
        return failed("proxima-active", f"the status file {path} is older than this engine "
                                        f"(written {since - written:.0f} s before it started)",
                      PLUGIN_FIX)
    pid = status.get("pid")
    if not status.get("active"):
        return failed("proxima-active", f"the engine (pid {pid}) reports active=false",
                      PLUGIN_FIX)
    if pid == server_pid and in_process:
        alloc = status.get("allocator") or {}
        return ok("proxima-active", f"engine in this process, pid {pid} ({status.get('engine', '?')}, "
                                    f"vLLM {status.get('vllm_version', '?')}, V0 in-process engine): "
                                    f"{status.get('num_blocks', alloc.get('num_blocks', '?'))} "
                                    f"blocks of {status.get('block_size', '?')} tokens, "
                                    f"{alloc.get('num_free', '?')} free")
    if pid == server_pid:
        return failed("proxima-active", f"Proxima is active in the API server (pid {pid}), "
                                        f"not in the engine process",
                      "run the engine in its own process (do not set "
                      "VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if engine_pids and pid not in engine_pids:
        return failed("proxima-active", f"the status comes from pid {pid}, not from this "
                                        f"engine ({', '.join(map(str, engine_pids))})",
                      "give each server its own PROXIMA_STATS_FILE (or leave it unset)")
    alloc = status.get("allocator") or {}
    return ok("proxima-active", f"engine pid {pid} ({status.get('engine', '?')}, vLLM "
                                f"{status.get('vllm_version', '?')}): {status.get('num_blocks', alloc.get('num_blocks', '?'))} "
                                f"blocks of {status.get('block_size', '?')} tokens, "
                                f"{alloc.get('num_free', '?')} free; server pid {server_pid}")


def pick_invariants_status(latest: dict | None, at_activation: dict | None) -> dict | None:
    """The newest snapshot that carries an invariant verdict (the engine checks the pool when
    it creates it, and may check again later)."""
    if latest is not None and "invariants_ok" in latest:
        return latest
    return at_activation


def check_invariants(status: dict | None) -> Check:
    if status is None:
        return failed("allocator-invariants", "no engine status to read", PLUGIN_FIX)
    if "invariants_ok" not in status:
        return failed("allocator-invariants", "the engine's status has no invariants_ok field",
                      "use the engine adapter of this proxima version (reinstall proxima)")
    checked_at = status.get("invariants_checked_at")
    steps = status.get("steps") or 0
    if isinstance(checked_at, (int, float)):
        # The engine renews its verdict at most once a minute and every snapshot carries the
        # last one, so the snapshot's step count does not date it; its own time does.
        when = time.strftime("at %H:%M:%S UTC", time.gmtime(checked_at))
    else:
        when = f"after {steps} scheduler steps" if steps else "when the engine created the pool"
    if not status["invariants_ok"]:
        error = status.get("invariants_error")
        return failed("allocator-invariants",
                      f"the engine (pid {status.get('pid')}) reports broken allocator invariants "
                      f"on the live pool, checked {when}{f': {error}' if error else ''}",
                      "do not serve: report it with the engine log; unset PROXIMA_ALLOCATOR and "
                      "run `vllm serve` meanwhile")
    alloc = status.get("allocator") or {}
    return ok("allocator-invariants",
              f"hold on the live pool, checked {when} ({alloc.get('num_free', '?')} of "
              f"{alloc.get('num_blocks', status.get('num_blocks', '?'))} blocks free, largest free "
              f"run {alloc.get('largest_free_run', '?')})")


def check_elastic(status: dict | None, wanted: bool) -> Check:
    """``elastic-kv``: with ``PROXIMA_ELASTIC=1`` the engine must report its elastic KV
    memory (mapped of the pool, the policy); without it the line is skipped."""
    from proxima.serve.report import skipped

    if not wanted:
        return skipped("elastic-kv", "PROXIMA_ELASTIC unset: a fixed KV pool "
                                     "(proxima serve --elastic to give unused KV memory back)")
    elastic = (status or {}).get("elastic")
    if not isinstance(elastic, dict) or "num_granules" not in elastic:
        return failed("elastic-kv", "PROXIMA_ELASTIC=1 but the engine reports no elastic KV "
                                    "memory in its status",
                      "run vLLM 0.26.0 with PROXIMA_ALLOCATOR=1 (proxima serve --elastic sets "
                      "both); see the engine log for the Proxima elastic KV line")
    from proxima.memory.policy_options import format_bytes

    def size(key):
        value = elastic.get(key)
        return format_bytes(int(value)) if isinstance(value, (int, float)) else "?"

    limits = (f", min {size('min_bytes')}, max {size('max_bytes')}"
              if elastic.get("min_bytes") is not None else "")
    return ok("elastic-kv", f"policy {elastic.get('policy', '?')}: {size('mapped_bytes')} of "
                            f"{size('pool_bytes')} mapped{limits}, granules of "
                            f"{elastic.get('granule_blocks', '?')} blocks "
                            f"({size('bytes_per_granule')})")


async def run_canary(base_url: str, model: str, *, token: str, api_key: str | None = None,
                     uds: str | None = None, verify: bool = True, timeout: float = 120.0) -> Check:
    """One short completion through the real HTTP listener (gunicorn's socket, the worker's
    uvicorn, vLLM's routes, the engine, Proxima's block pool) and back."""
    import httpx

    headers = {CANARY_HEADER: token}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {"model": model, "prompt": "Proxima canary:", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    transport = httpx.AsyncHTTPTransport(uds=uds, verify=verify) if uds else None
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout,
                                     verify=verify) as client:
            response = await client.post("/v1/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        return failed("canary", f"cannot reach the server at {base_url} ({type(exc).__name__}: "
                                f"{exc})", "check --host/--port/--uds and local firewalls")
    elapsed = time.monotonic() - started
    if response.status_code != 200:
        return failed("canary", f"POST /v1/completions answered {response.status_code}: "
                                f"{' '.join(response.text.split())[:300]}",
                      "see the server log above")
    try:
        tokens = int(response.json()["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return failed("canary", f"POST /v1/completions answered 200 without usage: "
                                f"{response.text[:200]}", "see the server log above")
    if tokens < 1:
        return failed("canary", "the completion has no tokens", "see the server log above")
    return ok("canary", f"POST /v1/completions through HTTP: {tokens} tokens in {elapsed:.2f} s")
