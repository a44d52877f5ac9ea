"""The output folder: what is in OUT before a run (finished parts, stray temporary files,
files that are not ours), checked against the flags, then prepared (the manifest first).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.distributed.ray_score.manifest import MANIFEST, Manifest
from hydra_deploy.distributed.ray_score.shards import Shard
from hydra_deploy.errors import ServeError
from hydra_deploy.optional import lazy_module

pq = lazy_module("pyarrow.parquet", purpose="hydra-score-dataset", error=ServeError)

logger = logging.getLogger("hydra_deploy")


_PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_TEMP_RE = re.compile(r"^\.(part-\d{5,}\.parquet|" + re.escape(MANIFEST) + r")\..*\.tmp$")


@dataclass
class OutState:
    """What is in OUT before a run: finished shards, files to clean up."""

    done: set[int] = field(default_factory=set)
    remove: list[Path] = field(default_factory=list)  # ours, removed before scoring starts
    keep_manifest: bool = False


def _ours(name: str) -> bool:
    return name == MANIFEST or bool(_PART_RE.match(name)) or bool(_TEMP_RE.match(name))


def inspect_out(
    out: Path, manifest: Manifest, shards: Sequence[Shard], *, resume: bool, overwrite: bool
) -> OutState:
    """Check OUT against this run and the flags; nothing is changed yet (see :func:`prepare_out`)."""
    if resume and overwrite:
        raise ServeError("--resume and --overwrite exclude each other: pick one")
    if not out.exists():
        return OutState()
    if not out.is_dir():
        if overwrite:
            return OutState(remove=[out])
        raise ServeError(f"{str(out)!r} exists and is a file; pass --overwrite to replace it")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return OutState()
    foreign = [n for n in names if not _ours(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise ServeError(
            f"{str(out)!r} holds files hydra-score-dataset did not write ({shown}); choose another "
            "--out (nothing was changed)"
        )
    temps = [out / n for n in names if _TEMP_RE.match(n)]
    parts = {int(m.group(1)): out / n for n in names if (m := _PART_RE.match(n))}
    if overwrite:
        return OutState(remove=[out / n for n in names])
    if not resume:
        raise ServeError(
            f"{str(out)!r} exists; pass --resume to score only its missing shards, or --overwrite "
            "to start over"
        )
    if MANIFEST not in names:
        raise ServeError(
            f"{str(out)!r} has no {MANIFEST}, so it cannot be resumed; pass --overwrite to start over"
        )
    previous = Manifest.read(out / MANIFEST)
    differences = previous.differences(manifest)
    if differences:
        raise ServeError(
            f"cannot resume {str(out)!r}: " + "; ".join(differences) + ". Pass --overwrite to "
            "score everything again into it, or choose another --out"
        )
    done = set()
    for index, path in sorted(parts.items()):
        if index >= len(shards):
            raise ServeError(
                f"{path} is not one of the {len(shards)} shards of the manifest; remove it and rerun with --resume"
            )
        rows = _parquet_rows(path)
        if rows != len(shards[index].labels):
            raise ServeError(
                f"{path} holds {rows} rows, its shard {len(shards[index].labels)}: it is not a "
                "part this run wrote; remove it and rerun with --resume"
            )
        done.add(index)
    return OutState(done=done, remove=temps, keep_manifest=True)


def _parquet_rows(path: Path) -> int:
    try:
        return pq.read_metadata(path).num_rows
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise ServeError(
            f"{path} is not a readable Parquet file ({err}); remove it and rerun with --resume"
        ) from err


def prepare_out(out: Path, manifest: Manifest, state: OutState) -> None:
    """Remove what ``state`` says (stray temporary files; everything ours on --overwrite), then
    write the manifest first, atomically (kept as it is on --resume)."""
    try:
        for path in state.remove:
            path.unlink()
            logger.debug("removed %s", path)
        out.mkdir(parents=True, exist_ok=True)
        if not state.keep_manifest:
            atomic_write_json(out / MANIFEST, manifest.to_dict())
    except OSError as err:
        raise ServeError(f"cannot prepare {out}: {err}") from err
