"""Output of every subcommand: files checked before the work and written whole or not at
all; log lines on stderr, so that stdout holds the result table alone.

``check_output_path`` runs before a replay or a benchmark starts, so that a result path
that cannot be written fails in one line instead of after an hour of work. ``write_atomic``
writes to a temporary name in the same directory and renames it over the target when
complete: a reader (or a crash, a full disk, Ctrl-C) never sees half a file.
Standard library only.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable

from proxima.errors import UserError


def check_output_path(path: str | os.PathLike | None, flag: str,
                      suffix: str | None = None) -> Path | None:
    """Fail now, in one line, unless ``path`` can be written as a file later.

    Refused: an empty name, a directory (or a name ending in ``/``), a path whose existing
    target is not a regular file (``/dev/null``, a FIFO: a rename would replace it), a
    wrong ``suffix`` (``--plot x.txt``), a parent directory that is missing or in which a
    file cannot be created (read-only, ``/proc``, no permission: probed by creating one).
    Returns the path, or None when none was given."""
    if path is None:
        return None
    text = os.fspath(path)
    if not text.strip():
        raise UserError(f"{flag} needs a file name, got {text!r}")
    target = Path(text)
    if text.endswith(("/", os.sep)) or target.is_dir():
        example = f"{text.rstrip('/')}/result{suffix or '.json'}"
        raise UserError(f"{flag} {text} is a directory: give a file name, e.g. {example}")
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


def logs_to_stderr(name: str) -> None:
    """Point the stream handlers of logger ``name`` that write to stdout at stderr (vLLM
    logs to stdout; 0.2x also reads VLLM_LOGGING_STREAM, 0.6 has no setting for it)."""
    for handler in logging.getLogger(name).handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
