"""Run vLLM's own block-pool, KV-offload and offloading-connector tests twice -- with stock's
pool and with Proxima's -- and list every test whose outcome differs.

    ./dev python tools/vllm_tests.py                       # the tested stack (vLLM 0.26.0)
    PROXIMA_STACK=newest ./dev python tools/vllm_tests.py  # vLLM 0.33.0

vLLM's wheel has no tests. They come from the sdist of the installed version on PyPI
(fetched once into the work folder, its sha256 checked against PyPI's index), from
``--sdist vllm-X.tar.gz``, or from a git mirror of github.com/vllm-project/vllm
(``--git-dir DIR``: ``git archive vX`` of tests/ and pyproject.toml). Only tests/ and
pyproject.toml (vLLM's pytest markers) are unpacked: vLLM's own package is the installed
one. vLLM's test conftest needs tblib, installed with pip into the work folder.

The work folder (default .dev/vllm-tests, git-ignored) keeps per version: the sources
(vllm-X/), pytest's output (X-stock.log, X-proxima.log), each test's outcome (X-stock.json,
X-proxima.json: see tools/vllm_tests_plugin.py) and the comparison (X-diff.md, also
printed). Exit status 0 when the run finished and no test passes with stock but not with
Proxima; 1 otherwise; 2 on bad input. docs/vllm-tests.md records the outcome and why each
difference is legitimate. Needs the network (PyPI) only to fetch the sdist; CI does not run
this (about 3 minutes a version with --parallel on 2 cores, once the sdist is here). On 0.33.0
add ``PYTEST_ADDOPTS='-k "not nixl"'``: its NIXL connector tests wait forever here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
from collections import Counter
from importlib.metadata import version as installed_version
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: what is run by default: the block pool, KV-cache manager and scheduler (tests/v1/core),
#: the simple CPU offload (it walks the GPU pool's free queue) and the offloading connector
TEST_PATHS = ["tests/v1/core", "tests/v1/simple_kv_offload",
              "tests/v1/kv_connector/unit/test_offloading_connector.py",
              "tests/v1/kv_connector/unit/offloading_connector"]
#: vLLM's CPU-side offload (manager, worker, tiers, transports): none of its tests builds a
#: GPU block pool, a KV-cache manager or a scheduler, so none can see Proxima; ~720 tests,
#: on request only (``tools/vllm_tests.py tests/v1/kv_offload``)
DEPS = ["tblib==3.2.2"]          # vLLM's tests/conftest.py imports it
#: vLLM's scheduler and connector test helpers build their ModelConfig from
#: "facebook/opt-125m" on the Hugging Face hub, out of reach here: its config.json (the
#: model's public architecture values; no weights, no tokenizer) goes into a hub cache of
#: the work folder, read offline. Tests that name other models fail alike with either pool.
STAND_IN_MODELS = {"facebook/opt-125m": {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
    "vocab_size": 50272, "max_position_embeddings": 2048, "word_embed_proj_dim": 768,
    "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
    "layer_norm_elementwise_affine": True, "pad_token_id": 1, "bos_token_id": 2,
    "eos_token_id": 2, "torch_dtype": "float16"}}
PYPI_INDEX = "https://pypi.org/simple/vllm/"
OUTCOMES = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]


def fail(message: str) -> None:
    print(f"vllm_tests: {message}", file=sys.stderr)
    sys.exit(2)


def sdist_from_pypi(version: str, dest: Path) -> Path:
    """vllm-<version>.tar.gz from PyPI's simple index (PEP 691 JSON), sha256 checked."""
    name = f"vllm-{version}.tar.gz"
    path = dest / name
    request = urllib.request.Request(
        PYPI_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        fail(f"PyPI has no {name}; pass --sdist or --git-dir")
    if not path.exists():
        print(f"vllm_tests: fetching {entry['url']}", file=sys.stderr)
        partial = path.with_suffix(".part")
        with urllib.request.urlopen(entry["url"], timeout=600) as response, \
                open(partial, "wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        partial.rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        path.unlink()
        fail(f"{name}: sha256 {digest}, PyPI says {entry['hashes']['sha256']}; removed, "
             "run again")
    return path


def unpack(sdist: Path | None, git_dir: Path | None, version: str, src: Path) -> None:
    """tests/ and pyproject.toml of vLLM ``version`` into ``src``."""
    src.mkdir(parents=True)
    if git_dir is not None:
        tag = f"v{version}"
        archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "--format=tar",
                                  tag, "tests", "pyproject.toml"], capture_output=True)
        if archive.returncode:
            fail(f"git archive {tag} in {git_dir}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
        return
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]
        if not any(m.name.startswith(prefix + "tests/") for m in members):
            fail(f"{sdist} has no {prefix}tests/ (is it vLLM {version}'s sdist?)")
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(src, members=members, filter="data")


def hub_cache(work: Path) -> Path:
    """A Hugging Face home whose hub cache holds the stand-in configs (HF_HOME)."""
    home = work / "hf"
    for repo, config in STAND_IN_MODELS.items():
        entry = home / "hub" / ("models--" + repo.replace("/", "--"))
        (entry / "snapshots" / "stand-in").mkdir(parents=True, exist_ok=True)
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text("stand-in")
        (entry / "snapshots" / "stand-in" / "config.json").write_text(json.dumps(config))
    return home


def run_pytest(mode: str, src: Path, work: Path, version: str, paths: list[str],
               extra: list[str]):
    """Start pytest on ``paths`` with one pool (``mode``); returns a function that waits
    for it and returns its report."""
    report = work / f"{version}-{mode}.json"
    log = work / f"{version}-{mode}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(work / "deps"), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        VLLM_TESTS_REPORT=str(report),
        # no network here: a test that needs a model from the hub fails at once, not
        # after the hub client's retries (it fails alike with either pool)
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        HF_HOME=str(hub_cache(work)), VLLM_TESTS_CPU_PLATFORM="1")
    env.pop("PROXIMA_POOL", None)
    env.pop("PROXIMA_ALLOCATOR", None)      # the plugin decides, not the vllm plugin hook
    if mode == "proxima":
        env["PROXIMA_POOL"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "vllm_tests_plugin", "-p",
               "no:cacheprovider", "-q", "-rN", *paths, *extra]
    print(f"vllm_tests: {mode}: {' '.join(command[1:])} (in {src}, log {log})",
          file=sys.stderr)
    report.unlink(missing_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=src, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)

    def result() -> dict:
        process.wait()
        return read_report(report, log)

    return result


def read_report(report: Path, log: Path) -> dict:
    """A finished run's report, else what a run cut short wrote (its .partial)."""
    if report.exists():
        return json.loads(report.read_text())
    partial = report.with_name(report.name + ".partial")
    if not partial.exists():
        fail(f"no report at {report} (nor a partial one); see {log}")
    results = {}
    for line in partial.read_text().splitlines():
        if line.strip():
            results.update(json.loads(line))
    print(f"vllm_tests: {partial}: a run cut short, {len(results)} tests", file=sys.stderr)
    return results


def compare(version: str, stock: dict, proxima: dict) -> tuple[str, int]:
    """The markdown comparison of the tests both runs finished, and how many of them pass
    with stock only."""
    common = set(stock) & set(proxima)
    unmatched = len(set(stock) ^ set(proxima))
    stock = {t: r for t, r in stock.items() if t in common}
    proxima = {t: r for t, r in proxima.items() if t in common}
    lines = [f"## vLLM {version}: stock's pool vs Proxima's", "",
             f"{len(common)} tests finished in both runs"
             + (f" ({unmatched} more in one run only: a run cut short)" if unmatched else "")
             + ".", "",
             "| pool | " + " | ".join(OUTCOMES) + " | built Proxima's pool |",
             "|---|" + "---|" * (len(OUTCOMES) + 1)]
    for name, results in (("stock", stock), ("Proxima", proxima)):
        counts = Counter(r["outcome"] for r in results.values())
        used = sum(1 for r in results.values() if r.get("pools"))
        lines.append(f"| {name} | " + " | ".join(str(counts[o]) for o in OUTCOMES)
                     + f" | {used if name == 'Proxima' else '-'} |")
    differ = sorted(t for t in common if stock[t]["outcome"] != proxima[t]["outcome"])
    worse = [t for t in differ if stock[t]["outcome"] == "passed"]
    lines += ["", f"{len(differ)} tests differ ({len(worse)} pass with stock only):", ""]
    for t in differ:
        s, p = stock[t], proxima[t]
        lines.append(f"- `{t}`: stock {s['outcome']}, Proxima {p['outcome']}: "
                     f"{p['message'] or s['message']}")
    return "\n".join(lines) + "\n", len(worse)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--sdist", type=Path, help="vLLM's sdist (default: from PyPI)")
    source.add_argument("--git-dir", type=Path, help="a git mirror of vLLM with its tags")
    parser.add_argument("--work", type=Path, default=ROOT / ".dev" / "vllm-tests")
    parser.add_argument("--only", choices=["stock", "proxima", "none"],
                        help="run one pool only, or none: the last reports are compared "
                             "(a run cut short: the tests it finished)")
    parser.add_argument("--parallel", action="store_true",
                        help="run both pools at once (two pytest processes)")
    parser.add_argument("paths", nargs="*", help=f"test paths (default: {TEST_PATHS})")
    args, extra = parser.parse_known_args(argv)
    for given in (args.sdist, args.git_dir):
        if given is not None and not given.exists():
            fail(f"{given} does not exist")
    version = installed_version("vllm")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"vllm-{version}"
    if not (src / ".complete").exists():
        if src.exists():
            subprocess.run(["rm", "-rf", str(src)], check=True)
        sdist = args.sdist
        if sdist is None and args.git_dir is None:
            sdist = sdist_from_pypi(version, work)
        unpack(sdist, args.git_dir, version, src)
        (src / ".complete").touch()
    if not (work / "deps" / ".complete").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", str(work / "deps"), *DEPS], check=True)
        (work / "deps" / ".complete").touch()
    paths = args.paths or [p for p in TEST_PATHS if (src / p).exists()]
    waits = {}                      # mode -> a function returning its report
    for mode in ("stock", "proxima"):
        if args.only not in (None, mode):
            previous = work / f"{version}-{mode}.json"
            waits[mode] = lambda previous=previous, mode=mode: read_report(
                previous, work / f"{version}-{mode}.log")
            continue
        waits[mode] = run_pytest(mode, src, work, version, paths, extra)
        if not args.parallel:
            done = waits[mode]()
            waits[mode] = lambda done=done: done
    results = {mode: wait() for mode, wait in waits.items()}
    text, worse = compare(version, results["stock"], results["proxima"])
    (work / f"{version}-diff.md").write_text(text)
    print(text)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
