"""Atomic file writes: an interrupted write never leaves a half-written file behind a valid name."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temporary file in the same folder, fsync it, then ``os.replace``.

    The file keeps the mode of the file it replaces (new files get the usual umask mode). Raises
    OSError; callers turn it into their own HydraError.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """``atomic_write_text`` of ``data`` as JSON (NaN refused), creating the parent folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")
