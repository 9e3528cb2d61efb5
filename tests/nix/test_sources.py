"""The pins in nix/sources.nix are real: the hashes match the files they name, and every patch
in nix/patches/ applies to the pinned vLLM. Downloads come from PyPI once and are cached under
~/.cache/proxima/sources (PROXIMA_CACHE overrides ~/.cache/proxima)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PROXIMA_CACHE", Path.home() / ".cache" / "proxima")) / "sources"


@pytest.fixture(scope="module")
def sources(nix_env, require):
    require("nix-instantiate")
    out = subprocess.run(
        ["nix-instantiate", "--eval", "--strict", "--json", str(REPO / "nix" / "sources.nix")],
        env=nix_env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out)


def sri(hex_digest: str) -> str:
    return "sha256-" + base64.b64encode(bytes.fromhex(hex_digest)).decode()


def fetch(url: str, sha256: str) -> Path:
    """The file at url, from the cache when it is there and intact."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / url.rsplit("/", 1)[1]
    if not (path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256):
        tmp = path.with_suffix(".part")
        try:
            with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f)
        except urllib.error.HTTPError as exc:
            pytest.fail(f"{url}: {exc} (the pinned URL is wrong or the file was removed)")
        except (urllib.error.URLError, OSError) as exc:
            pytest.skip(f"cannot download {url} (no route to PyPI?): {exc}")
        tmp.replace(path)
    return path


def pypi_pins(sources) -> dict:
    """name -> pin of every file pinned by URL: vLLM and the PyPI fallbacks and pins."""
    return {"vllm": sources["vllm"], **sources["fallbacks"], **sources["newer"]}


def test_sri_hashes_agree_with_the_hex_digests(sources):
    pinned = pypi_pins(sources)
    assert len(pinned) >= 6
    for pin in pinned.values():
        assert pin["hash"] == sri(pin["sha256"]), pin


def test_cuda_pin_is_12_1_with_the_required_capabilities(sources):
    assert sources["cuda"]["version"] == "12.1"
    assert sources["cuda"]["attr"] == "cudaPackages_12_1"
    assert {"8.0", "8.6", "8.9", "9.0"} <= set(sources["cuda"]["capabilities"])


@pytest.mark.parametrize("name", ["vllm", "uvicorn-worker", "compressed-tensors",
                                  "mistral-common", "partial-json-parser", "gunicorn"])
def test_pinned_file_has_the_pinned_hash(sources, name):
    pin = pypi_pins(sources)[name]
    path = fetch(pin["url"], pin["sha256"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pin["sha256"], (
        f"{pin['url']} does not match nix/sources.nix: the upstream file changed or the pin is wrong")


def test_patches_apply_to_the_pinned_vllm(sources, tmp_path, require):
    require("patch")
    pin = sources["vllm"]
    with tarfile.open(fetch(pin["url"], pin["sha256"])) as tar:
        tar.extractall(tmp_path, filter="data")
    tree = tmp_path / f"vllm-{pin['version']}"
    # The CUTLASS tag and the flash-attention commit nix/sources.nix provides are the ones
    # vLLM's CMake would fetch.
    cmake = (tree / "CMakeLists.txt").read_text()
    assert f"GIT_TAG {sources['cutlass']['rev']}" in cmake
    flash = re.search(r"GIT_REPOSITORY https://github.com/vllm-project/flash-attention.git\s+"
                      r"GIT_TAG (\w+)", cmake)
    assert flash and flash[1] == sources["flash-attention"]["rev"]
    # Proxima hooks in through this entry-point group and needs no source patch.
    assert "vllm.general_plugins" in (tree / "vllm" / "plugins" / "__init__.py").read_text()
    patches = sorted((REPO / "nix" / "patches").glob("*.patch"))
    assert patches, "nix/patches/ is empty"
    for patch in patches:
        proc = subprocess.run(["patch", "-p1", "--forward", "-i", str(patch)], cwd=tree,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}"
    assert 'os.environ.get("cmakeFlags", "")' in (tree / "setup.py").read_text()


# ---- what the stub nixpkgs knows of these sdists is what they say (tests/nix/stub-nixpkgs) --

STUB_SDISTS = REPO / "tests" / "nix" / "stub-nixpkgs" / "sdists.nix"
# uvicorn-worker 0.4.0 is no longer pinned, but the stub knows it: the test that breaks the pin
# on purpose (tests/nix/test_flake.py) moves back to it.
UVICORN_WORKER_040 = {
    "version": "0.4.0",
    "url": "https://files.pythonhosted.org/packages/80/59/9101b9c0680fd80e9d26c07deb822a5d18a324339fcf9cd017885ee808ad/uvicorn_worker-0.4.0.tar.gz",
    "sha256": "8ee5306070d8f38dce124adce488c3c0b50f20cf0c0222b12c66188da7214493",
}


@pytest.fixture(scope="module")
def stub_sdists(nix_env, require):
    require("nix-instantiate")
    out = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", str(STUB_SDISTS)],
                         env=nix_env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def sdist_tree(pin: dict, dest: Path) -> Path:
    with tarfile.open(fetch(pin["url"], pin["sha256"])) as tar:
        tar.extractall(dest, filter="data")
    (tree,) = [p for p in dest.iterdir() if p.is_dir()]
    return tree


def requires_dist(tree: Path) -> list[str]:
    """The sdist's unconditional-or-marker Requires-Dist (extras left out), as it declares them."""
    head = (tree / "PKG-INFO").read_text().split("\n\n", 1)[0]
    found = [line.split(":", 1)[1].strip() for line in head.splitlines()
             if line.startswith("Requires-Dist:")]
    if not found:                                 # old metadata: only egg-info has them
        (requires,) = tree.glob("**/*.egg-info/requires.txt")
        found = requires.read_text().split("\n\n", 1)[0].split()
    return [r for r in found if "extra ==" not in r]


def sdist_pins(sources) -> dict:
    pins = {f"{name}-{pin['version']}": pin for name, pin in pypi_pins(sources).items()}
    pins["uvicorn-worker-0.4.0"] = UVICORN_WORKER_040
    return pins


def test_the_stub_knows_every_pinned_sdist(sources, stub_sdists):
    assert set(sdist_pins(sources)) == set(stub_sdists)


@pytest.mark.parametrize("key", ["vllm-0.6.3.post1", "uvicorn-worker-0.3.0", "gunicorn-25.1.0",
                                 "uvicorn-worker-0.4.0", "compressed-tensors-0.6.0",
                                 "mistral-common-1.4.4", "partial-json-parser-0.2.1.1.post4"])
def test_the_stubs_record_of_an_sdist_is_what_the_sdist_says(sources, stub_sdists, key, tmp_path):
    tomllib = pytest.importorskip("tomllib")
    recorded = stub_sdists[key]
    pin = sdist_pins(sources)[key]
    if pin.get("format") == "wheel":                  # METADATA of the wheel; no build system
        with zipfile.ZipFile(fetch(pin["url"], pin["sha256"])) as zf:
            meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
        head = meta.decode().split("\n\n", 1)[0]
        found = [l.split(":", 1)[1].strip() for l in head.splitlines()
                 if l.startswith("Requires-Dist:") and "extra ==" not in l]
        assert recorded["requiresDist"] == found and "buildSystem" not in recorded
        return
    tree = sdist_tree(pin, tmp_path)
    assert recorded["requiresDist"] == requires_dist(tree)
    actual = tomllib.loads((tree / "pyproject.toml").read_text()).get("build-system")
    stub = tomllib.loads(recorded["buildSystem"])["build-system"] if recorded["buildSystem"] else None
    assert stub == actual
    if "fetchContent" in recorded:
        declared = re.findall(r"FetchContent_Declare\(\s*([\w-]+)", (tree / "CMakeLists.txt").read_text())
        assert set(recorded["fetchContent"]) == set(declared)
        for name, var in recorded["fetchContent"].items():
            # CMake's own FETCHCONTENT_SOURCE_DIR_<NAME>, or a variable the file reads
            assert var == f"FETCHCONTENT_SOURCE_DIR_{name.upper()}" or \
                f"if({var})" in (tree / "CMakeLists.txt").read_text(), (name, var)


def test_vllms_requirement_names_are_its_requires_dist(sources, tmp_path):
    """sources.vllm.requires: the names whose markers hold for the image (Linux x86_64,
    Python 3.12), normalized as nixpkgs names packages."""
    tree = sdist_tree(sources["vllm"], tmp_path)
    names = set()
    for req in requires_dist(tree):
        spec, _, marker = req.partition(";")
        marker = marker.strip()
        if marker.startswith("python_version < "):
            continue                                        # < "3.9": not for 3.12
        name = re.match(r"[A-Za-z0-9_.-]+", spec.strip())[0]
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    assert sorted(sources["vllm"]["requires"]) == sorted(names)
