"""What `proxima bundle` copies in beside the wheelhouse: container image archives
(checked, copied, or written by running a Nix image script, with their tags and labels),
a Nix closure (nix-store --export) and a model directory.
Imports only the standard library."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from proxima.bundle_wheelhouse import say
from proxima.errors import UserError


SERVING_STACKS = ("card", "tested")


@dataclass
class ImageInput:
    path: Path
    kind: str                       # "archive" or "script"
    tags: list[str] = field(default_factory=list)
    labels: dict = field(default_factory=dict)


def check_image(image: Path) -> ImageInput:
    if not image.exists():
        raise UserError(f"--image {image}: no such file")
    if not image.is_file():
        raise UserError(f"--image {image}: not a file (give the image archive or the image script)")
    if tarfile.is_tarfile(image):
        info = docker_archive_info(image)
        if info is None:
            raise UserError(f"--image {image}: a tar archive, but not a docker-archive image "
                            "(no manifest.json); make one with `skopeo copy oci:DIR:TAG "
                            "docker-archive:FILE.tar:NAME:TAG` or `docker save`")
        return ImageInput(image, "archive", *info)
    if os.access(image, os.X_OK) and is_program(image):
        return ImageInput(image, "script")
    raise UserError(f"--image {image}: neither a docker-archive image (a .tar with "
                    "manifest.json: docker save, docker/build-oci.sh, nix build "
                    ".#proxima-image-tarball) nor an executable image script (the `result` of "
                    "nix build .#proxima-image)")


def is_program(path: Path) -> bool:
    """A script (#!) or an ELF executable: what `nix build .#proxima-image` leaves."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head[:2] == b"#!" or head == b"\x7fELF"


def add_image(image: ImageInput, dest: Path) -> dict:
    """Copy an image archive (or run a Nix stream script into one) and read its tags."""
    dest.mkdir(exist_ok=True)
    name = archive_name(image.path)
    if image.kind == "archive":
        target = dest / name
        say(f"copying {image.path} ({image.path.stat().st_size / 2**20:.0f} MiB)")
        shutil.copy2(image.path, target)
        tags, labels = image.tags, image.labels
    else:
        # nix build .#proxima-image: `result` is a script that writes the image to stdout.
        target = dest / f"{name}.tar"
        say(f"running the image script {image.path}")
        with open(target, "wb") as fh:
            try:
                done = subprocess.run([str(image.path)], stdout=fh, stderr=subprocess.PIPE)
            except OSError as exc:
                raise UserError(f"--image {image.path}: cannot run the image script: "
                                f"{exc.strerror}") from None
        if done.returncode != 0:
            raise UserError(f"--image {image.path}: the image script failed (exit "
                            f"{done.returncode}): "
                            f"{done.stderr.decode(errors='replace').strip()[-500:]}")
        info = docker_archive_info(target)
        if info is None:
            raise UserError(f"--image {image.path}: the script's output is not a docker-archive "
                            "image (no manifest.json)")
        tags, labels = info
    stack = labels.get("ai.proxima.stack")
    return {"file": target.name, "tags": tags, "stack": stack,
            "cuda": labels.get("ai.proxima.cuda.version"),
            "serves": stack in SERVING_STACKS or (stack is None and bool(labels.get(
                "ai.proxima.vllm.version")))}


def archive_name(image: Path) -> str:
    """A readable file name: Nix's `result` link is named after its store path, less the hash."""
    real = image.resolve()
    name = real.name
    if str(real).startswith("/nix/store/") and len(name) > 33 and name[32] == "-":
        name = name[33:]
    return name


def docker_archive_info(path: Path) -> tuple[list[str], dict] | None:
    """(RepoTags, config Labels) of a `docker load`-able archive, or None when it is not one."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.load(member) if member else None
            if not isinstance(manifest, list) or not manifest:
                return None
            labels = {}
            config_name = manifest[0].get("Config") if isinstance(manifest[0], dict) else None
            if config_name:
                try:
                    config = json.load(tar.extractfile(config_name))
                    labels = (config.get("config") or {}).get("Labels") or {}
                except (KeyError, ValueError, AttributeError, TypeError):
                    labels = {}
    except (KeyError, tarfile.TarError, ValueError, OSError):
        return None
    tags = [tag for entry in manifest if isinstance(entry, dict)
            for tag in (entry.get("RepoTags") or [])]
    return tags, labels


def docker_archive_tags(path: Path) -> list[str] | None:
    info = docker_archive_info(path)
    return None if info is None else info[0]


def nix_requisites(store_path: str) -> list[str]:
    if shutil.which("nix-store") is None:
        raise UserError("--nix-closure needs nix-store on PATH (install Nix, or drop the option)")
    query = subprocess.run(["nix-store", "--query", "--requisites", store_path],
                           capture_output=True, text=True)
    if query.returncode != 0:
        raise UserError(f"--nix-closure {store_path}: not a valid store path "
                        f"({_nix_error(query.stderr)}); build it first, e.g. nix build .#proxima")
    return query.stdout.split()


def _nix_error(stderr: str) -> str:
    """Nix's own complaint as one line: its warnings (e.g. about build users) dropped, the
    rest joined, at most 300 characters."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith("warning:")] or lines
    return " ".join(kept)[-300:] or "no message"


def export_nix_closure(store_path: str, paths: list[str], dest: Path) -> str:
    dest.mkdir()
    say(f"exporting the Nix closure of {store_path} ({len(paths)} store paths)")
    with open(dest / "closure.nar", "wb") as fh:
        done = subprocess.run(["nix-store", "--export", *paths], stdout=fh,
                              stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise UserError(f"nix-store --export failed: {_nix_error(done.stderr.decode(errors='replace'))}")
    (dest / "store-path").write_text(store_path + "\n")
    return f"{store_path} ({len(paths)} store paths)"


def add_model(model: Path | None, dest: Path) -> str | None:
    dest.mkdir()
    if model is None:
        (dest / "README.md").write_text(
            "# Models\n\nNo model was bundled. On the serving machine, put the model directory\n"
            "(the one with config.json, tokenizer files and weights) under /models and mount it:\n\n"
            "    docker run --gpus all -v /models:/models -p 8000:8000 IMAGE /models/<name>\n\n"
            "With no model argument, `proxima serve` serves its embedded random-weights demo "
            "model.\n")
        return None
    say(f"copying the model {model}")
    shutil.copytree(model, dest / model.name, symlinks=False)
    return f"models/{model.name}"
