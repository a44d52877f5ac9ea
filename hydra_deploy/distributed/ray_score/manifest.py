"""The manifest, ``OUT/_hydra_manifest.json``: the model, the items, the shard size, the
columns and the decisions (a hash of the record applied) of a run; ``--resume`` compares it with
the run's own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra_deploy.errors import ServeError

MANIFEST = "_hydra_manifest.json"
MANIFEST_FORMAT = "hydra-score-dataset/1"


@dataclass
class Manifest:
    """``OUT/_hydra_manifest.json``: what OUT holds (or will hold once every part is written)."""

    export: str
    onnx_sha256: str
    kind: str
    inputs: list[str]
    items: int
    items_sha256: str
    shard_size: int
    shards: list[dict[str, Any]]
    columns: list[str]
    member_logits: bool
    batch_size: int
    class_names: list[str] | None = None
    decisions_sha256: str | None = None  # the decisions record applied (None: raw scores)
    package_version: str = ""
    created: str = ""
    format: str = MANIFEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
            return cls.from_dict(data)
        except (OSError, ValueError, TypeError) as err:
            raise ServeError(
                f"cannot read {path} ({err}); pass --overwrite to start OUT over"
            ) from err

    def differences(self, other: Manifest) -> list[str]:
        """What differs between this (OUT's) manifest and ``other`` (this run's), in words."""
        found = []
        if self.onnx_sha256 != other.onnx_sha256:
            found.append(
                f"the model differs (model.onnx sha256 {self.onnx_sha256[:12]}... in "
                f"OUT, {other.onnx_sha256[:12]}... now, {other.export})"
            )
        if self.kind != other.kind:
            found.append(f"the inputs are {other.kind}, OUT holds {self.kind}")
        elif self.items_sha256 != other.items_sha256:
            where = ""
            for mine, theirs in zip(self.shards, other.shards, strict=False):
                if mine.get("sha256") != theirs.get("sha256"):
                    where = f"; the first difference is in shard {theirs['part']}"
                    break
            found.append(f"the inputs differ ({self.items} items in OUT, {other.items} now{where})")
        if self.shard_size != other.shard_size:
            found.append(
                f"the shard size differs ({self.shard_size} in OUT, {other.shard_size} now)"
            )
        if self.member_logits != other.member_logits:
            found.append(
                f"the columns differ ({'with' if self.member_logits else 'without'} "
                f"--member-logits in OUT, {'with' if other.member_logits else 'without'} now)"
            )
        if self.decisions_sha256 != other.decisions_sha256:
            said = {None: "raw scores"}
            found.append(
                "the decisions differ ("
                + said.get(self.decisions_sha256, "decisions")
                + " in OUT, "
                + said.get(other.decisions_sha256, "decisions")
                + " now"
                + (
                    ": hydra.json's decisions were fitted again"
                    if self.decisions_sha256 and other.decisions_sha256
                    else "; --raw leaves them out"
                )
                + ")"
            )
        elif self.columns != other.columns and self.member_logits == other.member_logits:
            found.append(f"the columns differ ({self.columns} in OUT, {other.columns} now)")
        return found
