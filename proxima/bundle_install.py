"""install.py of an air-gapped bundle: check the copy and this machine, then install offline.

`proxima bundle` copies this file into every bundle as ``install.py``. On the far side, where
nothing is installed yet, it is run by the system's Python from the bundle directory::

    python3 install.py [VENV]          (default VENV: ./venv)

1. every file against SHA256SUMS (a bad copy stops here);
2. this interpreter and machine against what the wheelhouse was built for (bundle.json: the
   Python version of its compiled wheels, the CPU architecture, the oldest glibc they need);
   a mismatch stops here with one line saying what the wheelhouse needs and what to do;
3. ``python3 -m venv VENV`` and ``VENV/bin/pip install --no-index --find-links wheelhouse
   'proxima[EXTRAS]==VERSION'`` (the extras the bundle was written with), then
   ``VENV/bin/proxima --version``.

Standard library only, and no import of Proxima: it must run before anything is installed.
The same functions compute the requirements when the bundle is written (proxima/bundle.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import venv
from pathlib import Path

SUMS = "SHA256SUMS"
MANIFEST = "bundle.json"

# Legacy manylinux tags and the glibc they stand for (PEP 600).
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


class Refused(Exception):
    """This machine cannot use the bundle; the message is the one line to print."""


# ---- what a wheelhouse needs (used by `proxima bundle` too) -------------------------------

def wheel_tags(filename: str) -> tuple[list[str], list[str], list[str]]:
    """(python tags, abi tags, platform tags) of a wheel file name (PEP 427, compressed sets)."""
    parts = filename[:-len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {filename}")
    py, abi, plat = parts[-3:]
    return py.split("."), abi.split("."), plat.split(".")


def _platform_need(tag: str) -> tuple[str | None, tuple[int, int] | None, str | None]:
    """(machine, minimum glibc, libc) for one platform tag; (None, None, None) for 'any'."""
    if tag == "any":
        return None, None, None
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if m:
        return m[3], (int(m[1]), int(m[2])), "glibc"
    m = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(\w+)", tag)
    if m:
        return m[2], _LEGACY_MANYLINUX[m[1]], "glibc"
    m = re.fullmatch(r"musllinux_(\d+)_(\d+)_(\w+)", tag)
    if m:
        return m[3], (int(m[1]), int(m[2])), "musl"
    m = re.fullmatch(r"linux_(\w+)", tag)
    if m:
        return m[1], None, None
    return tag, None, None      # macosx_*, win_*: a machine we name by its tag


def requirements(wheel_names: list[str]) -> dict:
    """What a machine needs to install every wheel of a wheelhouse.

    ``python``: the CPython "X.Y" that compiled (cpXY, non-abi3) wheels were built for, or
    None when every wheel is pure Python or abi3; ``python_min``: the oldest CPython an abi3
    wheel accepts; ``machine``: the CPU architecture (x86_64, aarch64), None if all pure;
    ``glibc``: the oldest glibc "X.Y" that all manylinux wheels accept; ``libc``: glibc or
    musl; ``compiled``: the wheels that set these."""
    exact, abi3_min, machines, glibc, libcs, compiled = set(), None, set(), None, set(), []
    for name in sorted(wheel_names):
        pys, abis, plats = wheel_tags(name)
        needs_py = [p for p in pys if re.fullmatch(r"cp\d+", p)]
        if needs_py:
            versions = sorted(f"{p[2]}.{p[3:]}" for p in needs_py)
            if "abi3" in abis:
                low = min(versions, key=lambda v: tuple(map(int, v.split("."))))
                if abi3_min is None or tuple(map(int, low.split("."))) > tuple(map(int, abi3_min.split("."))):
                    abi3_min = low
            else:
                exact.add(versions[0] if len(versions) == 1 else "|".join(versions))
        needs = [_platform_need(p) for p in plats]
        if all(n == (None, None, None) for n in needs):
            if needs_py:
                compiled.append(name)
            continue
        compiled.append(name)
        machines.update(n[0] for n in needs if n[0])
        libcs.update(n[2] for n in needs if n[2])
        floors = [n[1] for n in needs if n[1] is not None]
        if floors:
            wheel_floor = min(floors)       # any one of a wheel's tags is enough
            glibc = wheel_floor if glibc is None else max(glibc, wheel_floor)
    return {
        "python": "|".join(sorted(exact)) if exact else None,
        "python_min": abi3_min,
        "machine": "|".join(sorted(machines)) if machines else None,
        "glibc": f"{glibc[0]}.{glibc[1]}" if glibc else None,
        "libc": "|".join(sorted(libcs)) if libcs else None,
        "compiled": compiled,
    }


def this_machine() -> dict:
    """What the running interpreter and machine offer, in the terms of :func:`requirements`."""
    libc, version = platform.libc_ver()
    if not libc:
        try:
            libc, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        except (ValueError, OSError, AttributeError):
            libc, version = "", ""
    return {
        "implementation": sys.implementation.name,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "libc": "glibc" if libc == "glibc" else (libc or "unknown"),
        "glibc": version if libc == "glibc" else None,
    }


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def check_machine(need: dict, have: dict) -> None:
    """Raise Refused, naming the requirement, the value seen and what to do, on a mismatch."""
    where = f"{sys.executable} (Python {have['python']}, {have['machine']})"
    if need.get("python") or need.get("python_min"):
        if have["implementation"] != "cpython":
            raise Refused(f"this wheelhouse holds CPython wheels, this is {have['implementation']} "
                          f"at {where}: run install.py with CPython {need.get('python') or need['python_min']}")
    if need.get("python") and have["python"] not in need["python"].split("|"):
        raise Refused(f"this wheelhouse was built for Python {need['python']} (e.g. "
                      f"{need['compiled'][0]}), this is {where}: run install.py with "
                      f"python{need['python'].split('|')[0]}, or write the bundle again with "
                      f"`proxima bundle --python-version {have['python']}`")
    if need.get("python_min") and _version(have["python"]) < _version(need["python_min"]):
        raise Refused(f"this wheelhouse needs Python >= {need['python_min']}, this is {where}")
    if need.get("machine") and have["machine"] not in need["machine"].split("|"):
        raise Refused(f"this wheelhouse was built for {need['machine']} machines, this one is "
                      f"{have['machine']}: write the bundle again with `proxima bundle "
                      f"--platform` for {have['machine']}")
    if need.get("libc") == "glibc":
        if have["libc"] != "glibc" or not have.get("glibc"):
            raise Refused(f"this wheelhouse needs glibc >= {need['glibc']} (manylinux wheels), "
                          f"this machine's C library is {have['libc']}")
        if need.get("glibc") and _version(have["glibc"]) < _version(need["glibc"]):
            raise Refused(f"this wheelhouse needs glibc >= {need['glibc']}, this machine has "
                          f"{have['glibc']}: write the bundle again with `proxima bundle "
                          f"--platform manylinux_{have['glibc'].replace('.', '_')}_{have['machine']}`")


# ---- checking the copy ------------------------------------------------------------------

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def verify(bundle: Path) -> list[str]:
    """Lines describing every mismatch with SHA256SUMS; empty when the copy is intact."""
    sums = bundle / SUMS
    if not sums.is_file():
        raise Refused(f"{bundle}: no {SUMS}; is this a proxima bundle?")
    try:
        text = sums.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return [f"{SUMS}: not UTF-8 text (the copy is damaged)"]
    listed, bad = {}, []
    for number, line in enumerate(text.splitlines(), 1):
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            bad.append(f"{SUMS}:{number}: not a line '<sha256>  <file>' (the copy is damaged)")
            continue
        listed[name] = digest
    for name, digest in sorted(listed.items()):
        path = bundle / name
        if not path.is_file():
            bad.append(f"{name}: missing")
        elif sha256(path) != digest:
            bad.append(f"{name}: checksum differs")
    present = {p.relative_to(bundle).as_posix() for p in files(bundle)} - {SUMS}
    bad += [f"{name}: not listed in {SUMS}" for name in sorted(present - set(listed))]
    return bad


# ---- installing -------------------------------------------------------------------------

def install(bundle: Path, target: Path) -> int:
    bad = verify(bundle)
    if bad:
        for line in bad:
            print(f"FAILED {line}", file=sys.stderr)
        raise Refused(f"{len(bad)} file(s) of {bundle} do not match {SUMS}: copy the bundle again")
    manifest = json.loads((bundle / MANIFEST).read_text())
    check_machine(manifest["wheelhouse"]["needs"], this_machine())
    extras = manifest["wheelhouse"]["extras"]
    spec = f"proxima[{','.join(extras)}]=={manifest['proxima']}" if extras else \
        f"proxima=={manifest['proxima']}"
    if target.exists() and any(target.iterdir()):
        raise Refused(f"{target} exists and is not empty: give a new directory "
                      f"(python3 install.py NEW_VENV)")
    print(f"install.py: {bundle}: every file matches {SUMS}; this machine fits the wheelhouse")
    print(f"install.py: creating {target} and installing {spec} from wheelhouse/ (no network)",
          flush=True)
    venv.EnvBuilder(with_pip=True).create(target)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run([str(target / "bin" / "python"), "-m", "pip", "install", "--no-index",
                           "--find-links", str(bundle / "wheelhouse"), spec], env=env)
    if done.returncode != 0:
        raise Refused(f"pip install from wheelhouse/ failed (exit {done.returncode}), see above")
    subprocess.run([str(target / "bin" / "proxima"), "--version"], check=True)
    serves = manifest["wheelhouse"].get("serves")
    print(f"install.py: done: {target}/bin/proxima" + (
        "" if serves else " (this wheelhouse has no vLLM: replay and bundle work, serving needs "
                          "a bundle written with --extra vllm --extra serve, or the image)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1] if __doc__ else "python3 install.py [VENV]")
        return 0
    if len(argv) > 1:
        print(f"install.py: error: one argument at most (the venv directory), got {argv}",
              file=sys.stderr)
        return 2
    bundle = Path(__file__).resolve().parent
    target = Path(argv[0] if argv else "venv").absolute()
    try:
        return install(bundle, target)
    except Refused as exc:
        print(f"install.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("install.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
