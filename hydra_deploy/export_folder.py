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
:class:`ExportFolderError` that says what to do. The exporter makes its record from typed entries
(:meth:`ExportInfo.new` and :meth:`ExportInfo.replace`: :class:`TensorInfo`,
:class:`TokenizerEntry`, :class:`Preprocessing`, :class:`MergeRecord`, :class:`Int8Record`, each
checked by the ``from_dict`` that checks it when read) and writes it through :func:`write_info`,
which refuses a record the reader would refuse; a record read and written again is the same file.

It owns the engine's JSON sidecar too (:class:`EngineInfo`, :func:`read_engine_info`,
:func:`write_engine_info`: ``hydra-build`` writes it, the runner, the Triton repository and
``hydra-build``'s report read it, its ``format`` checked) and the decisions record
(:class:`DecisionRecord`), and it is the one module that spells the file names.

Imports the standard library and the project's stdlib-only modules (errors, atomic writes, the
family registry), and the set-score registry (numpy): the edge runtime reads export folders
without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, TypeVar

from hydra_deploy.atomic import atomic_write_text
from hydra_deploy.errors import EngineError, ExportError, RunnerError, ServeError, spelled
from hydra_deploy.families import family_names
from hydra_deploy.set_scores import SET_METHODS, SET_SCORES, set_score

__all__ = [
    "CALIBRATION_METHODS",
    "CROP_MODES",
    "DECISIONS_FORMAT",
    "DECISION_OUTPUTS",
    "DECISION_SCORES",
    "ENGINE_FORMAT",
    "ENGINE_INFO_FILE",
    "ENGINE_SUFFIXES",
    "FORMAT",
    "GRAPH_PRECISIONS",
    "INFO_FILE",
    "INT8_METHODS",
    "INTERPOLATIONS",
    "MODEL_FILE",
    "MONITOR_RATES",
    "RECORD_BACKENDS",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_DIR",
    "TOKENIZER_FILE",
    "TOKENIZER_FILES",
    "WEIGHTS_FILE",
    "DecisionRecord",
    "EngineInfo",
    "ExportFolderError",
    "ExportInfo",
    "Int8Record",
    "MergeRecord",
    "MonitorReference",
    "OodRule",
    "Preprocessing",
    "SelectiveRule",
    "SetRule",
    "TensorInfo",
    "TokenizerEntry",
    "engine_info_path",
    "file_sha256",
    "is_backend_name",
    "parse_batch_profile",
    "read_engine_info",
    "read_info",
    "reference_sha256",
    "write_decisions",
    "write_engine_info",
    "write_info",
]

MODEL_FILE = "model.onnx"
INFO_FILE = "hydra.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
#: TensorRT engine files (hydra-build writes ``.engine``; trtexec users often say ``.plan``).
ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
#: An engine's JSON sidecar sits beside it with this suffix (``<stem>.json``, :func:`engine_info_path`).
ENGINE_INFO_SUFFIX = ".json"
#: The sidecar's name inside a Triton model folder (beside ``1/model.plan``).
ENGINE_INFO_FILE = "engine.json"
#: The ``format`` of an engine sidecar this version writes and reads.
ENGINE_FORMAT = "hydra-engine/1"
#: The ``format`` of ``hydra.json`` this version writes and reads.
FORMAT = "hydra-export/1"
#: The precisions a graph can carry (``precision`` in hydra.json: fp32, or a strongly typed graph).
GRAPH_PRECISIONS = ("fp32", "fp16", "bf16", "int8")
#: How an INT8 graph was quantized (``int8.method``; :mod:`hydra_deploy.export.int8`): weights
#: only, or QDQ with activations calibrated on data.
INT8_METHODS = ("dynamic", "static")
#: How a static INT8 graph's activation ranges were calibrated (``int8.calibration_method``).
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
#: The resize interpolations hydra.json's ``preprocessing`` entry may name (timm's names; what
#: :mod:`hydra_deploy.engines.preprocess` implements).
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")

_REDO = "restore it or re-export the model with hydra-export"

#: the preprocessing record's entry listing what was taken from timm's default, not the model
DEFAULTED = "defaulted"
#: the preprocessing entries that decide how an image becomes the model's input
DECISIVE_PREPROCESSING = ("mean", "std", "interpolation", "crop_pct")


def default_preprocessing_warning(subject: str, config: Mapping[str, Any]) -> str | None:
    """The one warning, in the same words on every path (a checkpoint loaded by name or into a
    module, a re-export), when ``config`` (timm's data config of an image model) took entries from
    timm's default for the architecture instead of the model's own; None when it took none."""
    defaulted = [k for k in DECISIVE_PREPROCESSING if k in (config.get(DEFAULTED) or ())]
    if not defaulted:
        return None
    shown = ", ".join(f"{key} {_short(config.get(key))}" for key in defaulted)
    advice = spelled(
        "pass preprocessing={...} (commands: --mean, --std, --interpolation, --crop-pct)",
        "pass --mean, --std, --interpolation, --crop-pct",
    )
    return (
        f"{subject} records no {'/'.join(defaulted)}; using timm's default for the architecture "
        f"({shown}): if the model was trained otherwise, {advice} or put them in the checkpoint "
        "folder's config.json pretrained_cfg"
    )


def _short(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(f"{float(v):.4g}" for v in value) + ")"
    return str(value)


#: The ``format`` of the ``decisions`` entry of hydra.json (what ``hydra-calibrate`` writes).
DECISIONS_FORMAT = "hydra-decisions/1"
#: Prediction-set methods a decisions record may name (split conformal, on calibrated probs):
#: the registered set scores (:mod:`hydra_deploy.set_scores`), imported above.
#: Scores a selective (abstain) rule or an OOD flag may be fitted on (computed on the
#: temperature-scaled member probabilities).
DECISION_SCORES = ("msp", "predictive_entropy", "mutual_information")
#: how answer-or-abstain tests its thresholds (hydra_deploy.decisions.fit_selective)
SELECTIVE_PROCEDURES = ("graph", "bonferroni")
#: The graph outputs ``hydra-calibrate --in-graph`` adds after the model's own (those of the rules
#: a record holds: :attr:`DecisionRecord.fields`).
DECISION_OUTPUTS = ("calibrated_probs", "prediction_set", "accept", "ood_flag")
_REFIT = "fit it again with hydra-calibrate EXPORT --data LABELLED --overwrite"


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


# --- the typed entries of hydra.json (what the exporter writes, checked as the readers check) ----
#: The files of a text model's tokenizer that hydra-export copies into ``tokenizer/`` (those present).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
)
#: The tokenizer file a text export cannot run without (a fast tokenizer's, read by ``tokenizers``).
TOKENIZER_FILE = "tokenizer.json"
#: The tokenizer's own settings (its ``model_max_length``), beside it.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: How a static crop may be taken (timm's ``crop_mode``).
CROP_MODES = ("center", "squash", "border")


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entry_error(where: str, key: str, value: Any, expected: str) -> ExportFolderError:
    return ExportFolderError(
        f"{where} has a malformed {key} {value!r:.100} (expected {expected}); {_REDO}"
    )


@dataclass(frozen=True)
class TensorInfo:
    """A graph input or output as ``hydra.json`` records it (``inputs`` / ``outputs``): its name,
    its shape (a size, or the name of a dynamic axis such as ``"batch"``) and its numpy dtype
    (absent in records written by hand)."""

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "shape": list(self.shape)}
        if self.dtype is not None:
            entry["dtype"] = self.dtype
        return entry

    @classmethod
    def from_dict(cls, entry: Any, where: str = "a tensor entry") -> TensorInfo:
        """Check a parsed entry (``where`` names the record in errors)."""
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("shape"), list)
            and isinstance(entry.get("dtype", ""), str)
        ):
            raise _entry_error(
                where, "tensor", entry, '{"name": ..., "shape": [...], "dtype": ...}'
            )
        return cls(entry["name"], tuple(entry["shape"]), entry.get("dtype"))


@dataclass(frozen=True)
class TokenizerEntry:
    """A text export's ``tokenizer`` entry: the folder beside ``model.onnx`` that holds the
    tokenizer (``dir``, :data:`TOKENIZER_DIR`), the files copied there, the longest sequence it
    makes (``max_length``: the tokenizer's ``model_max_length``, at most the model's position
    embeddings) and the model's vocabulary size (None: unknown)."""

    dir: str
    max_length: int
    vocab_size: int | None = None
    files: tuple[str, ...] | None = None  # None: not recorded (records written by hand)

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"dir": self.dir}
        if self.files is not None:
            entry["files"] = list(self.files)
        return {**entry, "max_length": self.max_length, "vocab_size": self.vocab_size}

    @classmethod
    def from_dict(cls, entry: Any, where: str = "the tokenizer entry") -> TokenizerEntry:
        """Check a parsed entry (``where`` names the record in errors)."""

        def bad(expected: str) -> ExportFolderError:
            return _entry_error(where, "'tokenizer' entry", entry, expected)

        if not isinstance(entry, dict):
            raise bad('{"dir": ..., "max_length": ...}')
        directory, files = entry.get("dir"), entry.get("files")
        if not isinstance(directory, str) or not directory:
            raise bad('"dir": the name of the folder beside model.onnx')
        if not _is_int(entry.get("max_length"), 1):
            raise bad('"max_length": a positive integer')
        if not (entry.get("vocab_size") is None or _is_int(entry["vocab_size"], 1)):
            raise bad('"vocab_size": a positive integer or null')
        if files is not None and not (
            isinstance(files, list) and all(isinstance(f, str) for f in files)
        ):
            raise bad('"files": a list of file names')
        return cls(
            dir=directory,
            max_length=entry["max_length"],
            vocab_size=entry.get("vocab_size"),
            files=None if files is None else tuple(files),
        )


@dataclass(frozen=True)
class Preprocessing:
    """A vision export's ``preprocessing`` entry: timm's data config of the model (how an image
    becomes its input: :mod:`hydra_deploy.engines.preprocess`), and ``defaulted``, the decisive
    entries that were taken from timm's default for the architecture rather than the model's own.
    Entries of the config this version does not interpret are kept in ``other``."""

    input_size: tuple[int, ...]  # (C, H, W)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str | None = None
    crop_pct: float | None = None
    crop_mode: str | None = None
    defaulted: tuple[str, ...] = ()
    other: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"input_size": list(self.input_size)}
        if self.interpolation is not None:
            entry["interpolation"] = self.interpolation
        entry["mean"], entry["std"] = list(self.mean), list(self.std)
        for key in ("crop_pct", "crop_mode"):
            if getattr(self, key) is not None:
                entry[key] = getattr(self, key)
        entry.update(self.other or {})
        if self.defaulted:
            entry[DEFAULTED] = list(self.defaulted)
        return entry

    @classmethod
    def from_dict(cls, entry: Any, where: str = "the preprocessing entry") -> Preprocessing:
        """Check a parsed entry (tuples are taken for lists: a model's own data config)."""
        if not isinstance(entry, Mapping):
            raise _entry_error(where, "preprocessing", entry, "timm's data config, an object")
        size = entry.get("input_size")
        if not (
            isinstance(size, (list, tuple)) and len(size) == 3 and all(_is_int(v, 1) for v in size)
        ):
            raise _entry_error(where, "input_size", size, "[C, H, W], positive integers")
        for key in ("mean", "std"):
            value = entry.get(key)
            if not (
                isinstance(value, (list, tuple))
                and len(value) == size[0]
                and all(_is_number(v) for v in value)
            ):
                raise _entry_error(where, key, value, f"{size[0]} numbers, one per channel")
        choices = {"interpolation": INTERPOLATIONS, "crop_mode": CROP_MODES}
        for key, allowed in choices.items():
            if entry.get(key) is not None and entry[key] not in allowed:
                raise _entry_error(where, key, entry[key], f"one of {', '.join(allowed)}")
        crop = entry.get("crop_pct")
        if crop is not None and not (_is_number(crop) and crop > 0):
            raise _entry_error(where, "crop_pct", crop, "a positive number (1.0: no crop)")
        defaulted = entry.get(DEFAULTED) or ()
        if not (
            isinstance(defaulted, (list, tuple))
            and all(k in DECISIVE_PREPROCESSING for k in defaulted)
        ):
            raise _entry_error(where, DEFAULTED, defaulted, f"names among {DECISIVE_PREPROCESSING}")
        known = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode", DEFAULTED)
        other = {k: v for k, v in entry.items() if k not in known}
        return cls(
            input_size=tuple(size),
            mean=tuple(entry["mean"]),
            std=tuple(entry["std"]),
            interpolation=entry.get("interpolation"),
            crop_pct=crop,
            crop_mode=entry.get("crop_mode"),
            defaulted=tuple(defaulted),
            other=other or None,
        )


@dataclass(frozen=True)
class MergeRecord:
    """The ``merge`` entry: how the members' weights outside attention were merged, part by part
    (``embeddings``, ``norms``, ``mlp``, ``classifier``, ...: ``shared``, ``per-member``,
    ``average``, ``grouped``, ...), and counts (``trunk_layers``, ``padded_heads``). Which parts
    there are is the family's (a BERT ``pooler``, an OpenCLIP ``projection``): ``parts`` keeps
    them in the family's order."""

    parts: tuple[tuple[str, str | int], ...]

    def __getitem__(self, part: str) -> str | int:
        return dict(self.parts)[part]

    def get(self, part: str, default: Any = None) -> Any:
        return dict(self.parts).get(part, default)

    def to_dict(self) -> dict[str, str | int]:
        return dict(self.parts)

    @classmethod
    def from_dict(cls, entry: Any, where: str = "the merge entry") -> MergeRecord:
        """Check a parsed entry: part -> how (text) or a count."""
        if not (
            isinstance(entry, Mapping)
            and entry
            and all(
                isinstance(k, str) and (isinstance(v, str) or _is_int(v)) for k, v in entry.items()
            )
        ):
            raise _entry_error(where, "merge", entry, "part -> how it was merged, or a count")
        return cls(tuple(entry.items()))


@dataclass(frozen=True)
class ExportInfo:
    """A checked ``hydra.json``: the fields consumers interpret, typed, and the whole record.

    ``record`` is the JSON object as written; the typed fields are checked here, and the typed
    entries (:attr:`input_tensors`, :attr:`output_tensors`, :attr:`tokenizer_entry`,
    :attr:`preprocessing_config`, :attr:`merge_record`) are checked when read, by the same
    ``from_dict`` that checks them when the exporter writes them. The exporter makes its record
    with :meth:`new` and :meth:`replace` (typed values in, the record's JSON out, checked as
    :func:`read_info` checks it) and writes it with :func:`write_info`; a record read and written
    again is the same JSON.
    """

    path: Path
    record: Mapping[str, Any]
    family: str | None
    batch_profile: tuple[int, int, int] | None  # (min, opt, max)
    onnx_sha256: str | None
    precision: str
    class_names: tuple[str, ...] | None
    uq_outputs: bool
    decisions: DecisionRecord | None = None
    int8: Int8Record | None = None  # how an INT8 graph was quantized (precision "int8" only)

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def onnx_path(self) -> Path:
        return self.folder / MODEL_FILE

    @property
    def weights_path(self) -> Path:
        return self.folder / WEIGHTS_FILE

    # --- entries the exporter reports (no consumer interprets them) -------------------------------
    @property
    def exporter(self) -> str | None:
        """The torch -> ONNX exporter that wrote the graph (``dynamo`` or ``torchscript``)."""
        return self.record.get("exporter")

    @property
    def opset(self) -> int | None:
        return self.record.get("opset")

    @property
    def strongly_typed(self) -> bool:
        """Whether the graph is strongly typed (FP16/BF16: explicit casts, TensorRT's
        ``--stronglyTyped``)."""
        return bool(self.record.get("strongly_typed", False))

    @property
    def validation(self) -> Mapping[str, Any] | None:
        """What validation against PyTorch found (None: not validated): per batch, and the drift
        from FP32 of an FP16/BF16/INT8 export (:mod:`hydra_deploy.export.validate`)."""
        return self.record.get("validation")

    @property
    def graph_passes(self) -> Mapping[str, Any] | None:
        """What each graph-surgery pass did (:mod:`hydra_deploy.export.surgery`)."""
        return self.record.get("graph_passes")

    @property
    def precision_report(self) -> Mapping[str, Any] | None:
        """An FP16/BF16 graph's conversion: nodes per precision, casts, compute types."""
        return self.record.get("precision_report")

    @property
    def macs_per_example(self) -> Mapping[str, Any] | None:
        """Multiply-accumulates per example: ``{"single", "hydra", ...}``."""
        return self.record.get("macs_per_example")

    # --- typed entries, checked when read as when written ----------------------------------------
    @property
    def input_tensors(self) -> tuple[TensorInfo, ...]:
        """The graph inputs, typed (checked; empty when not recorded)."""
        return self._typed_tensors("inputs")

    @property
    def output_tensors(self) -> tuple[TensorInfo, ...]:
        """The graph outputs, typed (checked; empty when not recorded)."""
        return self._typed_tensors("outputs")

    @property
    def tokenizer_entry(self) -> TokenizerEntry | None:
        """A text export's tokenizer entry, typed (checked); None when there is none."""
        entry = self.record.get("tokenizer")
        return None if not entry else TokenizerEntry.from_dict(entry, str(self.path))

    @property
    def preprocessing_config(self) -> Preprocessing | None:
        """A vision export's preprocessing, typed (checked); None when there is none."""
        entry = self.record.get("preprocessing")
        return None if entry is None else Preprocessing.from_dict(entry, str(self.path))

    @property
    def merge_record(self) -> MergeRecord | None:
        """How the members' weights were merged, typed (checked); None when not recorded."""
        entry = self.record.get("merge")
        return None if entry is None else MergeRecord.from_dict(entry, str(self.path))

    # --- entries as written, for consumers that check them with their own advice ----------------
    @property
    def spec(self) -> Any:
        """The HydraSpec as written (a dict; the runners and :func:`HydraSpec.from_dict` check it)."""
        return self.record.get("spec")

    @property
    def preprocessing(self) -> Any:
        """timm's data config of a vision export (:mod:`hydra_deploy.engines.preprocess` checks it)."""
        return self.record.get("preprocessing")

    @property
    def tokenizer(self) -> Any:
        """A text export's ``tokenizer`` entry: ``{"dir", "max_length", "vocab_size"}`` as
        written (:class:`~hydra_deploy.engines.text.TextEncoder` checks it)."""
        return self.record.get("tokenizer")

    @property
    def backbone_config(self) -> Any:
        """The backbone's own config (a text model's ``max_position_embeddings``), as written."""
        return self.record.get("backbone_config")

    @property
    def backbone_kwargs(self) -> Any:
        """The constructor arguments that rebuild the backbone (reload checks them)."""
        return self.record.get("backbone_kwargs")

    @property
    def merge(self) -> Any:
        """How the non-attention weights were merged (reload checks it)."""
        return self.record.get("merge")

    @property
    def inputs(self) -> tuple[dict[str, Any], ...]:
        """The graph inputs ``{"name", "shape"[, "dtype"]}`` (checked; empty when not recorded)."""
        return self._tensors("inputs")

    @property
    def outputs(self) -> tuple[dict[str, Any], ...]:
        """The graph outputs ``{"name", "shape"[, "dtype"]}`` (checked; empty when not recorded)."""
        return self._tensors("outputs")

    def malformed_tensors(self, key: str) -> ExportFolderError:
        """The error for malformed ``inputs`` / ``outputs`` (also what stricter readers, such as
        Triton's, raise for entries they cannot use)."""
        return ExportFolderError(
            f"{self.path} has malformed {key} {self.record.get(key)!r:.100} (expected "
            '[{"name": ..., "shape": [...], "dtype": ...}, ...]); re-export the model with '
            "hydra-export"
        )

    def tensor_names(self, key: str) -> list[Any]:
        """The names of the recorded ``inputs`` / ``outputs``, unchecked (an entry that is not an
        object stands for itself, one without a name is None): for messages that list them."""
        entries = self.record.get(key) or []
        entries = entries if isinstance(entries, list) else [entries]
        return [e.get("name") if isinstance(e, dict) else e for e in entries]

    def _tensors(self, key: str) -> tuple[dict[str, Any], ...]:
        self._typed_tensors(key)  # checked
        return tuple(dict(e) for e in self.record.get(key) or ())

    def _typed_tensors(self, key: str) -> tuple[TensorInfo, ...]:
        entries = self.record.get(key)
        if entries is None or entries == []:
            return ()
        if not isinstance(entries, list):
            raise self.malformed_tensors(key)
        try:
            return tuple(TensorInfo.from_dict(e, str(self.path)) for e in entries)
        except ExportFolderError:
            raise self.malformed_tensors(key) from None

    # --- the writer's side: typed values in, the record's JSON out ------------------------------
    @classmethod
    def new(
        cls,
        folder: str | os.PathLike,
        *,
        family: str,
        backbone: str,
        spec: Mapping[str, Any],
        merge: MergeRecord,
        macs_per_example: Mapping[str, Any],
        parameters: Any,
        inputs: Sequence[TensorInfo],
        outputs: Sequence[TensorInfo],
        batch_profile: tuple[int, int, int],
        onnx_sha256: str,
        opset: int,
        exporter: str,
        preprocessing: Preprocessing | None = None,
        backbone_kwargs: Mapping[str, Any] | None = None,
        backbone_config: Mapping[str, Any] | None = None,
        class_names: Sequence[str] | None = None,
        validation: Mapping[str, Any] | None = None,
        tokenizer: TokenizerEntry | None = None,
        precision: str = "fp32",
        graph_passes: Mapping[str, Any] | None = None,
        precision_report: Mapping[str, Any] | None = None,
        uq_outputs: bool = False,
        package_version: str | None = None,
        int8: Int8Record | None = None,
    ) -> ExportInfo:
        """The record of a new export in ``folder`` (what :func:`write_info` writes there), from
        typed values, checked as :func:`read_info` checks it. Its entries come in the order this
        version has always written them; ``strongly_typed`` follows ``precision``."""
        entries: dict[str, Any] = {
            "format": FORMAT,
            "family": family,
            "backbone": backbone,
            "spec": spec,
            "merge": merge,
            "macs_per_example": macs_per_example,
            "parameters": parameters,
            "inputs": inputs,
            "outputs": outputs,
            "batch_profile": batch_profile,
            "preprocessing": preprocessing,
            "backbone_kwargs": backbone_kwargs,
            "backbone_config": backbone_config,
            "class_names": class_names,
            "opset": opset,
            "exporter": exporter,
            "onnx_sha256": onnx_sha256,
            "weights": WEIGHTS_FILE,
            "validation": validation,
            "tokenizer": tokenizer,
            "precision": precision,
            "strongly_typed": precision in _STRONGLY_TYPED,
            "graph_passes": graph_passes or {},
            "precision_report": precision_report,
            "uq_outputs": bool(uq_outputs),
            "package_version": package_version,
            "int8": int8,
        }
        optional = ("tokenizer", "precision_report", "int8")  # absent rather than null
        kept = {k: v for k, v in entries.items() if v is not None or k not in optional}
        return cls._checked(_record_json(kept), Path(folder) / INFO_FILE)

    def replace(self, **entries: Any) -> ExportInfo:
        """This record with ``entries`` (the names of :meth:`new`, typed values) put in, checked
        as :func:`read_info` checks it: an entry keeps its place, a new one goes last; a new
        ``precision`` sets ``strongly_typed`` too."""
        unknown = sorted(set(entries) - set(_RECORD_ENTRIES))
        if unknown:
            raise TypeError(f"hydra.json has no entries {unknown}; it has {_RECORD_ENTRIES}")
        if "precision" in entries:
            entries.setdefault("strongly_typed", entries["precision"] in _STRONGLY_TYPED)
        record = dict(self.record)
        record.update(_record_json(entries))
        return self._checked(record, self.path)

    @classmethod
    def _checked(cls, record: dict[str, Any], path: Path) -> ExportInfo:
        """The record as JSON, checked as read, its typed entries as their readers check them."""
        info = cls.from_record(json.loads(json.dumps(record)), path)
        for entry in _TYPED_ENTRIES:
            getattr(info, entry)
        return info

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
        decisions = record.get("decisions")
        if decisions is not None:
            decisions = DecisionRecord.from_dict(decisions, f"the decisions entry of {path}")
        int8 = record.get("int8")
        if (int8 is None) == (precision == "int8"):
            said = "no 'int8' entry" if int8 is None else "an 'int8' entry"
            raise ExportFolderError(
                f"{path} gives precision {precision!r} and {said}: an INT8 export (and only "
                f"one) records how it was quantized; {_REDO}"
            )
        if int8 is not None:
            int8 = Int8Record.from_dict(int8, f"the int8 entry of {path}")
        return cls(
            path=path,
            record=record,
            family=family,
            batch_profile=parse_batch_profile(record.get("batch_profile"), path),
            onnx_sha256=sha,
            precision=precision,
            class_names=None if names is None else tuple(names),
            uq_outputs=uq,
            decisions=decisions,
            int8=int8,
        )


#: The entries :meth:`ExportInfo.replace` puts in: :meth:`ExportInfo.new`'s (``decisions``: only
#: :func:`write_decisions`), and ``strongly_typed``, which follows ``precision``.
_RECORD_ENTRIES = (
    *(
        name
        for name, parameter in inspect.signature(ExportInfo.new).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ),
    "strongly_typed",
)
#: ExportInfo's typed views of entries (checked when read): :meth:`ExportInfo.new` reads each
_TYPED_ENTRIES = (
    "input_tensors",
    "output_tensors",
    "tokenizer_entry",
    "preprocessing_config",
    "merge_record",
)
#: precisions whose graph is strongly typed (explicit casts: :mod:`hydra_deploy.export.precision`)
_STRONGLY_TYPED = ("fp16", "bf16")


def _record_json(entries: Mapping[str, Any]) -> dict[str, Any]:
    """hydra.json's form of typed entries: a typed entry's ``to_dict``, a batch profile as
    ``{"min", "opt", "max"}``, tensor entries as a list; the rest as it is (JSON-able)."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if key == "batch_profile" and isinstance(value, (tuple, list)):
            value = dict(zip(("min", "opt", "max"), value, strict=True))
        elif key in ("inputs", "outputs", "class_names") and value is not None:
            value = [_entry_json(v) for v in value]
        else:
            value = _entry_json(value)
        out[key] = value
    return out


def _entry_json(value: Any) -> Any:
    """A typed entry as JSON (its ``to_dict``), a mapping as a dict, the rest as it is."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return dict(value) if isinstance(value, Mapping) else value


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
    return ExportInfo.from_record(_settled(record, path), path)


def write_info(folder: str | os.PathLike, record: ExportInfo | Mapping[str, Any]) -> ExportInfo:
    """Write ``record`` (an :class:`ExportInfo`, or the JSON object) as ``folder/hydra.json``
    (atomically), after checking it as :func:`read_info` would: what the exporter writes, every
    consumer reads."""
    path = Path(folder) / INFO_FILE
    if isinstance(record, ExportInfo):
        record = record.record
    if _REPLACING in record:
        raise ExportFolderError(
            f"{INFO_FILE}'s {_REPLACING!r} entry is written by write_decisions only; drop it"
        )
    text = json.dumps(record, indent=2) + "\n"
    info = ExportInfo.from_record(json.loads(text), path)
    atomic_write_text(path, text)
    return info


# --- the INT8 record (hydra-export --precision int8) ----------------------------------------------
def _counts(value: Any, where: str, field: str, low: int) -> dict[str, int]:
    if not (
        isinstance(value, dict)
        and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= low
            for k, v in value.items()
        )
    ):
        raise ExportFolderError(
            f"{where} has a malformed {field} {value!r:.80} (expected op type -> count >= {low}); "
            f"{_REDO}"
        )
    return dict(value)


@dataclass(frozen=True)
class Int8Record:
    """How an INT8 graph was quantized, stored as ``"int8"`` in hydra.json (written by
    :func:`hydra_deploy.export.int8.quantize_export`).

    ``method``: ``dynamic`` (weights only) or ``static`` (QDQ; ``calibration_method`` on
    ``num_calibration`` examples whose inputs hash to ``calibration_sha256``; None / 0 / None for
    dynamic). ``quantized_ops``: op type -> nodes computing on int8; ``integer_ops``: the
    quantization nodes in the file; ``kept_float``: what stayed float (``{"nodes", "why"}``);
    ``weights`` / ``activations``: the schemes in words. ``bias_kept_apart``: the 2-D products
    (static) whose bias is added as [1, 1, out] then squeezed, so that ONNX Runtime runs them as
    integer kernels rather than fusing them into a float Gemm (see ``export.int8``).
    """

    method: str
    calibration_method: str | None
    num_calibration: int
    calibration_sha256: str | None
    quantized_ops: dict[str, int]
    integer_ops: dict[str, int]
    kept_float: dict[str, dict[str, Any]]
    format: str | None = None  # "QDQ", or "QOperator (MatMulInteger)"
    weights: str | None = None
    activations: str | None = None
    onnxruntime_version: str | None = None
    bias_kept_apart: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "format": self.format,
            "calibration_method": self.calibration_method,
            "num_calibration": self.num_calibration,
            "calibration_sha256": self.calibration_sha256,
            "quantized_ops": dict(self.quantized_ops),
            "integer_ops": dict(self.integer_ops),
            "kept_float": {k: dict(v) for k, v in self.kept_float.items()},
            "weights": self.weights,
            "activations": self.activations,
            "onnxruntime_version": self.onnxruntime_version,
            "bias_kept_apart": self.bias_kept_apart,
        }

    @classmethod
    def from_dict(cls, entry: Any, where: str = "the int8 record") -> Int8Record:
        """Check a parsed record (``where`` names it in errors)."""

        def bad(field: str, value: Any, expected: str) -> ExportFolderError:
            return ExportFolderError(
                f"{where} has a malformed {field} {value!r:.80} (expected {expected}); {_REDO}"
            )

        if not isinstance(entry, dict):
            raise bad("record", entry, "a JSON object")
        method = entry.get("method")
        if method not in INT8_METHODS:
            raise bad("method", method, f"one of {', '.join(INT8_METHODS)}")
        calibration = entry.get("calibration_method")
        count = entry.get("num_calibration", 0)
        sha = entry.get("calibration_sha256")
        if method == "static":
            if calibration not in CALIBRATION_METHODS:
                raise bad("calibration_method", calibration, f"one of {CALIBRATION_METHODS}")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise bad("num_calibration", count, "an integer >= 1")
            if not (
                isinstance(sha, str) and len(sha) == 64 and set(sha) <= set("0123456789abcdef")
            ):
                raise bad("calibration_sha256", sha, "64 lowercase hex digits")
        elif (calibration, count, sha) != (None, 0, None):
            raise bad(
                "calibration", [calibration, count, sha], "none for dynamic INT8 (null, 0, null)"
            )
        quantized = _counts(entry.get("quantized_ops"), where, "quantized_ops", 1)
        if not quantized:
            raise bad("quantized_ops", quantized, "at least one quantized op")
        kept = entry.get("kept_float", {})
        if not (
            isinstance(kept, dict)
            and all(
                isinstance(v, dict)
                and isinstance(v.get("nodes"), int)
                and isinstance(v.get("why"), str)
                for v in kept.values()
            )
        ):
            raise bad("kept_float", kept, 'op -> {"nodes": count, "why": text}')
        texts = {}
        for key in ("format", "weights", "activations", "onnxruntime_version"):
            texts[key] = entry.get(key)
            if texts[key] is not None and not isinstance(texts[key], str):
                raise bad(key, texts[key], "text or null")
        apart = entry.get("bias_kept_apart", 0)
        if not isinstance(apart, int) or isinstance(apart, bool) or apart < 0:
            raise bad("bias_kept_apart", apart, "an integer >= 0")
        return cls(
            method=method,
            calibration_method=calibration,
            num_calibration=count,
            calibration_sha256=sha,
            quantized_ops=quantized,
            integer_ops=_counts(entry.get("integer_ops", {}), where, "integer_ops", 0),
            kept_float={k: dict(v) for k, v in kept.items()},
            bias_kept_apart=apart,
            **texts,
        )


# --- the TensorRT engine's JSON sidecar (hydra-build) ---------------------------------------------
_REBUILD = "rebuild the engine with hydra-build EXPORT_DIR"
#: What to do about a sidecar's batch profile (Triton needs one): also re-exporting may fix it.
_PROFILE_FIX = "re-export the model with hydra-export, or rebuild the engine with hydra-build"
#: Sidecar entries that say where the export an engine was built from lies (newest first).
_EXPORT_HINTS = ("export_dir", "onnx", "onnx_path", "source")


def engine_info_path(engine: str | os.PathLike) -> Path:
    """Where an engine's JSON sidecar is: ``<stem>.json`` beside it (a ``.json`` path stays)."""
    path = Path(engine)
    return path if path.suffix == ENGINE_INFO_SUFFIX else path.with_suffix(ENGINE_INFO_SUFFIX)


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True)
class EngineInfo:
    """A checked engine sidecar: what ``hydra-build`` wrote beside a TensorRT engine.

    ``record`` is the JSON object as written (:meth:`BuildPlan.sidecar
    <hydra_deploy.engines.tensorrt.BuildPlan.sidecar>` decides its contents); the typed fields are
    read here, once, for the runner, the Triton repository, ``hydra-build`` and
    ``hydra-calibrate``. A sidecar of another ``format`` is refused; one without a ``format``
    (written by hand beside a trtexec engine) is read for what it holds.
    """

    path: Path
    record: Mapping[str, Any]
    precision: str | None
    tensorrt_version: str | None
    gpu_name: str | None
    compute_capability: str | None
    strongly_typed: bool | None
    batch_profile: tuple[int, int, int] | None  # (min, opt, max)
    onnx_sha256: str | None
    #: where the export lies, as the sidecar says (``export_dir``, ``onnx``, ...), in that order
    export_hints: tuple[str, ...] = ()

    @property
    def spec(self) -> Any:
        """The HydraSpec the engine was built with, as written (the runner checks it)."""
        return self.record.get("spec")

    @property
    def class_names(self) -> Any:
        return self.record.get("class_names")

    @property
    def preprocessing(self) -> Any:
        return self.record.get("preprocessing")

    @property
    def family(self) -> Any:
        return self.record.get("family")

    @property
    def engine_io(self) -> Any:
        """The parsed network's I/O ``{"inputs": [...], "outputs": [...]}`` with the engine's
        dtypes, as written (the Triton repository checks it)."""
        return self.record.get("engine_io")

    @classmethod
    def from_record(cls, record: Any, path: str | os.PathLike) -> EngineInfo:
        """Check a parsed sidecar (``path`` names it in errors)."""
        path = Path(path)
        if not isinstance(record, dict):
            raise ExportFolderError(
                f"{path} is not an engine sidecar (a JSON object); restore it or {_REBUILD}"
            )
        found = record.get("format")
        if found is not None and found != ENGINE_FORMAT:
            raise ExportFolderError(
                f"{path} has format {found!r:.60}; this version reads {ENGINE_FORMAT!r} engine "
                f"sidecars: upgrade hydra-deploy, or {_REBUILD}"
            )
        sha = record.get("onnx_sha256")
        if sha is not None and not isinstance(sha, str):
            raise ExportFolderError(f"{path} has a malformed onnx_sha256 {sha!r:.80}; {_REBUILD}")
        gpu = record.get("gpu") if isinstance(record.get("gpu"), dict) else {}
        typed = record.get("strongly_typed")
        version = record.get("tensorrt_version")
        return cls(
            path=path,
            record=record,
            precision=_text_or_none(record.get("precision")),
            tensorrt_version=version if isinstance(version, str) else None,
            gpu_name=_text_or_none(gpu.get("name")),
            compute_capability=_text_or_none(gpu.get("compute_capability")),
            strongly_typed=typed if isinstance(typed, bool) else None,
            batch_profile=parse_batch_profile(record.get("batch_profile"), path, _PROFILE_FIX),
            onnx_sha256=sha or None,
            export_hints=tuple(
                record[key] for key in _EXPORT_HINTS if _text_or_none(record.get(key))
            ),
        )


def read_engine_info(engine: str | os.PathLike, *, required: bool = False) -> EngineInfo | None:
    """The checked sidecar of an engine (``engine``: the engine file or the sidecar itself);
    None when there is none and not ``required`` (an engine trtexec built)."""
    path = engine_info_path(engine)
    if not path.is_file():
        if not required:
            return None
        raise ExportFolderError(
            f"{path} is missing: hydra-build writes it beside the engine; {_REBUILD}"
        )
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise ExportFolderError(
            f"cannot read the engine's sidecar {path}: {err}; restore it or {_REBUILD}"
        ) from err
    except RecursionError:
        raise ExportFolderError(
            f"cannot read the engine's sidecar {path}: its JSON is nested too deeply; {_REBUILD}"
        ) from None
    return EngineInfo.from_record(record, path)


def write_engine_info(path: str | os.PathLike, record: dict[str, Any]) -> EngineInfo:
    """Write ``record`` as the sidecar ``path`` (atomically, NaN refused), after checking it as
    :func:`read_engine_info` would; its ``format`` is set to :data:`ENGINE_FORMAT`."""
    from hydra_deploy import atomic  # looked up at call time (tests make the disk full)

    record = {"format": ENGINE_FORMAT, **record}
    info = EngineInfo.from_record(json.loads(json.dumps(record)), path)
    atomic.atomic_write_json(path, record)
    return info


# --- the decisions record (hydra-calibrate) -------------------------------------------------------
def _malformed(where: str, field: str, value: Any, expected: str) -> ExportFolderError:
    return ExportFolderError(
        f"{where} has a malformed {field} {value!r:.80} (expected {expected}); {_REFIT}"
    )


def _number(
    entry: Mapping[str, Any], key: str, where: str, *, low: float, high: float, open_low: bool
) -> float:
    value = entry.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok:
        ok = (low < value if open_low else low <= value) and value <= high
    if not ok:
        side = "(" if open_low else "["
        raise _malformed(where, key, value, f"a number in {side}{low}, {high}]")
    return float(value)


def _count(entry: Mapping[str, Any], key: str, where: str, *, low: int = 0) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _malformed(where, key, value, f"an integer >= {low}")
    return value


def _choice(entry: Mapping[str, Any], key: str, where: str, choices: tuple[str, ...]) -> str:
    value = entry.get(key)
    if value not in choices:
        raise _malformed(where, key, value, f"one of {', '.join(choices)}")
    return value


def _section(record: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any] | None:
    value = record.get(key)
    if value is not None and not isinstance(value, dict):
        raise _malformed(where, key, value, "a JSON object or null")
    return value


_INF = float("inf")
P = TypeVar("P")


@dataclass(frozen=True, init=False)
class SetRule(Generic[P]):
    """Split conformal prediction sets at level ``1 - alpha`` on the calibrated probabilities.

    ``method`` names a registered set score (:data:`~hydra_deploy.set_scores.SET_SCORES`);
    ``qhat`` is one threshold, or one per class (``class_conditional``); ``params`` are the
    score's fitted parameters (its ``Params``: RAPS's lambda and k_reg; None: the defaults), or
    give them by name (``SetRule("raps", 0.1, (0.8,), lam=0.1, k_reg=2)``, as before ``params``).
    hydra.json records each parameter field under its key (and a score's constant entries: LAC
    and APS write RAPS's zero penalty, as every record did)."""

    method: str
    alpha: float
    qhat: tuple[float, ...]  # one value, or one per class
    class_conditional: bool
    params: P

    def __init__(
        self,
        method: str,
        alpha: float,
        qhat: tuple[float, ...],
        class_conditional: bool = False,
        params: P | None = None,
        **values: Any,
    ) -> None:
        for name, value in (
            ("method", method),
            ("alpha", alpha),
            ("qhat", tuple(qhat)),
            ("class_conditional", class_conditional),
            ("params", set_score(method).params(params, **values)),
        ):
            object.__setattr__(self, name, value)

    @property
    def lam(self) -> float:
        """RAPS's lambda (0 for a score without it): the field before ``params``."""
        return getattr(self.params, "lam", 0.0)

    @property
    def k_reg(self) -> int:
        """RAPS's k_reg (0 for a score without it): the field before ``params``."""
        return getattr(self.params, "k_reg", 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "alpha": self.alpha,
            "class_conditional": self.class_conditional,
            "qhat": list(self.qhat) if self.class_conditional else self.qhat[0],
            **SET_SCORES[self.method].recorded,
            **{_param_key(f): getattr(self.params, f.name) for f in fields(self.params)},
        }

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], where: str, num_classes: int) -> SetRule:
        conditional = entry.get("class_conditional", False)
        if not isinstance(conditional, bool):
            raise _malformed(where, "class_conditional", conditional, "true or false")
        qhat = entry.get("qhat")
        values = qhat if conditional else [qhat]
        if not (
            isinstance(values, list)
            and len(values) == (num_classes if conditional else 1)
            and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
                for v in values
            )
        ):
            expected = f"a list of {num_classes} finite numbers" if conditional else "a number"
            raise _malformed(where, "qhat", qhat, expected)
        method = _choice(entry, "method", where, SET_METHODS)
        params_type = SET_SCORES[method].Params
        return cls(
            method=method,
            alpha=_number(entry, "alpha", where, low=0.0, high=1.0, open_low=True),
            qhat=tuple(float(v) for v in values),
            class_conditional=conditional,
            params=params_type(**{f.name: _param(entry, f, where) for f in fields(params_type)}),
        )


def _param_key(spec: Field) -> str:
    """The key a set score's parameter field is recorded under."""
    return spec.metadata.get("key", spec.name)


def _param(entry: Mapping[str, Any], spec: Field, where: str) -> float | int:
    """A set score's parameter field, read from its record: an integer or a number, at least its
    ``metadata["low"]``."""
    if spec.type in (int, "int"):
        return _count(entry, _param_key(spec), where, low=spec.metadata.get("low", 0))
    low = spec.metadata.get("low", -_INF)
    return _number(entry, _param_key(spec), where, low=low, high=_INF, open_low=False)


@dataclass(frozen=True)
class SelectiveRule:
    """Answer when the calibrated ``score`` passes ``tau`` (msp: >= tau; an entropy: <= tau),
    chosen so that P(selective error rate > target_risk) <= delta."""

    score: str
    target_risk: float
    delta: float
    tau: float
    grid_size: int
    coverage: float  # share of the quantile part answered at tau
    #: how the grid's thresholds were tested (decisions.SELECTIVE_PROCEDURES): "graph" (a fixed
    #: sequence with a Bonferroni fallback), or "bonferroni" (records without the entry)
    procedure: str = "bonferroni"

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "target_risk": self.target_risk,
            "delta": self.delta,
            "tau": self.tau,
            "grid_size": self.grid_size,
            "coverage": self.coverage,
            "procedure": self.procedure,
        }

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], where: str) -> SelectiveRule:
        return cls(
            score=_choice(entry, "score", where, DECISION_SCORES),
            target_risk=_number(entry, "target_risk", where, low=0.0, high=1.0, open_low=True),
            delta=_number(entry, "delta", where, low=0.0, high=1.0, open_low=True),
            tau=_number(entry, "tau", where, low=-_INF, high=_INF, open_low=True),
            grid_size=_count(entry, "grid_size", where, low=1),
            coverage=_number(entry, "coverage", where, low=0.0, high=1.0, open_low=False),
            procedure=_choice(
                {"procedure": "bonferroni", **entry}, "procedure", where, SELECTIVE_PROCEDURES
            ),
        )


@dataclass(frozen=True)
class OodRule:
    """Flag an input when its OOD score (``score`` oriented higher = more unusual: msp negated)
    exceeds ``threshold``, so that at most ``alpha`` of in-distribution inputs are flagged."""

    score: str
    alpha: float
    threshold: float

    def to_dict(self) -> dict[str, Any]:
        return {"score": self.score, "alpha": self.alpha, "threshold": self.threshold}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], where: str) -> OodRule:
        return cls(
            score=_choice(entry, "score", where, DECISION_SCORES),
            alpha=_number(entry, "alpha", where, low=0.0, high=1.0, open_low=True),
            threshold=_number(entry, "threshold", where, low=-_INF, high=_INF, open_low=True),
        )


#: the rates a monitor compares with what calibration saw (hydra_deploy.monitor.RATES)
MONITOR_RATES = ("ood_flag", "abstained", "empty_set")


def reference_sha256(values: Sequence[float]) -> str:
    """The SHA-256 of reference values as little-endian float64 (what :class:`MonitorReference`
    stores beside them; numpy's ``values.astype('<f8').tobytes()`` hashes the same)."""
    return hashlib.sha256(struct.pack(f"<{len(values)}d", *values)).hexdigest()


@dataclass(frozen=True)
class MonitorReference:
    """What a drift monitor compares a deployed stream with (:mod:`hydra_deploy.monitor`).

    ``values``: the in-distribution values of the OOD score ``score`` (oriented higher = more
    unusual: msp negated) on the quantile part, sorted ascending, with their ``sha256``
    (:func:`reference_sha256`); ``counts``: for each rate of :data:`MONITOR_RATES` the record's
    rules give, how many of the quantile part's examples it hit, and of how many.
    """

    score: str
    values: tuple[float, ...]
    sha256: str
    counts: Mapping[str, tuple[int, int]] = field(hash=False)  # a dict: the record stays hashable

    @classmethod
    def new(
        cls, score: str, values: Sequence[float], counts: Mapping[str, tuple[int, int]]
    ) -> MonitorReference:
        ordered = tuple(sorted(float(v) for v in values))
        return cls(score, ordered, reference_sha256(ordered), dict(counts))

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "count": len(self.values),
            "sha256": self.sha256,
            "values": list(self.values),
            "counts": {name: list(pair) for name, pair in self.counts.items()},
        }

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], where: str) -> MonitorReference:
        where = f"{where}'s monitor reference"
        score = _choice(entry, "score", where, DECISION_SCORES)
        values = entry.get("values")
        if (
            not isinstance(values, list)
            or not values
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            or not all(_finite(float(v)) for v in values)
        ):
            raise _malformed(where, "values", values, "a list of finite numbers")
        ordered = tuple(float(v) for v in values)
        if list(ordered) != sorted(ordered) or _count(entry, "count", where, low=1) != len(ordered):
            raise _malformed(where, "values", f"{len(ordered)} values", "sorted, as many as count")
        if entry.get("sha256") != reference_sha256(ordered):
            raise ExportFolderError(
                f"{where}'s values do not match their SHA-256 (the file was edited or damaged); "
                f"{_REFIT}"
            )
        counts = entry.get("counts")
        if not isinstance(counts, dict) or set(counts) - set(MONITOR_RATES):
            raise _malformed(where, "counts", counts, f"an object of {', '.join(MONITOR_RATES)}")
        pairs: dict[str, tuple[int, int]] = {}
        for name, pair in counts.items():
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
                and 0 <= pair[0] <= pair[1]
            ):
                raise _malformed(where, f"counts.{name}", pair, "[hits, count]")
            pairs[name] = (pair[0], pair[1])
        return cls(score, ordered, entry["sha256"], pairs)


def _finite(value: float) -> bool:
    """``value`` is a finite number (this module imports no numpy)."""
    return value == value and value not in (_INF, -_INF)


@dataclass(frozen=True)
class DecisionRecord:
    """What ``hydra-calibrate`` fitted, stored as ``"decisions"`` in hydra.json.

    ``temperature`` is shared by the members (p = mean_m softmax(logits_m / T)); each rule is
    None when it was not fitted. ``onnx_sha256`` names the ``model.onnx`` the numbers were fitted
    on (a runner refuses the record for another file); ``data_sha256`` the calibration data.
    ``n_temperature`` / ``n_quantile``: the examples of the two parts (T, RAPS parameters and the
    selective grid on the first; every quantile on the second). ``in_graph``: the rules are also
    outputs of ``model.onnx``. ``backend``, ``precision`` and ``engine_sha256`` name the numbers
    it was fitted on (ONNX Runtime on the graph's precision, or one TensorRT engine file): a
    runner of other numbers refuses the record unless asked (:meth:`check_numbers`).
    """

    temperature: float
    num_classes: int
    onnx_sha256: str
    data_sha256: str
    n_temperature: int
    n_quantile: int
    holdout: float
    seed: int
    sets: SetRule | None = None
    selective: SelectiveRule | None = None
    ood: OodRule | None = None
    in_graph: bool = False
    #: what gave the numbers fitted on: ``"onnxruntime"`` or ``"tensorrt"`` (None: a record written
    #: before records named it, taken as ONNX Runtime on the folder's model.onnx)
    backend: str | None = None
    #: the precision of those numbers: the graph's (ONNX Runtime) or the engine's (TensorRT; None
    #: when its sidecar does not say); None with ``backend`` None: the folder's graph precision
    precision: str | None = None
    #: the SHA-256 of the engine file fitted on (``hydra-calibrate --engine``); None otherwise
    engine_sha256: str | None = None
    #: what a drift monitor compares the deployed stream with (None: a record from before it)
    monitor: MonitorReference | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """What applying the record gives per input, besides the prediction:
        ``calibrated_probs`` and ``confidence``, then ``prediction_set``, ``accept`` and
        ``ood_flag`` for the rules it holds (the names of the graph outputs with ``in_graph``,
        minus ``confidence``)."""
        held = (
            ("prediction_set", self.sets),
            ("accept", self.selective),
            ("ood_flag", self.ood),
        )
        return (
            "calibrated_probs",
            "confidence",
            *(name for name, rule in held if rule is not None),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DECISIONS_FORMAT,
            "temperature": self.temperature,
            "num_classes": self.num_classes,
            "sets": None if self.sets is None else self.sets.to_dict(),
            "selective": None if self.selective is None else self.selective.to_dict(),
            "ood": None if self.ood is None else self.ood.to_dict(),
            "n_temperature": self.n_temperature,
            "n_quantile": self.n_quantile,
            "holdout": self.holdout,
            "seed": self.seed,
            "onnx_sha256": self.onnx_sha256,
            "data_sha256": self.data_sha256,
            "in_graph": self.in_graph,
            **({} if self.monitor is None else {"monitor": self.monitor.to_dict()}),
            # a record from before these entries stays one (from_dict reads it back the same)
            **(
                {}
                if self.backend is None
                else {
                    "backend": self.backend,
                    "precision": self.precision,
                    "engine_sha256": self.engine_sha256,
                }
            ),
        }

    @classmethod
    def from_dict(cls, record: Any, where: str = "the decisions record") -> DecisionRecord:
        """Check a parsed record (``where`` names it in errors)."""
        if not isinstance(record, dict):
            raise _malformed(where, "record", record, "a JSON object")
        found = record.get("format")
        if found != DECISIONS_FORMAT:
            raise ExportFolderError(
                f"{where} has format {found!r:.60}; this version reads {DECISIONS_FORMAT!r}: "
                f"upgrade hydra-deploy, or {_REFIT}"
            )
        for key in ("onnx_sha256", "data_sha256"):
            sha = record.get(key)
            if not _is_sha256(sha):
                raise _malformed(where, key, sha, "64 lowercase hex digits")
        backend, precision, engine = _fitted_numbers(record, where)
        in_graph = record.get("in_graph", False)
        if not isinstance(in_graph, bool):
            raise _malformed(where, "in_graph", in_graph, "true or false")
        num_classes = _count(record, "num_classes", where, low=1)
        sets = _section(record, "sets", where)
        selective = _section(record, "selective", where)
        ood = _section(record, "ood", where)
        monitor = _section(record, "monitor", where)
        return cls(
            temperature=_number(record, "temperature", where, low=0.0, high=_INF, open_low=True),
            num_classes=num_classes,
            onnx_sha256=record["onnx_sha256"],
            data_sha256=record["data_sha256"],
            n_temperature=_count(record, "n_temperature", where, low=1),
            n_quantile=_count(record, "n_quantile", where, low=1),
            holdout=_number(record, "holdout", where, low=0.0, high=1.0, open_low=True),
            seed=_count(record, "seed", where),
            sets=None if sets is None else SetRule.from_dict(sets, where, num_classes),
            selective=None if selective is None else SelectiveRule.from_dict(selective, where),
            ood=None if ood is None else OodRule.from_dict(ood, where),
            in_graph=in_graph,
            backend=backend,
            precision=precision,
            engine_sha256=engine,
            monitor=None if monitor is None else MonitorReference.from_dict(monitor, where),
        )

    def fitted_numbers(self, folder_precision: str | None = None) -> tuple[str, str | None]:
        """(backend, precision) of the numbers the record was fitted on; a record from before
        records named them is taken as ONNX Runtime on the folder's graph (``folder_precision``)."""
        if self.backend is None:
            return "onnxruntime", folder_precision
        return self.backend, self.precision

    def numbers_mismatch(
        self,
        backend: str,
        precision: str | None,
        engine_sha256: str | None = None,
        *,
        folder_precision: str | None = None,
    ) -> list[str]:
        """How the numbers of a runner (``backend``, its ``precision``, an engine's file hash)
        differ from those the record was fitted on; empty when they are the same. A precision
        unknown on either side is not compared; the engine file is, for a TensorRT record."""
        fitted_backend, fitted_precision = self.fitted_numbers(folder_precision)
        found = []
        if backend != fitted_backend:
            found.append(f"backend {fitted_backend}, this runner is {backend}")
        if fitted_precision is not None and precision is not None and precision != fitted_precision:
            found.append(f"precision {fitted_precision}, this runner computes in {precision}")
        if backend == fitted_backend and self.engine_sha256 and engine_sha256 != self.engine_sha256:
            found.append(
                f"the engine file of sha256 {_short_sha(self.engine_sha256)}, this one is "
                f"{_short_sha(engine_sha256)}"
            )
        return found

    def describe_numbers(self, folder_precision: str | None = None) -> str:
        """The numbers the record was fitted on, in words (for messages)."""
        backend, precision = self.fitted_numbers(folder_precision)
        said = _numbers_in_words(backend, precision, self.engine_sha256)
        if self.backend is None:
            said += (
                " (the record names no backend: it was written before records did, and is taken "
                "as fitted in ONNX Runtime on the folder's model.onnx)"
            )
        return said

    def check_numbers(
        self,
        backend: str,
        precision: str | None,
        engine_sha256: str | None = None,
        *,
        folder: str,
        engine: str | None = None,
        folder_precision: str | None = None,
        allow_mismatch: bool = False,
    ) -> str | None:
        """Refuse the record for a runner whose numbers are not those it was fitted on (another
        backend, precision or engine file: :meth:`numbers_mismatch`): its guarantees hold only for
        those. ``allow_mismatch`` (``--allow-decisions-mismatch``): return the warning to log
        instead. None when the numbers are the same. ``folder`` / ``engine`` name the export and
        the engine file run (TensorRT) in the refit command."""
        found = self.numbers_mismatch(
            backend, precision, engine_sha256, folder_precision=folder_precision
        )
        if not found:
            return None
        fitted = self.describe_numbers(folder_precision)
        here = _numbers_in_words(backend, precision, None)  # its engine file: in ``found``
        refit = f"hydra-calibrate {folder} --data LABELLED" + (
            f" --engine {engine or 'ENGINE'}" if backend == "tensorrt" else ""
        )
        if allow_mismatch:
            return (
                f"applying the decisions in {folder}/{INFO_FILE} to {here} as asked "
                f"({spelled('allow_decisions_mismatch=True', '--allow-decisions-mismatch')}), "
                f"though they were fitted on {fitted} ({'; '.join(found)}): "
                f"{self._guarantees()} were shown for those numbers only and are not guaranteed "
                f"for these; fit them on these numbers with {refit} --overwrite"
            )
        raise ExportFolderError(
            f"the decisions in {folder}/{INFO_FILE} were fitted on {fitted}, not on {here} "
            f"({'; '.join(found)}); their guarantees hold only for the numbers they were fitted "
            f"on: fit them again with {refit} --overwrite, or apply them anyway with "
            f"{spelled('allow_decisions_mismatch=True', '--allow-decisions-mismatch')}"
        )

    def _guarantees(self) -> str:
        """What the record promises, in words: the part a mismatch leaves uncovered."""
        held = ["the calibration of the confidence (temperature)"]
        if self.sets is not None:
            held.append(f"the set coverage >= {1 - self.sets.alpha:g}")
        if self.selective is not None:
            s = self.selective
            held.append(
                f"the selective risk <= {s.target_risk:g} (with probability >= {1 - s.delta:g})"
            )
        if self.ood is not None:
            held.append(f"the OOD false-alarm rate <= {self.ood.alpha:g}")
        return ", ".join(held[:-1]) + " and " + held[-1] if len(held) > 1 else held[0]

    def check_fitted_on(self, onnx_sha256: str | None, model: str) -> None:
        """Refuse the record when it was fitted on another ``model.onnx`` than ``onnx_sha256``
        (a re-export, another precision, a model replaced by hand)."""
        if onnx_sha256 != self.onnx_sha256:
            raise ExportFolderError(
                f"the decisions in hydra.json were fitted on another model.onnx than {model} "
                f"(fitted on sha256 {self.onnx_sha256[:12]}..., this one is "
                f"{(onnx_sha256 or 'unknown')[:12]}...); their thresholds do not hold for it: "
                f"{_REFIT.replace('EXPORT', str(model))}"
            )


#: The backends a decisions record may name (``backend``: what produced the logits fitted on).
RECORD_BACKENDS = ("onnxruntime", "tensorrt")
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_BACKEND_NAMES = {"onnxruntime": "ONNX Runtime", "tensorrt": "TensorRT"}


def is_backend_name(value: Any) -> bool:
    """Whether ``value`` has the form of a backend name a record may hold: 1 to 32 lowercase
    letters, digits, '_', '.' and '-', from a letter or digit. Besides :data:`RECORD_BACKENDS`, a
    registered backend's ``record_name`` (:mod:`hydra_deploy.engines.backends`: this module
    imports no runtime to know them)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 32
        and value[0] in _NAME_START
        and set(value) <= _NAME_START | {"_", ".", "-"}
    )


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")


def _short_sha(sha: str | None) -> str:
    return "unknown" if sha is None else f"{sha[:12]}..."


def _numbers_in_words(backend: str, precision: str | None, engine_sha256: str | None) -> str:
    """``ONNX Runtime outputs of the fp32 model.onnx`` / ``the outputs of a TensorRT engine in
    fp16 (sha256 0123456789ab...)``."""
    if backend == "tensorrt":
        shown = f" in {precision}" if precision else ""
        sha = f" (sha256 {_short_sha(engine_sha256)})" if engine_sha256 else ""
        return f"the outputs of a TensorRT engine{shown}{sha}"
    shown = f" {precision}" if precision else ""
    return f"{_BACKEND_NAMES.get(backend, backend)} outputs of the{shown} {MODEL_FILE}"


def _fitted_numbers(
    record: Mapping[str, Any], where: str
) -> tuple[str | None, str | None, str | None]:
    """The checked ``backend``, ``precision``, ``engine_sha256`` of a decisions record: all None
    for a record written before records named them."""
    backend = record.get("backend")
    precision = record.get("precision")
    engine = record.get("engine_sha256")
    if backend is None:
        if precision is not None or engine is not None:
            raise _malformed(where, "backend", backend, f"one of {', '.join(RECORD_BACKENDS)}")
        return None, None, None
    if not is_backend_name(backend):
        raise _malformed(
            where, "backend", backend, f"{', '.join(RECORD_BACKENDS)} or a backend's record_name"
        )
    if precision is not None and not (isinstance(precision, str) and 0 < len(precision) <= 32):
        raise _malformed(where, "precision", precision, "a precision such as fp32, or null")
    if backend == "onnxruntime" and precision not in GRAPH_PRECISIONS:
        raise _malformed(where, "precision", precision, f"one of {', '.join(GRAPH_PRECISIONS)}")
    if backend == "tensorrt" and not _is_sha256(engine):
        raise _malformed(where, "engine_sha256", engine, "64 lowercase hex digits")
    if backend == "onnxruntime" and engine is not None:
        raise _malformed(where, "engine_sha256", engine, "null for an ONNX Runtime record")
    if engine is not None and not _is_sha256(engine):
        raise _malformed(where, "engine_sha256", engine, "64 lowercase hex digits, or null")
    return backend, precision, engine


def write_decisions(
    folder: str | os.PathLike,
    decisions: DecisionRecord | None,
    *,
    model: str | os.PathLike | None = None,
    outputs: Sequence[TensorInfo | Mapping[str, Any]] | None = None,
) -> ExportInfo:
    """Store ``decisions`` (None: remove them) in ``folder/hydra.json``, atomically; the rest of
    the record is kept as it is.

    ``model``: a new ``model.onnx`` (``hydra-calibrate --in-graph``: the decisions in its graph),
    written under a temporary name in the folder, that replaces the folder's together with the
    record: ``onnx_sha256`` follows it (``decisions`` must name it too) and ``outputs`` (its
    graph outputs, when given) replace the record's. The pair is switched by one rename, so that
    an interruption at any point (a kill included) leaves the old pair or the new one, never one
    file of each: hydra.json is first written with the new record and, as ``"replacing"``, the
    record it replaces; then ``model`` is renamed to model.onnx (the switch); then hydra.json is
    written without the old record. :func:`read_info` reads a hydra.json that still holds
    ``"replacing"`` as the record of the model.onnx it finds. ``model`` is moved into place, or
    removed when the call fails.
    """
    info = read_info(folder)
    record = dict(info.record)
    if decisions is None:
        record.pop("decisions", None)
    else:
        record["decisions"] = decisions.to_dict()
    if model is None:
        return write_info(info.folder, record)
    staged, switched, announced = Path(model), False, False
    try:
        sha = file_sha256(staged)
        if decisions is not None and decisions.onnx_sha256 != sha:
            raise ExportFolderError(
                f"the decisions name model.onnx sha256 {_short_sha(decisions.onnx_sha256)}, but "
                f"the new file {staged} is {_short_sha(sha)}: fit them on that file"
            )
        record["onnx_sha256"] = sha
        if outputs is not None:
            record["outputs"] = _record_json({"outputs": outputs})["outputs"]
        with open(staged, "rb") as handle:  # on disk before any name points at it
            os.fsync(handle.fileno())
        with contextlib.suppress(OSError):  # the mode of the file it replaces
            os.chmod(staged, info.onnx_path.stat().st_mode & 0o777)
        ExportInfo.from_record(json.loads(json.dumps(record)), info.path)  # checked first
        _write_json_text(info.folder / INFO_FILE, {**record, _REPLACING: dict(info.record)})
        announced = True
        _replace_model(staged, info.onnx_path)  # the switch
        switched = True
        _fsync_folder(info.folder)
    except BaseException:
        if not switched:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            if announced:  # tidy only: the reader takes this hydra.json as the old record
                with contextlib.suppress(Exception):
                    write_info(info.folder, dict(info.record))
        raise
    return write_info(info.folder, record)


#: hydra.json's entry while :func:`write_decisions` switches model.onnx: the record of the
#: model.onnx being replaced (:func:`read_info` reads it when model.onnx is still that file).
_REPLACING = "replacing"


def _replace_model(staged: Path, target: Path) -> None:
    """The one rename that switches model.onnx (a function of its own: the tests kill the
    writer on either side of it)."""
    os.replace(staged, target)


def _write_json_text(path: Path, record: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform can: not on Windows)."""
    with contextlib.suppress(OSError, AttributeError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _settled(record: Any, path: Path) -> Any:
    """The record of the model.onnx beside ``path``: a hydra.json that :func:`write_decisions`
    wrote for a switch of model.onnx that was interrupted still holds the record it replaces
    (``"replacing"``); that one when model.onnx is still the old file, else the new one."""
    if not isinstance(record, dict) or _REPLACING not in record:
        return record
    previous = record[_REPLACING]
    current = {key: value for key, value in record.items() if key != _REPLACING}
    if not isinstance(previous, dict) or _REPLACING in previous:
        raise ExportFolderError(f"{path} has a malformed {_REPLACING!r} entry; {_REDO}")
    try:
        sha = file_sha256(path.parent / MODEL_FILE)
    except OSError:  # no model.onnx: the consumer says so
        return current
    if sha != current.get("onnx_sha256") and sha == previous.get("onnx_sha256"):
        return previous
    return current
