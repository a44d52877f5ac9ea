"""The export folder contract: its file names, its format, its hash, one reader and one writer.

``hydra-export`` writes a folder::

    model.onnx            the fused network (member_logits [batch, M, C], plus the in-graph
                          uncertainty outputs with --uq-outputs)
    hydra.json            the record of it, read by every consumer through :func:`read_info`
    weights.safetensors   the fused weights (re-export, reload, hydra-compare)
    tokenizer/            text models only: the tokenizer the export was made with

Every module that reads ``hydra.json`` (the runners, the TensorRT build planner, reload, compare,
Triton repositories, hydra-serve, hydra-score-dataset) asks :func:`read_info`, so one rule decides
what a readable record is and every consumer gives the same answer about a damaged one: a missing
file, a file that is not UTF-8 JSON, not a JSON object, of another format (a missing ``format``
included), or with a malformed field that consumers interpret (``batch_profile``, ``onnx_sha256``,
``precision``, ``class_names``, ``uq_outputs``, a ``family`` that is not registered in
:mod:`hydra_deploy.families`) is refused with an
:class:`ExportFolderError` that says what to do. The exporter writes through :func:`write_info`,
which refuses a record the reader would refuse.

Imports the standard library and the project's stdlib-only modules (errors, atomic writes, the
family registry): the edge runtime reads export folders without torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_deploy.atomic import atomic_write_text
from hydra_deploy.errors import EngineError, ExportError, RunnerError, ServeError
from hydra_deploy.families import family_names

__all__ = [
    "FORMAT",
    "GRAPH_PRECISIONS",
    "INFO_FILE",
    "INTERPOLATIONS",
    "MODEL_FILE",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
    "ExportFolderError",
    "ExportInfo",
    "file_sha256",
    "parse_batch_profile",
    "read_info",
    "write_info",
]

MODEL_FILE = "model.onnx"
INFO_FILE = "hydra.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
#: The ``format`` of ``hydra.json`` this version writes and reads.
FORMAT = "hydra-export/1"
#: The precisions a graph can carry (``precision`` in hydra.json: fp32, or a strongly typed graph).
GRAPH_PRECISIONS = ("fp32", "fp16", "bf16")
#: The resize interpolations hydra.json's ``preprocessing`` entry may name (timm's names; what
#: :mod:`hydra_deploy.engines.preprocess` implements).
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")

_REDO = "restore it or re-export the model with hydra-export"


class ExportFolderError(RunnerError, EngineError, ExportError, ServeError):
    """An export folder or its ``hydra.json`` is missing, unreadable or malformed.

    One error for every stage that reads the folder: it is a :class:`RunnerError` to a runner's
    caller, an :class:`EngineError` to an engine build's, an :class:`ExportError` to a re-export's
    and a :class:`ServeError` to serving's, so each catches what it already catches.
    """


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks (``onnx_sha256`` in hydra.json)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ExportInfo:
    """A checked ``hydra.json``: the fields consumers interpret, typed, and the whole record.

    ``record`` is the JSON object as written (the spec, inputs, outputs, preprocessing, tokenizer
    and the rest, which the stage that uses them checks); the typed fields are checked here.
    """

    path: Path
    record: Mapping[str, Any]
    family: str | None
    batch_profile: tuple[int, int, int] | None  # (min, opt, max)
    onnx_sha256: str | None
    precision: str
    class_names: tuple[str, ...] | None
    uq_outputs: bool

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def onnx_path(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def weights_path(self) -> Path:
        return self.folder / WEIGHTS_FILE

    @classmethod
    def from_record(cls, record: Any, path: str | os.PathLike) -> ExportInfo:
        """Check a parsed ``hydra.json`` (``path`` names it in errors)."""
        path = Path(path)
        if not isinstance(record, dict):
            raise ExportFolderError(
                f"{path} holds {type(record).__name__}, not a JSON object; {_REDO}"
            )
        found = record.get("format")
        if found != FORMAT:
            said = "has no 'format' entry" if found is None else f"has format {found!r:.60}"
            raise ExportFolderError(
                f"{path} {said}; this version reads {FORMAT!r} exports: upgrade hydra-deploy, or "
                "re-export the model with this version of hydra-export"
            )
        family = record.get("family")
        if family is not None and (not isinstance(family, str) or family not in family_names()):
            raise ExportFolderError(
                f"{path} has family {family!r:.60}; this version knows "
                f"{', '.join(family_names())}: upgrade hydra-deploy, or {_REDO}"
            )
        sha = record.get("onnx_sha256")
        if sha is not None and not (
            isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
        ):
            raise ExportFolderError(
                f"{path} has a malformed onnx_sha256 {sha!r:.80} (64 lowercase hex digits); {_REDO}"
            )
        precision = record.get("precision", "fp32")
        if precision not in GRAPH_PRECISIONS:
            raise ExportFolderError(
                f"{path} gives precision {precision!r:.40}; expected one of {GRAPH_PRECISIONS}; "
                f"{_REDO}"
            )
        names = record.get("class_names")
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            raise ExportFolderError(
                f"class_names in {path} is not a list of strings ({names!r:.80}); {_REDO}"
            )
        uq = record.get("uq_outputs", False)
        if not isinstance(uq, bool):
            raise ExportFolderError(f"{path} has a malformed uq_outputs {uq!r:.40}; {_REDO}")
        return cls(
            path=path,
            record=record,
            family=family,
            batch_profile=parse_batch_profile(record.get("batch_profile"), path),
            onnx_sha256=sha,
            precision=precision,
            class_names=None if names is None else tuple(names),
            uq_outputs=uq,
        )


def parse_batch_profile(
    profile: Any, where: str | os.PathLike, fix: str = _REDO
) -> tuple[int, int, int] | None:
    """``{"min", "opt", "max"}`` -> (min, opt, max) with 1 <= min <= opt <= max; None if absent.

    The one parser of a batch profile, in hydra.json and in an engine's JSON sidecar alike
    (``where`` names the file in the error, ``fix`` says what to do).
    """
    if profile is None:
        return None
    keys = ("min", "opt", "max")
    values = [profile.get(k) for k in keys] if isinstance(profile, dict) else []
    if (
        len(values) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        or not 1 <= values[0] <= values[1] <= values[2]
    ):
        raise ExportFolderError(
            f"{where} has a malformed batch_profile {profile!r:.100} (expected "
            '{"min": 1, "opt": 8, "max": 32}: ints with 1 <= min <= opt <= max); '
            f"{fix}"
        )
    return values[0], values[1], values[2]


def read_info(path: str | os.PathLike, *, required: bool = True) -> ExportInfo | None:
    """The checked ``hydra.json`` of an export folder (``path``: the folder or the file).

    A missing file is an error when ``required`` (the caller needs the record), else None (a bare
    ``.onnx`` file beside no record).
    """
    path = Path(path)
    if path.is_dir():
        path = path / INFO_FILE
    if not path.is_file():
        if not required:
            return None
        raise ExportFolderError(
            f"{str(path.parent)!r} is not an export folder: {INFO_FILE} is missing; give the "
            f"folder hydra-export wrote ({MODEL_FILE} + {INFO_FILE}; hydra-export --out DIR)"
        )
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ExportFolderError(f"cannot read {path}: {err}; {_REDO}") from err
    except RecursionError:
        raise ExportFolderError(
            f"cannot read {path}: its JSON is nested too deeply; {_REDO}"
        ) from None
    return ExportInfo.from_record(record, path)


def write_info(folder: str | os.PathLike, record: dict[str, Any]) -> ExportInfo:
    """Write ``record`` as ``folder/hydra.json`` (atomically), after checking it as
    :func:`read_info` would: what the exporter writes, every consumer reads."""
    path = Path(folder) / INFO_FILE
    text = json.dumps(record, indent=2) + "\n"
    info = ExportInfo.from_record(json.loads(text), path)
    atomic_write_text(path, text)
    return info
