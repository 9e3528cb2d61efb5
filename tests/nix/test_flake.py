"""The flake, evaluated on this machine: syntax of every .nix file, `nix flake check
--no-build` against the stub nixpkgs, and the image's configuration as users will get it."""

from __future__ import annotations

import json
import re
import subprocess

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
    flags = flake.eval_json(f"{PKGS}.vllm.stubArgs.cmakeFlags")
    assert len(flags) == 1 and flags[0].startswith("-DFETCHCONTENT_SOURCE_DIR_CUTLASS=/nix/store/")
    assert flags[0].endswith("-cutlass-source"), flags
    env = flake.eval_json(f"{PKGS}.vllm.stubArgs.env")
    assert env["SETUPTOOLS_SCM_PRETEND_VERSION"] == "0.6.3.post1"


def test_gpu_checks_need_the_cuda_feature_and_cpu_checks_do_not(flake):
    checks = f"checks.{SYSTEM}"
    names = set(json.loads(flake.nix("eval", "--json", f".#{checks}",
                                     "--apply", "builtins.attrNames").stdout))
    assert {"proxima", "cpu-tests", "image-config", "cuda-pin", "gpu-selfcheck",
            "gpu-tests"} <= names
    for gpu in ("gpu-selfcheck", "gpu-tests"):
        assert flake.eval_json(f"{checks}.{gpu}.requiredSystemFeatures") == ["cuda"]
    cpu = json.loads(flake.nix("eval", "--json", f".#{checks}.cpu-tests",
                               "--apply", "d: d.requiredSystemFeatures or []").stdout)
    assert cpu == []


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
