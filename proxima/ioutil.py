"""Output of every subcommand: files checked before the work and written whole or not at
all; log lines on stderr, so that stdout holds the result table alone.

``check_output_path`` runs before a replay or a benchmark starts, so that a result path
that cannot be written fails in one line instead of after an hour of work. ``write_atomic``
writes to a temporary name in the same directory and renames it over the target when
complete: a reader (or a crash, a full disk, Ctrl-C) never sees half a file.
``publish_text`` / ``publish_text_later`` do the same, without fsync, for the live files an
engine rewrites while it runs (its status and stats files), the latter off the caller's
thread. Standard library only.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

from proxima.errors import UserError


def check_output_path(path: str | os.PathLike | None, flag: str,
                      suffix: str | None = None) -> Path | None:
    """Fail now, in one line, unless ``path`` can be written as a file later.

    Refused: an empty name, ``-`` (not stdout here: a file named '-'), a directory (or a
    name ending in ``/``), a path whose existing
    target is not a regular file (``/dev/null``, a FIFO: a rename would replace it), a
    wrong ``suffix`` (``--plot x.txt``), a parent directory that is missing or in which a
    file cannot be created (read-only, ``/proc``, no permission: probed by creating one).
    Returns the path, or None when none was given."""
    if path is None:
        return None
    text = os.fspath(path)
    if not text.strip():
        raise UserError(f"{flag} needs a file name, got {text!r}")
    if text == "-":                 # not stdout: stdout holds the table
        raise UserError(f"{flag} - would write a file named '-' ({flag} writes a file; the "
                        f"table is on stdout): give a file name, e.g. result{suffix or '.json'}")
    target = Path(text)
    if text.endswith(("/", os.sep)) or target.is_dir():
        example = f"{text.rstrip('/')}/result{suffix or '.json'}"
        what = "is a directory" if target.is_dir() else "ends in / (a directory's name)"
        raise UserError(f"{flag} {text} {what}: give a file name, e.g. {example}")
    if suffix and target.suffix.lower() != suffix:
        raise UserError(f"{flag} {text}: the file name must end in {suffix} "
                        f"(it writes {suffix[1:].upper()}), e.g. {target.with_suffix(suffix)}")
    if target.exists() or target.is_symlink():
        try:
            mode = target.stat().st_mode
        except OSError as exc:
            raise UserError(f"{flag} {text}: cannot use it ({exc.strerror or exc})") from None
        if not stat.S_ISREG(mode):
            raise UserError(f"{flag} {text} exists and is not a regular file: give a file name")
    parent = target.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise UserError(f"{flag} {text}: directory {parent} {why} (create it first)")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        raise UserError(f"{flag} {text}: cannot create a file in {parent} "
                        f"({exc.strerror or exc}): choose a writable directory") from None
    os.close(fd)
    os.unlink(probe)
    return target


def _same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` name one file: the same name, ``./name``, ``dir/../name``, a symlink
    to it (followed even where the target does not exist yet), or a hard link."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:             # one of them does not exist (yet): not the same file
        return False


def check_distinct_paths(outputs: dict[str, str | os.PathLike | None],
                         inputs: dict[str, str | os.PathLike | None] | None = None) -> None:
    """Fail now, in one line, when two outputs (``{flag: path}``) would be written to one
    file (the second would replace the first), or an output would replace an input."""
    given = [(flag, os.fspath(path)) for flag, path in outputs.items() if path]
    for flag, path in given:
        for in_flag, source in (inputs or {}).items():
            if source and _same_file(path, os.fspath(source)):
                raise UserError(f"{flag} {path} would overwrite the {in_flag.lstrip('-')} "
                                f"({in_flag} {os.fspath(source)}): give another name")
    for i, (flag, path) in enumerate(given):
        for other_flag, other in given[i + 1:]:
            if _same_file(path, other):
                raise UserError(f"{flag} {path} and {other_flag} {other} are the same file "
                                f"(one would overwrite the other): give each its own name")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` fills a temporary file next to ``path``, which then replaces ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give it; on any failure the
    temporary file is removed and ``path`` is left as it was (an OSError, e.g. a full disk,
    becomes a one-line UserError)."""
    target = Path(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                        dir=target.parent)
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:        # on disk before it gets the real name
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {target}: {exc.strerror or exc} "
                        f"(nothing was written there)") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def publish_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path``, a live file another process samples, with ``text`` whole.

    The text goes to ``.NAME.PID.tmp`` next to it and is renamed over it: a reader sees the
    old file or the new one, never part of one. No fsync (a sample, not a record: this runs
    on an engine's scheduler thread). A writer killed between the two steps leaves its
    temporary file (``.NAME.*.tmp``) behind."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _LiveFiles:
    """The files ``publish_text_later`` was given, written by one daemon thread.

    Each path keeps only its newest text until the thread writes it (a sample superseded
    before it was written is not written). Pops and writes happen under one lock, so the
    text a path ends with is the last one submitted, whoever writes it: the thread, a
    ``wait=True`` call, or the flush at interpreter exit. A child forked while the thread
    runs starts with no thread and nothing pending."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)   # a forked child has no thread,
        atexit.register(self.flush)                        # and a held lock stays held

    def _reset(self) -> None:
        self._lock = threading.Lock()           # the pending texts
        self._wake = threading.Condition(self._lock)
        self._io = threading.Lock()             # one pop-and-write at a time, in order
        self._pending: dict[Path, str] = {}
        self._thread: threading.Thread | None = None
        self._failed: set[Path] = set()

    def submit(self, path: Path, text: str, wait: bool) -> None:
        with self._lock:
            self._pending[path] = text
            if not wait and self._started():
                self._wake.notify()
                return
        self._write(path, raise_errors=True)

    def _started(self) -> bool:
        """The thread runs (started now if need be; under ``_lock``). False while the
        interpreter shuts down: the caller writes the text itself."""
        if self._thread is None:
            thread = threading.Thread(target=self._run, daemon=True, name="proxima-live-files")
            try:
                thread.start()
            except RuntimeError:
                return False
            self._thread = thread
        return True

    def flush(self) -> None:
        """Write every pending text now, on the caller's thread, after the write the
        thread may be making: when this returns, every file holds its last text."""
        with self._io:
            with self._lock:
                paths = list(self._pending)
            for path in paths:
                self._write_held(path, raise_errors=False)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._wake.wait()
                paths = list(self._pending)
            for path in paths:
                self._write(path, raise_errors=False)

    def _write(self, path: Path, raise_errors: bool) -> None:
        with self._io:
            self._write_held(path, raise_errors)

    def _write_held(self, path: Path, raise_errors: bool) -> None:
        with self._lock:
            text = self._pending.pop(path, None)
        if text is None:
            return
        try:
            publish_text(path, text)
        except OSError as exc:
            if raise_errors:
                raise
            if path not in self._failed:        # once per path: a full disk, a removed dir
                self._failed.add(path)
                logging.getLogger(__name__).warning(
                    "cannot write %s: %s (later snapshots are tried and dropped "
                    "silently)", path, exc.strerror or exc)
        else:
            self._failed.discard(path)


_live_files = _LiveFiles()


def publish_text_later(path: str | os.PathLike, text: str, wait: bool = False) -> None:
    """:func:`publish_text` off the caller's thread: returns at once, and a daemon thread
    writes the text (the file's open, write and rename release the GIL, so an engine's
    scheduler thread does not wait for the disk). Only a path's newest text is kept until
    written; an older one never replaces a newer one. ``wait=True`` writes it now, on the
    caller's thread (what a reader must find at once: a forced or final snapshot), and
    raises its OSError; the thread logs a failed write once per path. Pending texts are
    written at interpreter exit."""
    _live_files.submit(Path(path), text, wait)


def flush_live_files() -> None:
    """Every text given to :func:`publish_text_later` is in its file when this returns."""
    _live_files.flush()


def logs_to_stderr(name: str) -> None:
    """Point the stream handlers of logger ``name`` that write to stdout at stderr (vLLM
    logs to stdout; 0.2x also reads VLLM_LOGGING_STREAM, 0.6 has no setting for it)."""
    for handler in logging.getLogger(name).handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def print_table(text: str) -> BrokenPipeError | None:
    """``text`` on stdout, flushed; the BrokenPipeError if stdout's reader went away
    (``| head``), for the caller to raise once its --json and --plot are written: a closed
    stdout must not lose the files of a finished run."""
    try:
        print(text, flush=True)
    except BrokenPipeError as exc:
        return exc
    return None


def shown(value) -> str:
    """``value`` as a user wrote it in JSON (``null``, ``true``, ``[1, 2]``) where it is
    JSON, else its ``repr``: for error lines about a value read from a file or a server."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class KeyTwice(ValueError):
    """A JSON object gives a key twice (``json.loads`` would keep its last value silently);
    ``key``: which."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} is given twice")
        self.key = key


def object_keys_once(pairs: list) -> dict:
    """``json.loads``' ``object_pairs_hook`` for input a person wrote: KeyTwice where an
    object gives a key twice."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise KeyTwice(key)
        out[key] = value
    return out
