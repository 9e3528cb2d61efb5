"""The three images (Nix, docker/Dockerfile, daemonless OCI) share one entrypoint and one
environment: docker/image-config.env. These checks need no tools."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def image_env() -> dict[str, str]:
    lines = (REPO / "docker" / "image-config.env").read_text().splitlines()
    pairs = [l.split("=", 1) for l in lines if l.strip() and not l.startswith("#")]
    return dict(pairs)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "docker" / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_environment_is_the_appliance_one():
    env = image_env()
    assert env["PROXIMA_ALLOCATOR"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"


def test_dockerfile_starts_from_the_tested_vllm_image():
    """The no-Nix image is the tested stack's (the GPU-proven vLLM that ./dev installs),
    pinned by the same file the Dockerfile uses as its constraint."""
    pins = (REPO / "requirements" / "vllm-0.26.txt").read_text()
    tested = re.search(r"^vllm==([0-9.]+)$", pins, flags=re.M)[1]
    assert "--constraint /opt/proxima-src/requirements/vllm-0.26.txt" in " ".join(
        rest for word, rest in dockerfile_instructions() if word == "RUN")
    ins = dockerfile_instructions()
    args = dict(rest.split("=", 1) for word, rest in ins if word == "ARG" and "=" in rest)
    assert args["VLLM_IMAGE"] == f"vllm/vllm-openai:v{tested}"
    assert ("FROM", "${VLLM_IMAGE}") in ins
    run = " ".join(rest for word, rest in ins if word == "RUN")
    assert f"vllm.__version__ == '{tested}'" in run


def test_dockerfile_has_the_appliance_entrypoint_env_port_and_volume():
    ins = dockerfile_instructions()
    entry = [json.loads(rest) for word, rest in ins if word == "ENTRYPOINT"]
    assert entry == [["proxima", "serve"]]
    env_text = " ".join(rest for word, rest in ins if word == "ENV")
    set_env = dict(re.findall(r"(\w+)=(\S+)", env_text))
    assert {k: set_env.get(k) for k in image_env()} == image_env()
    assert set(set_env) - set(image_env()) == {"HOME", "SSL_CERT_FILE"}
    assert ("EXPOSE", "8000") in ins
    assert ("VOLUME", "/models") in ins


def test_nix_image_sets_the_same_environment():
    nix = (REPO / "nix" / "image.nix").read_text()
    for key, value in image_env().items():
        assert f'"{key}={value}"' in nix, f"nix/image.nix does not set {key}={value}"
    assert re.search(r'"\$\{env\}/bin/proxima"\s*"serve"', nix)


def test_dockerfile_runs_as_proxima_with_a_health_check_a_compiler_and_certificates():
    ins = dockerfile_instructions()
    assert ("USER", "1000:1000") in ins
    # the USER comes after every RUN: nothing of the image's own runs as root
    last_run = max(i for i, (word, _) in enumerate(ins) if word == "RUN")
    assert ins.index(("USER", "1000:1000")) > last_run
    run = " ".join(rest for word, rest in ins if word == "RUN")
    assert "useradd --uid 1000 --gid 1000" in run
    assert "cc --version" in run and "ca-certificates" in run
    (health,) = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert health.endswith('CMD ["python3", "/usr/local/bin/proxima-healthcheck"]')
    assert "--start-period=1200s" in health
    assert ("COPY", "docker/healthcheck.py /usr/local/bin/proxima-healthcheck") in ins


def test_every_image_asks_the_same_health_check():
    """The Nix image, the Dockerfile and build-oci.sh all run docker/healthcheck.py."""
    nix = (REPO / "nix" / "image.nix").read_text()
    assert "healthcheck = ../docker/healthcheck.py;" in nix
    oci = (REPO / "docker" / "build-oci.sh").read_text()
    assert 'cat "$here/docker/healthcheck.py"' in oci
    assert '"/usr/local/bin/proxima-healthcheck"]' in oci
