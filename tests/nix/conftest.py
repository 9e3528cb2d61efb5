"""Shared fixtures for the flake tests: a Nix that needs no daemon, no network and no cache.

Debian's nix-bin (2.8) runs as root against /nix/store with the settings below. Real nixpkgs
cannot be fetched here, so the flake is evaluated against tests/nix/stub-nixpkgs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "tests" / "nix" / "stub-nixpkgs"
SYSTEM = "x86_64-linux"

NIX_CONF = """\
experimental-features = nix-command flakes
build-users-group =
substituters =
sandbox = false
"""


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (CI installs it: bash nix/ci-checks.sh)")
    return path


@pytest.fixture(scope="session")
def require():
    """require("tool") -> its path, or skip the test with the reason."""
    return need


@pytest.fixture(scope="session")
def nix_env(tmp_path_factory) -> dict:
    need("nix")
    conf = tmp_path_factory.mktemp("nixconf")
    (conf / "nix.conf").write_text(NIX_CONF)
    env = dict(os.environ, NIX_CONF_DIR=str(conf))
    # The user's own nix.conf files must not change what is tested.
    env.pop("NIX_USER_CONF_FILES", None)
    env["NIX_USER_CONF_FILES"] = str(conf / "nix.conf")
    return env


def copy_tree(dst: Path) -> Path:
    """The flake's files as a plain directory (a `path:` flake sees untracked files too)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=REPO, check=True, capture_output=True,
        ).stdout.decode().split("\0")
        files = [f for f in listed if f and (REPO / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts]
    for rel in files:
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dst


class Flake:
    def __init__(self, root: Path, env: dict):
        self.root, self.env = root, env

    def nix(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["nix", *args, "--override-input", "nixpkgs", f"path:{STUB}"],
            cwd=self.root, env=self.env, capture_output=True, text=True, timeout=600,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"nix {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def eval_json(self, attr: str):
        return json.loads(self.nix("eval", "--json", f".#{attr}").stdout)

    def check(self) -> subprocess.CompletedProcess:
        return self.nix("flake", "check", "--no-build", check=False)


@pytest.fixture(scope="session")
def flake(nix_env, tmp_path_factory) -> Flake:
    return Flake(copy_tree(tmp_path_factory.mktemp("flake")), nix_env)


@pytest.fixture
def fresh_flake(nix_env, tmp_path) -> Flake:
    """A private copy that a test may edit (to show that a check can fail)."""
    return Flake(copy_tree(tmp_path / "flake"), nix_env)
