"""Reading ``.npy`` / ``.npz`` array files (numpy only, safe on an edge device): one reader for
every command, and one answer for a file it cannot read."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from hydra_deploy.errors import HydraError

#: what numpy raises for a missing, unreadable, truncated or foreign array file
READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def read_array_file(
    path: str | os.PathLike,
    *,
    error: type[HydraError] = HydraError,
    what: str = "the array file",
    hint: str = "give a complete .npy (np.save) or .npz (np.savez)",
    prefix: str = "",
) -> np.ndarray | dict[str, np.ndarray]:
    """A ``.npz`` as a dict of its arrays (all read now), anything else as one ``.npy`` array;
    never unpickles. A file numpy cannot read raises ``error`` naming ``what``, the cause and
    what to do (``hint``, or to check permissions), after ``prefix`` (``"ID data: "``)."""
    path = Path(path)
    try:
        if path.suffix.lower() == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        return np.load(path, allow_pickle=False)
    except READ_ERRORS as err:
        fix = "check the file's permissions" if isinstance(err, PermissionError) else hint
        named = " ".join(part for part in ("cannot read", what, str(path)) if part)
        raise error(f"{prefix}{named} ({err}); {fix}") from err
