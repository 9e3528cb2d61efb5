"""`proxima bundle`'s wheelhouse: the proxima wheel (built from this checkout or given)
and, through pip, the wheels of its requirements and chosen extras for the serving
machine's Python and platform; what a wheel or a checkout's pyproject.toml offers; and the
progress line every part of `proxima bundle` prints (:func:`say`).
Imports only the standard library (and pip, run as a program)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from proxima import bundle_install
from proxima.errors import UserError


def say(message: str) -> None:
    print(f"proxima bundle: {message}", file=sys.stderr, flush=True)


def project_root() -> Path | None:
    """The checkout this proxima was imported from, when it was (editable or in-tree)."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "proxima"' in pyproject.read_text():
        return root
    return None


def load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:             # Python 3.10: pip's own copy of tomli
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def extras_of_wheel(wheel: Path) -> list[str]:
    try:
        return list(wheel_metadata(wheel).get_all("Provides-Extra") or [])
    except (zipfile.BadZipFile, StopIteration, OSError) as exc:
        raise UserError(f"--wheel {wheel}: cannot read its METADATA ({exc})") from None


def extras_of_pyproject(pyproject: Path) -> list[str]:
    data = load_toml(pyproject)
    return list(data.get("project", {}).get("optional-dependencies", {}))


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
