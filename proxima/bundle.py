"""`proxima bundle`: everything an air-gapped machine needs, in one directory (or tarball).

Written on a machine with network, carried across the air gap, installed there without any::

    DIR/
      README.md      how to install and serve from this bundle, offline
      SHA256SUMS     every other file's checksum (`sha256sum -c SHA256SUMS`)
      image/         container image archives (`docker load -i image/<file>`)
      nix/           a Nix closure (`nix-store --import < nix/closure.nar`), when asked for
      wheelhouse/    the proxima wheel and its dependencies'
                     (`pip install --no-index --find-links wheelhouse proxima`)
      models/        a model directory, or how to mount one at /models

Image archives come from `docker/build-oci.sh` (out/oci-image/proxima-oci.tar), from
`docker save`, or from the flake: `nix build .#proxima-image-tarball` (a tarball) or
`nix build .#proxima-image` (a script that streams the image; it is run and its output kept).

`proxima bundle --verify DIR` checks a bundle against its SHA256SUMS on the far side.
Imports only the standard library: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from proxima import __version__
from proxima.errors import UserError

SUMS = "SHA256SUMS"
# Tar members get this time, owner and mode bits, so the same bundle gives the same tarball.
EPOCH = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="directory to write (must not exist or be empty)")
    parser.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                        help="image archive (docker-archive .tar or .tar.gz) or a Nix "
                             "streamLayeredImage script; repeatable")
    parser.add_argument("--nix-closure", metavar="STORE_PATH",
                        help="export this store path and its closure to nix/closure.nar")
    parser.add_argument("--model", type=Path, help="model directory to include under models/")
    parser.add_argument("--wheel", type=Path,
                        help="use this proxima wheel instead of building one from the checkout")
    parser.add_argument("--extra", action="append", default=[],
                        help="also download the dependencies of this pyproject extra into the "
                             "wheelhouse (e.g. vllm); needs network now, none later")
    parser.add_argument("--tar", action="store_true", help="also write OUT.tar")
    parser.add_argument("--verify", type=Path, metavar="DIR",
                        help="check DIR against its SHA256SUMS and exit")


def run(args: argparse.Namespace) -> int:
    if args.verify:
        bad = verify(args.verify)
        if bad:
            for line in bad:
                print(f"FAILED {line}", file=sys.stderr)
            print(f"proxima bundle: {len(bad)} file(s) of {args.verify} do not match {SUMS}: "
                  "copy the bundle again", file=sys.stderr)
            return 1
        print(f"proxima bundle: {args.verify}: every file matches {SUMS}")
        return 0
    if args.out is None:
        raise UserError("--out DIR is required (or --verify DIR)")
    out = write_bundle(args.out, images=args.image, nix_closure=args.nix_closure,
                       model=args.model, wheel=args.wheel, extras=args.extra)
    print(f"proxima bundle: wrote {out}")
    if args.tar:
        tarball = write_tar(out)
        print(f"proxima bundle: wrote {tarball}")
    return 0


# ---- writing --------------------------------------------------------------------------------

def write_bundle(out: Path, *, images: list[Path] = (), nix_closure: str | None = None,
                 model: Path | None = None, wheel: Path | None = None,
                 extras: list[str] = ()) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory; "
                        "choose a new path (a bundle is written whole, never merged)")
    for image in images:
        if not image.is_file():
            raise UserError(f"--image {image}: no such file")
    if model is not None and not model.is_dir():
        raise UserError(f"--model {model}: not a directory (give the model's directory, "
                        "the one with config.json)")
    out.mkdir(parents=True, exist_ok=True)
    contents = {"wheelhouse": build_wheelhouse(out / "wheelhouse", wheel=wheel, extras=extras)}
    contents["images"] = [add_image(image, out / "image") for image in images]
    if nix_closure:
        contents["nix"] = export_nix_closure(nix_closure, out / "nix")
    contents["model"] = add_model(model, out / "models")
    (out / "README.md").write_text(readme(contents))
    write_sums(out)
    return out


def project_root() -> Path | None:
    """The checkout this proxima was imported from, when it was (editable or in-tree)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "proxima"' in pyproject.read_text():
        return root
    return None


def build_wheelhouse(dest: Path, *, wheel: Path | None, extras: list[str]) -> list[str]:
    dest.mkdir(parents=True)
    if wheel is not None:
        if not (wheel.is_file() and wheel.name.startswith("proxima-") and wheel.suffix == ".whl"):
            raise UserError(f"--wheel {wheel}: not a proxima-*.whl file")
        shutil.copy2(wheel, dest / wheel.name)
    else:
        root = project_root()
        if root is None:
            raise UserError("this proxima is not a source checkout, so no wheel can be built; "
                            "pass --wheel proxima-<version>-py3-none-any.whl")
        build_wheel(root, dest)
    (built,) = dest.glob("proxima-*.whl")
    requirements = wheel_requirements(built, extras)
    if requirements:
        pip(["download", "--only-binary=:all:", "--dest", str(dest), *requirements])
    return sorted(p.name for p in dest.iterdir())


def build_wheel(root: Path, dest: Path) -> None:
    """The proxima wheel from a checkout; the checkout is copied so no build/ lands in it."""
    with tempfile.TemporaryDirectory(prefix="proxima-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (root / name).exists():
                shutil.copy2(root / name, src / name)
        if not (src / "README.md").exists():  # pyproject.toml names it as the readme
            (src / "README.md").write_text("# proxima\n")
        shutil.copytree(root / "proxima", src / "proxima",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        # Without a modern setuptools here, pip fetches one into an isolated build environment.
        isolation = ["--no-build-isolation"] if _has_modern_setuptools() else []
        pip(["wheel", "--no-deps", *isolation, "-w", str(dest), str(src)])


def _has_modern_setuptools() -> bool:
    """setuptools >= 70.1 builds wheels by itself: no build isolation (and no network) needed."""
    try:
        from importlib.metadata import version
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except Exception:
        return False
    return (major, minor) >= (70, 1)


def wheel_requirements(wheel: Path, extras: list[str]) -> list[str]:
    """Requires-Dist of the wheel: the unconditional ones plus those of the chosen extras."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    known = set(meta.get_all("Provides-Extra") or [])
    unknown = sorted(set(extras) - known)
    if unknown:
        raise UserError(f"--extra {', '.join(unknown)}: not an extra of proxima "
                        f"(it has: {', '.join(sorted(known)) or 'none'})")
    picked = []
    for req in meta.get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        marker = marker.strip()
        if not marker or any(f'extra == "{e}"' in marker or f"extra == '{e}'" in marker
                             for e in extras):
            picked.append(spec.strip())
    return picked


def pip(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise UserError(f"pip {args[0]} failed (exit {done.returncode}):\n{tail}")


def add_image(image: Path, dest: Path) -> str:
    """Copy an image archive (or run a Nix stream script into one) and check it loads."""
    dest.mkdir(exist_ok=True)
    name = archive_name(image)
    if tarfile.is_tarfile(image):
        target = dest / name
        shutil.copy2(image, target)
    elif os.access(image, os.X_OK):
        # nix build .#proxima-image: `result` is a script that writes the image to stdout.
        target = dest / f"{name}.tar"
        with open(target, "wb") as fh:
            done = subprocess.run([str(image)], stdout=fh, stderr=subprocess.PIPE)
        if done.returncode != 0:
            raise UserError(f"--image {image}: the image script failed (exit {done.returncode}): "
                            f"{done.stderr.decode(errors='replace').strip()[-500:]}")
    else:
        raise UserError(f"--image {image}: neither an image archive (tar) nor an executable "
                        "image script")
    tags = docker_archive_tags(target)
    if tags is None:
        target.unlink()
        raise UserError(f"--image {image}: a tar archive, but not a docker-archive image "
                        "(no manifest.json); make one with `skopeo copy oci:DIR:TAG "
                        "docker-archive:FILE.tar:NAME:TAG` or `docker save`")
    return f"{target.name} ({', '.join(tags) or 'untagged'})"


def archive_name(image: Path) -> str:
    """A readable file name: Nix's `result` link is named after its store path, less the hash."""
    real = image.resolve()
    name = real.name
    if str(real).startswith("/nix/store/") and len(name) > 33 and name[32] == "-":
        name = name[33:]
    return name


def docker_archive_tags(path: Path) -> list[str] | None:
    """The RepoTags of a `docker load`-able archive, or None when it is not one."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.load(member) if member else None
    except (KeyError, tarfile.TarError, ValueError, OSError):
        return None
    if not isinstance(manifest, list) or not manifest:
        return None
    return [tag for entry in manifest for tag in (entry.get("RepoTags") or [])]


def export_nix_closure(store_path: str, dest: Path) -> str:
    if shutil.which("nix-store") is None:
        raise UserError("--nix-closure needs nix-store on PATH (install Nix, or drop the option)")
    dest.mkdir()
    query = subprocess.run(["nix-store", "--query", "--requisites", store_path],
                           capture_output=True, text=True)
    if query.returncode != 0:
        raise UserError(f"--nix-closure {store_path}: not a valid store path "
                        f"({query.stderr.strip()[-300:]}); build it first, e.g. nix build .#proxima")
    paths = query.stdout.split()
    with open(dest / "closure.nar", "wb") as fh:
        done = subprocess.run(["nix-store", "--export", *paths], stdout=fh,
                              stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise UserError(f"nix-store --export failed: {done.stderr.decode(errors='replace')[-300:]}")
    (dest / "store-path").write_text(store_path + "\n")
    return f"{store_path} ({len(paths)} store paths)"


def add_model(model: Path | None, dest: Path) -> str:
    dest.mkdir()
    if model is None:
        (dest / "README.md").write_text(
            "# Models\n\nNo model was bundled. On the serving machine, put the model directory\n"
            "(the one with config.json, tokenizer files and weights) under /models and mount it:\n\n"
            "    docker run --gpus all -v /models:/models -p 8000:8000 IMAGE /models/<name>\n\n"
            "With no model argument, `proxima serve` serves its embedded random-weights demo "
            "model.\n")
        return "none (see models/README.md)"
    shutil.copytree(model, dest / model.name, symlinks=False)
    return f"models/{model.name}"


def readme(contents: dict) -> str:
    images = contents["images"]
    load = "\n".join(f"    docker load -i image/{img.split(' ')[0]}" for img in images) or \
        "    (no image archive in this bundle)"
    first_tag = next((img.split("(")[1].rstrip(")").split(",")[0] for img in images
                      if "(" in img and "untagged" not in img), "IMAGE")
    model = contents["model"]
    model_arg = f"/{model}" if model.startswith("models/") else ""
    nix = contents.get("nix")
    nix_text = (f"\n## Nix\n\nThe closure of `{nix}`:\n\n    nix-store --import < nix/closure.nar\n"
                f"    $(cat nix/store-path)/bin/proxima serve\n") if nix else ""
    return f"""# Proxima {__version__}: air-gapped bundle

Everything here installs and serves without network. Check the copy first:

    sha256sum -c {SUMS}          # or: proxima bundle --verify .

## Container image

{load}
    docker run --gpus all -v "$PWD/models:/models" -p 8000:8000 {first_tag} {model_arg}

The image's entrypoint is `proxima serve` (self-check first); it sets PROXIMA_ALLOCATOR=1,
HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1, so nothing is fetched from a model hub.
{nix_text}
## Python (no container)

    python3 -m venv venv
    venv/bin/pip install --no-index --find-links wheelhouse proxima
    venv/bin/proxima --version

The wheelhouse holds: {', '.join(contents['wheelhouse'])}.
vLLM itself is only in the wheelhouse when the bundle was written with `--extra vllm`.

## Model

{model}
"""


def write_sums(out: Path) -> None:
    lines = [f"{sha256(p)}  {p.relative_to(out).as_posix()}" for p in sorted(files(out))
             if p.name != SUMS or p.parent != out]
    (out / SUMS).write_text("\n".join(lines) + "\n")


def files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_tar(out: Path) -> Path:
    """OUT.tar: sorted members, fixed times and owners (same bundle, same bytes)."""
    tarball = out.with_name(out.name + ".tar")

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "root", "root"
        info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
        return info

    with tarfile.open(tarball, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(out, arcname=out.name, recursive=False, filter=normalize)
        for path in sorted(out.rglob("*")):
            tar.add(path, arcname=f"{out.name}/{path.relative_to(out).as_posix()}",
                    recursive=False, filter=normalize)
    return tarball


# ---- verifying ------------------------------------------------------------------------------

def verify(bundle: Path) -> list[str]:
    """Lines describing every mismatch; empty when the bundle is intact."""
    sums = bundle / SUMS
    if not sums.is_file():
        raise UserError(f"{bundle}: no {SUMS}; is this a proxima bundle?")
    listed = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    bad = []
    for name, digest in sorted(listed.items()):
        path = bundle / name
        if not path.is_file():
            bad.append(f"{name}: missing")
        elif sha256(path) != digest:
            bad.append(f"{name}: checksum differs")
    present = {p.relative_to(bundle).as_posix() for p in files(bundle)} - {SUMS}
    bad += [f"{name}: not listed in {SUMS}" for name in sorted(present - set(listed))]
    return bad


if __name__ == "__main__":  # python -m proxima.bundle ...
    parser = argparse.ArgumentParser(prog="proxima bundle", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"proxima bundle: error: {exc}", file=sys.stderr)
        sys.exit(2)
