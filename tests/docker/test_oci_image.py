"""The daemonless image (docker/build-oci.sh): built with umoci and skopeo from this
checkout, reproducible, `docker load`-able, and its entrypoint run under runc.

Slow parts are cached under ~/.cache/proxima/oci (the Debian base layer, the build venv);
a warm build takes about half a minute on two cores."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "build-oci.sh"
VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (CI installs them: bash nix/ci-checks.sh)")


def snapshot(dst: Path) -> Path:
    """Proxima's sources as they are now, so that both builds see the same files."""
    dst.mkdir(parents=True)
    shutil.copy2(REPO / "pyproject.toml", dst)
    if (REPO / "README.md").exists():
        shutil.copy2(REPO / "README.md", dst)
    shutil.copytree(REPO / "proxima", dst / "proxima",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dst


def build(src: Path, out: Path) -> str:
    proc = subprocess.run(["bash", str(SCRIPT), "--src", str(src), "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"build-oci.sh failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return snapshot(tmp_path_factory.mktemp("oci-src") / "src")


@pytest.fixture(scope="module")
def image(src, tmp_path_factory) -> tuple[Path, str]:
    need("umoci", "skopeo", "apt-get", "dpkg-deb")
    out = tmp_path_factory.mktemp("oci-out")
    return out, build(src, out)


def blob(layout: Path, digest: str) -> dict:
    return json.loads((layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_text())


def image_config(out: Path) -> dict:
    layout = out / "oci"
    index = json.loads((layout / "index.json").read_text())
    (manifest,) = index["manifests"]
    assert manifest["annotations"]["org.opencontainers.image.ref.name"] == VERSION
    return blob(layout, blob(layout, manifest["digest"])["config"]["digest"])


def test_image_config_is_the_appliance_one(image):
    out, digest = image
    assert digest.startswith("sha256:")
    cfg = image_config(out)
    c = cfg["config"]
    assert c["Entrypoint"] == ["/usr/local/bin/proxima", "serve"]
    env = dict(e.split("=", 1) for e in c["Env"])
    assert env["PROXIMA_ALLOCATOR"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert "8000/tcp" in c["ExposedPorts"] and "/models" in c["Volumes"]
    assert c["Labels"]["org.opencontainers.image.version"] == VERSION
    # Not root; Docker's health check on /health with the image's own Python; the CA bundle.
    assert c["User"] == "1000:1000"
    assert c["Healthcheck"]["Test"] == ["CMD", "/usr/bin/python3.11",
                                        "/usr/local/bin/proxima-healthcheck"]
    assert c["Healthcheck"]["Retries"] == 3 and c["Healthcheck"]["StartPeriod"] >= 600 * 10**9
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca-certificates.crt"
    assert cfg["created"] == "1970-01-01T00:00:01Z"
    assert all(h["created"] == "1970-01-01T00:00:01Z" for h in cfg["history"])
    assert len(cfg["rootfs"]["diff_ids"]) == 2


def test_docker_archive_is_loadable(image):
    """`docker load` reads manifest.json: one image, tagged, whose config and layers exist."""
    out, _ = image
    with tarfile.open(out / "proxima-oci.tar") as tar:
        names = set(tar.getnames())
        (entry,) = json.load(tar.extractfile("manifest.json"))
        # skopeo writes the fully qualified name; `docker images` shows it as proxima:<tag>.
        assert entry["RepoTags"] == [f"docker.io/library/proxima:{VERSION}-slim"]
        assert entry["Config"] in names and all(layer in names for layer in entry["Layers"])
        config = json.load(tar.extractfile(entry["Config"]))
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/proxima", "serve"]
    # docker load reads the health check and the user from this config, as written.
    assert config["config"]["User"] == "1000:1000"
    assert config["config"]["Healthcheck"]["Test"][-1] == "/usr/local/bin/proxima-healthcheck"


def test_same_sources_give_the_same_image_digest(image, src, tmp_path):
    _, first = image
    assert build(src, tmp_path / "again") == first


@pytest.fixture(scope="module")
def bundle(image, tmp_path_factory) -> Path:
    """The image unpacked into an OCI runtime bundle (rootfs + config.json) for runc."""
    need("runc", "umoci")
    if os.geteuid() != 0:
        pytest.skip("runc needs root here (CI runs as root)")
    out, _ = image
    path = tmp_path_factory.mktemp("bundle") / "b"
    subprocess.run(["umoci", "unpack", "--image", f"{out / 'oci'}:{VERSION}", str(path)],
                   check=True, capture_output=True)
    return path


def run_in_image(bundle: Path, *args: str, exe: str | None = None) -> subprocess.CompletedProcess:
    """Run the image's entrypoint executable (or `exe`) with args, under runc, no network,
    read-only, as the user the image's config names (umoci unpack translates it)."""
    orig = bundle / "config.json.orig"  # what umoci unpack wrote, from the image's config
    if not orig.exists():
        shutil.copy2(bundle / "config.json", orig)
    config = json.loads(orig.read_text())
    entry = config["process"]["args"]
    assert entry[:2] == ["/usr/local/bin/proxima", "serve"], entry  # the image's entrypoint
    config["process"]["args"] = [exe or entry[0], *args]
    config["process"]["terminal"] = False
    config["root"]["readonly"] = True
    (bundle / "config.json").write_text(json.dumps(config))
    return subprocess.run(["runc", "run", "--bundle", str(bundle), f"proxima-test-{uuid.uuid4().hex[:8]}"],
                          capture_output=True, text=True, timeout=120)


def test_entrypoint_runs_under_runc(bundle):
    proc = run_in_image(bundle, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"proxima {VERSION}"


def test_the_image_runs_as_the_unprivileged_user_proxima(bundle):
    config = json.loads((bundle / "config.json.orig").read_text() if (bundle / "config.json.orig")
                        .exists() else (bundle / "config.json").read_text())
    assert config["process"]["user"] == {"uid": 1000, "gid": 1000}
    proc = run_in_image(bundle, "-c", "import getpass, os; print(os.getuid(), os.getgid(), "
                        "getpass.getuser(), os.environ['HOME'])", exe="/usr/bin/python3.11")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1000", "1000", "proxima", "/tmp"]


def test_the_health_check_runs_in_the_image_and_fails_with_no_server(bundle):
    proc = run_in_image(bundle, exe="/usr/local/bin/proxima-healthcheck")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("proxima-healthcheck: http://127.0.0.1:8000/health: no answer")


def test_the_image_has_a_ca_bundle_that_python_loads(bundle):
    proc = run_in_image(bundle, "-c", "import ssl; print(len(ssl.create_default_context()"
                        ".get_ca_certs()))", exe="/usr/bin/python3.11")
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 100


def test_selfcheck_in_the_image_says_there_is_no_gpu(bundle, src):
    if not (src / "proxima" / "serve" / "selfcheck.py").exists():
        pytest.skip("proxima/serve/selfcheck.py is not in this checkout yet (issue 5)")
    proc = run_in_image(bundle, "selfcheck")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    if "no NVIDIA GPU" not in out and "torch cannot be imported" in out:
        # This image has no torch (no vLLM stack); the self-check asks torch before it looks
        # for a GPU device. Passes as soon as the GPU line checks for a device first.
        pytest.xfail("selfcheck reports the missing torch before the missing GPU: " + out[:200])
    assert "no NVIDIA GPU" in out, out
    assert "Traceback" not in out, out


def test_bundle_carries_the_image(image, tmp_path):
    """The air-gapped bundle of this image: archive, checksums, README with its tag."""
    out, _ = image
    done = subprocess.run([sys.executable, "-m", "proxima.bundle", "--out", str(tmp_path / "b"),
                           "--image", str(out / "proxima-oci.tar"), "--tar"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    bundle = tmp_path / "b"
    sums = (bundle / "SHA256SUMS").read_text()
    assert "  image/proxima-oci.tar\n" in sums
    assert (bundle / "image" / "proxima-oci.tar").read_bytes() == (out / "proxima-oci.tar").read_bytes()
    readme = (bundle / "README.md").read_text()
    assert f"docker.io/library/proxima:{VERSION}-slim" in readme
    assert (tmp_path / "b.tar").is_file()
    # Its only image is the slim one: the bundle says, when written and in its README, that
    # it cannot serve.
    assert "no image here can serve (the slim image has no vLLM)" in done.stderr
    assert "only image is the slim CI image (no vLLM)" in readme
