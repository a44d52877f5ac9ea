"""Items and shards: the INPUT arguments as one ordered list of items, cut into shards of
consecutive items (across file boundaries), and the part file each shard is written to.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra_deploy.engines.sources import IMAGES, read_sources
from hydra_deploy.errors import RunnerError
from hydra_deploy.families import get_family

#: one item the actors score: an absolute image path, a text, or a sentence pair
Item = str | tuple[str, str]


def part_name(shard: int) -> str:
    """The Parquet file of shard ``shard`` in OUT: ``part-00007.parquet``."""
    return f"part-{shard:05d}.parquet"


@dataclass(frozen=True)
class Shard:
    """``shard_size`` consecutive items: their labels (the ``item`` column) and what the actors
    read (absolute image paths, or the text lines: ``(text, second text)`` for sentence pairs)."""

    index: int
    labels: tuple[str, ...]
    sources: tuple[Item, ...]

    @property
    def part(self) -> str:
        return part_name(self.index)

    @property
    def sha256(self) -> str:
        return _digest(self.labels, self.sources)

    def summary(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "items": len(self.labels),
            "first": self.labels[0],
            "last": self.labels[-1],
            "sha256": self.sha256,
        }


def _digest(labels: Sequence[str], sources: Sequence[Item]) -> str:
    digest = hashlib.sha256()
    for label, source in zip(labels, sources, strict=True):
        text = "\t".join(source) if isinstance(source, tuple) else source
        digest.update(f"{label}\t{text}\n".encode())
    return digest.hexdigest()


def source_columns(sources: Sequence[Item]) -> dict[str, list[str | None]]:
    """What the actors read, as table columns: ``source`` (an absolute image path or a text)
    and, when any item is a sentence pair, ``pair`` (its second text; None for a single text)."""
    columns: dict[str, list[str | None]] = {
        "source": [s[0] if isinstance(s, tuple) else s for s in sources]
    }
    if any(isinstance(s, tuple) for s in sources):
        columns["pair"] = [s[1] if isinstance(s, tuple) else None for s in sources]
    return columns


def batch_items(batch: Mapping[str, Any]) -> list[Item]:
    """The items of a batch of those columns (:func:`source_columns`) as
    :func:`hydra_deploy.engines.sources.prepare` takes them."""
    sources = [str(s) for s in batch["source"]]
    if "pair" not in batch:
        return sources
    return [
        text if pair is None else (text, str(pair))
        for text, pair in zip(sources, batch["pair"], strict=True)
    ]


def collect_items(family: str, inputs: Sequence[str | os.PathLike]) -> tuple[list[str], list[Item]]:
    """The INPUT arguments -> (labels, sources) in input order, read as hydra-run reads them
    (:func:`hydra_deploy.engines.sources.read_source`), arrays refused. ``family`` is the
    export's; sources are absolute image paths (image models) or the lines of ``.txt`` and
    ``.tsv`` files (``(text, second text)`` for a ``.tsv`` of sentence pairs)."""

    if not inputs:
        raise RunnerError(
            "no INPUTS given: give image files or folders (or .txt files for text models)"
        )
    labels: list[str] = []
    sources: list[Item] = []
    for source in read_sources(
        inputs,
        get_family(family),
        model="EXPORT_DIR",
        arrays_elsewhere="hydra-score-dataset reads image files and folders (and .txt files "
        "for text models); score preprocessed .npy/.npz arrays with hydra-run",
    ):
        labels += source.names
        if source.kind == IMAGES:
            sources += [os.path.abspath(path) for path in source.items]
        else:
            sources += list(source.items)
    return labels, sources


def plan_shards(labels: Sequence[str], sources: Sequence[Item], shard_size: int) -> list[Shard]:
    """Consecutive chunks of ``shard_size`` items (the last one may be shorter)."""
    return [
        Shard(
            index,
            tuple(labels[start : start + shard_size]),
            tuple(sources[start : start + shard_size]),
        )
        for index, start in enumerate(range(0, len(labels), shard_size))
    ]
