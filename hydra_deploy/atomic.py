"""Atomic file writes: an interrupted write never leaves a half-written file behind a valid name."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _mode_for(path: Path) -> int:
    """The mode of the file ``path`` replaces, else the usual umask mode of a new file."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary name in ``path``'s folder to write to (by a library that takes a path); on a
    clean exit it is fsynced and renamed to ``path``, on any exception (KeyboardInterrupt
    included) removed. The file keeps the mode of the file it replaces."""
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def staging_dir(parent: str | os.PathLike, name: str, suffix: str = ".tmp") -> Path:
    """A new hidden folder in ``parent`` to assemble an artifact folder in, then rename into place.

    ``tempfile.mkdtemp`` makes it private (``drwx------``); the result is an ordinary folder, so
    it gets the umask's mode like any ``mkdir``. Raises OSError.
    """
    folder = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=suffix, dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    return folder


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file in the same folder, fsync it, then ``os.replace``.

    Raises OSError; callers turn it into their own HydraError.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` as UTF-8 with ``\\n`` line ends."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """``atomic_write_text`` of ``data`` as JSON (NaN refused), creating the parent folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")
