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
from proxima.bundle import SUMS, verify, write_bundle, write_sums, write_tar
from proxima.bundle_install import check_machine, requirements, Refused
from proxima.bundle_wheelhouse import build_wheel, project_root
from proxima.errors import UserError


def docker_archive(path: Path, tag: str = "proxima:test", labels: dict | None = None) -> Path:
    """A minimal `docker load`-able archive: manifest.json, a config and one layer."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        data = b"hello\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    members = {
        "layer.tar": layer.getvalue(),
        "config.json": json.dumps({"config": {"Entrypoint": ["proxima", "serve"],
                                              "Labels": labels or {}}}).encode(),
        "manifest.json": json.dumps([{"Config": "config.json", "RepoTags": [tag],
                                      "Layers": ["layer.tar"]}]).encode(),
    }
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


# The labels of the Nix image (nix/image.nix): the card stack on CUDA 12.1.
CARD = {"ai.proxima.stack": "card", "ai.proxima.cuda.version": "12.1",
        "ai.proxima.vllm.version": "0.6.3.post1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Proxima's wheel, built once from this checkout (the bundle's own builder)."""
    dest = tmp_path_factory.mktemp("wheel")
    build_wheel(project_root(), dest)
    (whl,) = dest.glob("proxima-*.whl")
    return whl


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, wheel) -> Path:
    tmp = tmp_path_factory.mktemp("bundle")
    model = tmp / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    image = docker_archive(tmp / "proxima-oci.tar", labels=CARD)
    return write_bundle(tmp / "out", images=[image], model=model, wheel=wheel)


def test_layout(bundle):
    names = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
    assert {"README.md", SUMS, "install.py", "bundle.json", "image/proxima-oci.tar",
            "models/tiny/config.json"} <= names
    assert any(n.startswith("wheelhouse/proxima-") and n.endswith(".whl") for n in names)
    readme = (bundle / "README.md").read_text()
    assert "docker load -i image/proxima-oci.tar" in readme
    assert "docker run --gpus all" in readme and "proxima:test /models/tiny" in readme
    assert "python3 install.py venv" in readme
    assert "--no-index --find-links wheelhouse 'proxima==" in readme
    # The host prerequisites, by name: the CUDA 12.1 driver floor, the container tools.
    assert "driver >= 530.30.02 (CUDA 12.1" in readme
    assert "NVIDIA Container Toolkit" in readme and "Docker or Podman" in readme
    manifest = json.loads((bundle / "bundle.json").read_text())
    assert manifest["images"] == [{"file": "proxima-oci.tar", "tags": ["proxima:test"],
                                   "stack": "card", "cuda": "12.1", "serves": True}]
    assert manifest["wheelhouse"]["needs"]["python"] is None   # the proxima wheel is pure


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


def test_the_bundle_directory_has_the_mode_mkdir_gives_not_mkdtemps_0700(tmp_path, wheel):
    """It is written under a temporary name (mkdtemp: mode 0700) and renamed: it kept 0700,
    so another user (docker load, install.py run by the service account) could not read it."""
    umask = os.umask(0o027)
    try:
        out = write_bundle(tmp_path / "b", wheel=wheel)
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o750


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


# ---- bad input: one line, non-zero exit, nothing written (issue 15) -------------------------

def bundle_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxima.cli", "bundle", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if name in p.name)


@pytest.mark.parametrize(("args", "message"), [
    (["--image", "{tmp}/notimg.txt"], "--image {tmp}/notimg.txt: neither a docker-archive image"),
    (["--image", "{tmp}/missing.tar"], "--image {tmp}/missing.tar: no such file"),
    (["--extra", "nosuch"], "--extra nosuch: not an extra of proxima (it has: plot, serve, test"),
    (["--model", "{tmp}"], "no config.json in it"),
    (["--python-version", "three"], "--python-version three: give X.Y"),
    (["--platform", "any"], "--platform 'any': not a wheel platform tag"),
])
def test_bad_input_twice_says_one_line_and_leaves_nothing(tmp_path, args, message):
    """`proxima bundle --out D --image notimg.txt` run twice: the same one-line error both
    times, exit 2, and neither D nor a partial copy of it is ever written."""
    (tmp_path / "notimg.txt").write_text("not an image\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = tmp_path / "D"
    for _ in range(2):
        done = bundle_cli("--out", str(out), *args)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr              # checked before any work started
        assert lines[0].startswith("proxima bundle: error: ")
        assert message.replace("{tmp}", str(tmp_path)) in lines[0]
        assert not out.exists() and leftovers(tmp_path, "D") == []


def test_a_failure_after_work_started_leaves_nothing_either(tmp_path, wheel):
    """The image script fails once the wheelhouse is written: no D, no partial D beside it."""
    failing = tmp_path / "result"
    failing.write_text("#!/bin/sh\necho 'no space left on device' >&2\nexit 3\n")
    failing.chmod(0o755)
    out = tmp_path / "D"
    done = bundle_cli("--out", str(out), "--image", str(failing), "--wheel", str(wheel))
    assert done.returncode == 2
    deep = bundle_cli("--out", str(tmp_path / "new" / "a" / "D"), "--image", str(failing),
                      "--wheel", str(wheel))       # --out's missing parents: made, then left
    assert deep.returncode == 2 and not (tmp_path / "new").exists(), deep.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"proxima bundle: error: --image {failing}: the image script failed (exit 3): "
        "no space left on device")
    assert "Traceback" not in done.stderr
    assert not out.exists() and leftovers(tmp_path, "D") == []
    # and D is free for the next, good run
    good = docker_archive(tmp_path / "img.tar", labels=CARD)
    again = bundle_cli("--out", str(out), "--image", str(good), "--wheel", str(wheel))
    assert again.returncode == 0, again.stderr
    assert verify(out) == [] and leftovers(tmp_path, "D") == ["D"]


@pytest.mark.parametrize("signame, status, word", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                                  ("SIGINT", 130, "interrupted")])
def test_a_bundle_stopped_mid_way_leaves_nothing(tmp_path, wheel, signame, status, word):
    """SIGTERM (a time limit, docker stop, kill) while the image script runs: the command
    died at once and left .D.partial-XXXX beside D (the wheelhouse, a copy of the model...).
    Now it stops as on Ctrl-C: exit 143, one line, nothing left."""
    import signal
    import time

    script = tmp_path / "result"
    started = tmp_path / "started"
    script.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 600\n")
    script.chmod(0o755)
    out = tmp_path / "D"
    proc = subprocess.Popen([sys.executable, "-m", "proxima.cli", "bundle", "--out", str(out),
                             "--image", str(script), "--wheel", str(wheel), "--tar"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120          # the wheelhouse, then the script
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), proc.communicate()
        proc.send_signal(getattr(signal, signame))
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == f"proxima bundle: {word}"
    assert leftovers(tmp_path, "D") == []
    assert leftovers(tmp_path, "started") == ["started"]     # the script ran, and was stopped


def test_two_images_of_one_file_name_are_refused(tmp_path, wheel):
    """Both were copied to image/img.tar: the second replaced the first, and the manifest
    and README listed two images of which one was there."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = docker_archive(tmp_path / "a" / "img.tar", tag="proxima:one")
    second = docker_archive(tmp_path / "b" / "img.tar", tag="proxima:two")
    out = tmp_path / "D"
    done = bundle_cli("--out", str(out), "--image", str(first), "--image", str(second),
                      "--wheel", str(wheel))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"proxima bundle: error: --image {second} and --image {first} would both be "
        f"image/img.tar (one would replace the other): give each image a file name of its own"]
    assert leftovers(tmp_path, "D") == []


def test_an_empty_out_directory_is_taken(tmp_path, wheel):
    (tmp_path / "D").mkdir()
    out = write_bundle(tmp_path / "D", wheel=wheel)
    assert verify(out) == [] and leftovers(tmp_path, "D") == ["D"]


# ---- the bundle's README, step by step, as an operator runs it (issue 17, item 6) ----------

def readme_commands(readme: str) -> list[str]:
    """The README's commands: its indented code lines, in order."""
    return [line[4:] for line in readme.splitlines() if line.startswith("    ") and line.strip()]


@pytest.fixture(scope="module")
def serve_bundle(tmp_path_factory, wheel) -> Path:
    """A bundle with the `serve` extra (gunicorn, uvicorn-worker: small, downloaded now)."""
    tmp = tmp_path_factory.mktemp("serve-bundle")
    image = docker_archive(tmp / "proxima.tar", tag="proxima:0.1.0-cuda12.1", labels=CARD)
    try:
        return write_bundle(tmp / "proxima-bundle", images=[image], wheel=wheel,
                            extras=["serve"], tar=True)
    except UserError as exc:
        if "pip download failed" in str(exc) and "network" in str(exc).lower():
            pytest.skip(f"no route to PyPI: {exc}")
        raise


def test_the_readme_steps_work_as_written(serve_bundle, tmp_path):
    """Carry the tarball across (unpack it elsewhere), then run every README command that needs
    neither Docker nor a GPU, exactly as written, from the bundle directory."""
    far = tmp_path / "far-side"
    far.mkdir()
    with tarfile.open(serve_bundle.with_name(serve_bundle.name + ".tar")) as tar:
        tar.extractall(far, filter="data")
    bundle = far / serve_bundle.name
    commands = readme_commands((bundle / "README.md").read_text())
    container = [c for c in commands if c.split()[0] in ("docker", "podman")]
    assert container == ["docker load -i image/proxima.tar",
                         'docker run --gpus all -v "$PWD/models:/models" -p 8000:8000 '
                         "proxima:0.1.0-cuda12.1"]
    runnable = [c for c in commands if c not in container]
    assert runnable == ["sha256sum -c SHA256SUMS", "python3 install.py venv",
                        "venv/bin/proxima --version"]
    env = clean_pip_env()
    for command in runnable:
        done = subprocess.run(["bash", "-c", command], cwd=bundle, capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}"
    assert done.stdout.strip() == f"proxima {__version__}"
    # The extra it was written with is installed: the serving supervisor is there.
    check = subprocess.run([str(bundle / "venv/bin/python"), "-c",
                            "import gunicorn, uvicorn_worker, proxima; print(proxima.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    assert str(bundle / "venv") in check.stdout


def test_the_readme_says_when_the_python_install_cannot_serve(serve_bundle):
    readme = (serve_bundle / "README.md").read_text()
    assert "'proxima[serve]==" in readme
    assert "without vLLM: this Python install cannot serve" in readme
    assert "--extra vllm-0-26 --extra serve" in readme


def copy_with(bundle: Path, tmp_path: Path, needs: dict) -> Path:
    """A copy whose bundle.json says the wheelhouse needs `needs` (checksums rewritten)."""
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["wheelhouse"]["needs"].update(needs)
    (copy / "bundle.json").write_text(json.dumps(manifest))
    write_sums(copy)
    return copy


def test_install_refuses_another_python_in_one_line(serve_bundle, tmp_path):
    other = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"
    copy = copy_with(serve_bundle, tmp_path, {
        "python": other, "machine": "x86_64", "libc": "glibc", "glibc": "2.17",
        "compiled": [f"numpy-1.26.4-cp{other.replace('.', '')}-manylinux2014_x86_64.whl"]})
    done = subprocess.run([sys.executable, "install.py", "venv"], cwd=copy, capture_output=True,
                          text=True, env=clean_pip_env())
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert line.startswith(f"install.py: error: this wheelhouse was built for Python {other} ")
    assert f"(Python {here}," in line and f"--python-version {here}" in line
    assert not (copy / "venv").exists()


def test_install_refuses_a_damaged_copy(serve_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(serve_bundle, copy)
    (wheel_file,) = (copy / "wheelhouse").glob("gunicorn-*.whl")
    wheel_file.write_bytes(wheel_file.read_bytes()[:-1])
    done = subprocess.run([sys.executable, "install.py"], cwd=copy, capture_output=True,
                          text=True, env=clean_pip_env())
    assert done.returncode == 2
    assert f"FAILED wheelhouse/{wheel_file.name}: checksum differs" in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("do not match SHA256SUMS: copy the "
                                                          "bundle again")
    assert not (copy / "venv").exists()


def test_a_wheelhouse_for_another_python_and_platform(tmp_path, wheel):
    """--python-version / --platform reach pip: the wheelhouse is for the serving machine."""
    try:
        out = write_bundle(tmp_path / "b", wheel=wheel, extras=["serve"], python_version="3.12",
                           platforms=["manylinux_2_28_x86_64"])
    except UserError as exc:
        if "pip download failed" in str(exc):
            pytest.skip(f"no route to PyPI: {exc}")
        raise
    files = json.loads((out / "bundle.json").read_text())["wheelhouse"]["files"]
    assert any(f.startswith("gunicorn-") for f in files)


def test_what_a_wheelhouse_needs_is_read_from_its_wheel_names():
    """The card stack's wheels (CPython 3.11, x86_64): the strictest glibc floor wins, abi3
    wheels set a minimum, pure wheels set nothing."""
    need = requirements([
        "torch-2.4.0-cp311-cp311-manylinux1_x86_64.whl",
        "numpy-1.26.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "tokenizers-0.20.3-cp39-abi3-manylinux_2_28_x86_64.whl",
        "gunicorn-23.0.0-py3-none-any.whl",
    ])
    assert (need["python"], need["python_min"], need["machine"], need["glibc"]) == (
        "3.11", "3.9", "x86_64", "2.28")
    assert requirements(["gunicorn-23.0.0-py3-none-any.whl"])["machine"] is None
    have = {"implementation": "cpython", "python": "3.11", "machine": "x86_64",
            "libc": "glibc", "glibc": "2.36"}
    check_machine(need, have)
    with pytest.raises(Refused, match="needs glibc >= 2.28, this machine has 2.27"):
        check_machine(need, {**have, "glibc": "2.27"})
    with pytest.raises(Refused, match="built for x86_64 machines, this one is aarch64"):
        check_machine(need, {**have, "machine": "aarch64"})


def test_a_slim_only_bundle_warns_that_it_cannot_serve(tmp_path, wheel):
    slim = docker_archive(tmp_path / "proxima-oci.tar", tag="proxima:0.1.0-slim",
                          labels={"ai.proxima.stack": "slim"})
    done = bundle_cli("--out", str(tmp_path / "b"), "--image", str(slim), "--wheel", str(wheel))
    assert done.returncode == 0, done.stderr
    assert "warning: image/proxima-oci.tar (proxima:0.1.0-slim): no image here can serve" \
        in done.stderr
    readme = (tmp_path / "b" / "README.md").read_text()
    assert "only image is the slim CI image (no vLLM)" in readme
    # With a serving image beside it, no warning.
    card = docker_archive(tmp_path / "proxima.tar", tag="proxima:0.1.0-cuda12.1", labels=CARD)
    both = bundle_cli("--out", str(tmp_path / "c"), "--image", str(slim), "--image", str(card),
                      "--wheel", str(wheel))
    assert both.returncode == 0 and "warning" not in both.stderr
    assert "proxima:0.1.0-cuda12.1" in (tmp_path / "c" / "README.md").read_text()
