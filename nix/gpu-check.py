"""The appliance's GPU check: the image's own stack on a real GPU, or a loud failure.

    nix build .#proxima.gpuCheck     in the build sandbox of a builder with the `cuda` feature
    nix run .#gpu-check              the same script, outside the sandbox, on a GPU machine
    python3 nix/gpu-check.py         from a checkout, in any environment with Proxima + vLLM

Steps (each a subprocess, so CUDA never touches this process; each with a time limit):

1. gpu          torch sees a CUDA device; without one this FAILS (exit 1), it never skips
2. selfcheck    `proxima selfcheck --json`: GPU, driver/CUDA, versions, then a small engine
                with the embedded demo model: engine, proxima-active, allocator-invariants
3. identity     the same greedy requests through vLLM twice, stock (PROXIMA_ALLOCATOR=0) and
                Proxima (=1), each in a fresh process, in a KV cache small enough to force
                preemption: every request's token ids must be identical, and Proxima must
                report itself active in its run only
4. serve        `proxima serve` (the images' entrypoint, demo model) on 127.0.0.1: /health
                (what the images' health check asks, via docker/healthcheck.py when present)
                turns 200 only after the self-check with its canary passed; its report says
                so; one completion through the OpenAI API; SIGTERM stops it

On vLLM 0.6.3.post1 (the image's stack) this is the V0 engine; on the tested stack (vLLM 0.26)
the same steps run on V1. `--out FILE` writes the report as JSON (the derivation's output).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# Small on purpose: a few minutes on one GPU, most of it engine start-up.
REQUESTS = 48
PROMPT_LEN = (32, 200)
MAX_TOKENS = 48
BLOCK_SIZE = 16
# 48 blocks of 16 tokens: about four of these requests fit at once, so decoding preempts.
NUM_GPU_BLOCKS = 48
LIMITS_S = {"gpu": 120, "selfcheck": 900, "identity": 900, "serve": 900}
DEMO_MODEL = "proxima-demo-random-weights"


class Failed(Exception):
    pass


def log(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)


def run(step: str, argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=LIMITS_S[step],
                              env=env)
    except subprocess.TimeoutExpired:
        raise Failed(f"{step}: no result after {LIMITS_S[step]} s: {' '.join(argv[:4])} ...")


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---- 1. a GPU, or a loud failure -----------------------------------------------------------

GPU_PROBE = """
import json, torch
ok = torch.cuda.is_available() and torch.cuda.device_count() > 0
print(json.dumps({"cuda": ok, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}))
"""


def check_gpu() -> dict:
    done = run("gpu", [sys.executable, "-c", GPU_PROBE])
    if done.returncode != 0:
        raise Failed(f"gpu: torch cannot be imported in this environment:\n{tail(done.stderr)}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    if not info["cuda"]:
        raise Failed("gpu: no CUDA device visible (torch.cuda.is_available() is False). This "
                     "check needs a GPU: run it on a builder with the `cuda` system feature that "
                     "mounts the driver into the sandbox, or `nix run .#gpu-check` on a machine "
                     "with an NVIDIA GPU")
    return info


# ---- 2. proxima selfcheck ------------------------------------------------------------------

def check_selfcheck() -> dict:
    done = run("selfcheck", [sys.executable, "-m", "proxima.cli", "selfcheck", "--json"])
    try:
        report = json.loads(done.stdout[done.stdout.index("{"):])
    except ValueError:
        raise Failed(f"selfcheck: no JSON report (exit {done.returncode}):\n"
                     f"{tail(done.stdout + done.stderr)}")
    status = {c["name"]: c["status"] for c in report.get("checks", [])}
    needed = ["gpu", "cuda", "versions", "engine", "proxima-active", "allocator-invariants"]
    bad = [f"{n}={status.get(n, 'missing')}" for n in needed if status.get(n) != "ok"]
    if done.returncode != 0 or bad:
        raise Failed(f"selfcheck: exit {done.returncode}, not ok: {', '.join(bad) or '-'}\n"
                     f"{tail(done.stdout + done.stderr)}")
    return {"checks": status}


# ---- 3. token identity, stock vs Proxima ---------------------------------------------------

def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids 3..511 of the demo model's 512 (0-2 are its special tokens).
    return [[rng.randrange(3, 512) for _ in range(rng.randint(*PROMPT_LEN))]
            for _ in range(REQUESTS)]


def child(allocator: str, out: Path) -> int:
    """One engine, all requests, greedy: token ids, preemptions and Proxima's status to `out`."""
    status_file = out.with_suffix(".status.json")
    os.environ["PROXIMA_ALLOCATOR"] = "1" if allocator == "proxima" else "0"
    os.environ["PROXIMA_STATS_FILE"] = str(status_file)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from proxima.vllm.status import read_status
    from proxima.models import TINY_LLAMA_DIR
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(TINY_LLAMA_DIR), load_format="dummy", skip_tokenizer_init=True, seed=0,
              enforce_eager=True, max_model_len=512, block_size=BLOCK_SIZE,
              num_gpu_blocks_override=NUM_GPU_BLOCKS, gpu_memory_utilization=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    preemptions = None
    scheduler = getattr(llm.llm_engine, "scheduler", None)
    if scheduler:                                   # V0: the scheduler runs in this process
        preemptions = sum(s.num_cumulative_preemption for s in scheduler)
    elif hasattr(llm, "get_metrics"):               # V1: the engine core's counter
        preemptions = int(sum(m.value for m in llm.get_metrics()
                              if getattr(m, "name", "") == "vllm:num_preemptions"))
    status = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:              # the last snapshot may land just after
        status = read_status(status_file)
        if status is not None:
            break
        time.sleep(0.2)
    out.write_text(json.dumps({
        "allocator": allocator,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "preemptions": preemptions,
        "active": bool(status and status.get("active") is True),
        "engine": status.get("engine") if status else None,
    }))
    return 0


def check_identity(tmp: Path) -> dict:
    runs = {}
    for allocator in ("stock", "proxima"):
        out = tmp / f"{allocator}.json"
        done = run("identity", [sys.executable, __file__, "--child", allocator,
                                "--child-out", str(out)])
        if done.returncode != 0 or not out.exists():
            raise Failed(f"identity: the {allocator} run failed (exit {done.returncode}):\n"
                         f"{tail(done.stdout + done.stderr)}")
        runs[allocator] = json.loads(out.read_text())
    stock, prox = runs["stock"], runs["proxima"]
    if not prox["active"]:
        raise Failed("identity: Proxima did not report itself active in the PROXIMA_ALLOCATOR=1 "
                     "run (no active status): the vllm.general_plugins entry point did not load")
    if stock["active"]:
        raise Failed("identity: Proxima was active in the stock run (PROXIMA_ALLOCATOR=0)")
    short = [i for i, t in enumerate(prox["tokens"]) if len(t) != MAX_TOKENS]
    differing = [i for i, (a, b) in enumerate(zip(stock["tokens"], prox["tokens"])) if a != b]
    if len(stock["tokens"]) != REQUESTS or len(prox["tokens"]) != REQUESTS or short:
        raise Failed(f"identity: expected {REQUESTS} outputs of {MAX_TOKENS} tokens, got "
                     f"{len(stock['tokens'])} / {len(prox['tokens'])}, short: {short[:5]}")
    if differing:
        raise Failed(f"identity: {len(differing)} of {REQUESTS} requests differ between stock "
                     f"and Proxima (first: {differing[:5]})")
    for name, r in runs.items():
        if r["preemptions"] is not None and r["preemptions"] < 1:
            raise Failed(f"identity: the {name} run was not preempted ({r['preemptions']}): the "
                         f"KV cache of {NUM_GPU_BLOCKS} blocks did not put it under pressure")
    return {"requests": REQUESTS, "identical": REQUESTS, "engine": prox["engine"],
            "preemptions": {n: r["preemptions"] for n, r in runs.items()}}


# ---- 4. proxima serve: health, self-check with canary, one completion ----------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict | None]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def healthcheck_script() -> Path | None:
    given = os.environ.get("PROXIMA_HEALTHCHECK")
    here = Path(__file__).resolve().parent.parent / "docker" / "healthcheck.py"
    path = Path(given) if given else here
    return path if path.is_file() else None


def check_serve(tmp: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logfile = tmp / "serve.log"
    env = dict(os.environ, PROXIMA_STATS_FILE=str(tmp / "serve-status.json"),
               VLLM_NO_USAGE_STATS="1")
    env.pop("PROXIMA_ALLOCATOR", None)          # the entrypoint's own default (on)
    with open(logfile, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "serve", "--host",
                                 "127.0.0.1", "--port", str(port), "--enforce-eager"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    started = time.monotonic()
    try:
        health = 0
        while time.monotonic() - started < LIMITS_S["serve"]:
            if proc.poll() is not None:
                raise Failed(f"serve: proxima serve exited ({proc.returncode}) before it was "
                             f"healthy:\n{tail(logfile.read_text())}")
            health, _ = http(f"{base}/health", timeout=5)
            if health == 200:
                break
            time.sleep(2)
        if health != 200:
            raise Failed(f"serve: /health not 200 after {LIMITS_S['serve']} s (last: {health})"
                         f":\n{tail(logfile.read_text())}")
        ready_s = time.monotonic() - started
        code, report = http(f"{base}/proxima/selfcheck")
        checks = {c["name"]: c["status"] for c in (report or {}).get("checks", [])}
        if code != 200 or report.get("passed") is not True or checks.get("canary") != "ok":
            raise Failed(f"serve: healthy, but its self-check says passed={report and report.get('passed')}"
                         f", canary={checks.get('canary')} ({code})")
        script = healthcheck_script()
        if script is not None:
            probe = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                   env=dict(os.environ, PROXIMA_HEALTH_URL=f"{base}/health"),
                                   timeout=30)
            if probe.returncode != 0:
                raise Failed(f"serve: the images' health check failed against a healthy server: "
                             f"{probe.stderr.strip()}")
        code, completion = http(f"{base}/v1/completions",
                                {"model": DEMO_MODEL, "prompt": "Proxima", "max_tokens": 8,
                                 "temperature": 0}, timeout=120)
        if code != 200 or not (completion or {}).get("choices"):
            raise Failed(f"serve: /v1/completions answered {code}: {str(completion)[:300]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"ready_s": round(ready_s, 1), "checks": checks,
            "healthcheck_script": str(script) if script else None, "exit": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    parser.add_argument("--child", choices=("stock", "proxima"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.child_out)

    report: dict = {"passed": False, "steps": {}}
    steps = [("gpu", check_gpu), ("selfcheck", check_selfcheck),
             ("identity", check_identity), ("serve", check_serve)]
    try:
        with tempfile.TemporaryDirectory(prefix="proxima-gpu-check-") as tmp:
            for name, step in steps:
                t = time.monotonic()
                result = step(Path(tmp)) if step in (check_identity, check_serve) else step()
                report["steps"][name] = dict(result, seconds=round(time.monotonic() - t, 1))
                log(f"[ok] {name} ({report['steps'][name]['seconds']} s): "
                    f"{json.dumps(result)[:300]}")
        report["passed"] = True
        log("PASSED")
        return 0
    except Failed as exc:
        report["failure"] = str(exc)
        log(f"FAILED: {exc}")
        return 1
    finally:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
