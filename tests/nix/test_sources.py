"""The pins in nix/sources.nix are real: the hashes match the files they name, and every patch
in nix/patches/ applies to the pinned vLLM. Downloads come from PyPI once and are cached under
~/.cache/proxima/sources (PROXIMA_CACHE overrides ~/.cache/proxima)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
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


def test_sri_hashes_agree_with_the_hex_digests(sources):
    pinned = [s for s in sources.values() if isinstance(s, dict) and "sha256" in s]
    assert len(pinned) >= 2
    for pin in pinned:
        assert pin["hash"] == sri(pin["sha256"]), pin


def test_cuda_pin_is_12_1_with_the_required_capabilities(sources):
    assert sources["cuda"]["version"] == "12.1"
    assert sources["cuda"]["attr"] == "cudaPackages_12_1"
    assert {"8.0", "8.6", "8.9", "9.0"} <= set(sources["cuda"]["capabilities"])


@pytest.mark.parametrize("name", ["vllm", "uvicorn-worker"])
def test_pinned_file_has_the_pinned_hash(sources, name):
    pin = sources[name]
    path = fetch(pin["url"], pin["sha256"])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pin["sha256"], (
        f"{pin['url']} does not match nix/sources.nix: the upstream file changed or the pin is wrong")


def test_patches_apply_to_the_pinned_vllm(sources, tmp_path, require):
    require("patch")
    pin = sources["vllm"]
    with tarfile.open(fetch(pin["url"], pin["sha256"])) as tar:
        tar.extractall(tmp_path, filter="data")
    tree = tmp_path / f"vllm-{pin['version']}"
    # The CUTLASS tag nix/sources.nix provides is the one vLLM's CMake would fetch.
    assert f"GIT_TAG {sources['cutlass']['rev']}" in (tree / "CMakeLists.txt").read_text()
    # Proxima hooks in through this entry-point group and needs no source patch.
    assert "vllm.general_plugins" in (tree / "vllm" / "plugins" / "__init__.py").read_text()
    patches = sorted((REPO / "nix" / "patches").glob("*.patch"))
    assert patches, "nix/patches/ is empty"
    for patch in patches:
        proc = subprocess.run(["patch", "-p1", "--forward", "-i", str(patch)], cwd=tree,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}"
    assert 'os.environ.get("cmakeFlags", "")' in (tree / "setup.py").read_text()
