"""What the GPU proof drivers share: a time budget, child processes that always die, results
written as they come, and few files in $OUT.

The drivers never touch CUDA themselves (vLLM forks and spawns engine processes; a parent
holding a CUDA context would break them): every engine and every GPU allocation runs in a
child process started here, in its own process group, killed (the whole group) when its
time is up or the driver exits for any reason.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(ROOT / "tools" / "gpu" / "dummy-llama")   # Llama-3.1-8B's shape, for load_format=dummy
TOKENIZER = str(ROOT / "proxima" / "models" / "tiny-llama")

_children: list[subprocess.Popen] = []


def kill_all() -> None:
    """Kill every child process group still alive (SIGTERM, then SIGKILL)."""
    for proc in list(_children):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + 10
    for proc in list(_children):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    _children.clear()


def _on_signal(signum, frame):
    kill_all()
    sys.exit(128 + signum)


atexit.register(kill_all)
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_sig, _on_signal)


def engine_env(cache_root: Path, **extra) -> dict:
    """The environment of an engine child: the repo and the staged vLLM on the path, a
    shared compile cache, no FlashInfer sampler, NVLink multicast off; PROXIMA_* unset
    unless given."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("PROXIMA_"):
            del env[key]
    site = env.get("PYTHONPATH", "")
    parts = [str(ROOT)] + [p for p in site.split(os.pathsep) if p and p != str(ROOT)]
    if "/tmp/site" not in parts and Path("/tmp/site").is_dir():
        parts.append("/tmp/site")
    env.update(PYTHONPATH=os.pathsep.join(parts), VLLM_CACHE_ROOT=str(cache_root),
               VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def budget_refusal(driver: str, budget: float, what: str, plan, hints: str) -> str | None:
    """The one line that refuses a ``--budget`` too small for a driver's time plan (None:
    it fits). ``plan``: (seconds, text) per setup, the least each can take; ``what``: what
    the plan is of; ``hints``: the other ways out, after a budget that would do."""
    need = sum(seconds for seconds, _ in plan)
    if budget >= need:
        return None
    return (f"{driver}: --budget {budget:.0f}s is too little for {what}, at least "
            f"{need:.0f}s: {'; '.join(text for _, text in plan)}; give --budget "
            f"{math.ceil(need) + 30} or more, {hints}")


class Budget:
    """Wall-clock budget of a driver: ``left()`` seconds remain."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.end - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def cap(self, seconds: float, reserve: float = 10.0) -> float:
        """``seconds``, or what is left minus ``reserve`` if less."""
        return max(0.0, min(seconds, self.left() - reserve))


class Out:
    """$OUT: one JSON of results (rewritten after every change), one log, and the
    children's logs packed into one .tgz at the end (at most 3 files of ours)."""

    def __init__(self, out: Path, name: str) -> None:
        self.dir = out
        out.mkdir(parents=True, exist_ok=True)
        self.json = out / f"{name}.json"
        self.log_path = out / f"{name}.log"
        self.logs = out / f"{name}-children"
        self.logs.mkdir(exist_ok=True)
        self.tgz = out / f"{name}-logs.tgz"
        self.results: dict = {"driver": name, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime()),
                              "subproofs": {}}
        self._log = self.log_path.open("a")
        self.save()

    def log(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        text = f"[{stamp}] {line}"
        print(text, flush=True)
        self._log.write(text + "\n")
        self._log.flush()

    def save(self) -> None:
        tmp = self.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        tmp.replace(self.json)

    def record(self, subproof: str, **fields) -> dict:
        entry = self.results["subproofs"].setdefault(subproof, {})
        entry.update(fields)
        self.save()
        return entry

    def child_log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def finish(self) -> None:
        children = sorted(self.logs.glob("*"))
        if children:     # no children (a --pool summary): no empty .tgz
            with tarfile.open(self.tgz, "w:gz") as tar:
                for path in children:
                    tar.add(path, arcname=f"{self.logs.name}/{path.name}")
        for path in children:
            path.unlink()
        self.logs.rmdir()
        self.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.save()
        self._log.close()


def start(cmd: list[str], env: dict, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """A child in its own process group, output to ``log``; killed by :func:`kill_all`."""
    handle = log.open("ab")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    handle.close()
    _children.append(proc)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass
    if proc in _children:
        _children.remove(proc)
    return proc.returncode


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> int:
    """Run a child to completion within ``timeout`` s; 124 if it ran out of time."""
    if timeout <= 1:
        return 124
    proc = start(cmd, env, log)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        return 124
    finally:
        if proc in _children:
            _children.remove(proc)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_for(predicate, timeout: float, every: float = 0.5):
    """``predicate()`` until truthy (returned) or ``timeout`` s passed (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def settings_diff(data: dict, keys, mine: dict | None, norm=lambda v: v,
                  here: str = "here") -> tuple[dict, str]:
    """An earlier run's ``keys`` (its ``settings``), and how they differ from ``mine``:
    "KEY A there, B <here>", comma-separated; "" where they agree or ``mine`` is None."""
    theirs = {k: norm((data.get("settings") or {}).get(k)) for k in keys}
    if mine is None or theirs == mine:
        return theirs, ""
    return theirs, ", ".join(f"{k} {theirs[k]} there, {mine[k]} {here}" for k in keys
                             if theirs[k] != mine[k])


def _pair_ratio(full_a: dict, full_b: dict, rate, keep) -> tuple[int, float] | None:
    """Two runs' bursts ({burst key: burst}) on the keys both ran that ``keep`` picks: how
    many, and a's output tok/s over b's (None where they share none)."""
    common = sorted(k for k in set(full_a) & set(full_b) if keep(k, full_b[k]))
    if not common:
        return None
    return len(common), round(rate(full_a[k] for k in common)
                              / rate(full_b[k] for k in common), 3)


def run_pairs(a: tuple[str, list], b: tuple[str, list], rate,
              keep=lambda key, burst: True) -> list[dict]:
    """Each run of one setup against each run of another, on the bursts both ran in full:
    ``a`` and ``b`` are (setup name, [(run label, {burst key: burst})]); ``rate`` gives the
    output tok/s of bursts; ``keep`` picks the keys (a workload's). The ratio a / b."""
    (name_a, runs_a), (name_b, runs_b) = a, b
    rows = []
    for label_a, full_a in runs_a:
        for label_b, full_b in runs_b:
            got = _pair_ratio(full_a, full_b, rate, keep)
            if got:
                rows.append({name_a: label_a, name_b: label_b, "bursts": got[0],
                             "ratio": got[1]})
    return rows


def run_spread(runs: list, rate, keep=lambda key, burst: True) -> list[dict]:
    """A setup's runs against each other (its spread), as :func:`run_pairs` does."""
    rows = []
    for i, (label_a, full_a) in enumerate(runs):
        for label_b, full_b in runs[i + 1:]:
            got = _pair_ratio(full_a, full_b, rate, keep)
            if got:
                rows.append({"runs": [label_a, label_b], "bursts": got[0], "ratio": got[1]})
    return rows
