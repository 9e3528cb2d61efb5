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
Imports only the standard library: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from proxima import __version__
from proxima import bundle_install
from proxima.bundle_install import MANIFEST, SUMS, files, sha256, verify
from proxima.errors import UserError

# Tar members get this time, owner and mode bits, so the same bundle gives the same tarball.
EPOCH = 1
# The oldest NVIDIA Linux driver of each CUDA release (CUDA's release notes, table 3).
MIN_DRIVER = {"12.1": "530.30.02", "12.4": "550.54.14", "12.8": "570.26", "13.0": "580.65.06"}
SERVING_STACKS = ("card", "tested")


EXIT_STATUS = """\
exit status:
  0    the bundle was written; with --verify: every file matches SHA256SUMS
  1    --verify: a file is missing or does not match (each named on stderr)
  2    bad input or environment (one line)
  130  interrupted (Ctrl-C)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EXIT_STATUS
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="directory to write; must not exist or be empty (default: none, "
                             "required unless --verify)")
    parser.add_argument("--image", type=Path, action="append", default=[], metavar="FILE",
                        help="image archive (docker-archive .tar or .tar.gz) or a Nix "
                             "streamLayeredImage script; repeatable (default: no image)")
    parser.add_argument("--nix-closure", metavar="STORE_PATH",
                        help="export this store path and its closure to nix/closure.nar "
                             "(default: none)")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="model directory (with config.json) to include under models/ "
                             "(default: none; models/README.md says how to mount one)")
    parser.add_argument("--wheel", type=Path, metavar="FILE",
                        help="use this proxima wheel instead of building one from the checkout "
                             "(default: build it)")
    parser.add_argument("--extra", action="append", default=[], metavar="NAME",
                        help="also put the wheels of this pyproject extra into the wheelhouse, "
                             "e.g. vllm (the tested stack, some GB), vllm-cu121 (the card stack), "
                             "serve (gunicorn + uvicorn-worker); repeatable; needs network now, "
                             "none later (default: none: the wheelhouse cannot serve)")
    parser.add_argument("--python-version", metavar="X.Y",
                        help="Python of the serving machine, for the wheelhouse "
                             f"(default: this one, {sys.version_info.major}.{sys.version_info.minor})")
    parser.add_argument("--platform", action="append", default=[], metavar="TAG",
                        help="wheel platform tag of the serving machine, e.g. "
                             "manylinux_2_28_x86_64; repeatable (default: this machine's)")
    parser.add_argument("--tar", action="store_true", help="also write DIR.tar (default: off)")
    parser.add_argument("--verify", type=Path, metavar="DIR",
                        help="check DIR against its SHA256SUMS and exit")


def run(args: argparse.Namespace) -> int:
    if args.verify:
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


def say(message: str) -> None:
    print(f"proxima bundle: {message}", file=sys.stderr, flush=True)


# ---- checking the inputs (before any work) --------------------------------------------------

@dataclass
class ImageInput:
    path: Path
    kind: str                       # "archive" or "script"
    tags: list[str] = field(default_factory=list)
    labels: dict = field(default_factory=dict)


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
                 platforms) -> Plan:
    """Every check that can be made before work starts; UserError on the first bad input."""
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty directory; "
                        "choose a new path (a bundle is written whole, never merged)")
    parent = next(p for p in [out.parent, *out.parent.parents] if p.exists())
    if not os.access(parent, os.W_OK):
        raise UserError(f"--out {out}: {parent} is not writable")
    checked = [check_image(Path(image)) for image in images]
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
        if not re.fullmatch(r"3\.\d+", python_version):
            raise UserError(f"--python-version {python_version}: give X.Y, e.g. 3.12")
        pip_target += ["--python-version", python_version, "--implementation", "cp"]
    for tag in platforms:
        if not re.fullmatch(r"[a-z0-9_]+", tag) or tag == "any":
            raise UserError(f"--platform {tag}: not a wheel platform tag "
                            "(e.g. manylinux_2_28_x86_64, manylinux2014_aarch64)")
        pip_target += ["--platform", tag]
    nix_paths = None
    if nix_closure:
        nix_paths = nix_requisites(nix_closure)
    return Plan(out=out, images=checked, extras=sorted(set(extras)), wheel=wheel, root=root,
                model=model, nix_paths=nix_paths, nix_closure=nix_closure,
                pip_target=pip_target)


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


def extras_of_wheel(wheel: Path) -> list[str]:
    try:
        return list(wheel_metadata(wheel).get_all("Provides-Extra") or [])
    except (zipfile.BadZipFile, StopIteration, OSError) as exc:
        raise UserError(f"--wheel {wheel}: cannot read its METADATA ({exc})") from None


def load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:             # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def extras_of_pyproject(pyproject: Path) -> list[str]:
    data = load_toml(pyproject)
    return list(data.get("project", {}).get("optional-dependencies", {}))


def nix_requisites(store_path: str) -> list[str]:
    if shutil.which("nix-store") is None:
        raise UserError("--nix-closure needs nix-store on PATH (install Nix, or drop the option)")
    query = subprocess.run(["nix-store", "--query", "--requisites", store_path],
                           capture_output=True, text=True)
    if query.returncode != 0:
        raise UserError(f"--nix-closure {store_path}: not a valid store path "
                        f"({query.stderr.strip()[-300:]}); build it first, e.g. nix build .#proxima")
    return query.stdout.split()


# ---- writing --------------------------------------------------------------------------------

def write_bundle(out: Path, *, images: list[Path] = (), nix_closure: str | None = None,
                 model: Path | None = None, wheel: Path | None = None,
                 extras: list[str] = (), python_version: str | None = None,
                 platforms: list[str] = (), tar: bool = False) -> Path:
    """Check every input, write the bundle beside ``out`` and rename it to ``out`` when done."""
    plan = check_inputs(out, images=images, nix_closure=nix_closure, model=model, wheel=wheel,
                        extras=list(extras), python_version=python_version,
                        platforms=list(platforms))
    out = plan.out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    done = False
    try:
        build(plan, staging)
        if out.exists():
            out.rmdir()             # empty (checked), so the rename can take its place
        staging.rename(out)
        done = True
    finally:
        if not done:
            shutil.rmtree(staging, ignore_errors=True)
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


def project_root() -> Path | None:
    """The checkout this proxima was imported from, when it was (editable or in-tree)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "proxima"' in pyproject.read_text():
        return root
    return None


def build_wheelhouse(dest: Path, plan: Plan) -> dict:
    dest.mkdir(parents=True)
    if plan.wheel is not None:
        shutil.copy2(plan.wheel, dest / plan.wheel.name)
    else:
        say("building the proxima wheel from the checkout")
        build_wheel(plan.root, dest)
    (built,) = dest.glob("proxima-*.whl")
    requirements = wheel_requirements(built, plan.extras)
    if requirements:
        say(f"downloading {len(requirements)} requirement(s) and their dependencies into "
            f"wheelhouse/ ({'extras: ' + ', '.join(plan.extras) if plan.extras else 'no extras'})")
        pip(["download", "--only-binary=:all:", "--progress-bar", "off", "--dest", str(dest),
             *plan.pip_target, *requirements])
    wheels = sorted(p.name for p in dest.iterdir())
    names = {re.split(r"-", w, maxsplit=1)[0].lower() for w in wheels}
    return {
        "extras": plan.extras,
        "files": wheels,
        "needs": bundle_install.requirements([w for w in wheels if w.endswith(".whl")]),
        "serves": "vllm" in names and "gunicorn" in names and "uvicorn_worker" in names,
    }


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
        # When this environment cannot meet pyproject's build-system, pip builds in an
        # isolated environment with what it asks for (fetched from the index).
        isolation = ["--no-build-isolation"] if build_requirements_met(src / "pyproject.toml") else []
        pip(["wheel", "--no-deps", *isolation, "-w", str(dest), str(src)])


def build_requirements_met(pyproject: Path) -> bool:
    """Whether this environment has every build-system requirement of ``pyproject`` (names and
    `>=` floors; anything else counts as unmet), so the wheel builds with no network."""
    from importlib.metadata import PackageNotFoundError, version

    requires = load_toml(pyproject).get("build-system", {}).get("requires", [])
    for req in requires:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(?:>=\s*([0-9][0-9.]*))?\s*", req)
        if not m:
            return False
        try:
            have = version(m[1])
        except PackageNotFoundError:
            return False
        if m[2] and _numeric(have) < _numeric(m[2]):
            return False
    return True


def _numeric(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(meta_name).decode())


def wheel_requirements(wheel: Path, extras: list[str]) -> list[str]:
    """Requires-Dist of the wheel: the unconditional ones plus those of the chosen extras."""
    meta = wheel_metadata(wheel)
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


# The lines of pip's output shown as progress (all of it goes to the log).
PIP_SHOWN = ("Collecting", "Downloading", "Saved", "Successfully", "ERROR", "Created wheel")


def pip(args: list[str]) -> None:
    """Run pip, its output indented on stderr as it comes (progress on long downloads)."""
    log = Path(tempfile.gettempdir()) / f"proxima-bundle-pip-{os.getpid()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    with open(log, "w") as fh:
        for line in proc.stdout:
            fh.write(line)
            text = line.strip()
            if text.startswith(PIP_SHOWN):
                print(f"  pip: {text}", file=sys.stderr, flush=True)
            if text:
                tail = (tail + [text])[-20:]
    rc = proc.wait()
    if rc != 0:
        reason = next((l for l in reversed(tail) if l.startswith("ERROR")), tail[-1] if tail else "")
        raise UserError(f"pip {args[0]} failed (exit {rc}): {reason} (full output: {log})")
    log.unlink(missing_ok=True)


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


def export_nix_closure(store_path: str, paths: list[str], dest: Path) -> str:
    dest.mkdir()
    say(f"exporting the Nix closure of {store_path} ({len(paths)} store paths)")
    with open(dest / "closure.nar", "wb") as fh:
        done = subprocess.run(["nix-store", "--export", *paths], stdout=fh,
                              stderr=subprocess.PIPE)
    if done.returncode != 0:
        raise UserError(f"nix-store --export failed: {done.stderr.decode(errors='replace')[-300:]}")
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


def readme(manifest: dict, slim_only: bool) -> str:
    images = manifest["images"]
    wh = manifest["wheelhouse"]
    model = manifest["model"]
    model_arg = f" /{model}" if model else ""
    serving = [i for i in images if i["serves"]] or images
    tag = next((i["tags"][0] for i in serving if i["tags"]), "IMAGE")
    drivers = sorted({f"driver >= {MIN_DRIVER[i['cuda']]} (CUDA {i['cuda']}, image {i['file']})"
                      for i in images if i.get("cuda") in MIN_DRIVER})
    driver_line = "; ".join(drivers) if drivers else \
        "the driver that the image's CUDA release needs (CUDA 12.1: >= 530.30.02)"
    needs = wh["needs"]
    py_need = (f"CPython {needs['python']}" if needs["python"] else
               f"Python >= {needs['python_min']}" if needs["python_min"] else "Python >= 3.10")
    plat_need = ", ".join(filter(None, [needs["machine"],
                                        needs["glibc"] and f"glibc >= {needs['glibc']}"]))
    spec = f"proxima[{','.join(wh['extras'])}]" if wh["extras"] else "proxima"
    if images:
        load = "\n".join(f"    docker load -i image/{i['file']}" for i in images)
        container = f"""{load}
    docker run --gpus all -v "$PWD/models:/models" -p 8000:8000 {tag}{model_arg}

With Podman: `podman load -i image/<file>`, then `podman run --device nvidia.com/gpu=all ...`
(CDI; `nvidia-ctk cdi generate` once). The entrypoint is `proxima serve`: the self-check
runs first, and `GET /health` on port 8000 answers 200 once it passed (the image's health
check asks the same). It sets PROXIMA_ALLOCATOR=1, HF_HUB_OFFLINE=1 and
TRANSFORMERS_OFFLINE=1, so nothing is fetched from a model hub.
"""
        if slim_only:
            container += """
**This bundle's only image is the slim CI image (no vLLM): it runs `proxima --version` and
`proxima selfcheck`, but it cannot serve.** Write the bundle again with the Nix image
(`nix build .#proxima-image`) or the Dockerfile's (`docker save proxima:<version>-vllm0.26.0`).
"""
    else:
        container = "No image archive in this bundle.\n"
    if wh["serves"]:
        python_use = f"    venv/bin/proxima serve{model_arg or ' /models/<name>'} --port 8000\n"
        python_note = (f"The wheelhouse holds vLLM and the serving supervisor ({spec}); the\n"
                       "machine needs the NVIDIA driver above, no container toolkit.")
    else:
        python_use = "    venv/bin/proxima --version\n"
        python_note = (f"The wheelhouse holds {spec} without vLLM: this Python install cannot "
                       "serve (nor replay,\nwhich drives vLLM's scheduler). Serve from the image, "
                       "or write the bundle with\n`--extra vllm --extra serve` (the tested stack) "
                       "or `--extra vllm-cu121 --extra serve` (the card stack).")
    nix = manifest.get("nix")
    nix_text = (f"\n## Nix\n\nThe closure of `{nix}`:\n\n    nix-store --import < nix/closure.nar\n"
                f"    $(cat nix/store-path)/bin/proxima serve\n") if nix else ""
    return f"""# Proxima {manifest['proxima']}: air-gapped bundle

Everything here installs and serves without network.

## What the serving machine needs

- Linux with an NVIDIA GPU and its driver: {driver_line};
- for the image: Docker or Podman, and the NVIDIA Container Toolkit (it mounts the host's
  driver libraries into the container; `docker run --gpus all` needs it);
- for the Python install instead: {py_need}{', ' + plat_need if plat_need else ''}
  (what the wheelhouse's wheels were built for; `install.py` checks it).

## 1. Check the copy

    sha256sum -c {SUMS}

## 2. Serve from the container image

{container}
## Or: install the Python package (no container)

    python3 install.py venv
{python_use}
`install.py` checks every file against {SUMS} and this machine against the wheelhouse, then
runs `venv/bin/pip install --no-index --find-links wheelhouse '{spec}=={manifest['proxima']}'`.
{python_note}
The wheelhouse: {', '.join(wh['files'])}.
{nix_text}
## Model

{model or 'None bundled (see models/README.md).'}
"""


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
    try:
        sys.exit(run(parser.parse_args()))
    except UserError as exc:
        print(f"proxima bundle: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("proxima bundle: interrupted", file=sys.stderr)
        sys.exit(130)
