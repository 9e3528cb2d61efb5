"""The flake, evaluated on this machine: syntax of every .nix file, `nix flake check
--no-build` against the stub nixpkgs, and the image's configuration as users will get it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "x86_64-linux"
PKGS = f"packages.{SYSTEM}"


def nix_files():
    return sorted(p for p in REPO.rglob("*.nix") if ".git" not in p.parts)


def test_every_nix_file_parses(nix_env, require):
    require("nix-instantiate")
    files = nix_files()
    assert REPO / "flake.nix" in files and len(files) >= 8, files
    for path in files:
        proc = subprocess.run(["nix-instantiate", "--parse", str(path)], env=nix_env,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{path.relative_to(REPO)}:\n{proc.stderr}"


def test_flake_check_no_build_passes(flake):
    proc = flake.check()
    assert proc.returncode == 0, proc.stderr


def test_flake_lock_pins_nixos_24_11():
    lock = json.loads((REPO / "flake.lock").read_text())
    node = lock["nodes"][lock["nodes"]["root"]["inputs"]["nixpkgs"]]
    assert node["original"] == {"owner": "NixOS", "repo": "nixpkgs", "ref": "nixos-24.11",
                                "type": "github"}
    locked = node["locked"]
    assert locked["type"] == "github" and locked["owner"] == "NixOS"
    assert re.fullmatch(r"[0-9a-f]{40}", locked["rev"])
    assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked["narHash"])
    assert lock["version"] == 7


def test_image_config(flake):
    cfg = flake.eval_json(f"{PKGS}.proxima-image.imageConfig")
    entry = cfg["Entrypoint"]
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-[^/]+/bin/proxima", entry[0]), entry
    assert entry[1:] == ["serve"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["PROXIMA_ALLOCATOR"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    # Both places where the NVIDIA Container Toolkit may put the driver libraries.
    assert {"/usr/lib64", "/usr/lib/x86_64-linux-gnu"} <= set(env["LD_LIBRARY_PATH"].split(":"))
    assert env["PATH"] == entry[0].rsplit("/", 1)[0]
    assert cfg["ExposedPorts"] == {"8000/tcp": {}}
    assert "/models" in cfg["Volumes"]
    labels = cfg["Labels"]
    assert labels["ai.proxima.cuda.version"] == "12.1"
    assert labels["ai.proxima.vllm.version"] == "0.6.3.post1"
    assert labels["org.opencontainers.image.title"] == "proxima"
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert labels["org.opencontainers.image.version"] == version
    assert {"8.0", "8.6", "8.9", "9.0"} <= set(labels["ai.proxima.cuda.capabilities"].split(","))
    # Not root; a health check on /health with the image's own Python; Triton's C compiler;
    # the CA bundle.
    assert cfg["User"] == "1000:1000"
    hc = cfg["Healthcheck"]
    assert hc["Test"][0] == "CMD" and hc["Test"][1] == entry[0].rsplit("/", 1)[0] + "/python"
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-healthcheck\.py", hc["Test"][2])
    assert hc["Interval"] == 30 * 10**9 and hc["Retries"] == 3 and hc["StartPeriod"] >= 600 * 10**9
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-gcc-wrapper-[0-9.]+/bin/cc", env["CC"])
    assert env["SSL_CERT_FILE"].endswith("/etc/ssl/certs/ca-bundle.crt")


def test_tarball_variant_has_the_same_config(flake):
    stream = flake.eval_json(f"{PKGS}.proxima-image.imageConfig")
    tarball = flake.eval_json(f"{PKGS}.proxima-image-tarball.stream.imageConfig")
    assert stream == tarball
    assert flake.eval_json(f"{PKGS}.proxima-image.isExe") is True


def test_cuda_is_pinned_to_12_1_everywhere(flake):
    assert flake.eval_json(f"{PKGS}.vllm.version") == "0.6.3.post1"
    assert flake.eval_json(f"checks.{SYSTEM}.cuda-pin.name") == "proxima-cuda-pin"


def test_vllm_override_uses_the_pinned_source_and_patches(flake):
    args = flake.eval_json(f"{PKGS}.vllm.stubArgs.patches")
    # Store paths of patches: /nix/store/<hash>-<name>.
    assert [p.split("/")[-1].split("-", 1)[1] for p in args] == [
        "0001-setup.py-pass-nix-cmakeFlags-to-cmake.patch"]
    env = flake.eval_json(f"{PKGS}.vllm.stubArgs.env")
    assert env["SETUPTOOLS_SCM_PRETEND_VERSION"] == "0.6.3.post1"
    post = flake.eval_json(f"{PKGS}.vllm.stubArgs.postPatch")
    assert """--replace-fail '"torch == 2.4.0",' '"torch",'""" in post


def test_vllm_cmake_flags_keep_nixpkgs_and_pin_both_fetchcontent_sources(flake):
    """nixos-24.11's flags stay (architectures, the merged CUDA 12.1 root, cuDNN/cuFile/cuBLAS);
    CUTLASS and flash-attention come from the pins, once each."""
    flags = flake.eval_json(f"{PKGS}.vllm.stubArgs.cmakeFlags")
    by_name = {}
    for flag in flags:
        name, _, value = flag[2:].partition("=")
        assert name not in by_name, f"{name} given twice: {flags}"
        by_name[name] = value
    assert by_name["TORCH_CUDA_ARCH_LIST"] == "8.0;8.6;8.9;9.0"
    assert by_name["CUTLASS_NVCC_ARCHS_ENABLED"] == "80;86;89;90"
    assert by_name["CUDA_TOOLKIT_ROOT_DIR"].endswith("-cuda-merged-12.1")
    assert {by_name[k] for k in ("CAFFE2_USE_CUDNN", "CAFFE2_USE_CUFILE", "CUTLASS_ENABLE_CUBLAS")} == {"ON"}
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-cutlass-source", by_name["FETCHCONTENT_SOURCE_DIR_CUTLASS"])
    assert re.fullmatch(r"/nix/store/[a-z0-9]{32}-flash-attention-source-with-cutlass",
                        by_name["VLLM_FLASH_ATTN_SRC_DIR"])
    src = flake.eval_json(f"{PKGS}.vllm.passthru.flashAttention.buildCommand")
    assert "-flash-attention-source" in src and "ln -s /nix/store/" in src and "csrc/cutlass" in src


def test_vllm_gets_every_requirement_that_the_0_6_2_expression_lacks(flake):
    added = flake.eval_json(f"{PKGS}.vllm.passthru.proximaAddedDependencies")
    assert {"compressed-tensors", "mistral-common", "partial-json-parser", "nvidia-ml-py"} <= set(added)
    deps = json.loads(flake.nix("eval", "--json", f".#{PKGS}.vllm.stubArgs.dependencies",
                                "--apply", "map (d: d.name)").stdout)
    # nixos-24.11 has no mistral-common: the PyPI fallback (nix/sources.nix) is used.
    assert "python312-mistral-common-1.4.4" in deps
    assert "python312-uvicorn-worker-0.3.0" in json.loads(flake.nix(
        "eval", "--json", f".#{PKGS}.proxima.stubArgs.dependencies",
        "--apply", "map (d: d.name)").stdout)


def test_the_nix_build_of_proxima_rewrites_the_spdx_license(flake):
    post = flake.eval_json(f"{PKGS}.proxima.stubArgs.postPatch")
    assert """--replace-fail 'license = "Apache-2.0"' 'license = { text = "Apache-2.0" }'""" in post
    assert """--replace-fail '"setuptools>=77"' '"setuptools"'""" in post


def test_gpu_check_lives_outside_the_flake_checks(flake):
    """`nix flake check` on a CPU builder needs no GPU and no CUDA build; the GPU check is
    proxima.gpuCheck (requiredSystemFeatures = cuda) and `nix run .#gpu-check`."""
    checks = f"checks.{SYSTEM}"
    names = set(json.loads(flake.nix("eval", "--json", f".#{checks}",
                                     "--apply", "builtins.attrNames").stdout))
    assert names == {"cpu-tests", "image-config", "cuda-pin", "gpu-check-wired"}
    for name in names:
        feats = json.loads(flake.nix("eval", "--json", f".#{checks}.{name}",
                                     "--apply", "d: d.requiredSystemFeatures or []").stdout)
        assert feats == [], (name, feats)
    gpu = f"{PKGS}.proxima.gpuCheck"
    assert flake.eval_json(f"{gpu}.requiredSystemFeatures") == ["cuda"]
    script = flake.eval_json(f"{gpu}.buildCommand")
    assert re.search(r"python /nix/store/[a-z0-9]{32}-gpu-check\.py --out \$out", script), script
    assert flake.eval_json(f"{gpu}.CC").endswith("-gcc-wrapper-13.3.0/bin/cc")
    assert flake.eval_json(f"{gpu}.PROXIMA_HEALTHCHECK").endswith("-healthcheck.py")
    app = flake.eval_json(f"apps.{SYSTEM}.gpu-check")
    assert app["type"] == "app" and app["program"].endswith("/bin/proxima-gpu-check")


def test_cpu_checks_need_no_cuda_build(flake):
    """Everything `nix flake check` builds on a CPU builder: no torch, vLLM, triton or CUDA."""
    for check in ("cpu-tests", "image-config", "cuda-pin", "gpu-check-wired"):
        drvs = json.loads(flake.nix("show-derivation", "-r",
                                    f".#checks.{SYSTEM}.{check}").stdout)
        names = sorted(d["env"].get("name", "") for d in drvs.values())
        names.remove(f"proxima-{check}")
        assert check != "cpu-tests" or "python312-proxima-core-0.1.0" in names, names
        heavy = [n for n in names if re.search(r"vllm|torch|triton|cuda|xformers|cupy", n)]
        assert heavy == [], (check, heavy)
    core = json.loads(flake.nix("eval", "--json", f".#{PKGS}.proxima.core.stubArgs.dependencies",
                                "--apply", "map (d: d.name)").stdout)
    assert core == []


def test_apps_run_proxima_subcommands(flake):
    for app in ("serve", "selfcheck", "default"):
        got = flake.eval_json(f"apps.{SYSTEM}.{app}")
        assert got["type"] == "app"
        want = "serve" if app == "default" else app
        assert got["program"].endswith(f"/bin/proxima-{want}"), got


@pytest.mark.parametrize(
    ("path", "old", "new", "message"),
    [
        ("nix/image.nix", '"PROXIMA_ALLOCATOR=1"', '"PROXIMA_ALLOCATOR=0"',
         "Env must set PROXIMA_ALLOCATOR=1"),
        ("nix/image.nix", '"8000/tcp" = { };', '"8080/tcp" = { };', "port 8000/tcp"),
        ("nix/sources.nix", 'attr = "cudaPackages_12_1";', 'attr = "cudaPackages_12_4";',
         "cudaPackages is CUDA 12.4, the pin is 12.1"),
        ("nix/image.nix", '"serve"\n    ];', '"selfcheck"\n    ];', "must end in `serve`"),
        ("nix/image.nix", 'User = "${toString uid}:${toString gid}";', 'User = "0:0";',
         "must run as a non-root user, User is 0:0"),
        ("nix/image.nix", '"${healthcheck}"', '"/bin/true"', "must declare a health check"),
        # item 3: what nixpkgs' build would reject, rejected by the stub at evaluation
        ("nix/vllm.nix", '      (lib.cmakeFeature "VLLM_FLASH_ATTN_SRC_DIR" "${flashAttention}")\n',
         "", "FetchContent would git-clone vllm-flash-attn"),
        ("nix/vllm.nix", "cmakeFlags = lib.filter (flag: !isSourceFlag flag) (old.cmakeFlags or [ ]) ++ [",
         "cmakeFlags = [", "must pass -DTORCH_CUDA_ARCH_LIST=8.0;8.6;8.9;9.0"),
        ("nix/vllm.nix", """substituteInPlace pyproject.toml --replace-fail '"torch == 2.4.0",' '"torch",'""",
         "", "pypa/build of vllm-0.6.3.post1: ERROR Missing dependencies: torch == 2.4.0 (the "
             "build environment has torch 2.5.1)"),
        ("nix/vllm.nix", "dependencies = (old.dependencies or [ ]) ++ map pythonPackage missing;",
         "dependencies = old.dependencies or [ ];", "- mistral-common not installed"),
        ("nix/sources.nix", 'version = "0.3.0";', 'version = "0.4.0";',
         "uvicorn>=0.36.0 not satisfied by version 0.30.6"),
        ("nix/package.nix", "inherit src postPatch;", "inherit src;",
         "`project.license` must be valid exactly by one definition"),
        ("nix/package.nix", "inherit src postPatch;", "inherit src;",
         "ERROR Missing dependencies: setuptools>=77 (the build environment has setuptools 75.1.0)"),
        ("nix/package.nix", 'requiredSystemFeatures = [ "cuda" ];', "",
         "proxima.passthru.gpuCheck must carry requiredSystemFeatures"),
    ],
)
def test_flake_check_catches_a_broken_appliance(fresh_flake, path, old, new, message):
    target = fresh_flake.root / path
    text = target.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    target.write_text(text.replace(old, new))
    proc = fresh_flake.check()
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


# ---- the postPatch of the Nix build, run for real against nixos-24.11's setuptools --------

CACHE = Path(os.environ.get("PROXIMA_CACHE", Path.home() / ".cache" / "proxima"))
# nixos-24.11's setuptools and the pypa/build its pypaBuildHook runs (no isolation).
NIXOS_24_11_BUILD = ["setuptools==75.1.0", "build==1.2.2", "wheel==0.44.0"]


@pytest.fixture(scope="module")
def setuptools_75(tmp_path_factory) -> Path:
    venv = CACHE / "nixos-24.11-build-venv"
    if not (venv / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                               *NIXOS_24_11_BUILD], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot install {NIXOS_24_11_BUILD} (no route to PyPI?): "
                        f"{done.stderr.strip()[-300:]}")
        (venv / ".complete").touch()
    return venv / "bin" / "python"


def substitute_in_place(text: str, script: str, file: str) -> str:
    """What `substituteInPlace FILE --replace-fail 'A' 'B'` lines of a script do to FILE."""
    for line in script.replace("\\\n", " ").splitlines():
        words = line.split()
        if not words or words[0] != "substituteInPlace" or file not in words[1:words.index(
                next(w for w in words if w.startswith("--")))]:
            continue
        for mode, a, b in re.findall(r"--replace(-fail|-warn)? '([^']*)' '([^']*)'", line):
            assert mode != "-fail" or a in text, f"--replace-fail {a!r}: not in {file}"
            text = text.replace(a, b)
    return text


def pypa_build(python: Path, tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "build", "--no-isolation", "--wheel",
                           "--outdir", str(tree / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300)


def test_the_postpatch_makes_the_wheel_build_with_nixos_24_11_setuptools(flake, setuptools_75,
                                                                           tmp_path):
    """pyproject.toml as it is fails with setuptools 75.1 + pypa/build (the Nix build on real
    nixos-24.11); after the package's postPatch it builds, and says the same license."""
    tree = tmp_path / "src"
    tree.mkdir()
    shutil.copy2(REPO / "pyproject.toml", tree)
    shutil.copy2(REPO / "README.md", tree)
    shutil.copytree(REPO / "proxima", tree / "proxima",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    before = pypa_build(setuptools_75, tree)
    assert before.returncode != 0
    assert "`project.license` must be valid" in before.stdout + before.stderr
    post = flake.eval_json(f"{PKGS}.proxima.stubArgs.postPatch")
    pyproject = tree / "pyproject.toml"
    original = pyproject.read_text()
    # Both of its lines are needed: the license alone still leaves setuptools>=77 unmet.
    license_only = "\n".join(l for l in post.splitlines() if "license" in l)
    pyproject.write_text(substitute_in_place(original, license_only, "pyproject.toml"))
    half = pypa_build(setuptools_75, tree)
    assert half.returncode != 0 and "Missing dependencies:\n\tsetuptools>=77" in half.stdout
    pyproject.write_text(substitute_in_place(original, post, "pyproject.toml"))
    after = pypa_build(setuptools_75, tree)
    assert after.returncode == 0, after.stdout[-2000:] + after.stderr[-2000:]
    (wheel,) = (tree / "dist").glob("proxima-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode()
    assert "License: Apache-2.0" in meta


# ---- the gunicorn of the Nix closure knows every setting `proxima serve` gives it ----------

SETTINGS_PROBE = """
import argparse, json
import gunicorn.config
from proxima.serve.gunicorn_conf import gunicorn_options
known = {s.name for s in gunicorn.config.KNOWN_SETTINGS}
options = gunicorn_options(argparse.Namespace(host="127.0.0.1", port=8000))
print(json.dumps({"version": __import__("gunicorn").__version__,
                  "unknown": sorted(set(options) - known)}))
"""


def settings_unknown_to(version: str) -> dict:
    target = CACHE / f"gunicorn-{version}"
    if not (target / ".complete").exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--target", str(target), f"gunicorn=={version}"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot install gunicorn {version}: {done.stderr.strip()[-300:]}")
        (target / ".complete").touch()
    probe = subprocess.run([sys.executable, "-c", SETTINGS_PROBE], capture_output=True,
                           text=True, env=dict(os.environ, PYTHONPATH=f"{target}:{REPO}"))
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout)


def test_the_nix_gunicorn_knows_every_setting_that_proxima_serve_sets(flake):
    deps = json.loads(flake.nix("eval", "--json", f".#{PKGS}.proxima.stubArgs.dependencies",
                                "--apply", "map (d: d.name)").stdout)
    (name,) = [d for d in deps if d.startswith("python312-gunicorn-")]
    version = name.rsplit("-", 1)[1]
    assert settings_unknown_to(version) == {"version": version, "unknown": []}
    # nixos-24.11's own gunicorn would not do: why nix/sources.nix pins a newer one.
    assert settings_unknown_to("23.0.0")["unknown"] == ["control_socket_disable"]
