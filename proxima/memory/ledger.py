"""A per-GPU ledger of the Proxima engines sharing one GPU: who holds what, who wants more.

Each engine's scheduler side keeps one record in one small file per GPU (under
``/dev/shm``, named by the GPU's UUID or index: :func:`ledger_path`) and reads the others'
records at each step boundary. A record says, in bytes of KV memory on that GPU: what the
engine has mapped, its minimum, and its *unmet demand* -- what it wants to map and the
GPU cannot give now (its last grow failed). An engine that sees another's unmet demand
gives back what it holds beyond its own need (:mod:`proxima.memory.policy`).

Why a file, and how it stays right:

* **One writer at a time.** Every read-modify-write holds ``fcntl.flock`` on a lock file
  beside the data (``<path>.lock``); the kernel drops the lock of a process that dies, so a
  kill never leaves the ledger locked.
* **No torn record.** The data is written whole to a temporary file in the same directory
  and renamed over the ledger (``os.replace``, atomic on one file system): a reader sees
  the old ledger or the new one, never part of one, whenever a writer is killed.
* **No stale claim.** A record carries its process's pid *and* start time (field 22 of
  ``/proc/<pid>/stat``, clock ticks since boot). A reader drops a record whose process is
  gone or whose pid now belongs to another process (pid reuse), so an engine killed with
  ``-9`` stops counting at the next read, and the next write removes its record.
* **Small and cheap.** JSON of a few hundred bytes on a memory-backed file system: a read
  is one open and one parse (tens of microseconds), a write happens only when the
  engine's own record changes (:meth:`Ledger.post`).

Pure Python (standard library only): no torch, no vLLM, no CUDA context.
Processes in different pid namespaces (containers) that share ``/dev/shm`` see each
other's pids wrongly: give each container its own ``/dev/shm`` or ledger directory
(``PROXIMA_LEDGER_DIR``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DIR_ENV = "PROXIMA_LEDGER_DIR"
DEFAULT_DIR = "/dev/shm"
VERSION = 1


def ledger_path(gpu: str | int, directory: str | os.PathLike | None = None) -> Path:
    """The ledger file of one GPU: ``<dir>/proxima-ledger-<gpu>.json``, ``gpu`` its UUID
    (``GPU-8c3e...``, preferred: the same whatever ``CUDA_VISIBLE_DEVICES`` says) or its
    index; ``dir`` from ``directory``, else ``PROXIMA_LEDGER_DIR``, else ``/dev/shm``."""
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", str(gpu).strip())
    if not key or key.startswith("."):
        raise ValueError(f"a GPU key must be a UUID or an index, got {gpu!r}")
    base = Path(directory if directory is not None
                else os.environ.get(DIR_ENV) or DEFAULT_DIR)
    return base / f"proxima-ledger-{key}.json"


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, from ``/proc``), or None
    when there is no such process or it is a zombie (dead, not yet reaped). Where
    ``/proc`` is missing, 0 for a live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        data = b""
    if data:
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        fields = data[data.rfind(b")") + 2:].split()
        if fields and fields[0] in (b"Z", b"X"):
            return None                  # killed, not yet reaped by its parent: gone
        try:
            return int(fields[19])       # field 22 overall; fields[0] is field 3
        except (IndexError, ValueError):
            pass
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return 0
        return 0
    return None


def load_records(path: str | os.PathLike) -> dict[str, Record]:
    """Every record in the ledger file at ``path`` (live or not), by key; a missing,
    unreadable or damaged file reads as empty, a malformed record is skipped."""
    try:
        # not waiting on a FIFO put in the ledger's place (/dev/shm is everyone's): only a
        # regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}          # missing, or not ours
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)   # a FIFO, a device, a directory: the next write replaces it whole
            return {}
        with os.fdopen(fd, "rb") as f:
            raw = json.loads(f.read() or b"{}")
    except (OSError, ValueError):
        return {}          # damaged: the next write replaces it whole
    out = {}
    entries = raw.get("engines", []) if isinstance(raw, dict) else []
    for entry in entries if isinstance(entries, list) else []:
        try:
            rec = Record(**{k: entry[k] for k in ("pid", "start", "mapped", "min",
                                                  "unmet", "updated")},
                         name=str(entry.get("name", "")),
                         **{k: entry.get(k, 0) for k in ("max", "nonkv", "port")},
                         model=str(entry.get("model", "")))
        except (KeyError, TypeError, AttributeError):
            continue
        if all(type(getattr(rec, k)) is int and getattr(rec, k) >= 0
               for k in ("pid", "start", "mapped", "min", "unmet", "max", "nonkv", "port")):
            out[rec.key] = rec
    return out


def live_records(path: str | os.PathLike) -> tuple[Record, ...]:
    """The live records of the ledger at ``path`` (a dead process's dropped): what every
    engine on that GPU holds, read without a handle of one's own (``proxima kv``, the
    sizing of an engine about to start)."""
    return tuple(r for r in load_records(path).values() if r.alive())


def damage(path: str | os.PathLike) -> str | None:
    """Why the ledger file at ``path`` cannot be read (:func:`load_records` reads it as
    empty), or None: it reads, it is missing, or it is no regular file (skipped, as there).
    For readers that show the ledgers."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)     # never waits on a FIFO
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        with os.fdopen(fd, "rb") as f:
            raw = json.loads(f.read() or b"{}")
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError:
        return "is not JSON"
    if not isinstance(raw, dict) or not isinstance(raw.get("engines", []), list):
        return "is not a ledger (no list of engines)"
    return None


def ledger_files(directory: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """``(gpu key, path)`` of every GPU ledger in ``directory`` (None: as
    :func:`ledger_path`), sorted by key."""
    base = Path(directory if directory is not None
                else os.environ.get(DIR_ENV) or DEFAULT_DIR)
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    prefix, suffix = "proxima-ledger-", ".json"
    return [(name[len(prefix):-len(suffix)], base / name) for name in names
            if name.startswith(prefix) and name.endswith(suffix)]


@dataclass(frozen=True)
class Record:
    """One engine's claim, in bytes of this GPU's memory."""

    pid: int
    start: int                 # the process's start time (:func:`process_start`)
    mapped: int = 0            # KV memory mapped now
    min: int = 0               # its minimum (never given back)
    unmet: int = 0             # memory it wants and could not map (0: none)
    updated: float = 0.0       # time.time() of the last post
    name: str = ""             # tells apart engines of one process (a two-engine replay)
    max: int = 0               # its maximum (0: not said)
    nonkv: int = 0             # what it holds besides KV: weights, activations (0: not said)
    model: str = ""            # the model it serves, and its port, where said (proxima kv)
    port: int = 0

    @property
    def key(self) -> str:
        return f"{self.pid}:{self.start}:{self.name}"

    def alive(self) -> bool:
        return process_start(self.pid) == self.start


@dataclass(frozen=True)
class LedgerView:
    """What a read found: the live records, this engine's own among them (``me``)."""

    records: tuple[Record, ...] = ()
    me: str | None = None

    @property
    def others(self) -> tuple[Record, ...]:
        return tuple(r for r in self.records if r.key != self.me)

    @property
    def others_unmet_bytes(self) -> int:
        """The memory other live engines want and cannot get (0: nobody is waiting)."""
        return sum(r.unmet for r in self.others)

    @property
    def others_mapped_bytes(self) -> int:
        return sum(r.mapped for r in self.others)


class LedgerError(RuntimeError):
    pass


class Ledger:
    """One engine's handle on one GPU's ledger file.

    Args:
        path: the ledger file (:func:`ledger_path`); its directory must exist.
        pid: the process the record speaks for (default: this one).
        name: tells apart several engines of one process (default: none).
        model, port, nonkv: what the record says of the engine besides its KV memory: the
            model it serves, its port, the bytes it holds besides KV (weights,
            activations), for ``proxima kv`` and the sizing of engines started later
            (``proxima.serve.sizing``); empty or 0 where not known.
    """

    def __init__(self, path: str | os.PathLike, pid: int | None = None,
                 name: str = "", *, model: str = "", port: int = 0, nonkv: int = 0) -> None:
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise LedgerError(f"the ledger's directory {self.path.parent} does not exist: "
                              f"set {DIR_ENV} to a writable directory")
        self.pid = os.getpid() if pid is None else pid
        start = process_start(self.pid)
        if start is None:
            raise LedgerError(f"process {self.pid} does not exist")
        self.start = start
        self.name = str(name)
        for label, value in (("port", port), ("nonkv", nonkv)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{label} must be an integer >= 0, got {value!r}")
        self.model, self.port, self.nonkv = str(model), port, nonkv
        self.key = f"{self.pid}:{self.start}:{self.name}"
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._posted: tuple | None = None
        self.writes = 0

    # ------------------------------------------------------------------ reading
    def _load(self) -> dict[str, Record]:
        return load_records(self.path)

    def read(self) -> LedgerView:
        """The live records (dead processes' dropped), without taking the lock: the file
        is only ever replaced whole."""
        live = tuple(r for r in self._load().values() if r.alive())
        return LedgerView(live, self.key)

    # ------------------------------------------------------------------ writing
    def _write(self, records: dict[str, Record]) -> None:
        data = json.dumps({"version": VERSION,
                           "engines": [asdict(r) for r in records.values()]},
                          separators=(",", ":")).encode()
        tmp = self.path.with_name(f".{self.path.name}.{self.pid}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self.writes += 1

    def _update(self, mine: Record | None) -> None:
        """Under the lock: drop dead records and stale temporary files, put ``mine`` (None:
        remove this engine's record), write the ledger whole."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            records = {k: r for k, r in self._load().items() if r.alive()}
            if mine is None:
                records.pop(self.key, None)
            else:
                records[self.key] = mine
            self._sweep_tmp()
            self._write(records)
        finally:
            os.close(fd)           # closing drops the lock

    def _sweep_tmp(self) -> None:
        """Temporary files of writers killed mid-write (their pid is gone)."""
        prefix = f".{self.path.name}."
        try:
            names = os.listdir(self.path.parent)
        except OSError:
            return
        for name in names:
            if name.startswith(prefix) and name.endswith(".tmp"):
                pid = name[len(prefix):-4]
                if pid.isdigit() and int(pid) != self.pid and process_start(int(pid)) is None:
                    try:
                        os.unlink(self.path.parent / name)
                    except OSError:
                        pass

    def post(self, mapped: int, minimum: int = 0, unmet: int = 0, force: bool = False,
             maximum: int = 0) -> bool:
        """This engine's record (bytes; ``maximum`` 0: not said); written only when it
        changed (or ``force``). Returns whether the file was written."""
        for name, value in (("mapped", mapped), ("minimum", minimum), ("unmet", unmet),
                            ("maximum", maximum)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        state = (mapped, minimum, unmet, maximum)
        if state == self._posted and not force:
            return False
        self._update(Record(self.pid, self.start, mapped, minimum, unmet, time.time(),
                            self.name, maximum, self.nonkv, self.model, self.port))
        self._posted = state
        return True

    def repost(self) -> bool:
        """Write this engine's last record again, now (``nonkv`` changed: an engine that
        sleeps). Returns whether there was one to write."""
        if self._posted is None:
            return False
        mapped, minimum, unmet, maximum = self._posted
        return self.post(mapped, minimum, unmet, force=True, maximum=maximum)

    def close(self) -> None:
        """Remove this engine's record (a clean shutdown; a killed engine's record is
        dropped by readers instead)."""
        try:
            self._update(None)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EACCES, errno.EROFS):
                raise
        self._posted = None
