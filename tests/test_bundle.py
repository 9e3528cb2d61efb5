"""`proxima bundle`: one directory that installs and serves without network.

The offline path is tested for real: a fresh venv installs Proxima from the bundle's
wheelhouse with `pip --no-index` and no other package source."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest

from proxima import __version__
from proxima.bundle import SUMS, verify, write_bundle, write_tar
from proxima.errors import UserError


def docker_archive(path: Path, tag: str = "proxima:test") -> Path:
    """A minimal `docker load`-able archive: manifest.json, a config and one layer."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        data = b"hello\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    members = {
        "layer.tar": layer.getvalue(),
        "config.json": json.dumps({"config": {"Entrypoint": ["proxima", "serve"]}}).encode(),
        "manifest.json": json.dumps([{"Config": "config.json", "RepoTags": [tag],
                                      "Layers": ["layer.tar"]}]).encode(),
    }
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Proxima's wheel, built once from this checkout (the bundle's own builder)."""
    from proxima.bundle import build_wheelhouse
    dest = tmp_path_factory.mktemp("wheel") / "wh"
    build_wheelhouse(dest, wheel=None, extras=[])
    (whl,) = dest.glob("proxima-*.whl")
    return whl


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, wheel) -> Path:
    tmp = tmp_path_factory.mktemp("bundle")
    model = tmp / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    image = docker_archive(tmp / "proxima-oci.tar")
    return write_bundle(tmp / "out", images=[image], model=model, wheel=wheel)


def test_layout(bundle):
    names = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert {"README.md", SUMS, "image/proxima-oci.tar", "models/tiny/config.json"} <= names
    assert any(n.startswith("wheelhouse/proxima-") and n.endswith(".whl") for n in names)
    readme = (bundle / "README.md").read_text()
    assert "docker load -i image/proxima-oci.tar" in readme
    assert "docker run --gpus all" in readme and "proxima:test /models/tiny" in readme
    assert "--no-index --find-links wheelhouse proxima" in readme


def test_sha256sums_cover_every_file_and_sha256sum_agrees(bundle):
    listed = {line.split("  ", 1)[1] for line in (bundle / SUMS).read_text().splitlines()}
    present = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert listed == present - {SUMS}
    assert verify(bundle) == []
    if shutil.which("sha256sum"):
        done = subprocess.run(["sha256sum", "--quiet", "-c", SUMS], cwd=bundle,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_verify_names_a_changed_a_missing_and_an_extra_file(bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    (copy / "models" / "tiny" / "config.json").write_text("{}")
    (copy / "image" / "proxima-oci.tar").unlink()
    (copy / "stray.txt").write_text("x")
    assert verify(copy) == ["image/proxima-oci.tar: missing",
                            "models/tiny/config.json: checksum differs",
                            f"stray.txt: not listed in {SUMS}"]
    done = subprocess.run([sys.executable, "-m", "proxima.bundle", "--verify", str(copy)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "3 file(s)" in done.stderr


def clean_pip_env() -> dict:
    """pip with no configuration: no index, no find-links but the ones given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_offline_install_from_the_wheelhouse(bundle, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    done = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--find-links",
                           str(bundle / "wheelhouse"), "proxima"],
                          capture_output=True, text=True, env=clean_pip_env(), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = subprocess.run([str(env_dir / "bin" / "proxima"), "--version"],
                         capture_output=True, text=True, env=clean_pip_env())
    assert out.returncode == 0 and out.stdout.strip() == f"proxima {__version__}"
    # It is the wheel's copy that runs, not this checkout's.
    where = subprocess.run([str(py), "-c", "import proxima; print(proxima.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path).stdout
    assert str(env_dir) in where


def test_tarball_is_reproducible(bundle, tmp_path):
    copy = tmp_path / bundle.name
    shutil.copytree(bundle, copy)
    first = write_tar(copy).read_bytes()
    os.utime(copy / "README.md", (12345, 12345))
    second = write_tar(copy).read_bytes()
    assert first == second
    with tarfile.open(copy.with_name(copy.name + ".tar")) as t:
        assert f"{copy.name}/{SUMS}" in t.getnames()


def test_refuses_a_non_empty_out_a_missing_model_and_a_non_image(tmp_path, wheel):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(UserError, match="not an empty directory"):
        write_bundle(tmp_path / "busy", wheel=wheel)
    with pytest.raises(UserError, match="not a directory"):
        write_bundle(tmp_path / "b1", model=tmp_path / "nope", wheel=wheel)
    not_image = tmp_path / "plain.tar"
    with tarfile.open(not_image, "w") as t:
        t.add(__file__, arcname="x.py")
    with pytest.raises(UserError, match="not a docker-archive"):
        write_bundle(tmp_path / "b2", images=[not_image], wheel=wheel)


def test_without_a_model_it_says_how_to_mount_one(tmp_path, wheel):
    out = write_bundle(tmp_path / "b", wheel=wheel)
    text = (out / "models" / "README.md").read_text()
    assert "-v /models:/models" in text
    assert verify(out) == []


def test_nix_closure_exports_and_imports_into_another_store(tmp_path, wheel):
    if shutil.which("nix-store") is None:
        pytest.skip("nix-store not installed (CI installs it: bash nix/ci-checks.sh)")
    conf = tmp_path / "nixconf"
    conf.mkdir()
    (conf / "nix.conf").write_text("build-users-group =\nsandbox = false\nsubstituters =\n")
    env = dict(os.environ, NIX_CONF_DIR=str(conf), NIX_USER_CONF_FILES=str(conf / "nix.conf"))
    payload = tmp_path / "payload.txt"
    payload.write_text("proxima closure test\n")
    add = subprocess.run(["nix-store", "--add", str(payload)], capture_output=True, text=True,
                         env=env)
    if add.returncode != 0:
        pytest.skip(f"this user cannot write /nix/store: {add.stderr.strip()}")
    store_path = add.stdout.strip()
    old = dict(os.environ)
    os.environ.update(env)
    try:
        out = write_bundle(tmp_path / "b", wheel=wheel, nix_closure=store_path)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert (out / "nix" / "store-path").read_text().strip() == store_path
    other = tmp_path / "other-store"
    with open(out / "nix" / "closure.nar", "rb") as fh:
        imp = subprocess.run(["nix-store", "--store", str(other), "--import"], stdin=fh,
                             capture_output=True, text=True, env=env)
    assert imp.returncode == 0, imp.stderr
    assert (other / store_path.lstrip("/")).read_text() == "proxima closure test\n"
    assert "nix-store --import < nix/closure.nar" in (out / "README.md").read_text()


def test_a_streaming_image_script_is_run_and_its_archive_kept(tmp_path, wheel):
    """`nix build .#proxima-image` leaves a script that writes the image to stdout."""
    archive = docker_archive(tmp_path / "made.tar", tag="proxima:0.1.0-cuda12.1")
    script = tmp_path / "result"
    script.write_text(f"#!/bin/sh\nexec cat {archive}\n")
    script.chmod(0o755)
    out = write_bundle(tmp_path / "b", images=[script], wheel=wheel)
    kept = out / "image" / "result.tar"
    assert kept.read_bytes() == archive.read_bytes()
    assert "docker load -i image/result.tar" in (out / "README.md").read_text()
    assert "proxima:0.1.0-cuda12.1" in (out / "README.md").read_text()
    failing = tmp_path / "broken"
    failing.write_text("#!/bin/sh\necho 'no space left' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(UserError, match="exit 3.*no space left"):
        write_bundle(tmp_path / "b2", images=[failing], wheel=wheel)
