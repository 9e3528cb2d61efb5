"""`proxima bundle`: everything an air-gapped machine needs, in one directory (or tarball).

Written on a machine with network, carried across the air gap, installed there without any::

    DIR/
      README.md      what the serving machine needs, and every step, offline
      SHA256SUMS     every other file's checksum (`sha256sum -c SHA256SUMS`)
      install.py     checks the copy and the machine, then installs the wheelhouse into a venv
      bundle.json    what is inside: images (tags, stack), extras, what the wheelhouse needs
      image/         container image archives (`docker load -i image/<file>`)
      nix/           a Nix closure (`nix-store --import < nix/closure.nar`), when asked for
      wheelhouse/    the proxima wheel and the wheels of its dependencies and chosen extras
      models/        a model directory, or how to mount one at /models

Image archives come from `docker/build-oci.sh` (out/oci-image/proxima-oci.tar), from
`docker save`, or from the flake: `nix build .#proxima-image-tarball` (a tarball) or
`nix build .#proxima-image` (a script that streams the image; it is run and its output kept).

The wheelhouse is for one Python version and platform: this interpreter's unless
--python-version / --platform name another (pip downloads wheels for that target). bundle.json
records what its compiled wheels need (CPython X.Y, CPU architecture, glibc), and install.py
refuses, in one line, a machine that does not fit.

Every input is checked before any work starts; the bundle is written under a temporary name
beside DIR and renamed to DIR only when complete, so a failed or interrupted run leaves
nothing behind. `proxima bundle --verify DIR` checks a copy against its SHA256SUMS.

This module is the command (its options, the checks of every input, writing DIR, its
SHA256SUMS and the tarball); its parts: bundle_wheelhouse.py (the wheels, through pip),
bundle_payload.py (images, the Nix closure, the model), bundle_readme.py (README.md), and
bundle_install.py (install.py, copied into the bundle, and the checksums).
Imports only the standard library: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from proxima import __version__
from proxima import bundle_install
from proxima.bundle_install import MANIFEST, SUMS, files, sha256, verify
from proxima.bundle_payload import (ImageInput, add_image, add_model, archive_name,
                                    check_image, export_nix_closure, nix_requisites)
from proxima.bundle_readme import readme
from proxima.bundle_wheelhouse import (build_wheelhouse, extras_of_pyproject, extras_of_wheel,
                                       project_root, say)
from proxima.errors import UserError

# Tar members get this time, owner and mode bits, so the same bundle gives the same tarball.
EPOCH = 1


EXIT_STATUS = """\
exit status:
  0    the bundle was written; with --verify: every file matches SHA256SUMS
  1    --verify: a file is missing or does not match (each named on stderr)
  2    bad input or environment (one line)
  130  interrupted (Ctrl-C), 143 terminated (SIGTERM): nothing is left (no DIR, no partial
       copy beside it)"""


def _dir_name(text: str) -> Path:
    """A directory named on the command line: '' is refused (Path('') would be '.')."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"needs a directory name, got {text!r}")
    return Path(text)


def _file_name(text: str) -> Path:
    """A file named on the command line: '' is refused (Path('') would be '.')."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"needs a file name, got {text!r}")
    return Path(text)


def _store_path(text: str) -> str:
    """--nix-closure: '' is refused (it was taken as no closure)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"needs a store path, e.g. /nix/store/...-proxima, "
                                         f"got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument("--out", type=_dir_name, metavar="DIR",
                        help="directory to write; must not exist or be empty (default: none, "
                             "required unless --verify)")
    parser.add_argument("--image", type=_file_name, action="append", default=[], metavar="FILE",
                        help="image archive (docker-archive .tar or .tar.gz) or a Nix "
                             "streamLayeredImage script; repeatable (default: no image)")
    parser.add_argument("--nix-closure", type=_store_path, metavar="STORE_PATH",
                        help="export this store path and its closure to nix/closure.nar "
                             "(default: none)")
    parser.add_argument("--model", type=_dir_name, metavar="DIR",
                        help="model directory (with config.json) to include under models/ "
                             "(default: none; models/README.md says how to mount one)")
    parser.add_argument("--wheel", type=_file_name, metavar="FILE",
                        help="use this proxima wheel instead of building one from the checkout "
                             "(default: build it)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME",
                        help="also put the wheels of this pyproject extra into the wheelhouse, "
                             "e.g. vllm-0-26 (vLLM 0.26.0, the tested stack, some GB), vllm "
                             "(vLLM 0.33.0, the newest, CPU-tested only), vllm-cu121 (the card "
                             "stack), "
                             "serve (gunicorn + uvicorn-worker); repeatable; needs network now, "
                             "none later (default: none: the wheelhouse cannot serve)")
    parser.add_argument("--python-version", metavar="X.Y",
                        help="Python of the serving machine, for the wheelhouse "
                             f"(default: this one, {sys.version_info.major}.{sys.version_info.minor})")
    parser.add_argument("--platform", action="append", default=[], metavar="TAG",
                        help="wheel platform tag of the serving machine, e.g. "
                             "manylinux_2_28_x86_64; repeatable (default: this machine's)")
    parser.add_argument("--tar", action="store_true", help="also write DIR.tar (default: off)")
    parser.add_argument("--verify", type=_dir_name, metavar="DIR",
                        help="check DIR against its SHA256SUMS and exit")


def run(args: argparse.Namespace) -> int:
    if args.verify:
        writing = [flag for flag, value in (
            ("--out", args.out), ("--image", args.image), ("--nix-closure", args.nix_closure),
            ("--model", args.model), ("--wheel", args.wheel), ("--extra", args.extra),
            ("--python-version", args.python_version), ("--platform", args.platform),
            ("--tar", args.tar)) if value]
        if writing:
            raise UserError(f"--verify DIR checks a bundle and writes nothing: "
                            f"{', '.join(writing)} do not apply with it (drop them, or drop "
                            f"--verify to write a bundle)")
        try:
            bad = verify(args.verify)
        except bundle_install.Refused as exc:
            raise UserError(str(exc)) from None
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
                       model=args.model, wheel=args.wheel, extras=args.extra,
                       python_version=args.python_version, platforms=args.platform,
                       tar=args.tar)
    print(f"proxima bundle: wrote {out}")
    if args.tar:
        print(f"proxima bundle: wrote {out.with_name(out.name + '.tar')}")
    return 0


# ---- checking the inputs (before any work) --------------------------------------------------


@dataclass
class Plan:
    out: Path
    images: list[ImageInput]
    extras: list[str]
    wheel: Path | None
    root: Path | None
    model: Path | None
    nix_paths: list[str] | None
    nix_closure: str | None
    pip_target: list[str]


def check_inputs(out: Path, *, images, nix_closure, model, wheel, extras, python_version,
                 platforms, tar: bool = False) -> Plan:
    """Every check that can be made before work starts; UserError on the first bad input."""
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory; "
                        "choose a new path (a bundle is written whole, never merged)")
    tarball = out.with_name(out.name + ".tar")
    if tar and (tarball.exists() or tarball.is_symlink()):
        raise UserError(f"--tar: {tarball} exists; choose a new --out (a bundle is written "
                        "whole, never over another)")
    parent = next(p for p in [out.parent, *out.parent.parents] if p.exists())
    if not parent.is_dir():
        raise UserError(f"--out {out}: {parent} is not a directory: choose another path")
    try:        # probed: os.access says yes to root, and to /proc or /sys
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create a directory in {parent} "
                        f"({exc.strerror or exc}): choose a writable place") from None
    checked = [check_image(Path(image)) for image in images]
    named: dict[str, Path] = {}
    for image in checked:                   # each is written to image/<name>: one per name
        name = archive_name(image.path) + ("" if image.kind == "archive" else ".tar")
        if name in named:
            raise UserError(f"--image {image.path} and --image {named[name]} would both be "
                            f"image/{name} (one would replace the other): give each image a "
                            f"file name of its own")
        named[name] = image.path
    if model is not None:
        model = Path(model)
        if not model.is_dir():
            raise UserError(f"--model {model}: not a directory (give the model's directory, "
                            "the one with config.json)")
        if not (model / "config.json").is_file():
            raise UserError(f"--model {model}: no config.json in it; give the model's own "
                            "directory (config.json, tokenizer files, weights)")
    root = None
    if wheel is not None:
        wheel = Path(wheel)
        if not (wheel.is_file() and wheel.name.startswith("proxima-") and wheel.suffix == ".whl"):
            raise UserError(f"--wheel {wheel}: not a proxima-*.whl file")
        known = extras_of_wheel(wheel)
    else:
        root = project_root()
        if root is None:
            raise UserError("this proxima is not a source checkout, so no wheel can be built; "
                            "pass --wheel proxima-<version>-py3-none-any.whl")
        known = extras_of_pyproject(root / "pyproject.toml")
    unknown = sorted(set(extras) - set(known))
    if unknown:
        raise UserError(f"--extra {', '.join(unknown)}: not an extra of proxima "
                        f"(it has: {', '.join(sorted(known)) or 'none'})")
    pip_target = []
    if python_version is not None:
        form = re.fullmatch(r"(\d+)\.(\d+)", python_version)
        if not form:
            raise UserError(f"--python-version {python_version}: give X.Y, e.g. 3.12")
        least = _least_python()
        if least and (int(form[1]), int(form[2])) < least:
            raise UserError(f"--python-version {python_version}: proxima needs Python >= "
                            f"{least[0]}.{least[1]} (its requires-python): give that or newer")
        if int(form[1]) != 3:
            raise UserError(f"--python-version {python_version}: there is no Python "
                            f"{form[1]}.x to build for: give 3.Y, e.g. 3.12")
        pip_target += ["--python-version", python_version, "--implementation", "cp"]
    for tag in platforms:
        if not re.fullmatch(r"[a-z0-9_]+", tag) or tag == "any":
            raise UserError(f"--platform {tag!r}: not a wheel platform tag "
                            "(e.g. manylinux_2_28_x86_64, manylinux2014_aarch64)")
        pip_target += ["--platform", tag]
    nix_paths = None
    if nix_closure:
        nix_paths = nix_requisites(nix_closure)
    return Plan(out=out, images=checked, extras=sorted(set(extras)), wheel=wheel, root=root,
                model=model, nix_paths=nix_paths, nix_closure=nix_closure,
                pip_target=pip_target)


def _least_python() -> tuple[int, int] | None:
    """The oldest Python proxima installs on (its Requires-Python, ``>=X.Y``), if known."""
    from importlib import metadata

    try:
        needs = metadata.metadata("proxima").get("Requires-Python") or ""
    except metadata.PackageNotFoundError:
        return None
    form = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", needs)
    return (int(form[1]), int(form[2])) if form else None


# ---- writing --------------------------------------------------------------------------------

def write_bundle(out: Path, *, images: list[Path] = (), nix_closure: str | None = None,
                 model: Path | None = None, wheel: Path | None = None,
                 extras: list[str] = (), python_version: str | None = None,
                 platforms: list[str] = (), tar: bool = False) -> Path:
    """Check every input, write the bundle beside ``out`` and rename it to ``out`` when done."""
    plan = check_inputs(out, images=images, nix_closure=nix_closure, model=model, wheel=wheel,
                        extras=list(extras), python_version=python_version,
                        platforms=list(platforms), tar=tar)
    out = plan.out
    made = [p for p in out.parents if not p.exists()]     # deepest first: removed on failure
    staging = None
    done = False
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        except OSError as exc:
            raise UserError(f"--out {out}: cannot create it ({exc.strerror or exc}): choose "
                            f"a writable place") from None
        umask = os.umask(0o022)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)    # as mkdir makes it: mkdtemp's 0700 would stay on DIR
        build(plan, staging)
        if out.exists():
            out.rmdir()             # empty (checked), so the rename can take its place
        staging.rename(out)
        done = True
    finally:
        if not done:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            for path in made:       # the parents --out's creation made, if still empty
                try:
                    path.rmdir()
                except OSError:
                    break
    if tar:
        write_tar(out)
    return out


def build(plan: Plan, dest: Path) -> None:
    contents = {"wheelhouse": build_wheelhouse(dest / "wheelhouse", plan)}
    contents["images"] = [add_image(image, dest / "image") for image in plan.images]
    if plan.nix_closure:
        contents["nix"] = export_nix_closure(plan.nix_closure, plan.nix_paths, dest / "nix")
    contents["model"] = add_model(plan.model, dest / "models")
    shutil.copy2(bundle_install.__file__, dest / "install.py")
    manifest = {
        "proxima": __version__,
        "images": contents["images"],
        "wheelhouse": contents["wheelhouse"],
        "model": contents["model"],
        "nix": contents.get("nix"),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    slim_only = bool(contents["images"]) and not any(i["serves"] for i in contents["images"])
    if slim_only:
        names = ", ".join(f"image/{i['file']} ({', '.join(i['tags']) or 'untagged'})"
                          for i in contents["images"])
        say(f"warning: {names}: no image here can serve (the slim image has no vLLM); add "
            "--image with the Nix image (nix build .#proxima-image) or the Dockerfile's "
            "(docker save proxima:<version>-vllm0.26.0)")
    (dest / "README.md").write_text(readme(manifest, slim_only))
    write_sums(dest)


def write_sums(out: Path) -> None:
    lines = [f"{sha256(p)}  {p.relative_to(out).as_posix()}" for p in sorted(files(out))
             if p.name != SUMS or p.parent != out]
    (out / SUMS).write_text("\n".join(lines) + "\n")


def write_tar(out: Path) -> Path:
    """OUT.tar: sorted members, fixed times and owners (same bundle, same bytes); written
    under a temporary name and renamed when complete."""
    tarball = out.with_name(out.name + ".tar")
    partial = out.with_name(f".{out.name}.tar.partial-{os.getpid()}")

    def normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "root", "root"
        info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
        return info

    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(out, arcname=out.name, recursive=False, filter=normalize)
            for path in sorted(out.rglob("*")):
                tar.add(path, arcname=f"{out.name}/{path.relative_to(out).as_posix()}",
                        recursive=False, filter=normalize)
        partial.replace(tarball)
    finally:
        partial.unlink(missing_ok=True)
    return tarball


if __name__ == "__main__":  # python -m proxima.bundle ...
    parser = argparse.ArgumentParser(prog="proxima bundle", description=__doc__.splitlines()[0])
    add_arguments(parser)
    from proxima.interrupts import describe, exit_status, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"proxima bundle: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        print(f"proxima bundle: {describe(exc)}", file=sys.stderr)
        sys.exit(exit_status(exc))
