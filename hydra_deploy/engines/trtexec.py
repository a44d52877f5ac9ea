"""trtexec recipes: the exact command lines that build a TensorRT engine from an export folder.

Pure Python (no TensorRT, no onnx package): a Jetson that has trtexec but not our build extras gets
the same commands. Three TensorRT generations differ in how precision is chosen:

- ``"8.6"`` (JetPack 6.0 ships 8.6.2; JetPack 5 ships 8.5, which cannot parse the opset-17
  LayerNormalization op) and ``"10"`` (10.0-10.11; JetPack 6.1 and 6.2 ship 10.3): an FP32 graph is
  built *weakly typed* with ``--fp16`` / ``--bf16``; ``--precisionConstraints=obey`` with
  ``--layerPrecisions=<layer>:fp32,...`` keeps every LayerNormalization (FP16 LayerNorm overflows)
  and the ensemble (uncertainty) head in FP32. The layer names are the ONNX node names, which
  TensorRT's ONNX parser gives the layers it creates, except 8.6's for LayerNormalization: there
  the command cannot pin them (see :func:`_unnamed_on_trt86`; the Python build pins them by layer
  type). Every FP32 command has ``--noTF32``: trtexec enables TF32 unless told not to.
- ``"10.12"`` and ``"11"``: TensorRT 10.12 deprecated weak typing and 11 removed ``--fp16``/``--bf16``;
  the graph carries its precision (``hydra-export --precision fp16|bf16``) and is built with
  ``--stronglyTyped`` (a no-op that 11 still accepts).
- A graph exported in FP16/BF16 is built ``--stronglyTyped`` from 10.0 on; TensorRT 8.6 has no strongly
  typed networks and builds it weakly typed with the same constraints.

This module also holds what the Python build (:mod:`hydra_deploy.engines.tensorrt`) shares with the
recipes: reading an export folder (:func:`load_source`), the precision rules
(:func:`choose_precision`), the FP32 layer list and the optimization-profile shapes. The shell
scripts in the repository's ``engines/`` folder reimplement these few rules with python3's standard
library; tests check that they print exactly :func:`trtexec_command`'s arguments.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_deploy.errors import EngineError
from hydra_deploy.export_folder import (
    FORMAT,
    GRAPH_PRECISIONS,
    INFO_FILE,
    MODEL_FILE,
    file_sha256,
    parse_batch_profile,
    read_info,
)

PRECISIONS = ("fp16", "bf16", "fp32", "best")
# trtexec generations: the key names the oldest release each recipe is written for.
GENERATIONS = {"8.6": (8, 6), "10": (10, 0), "10.12": (10, 12), "11": (11, 0)}
GENERATION_NAMES = {
    "8.6": "TensorRT 8.6 (JetPack 6.0: 8.6.2; not JetPack 5, whose 8.5 lacks LayerNormalization)",
    "10": "TensorRT 10.0-10.11 (JetPack 6.1 and 6.2: 10.3)",
    "10.12": "TensorRT 10.12 and later 10.x",
    "11": "TensorRT 11",
}
EXPORT_FORMAT = FORMAT  # hydra_deploy.export_folder owns it
# Ops of the ensemble head that compute in floating point; with weak typing they are pinned to FP32
# like LayerNormalization (shape-only ops, TopK and Casts are left to TensorRT).
HEAD_FLOAT_OPS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "Exp",
        "Log",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceLogSumExp",
        "Mul",
        "Div",
        "Sub",
        "Add",
        "Neg",
        "Max",
        "Min",
        "Clip",
        "Sum",
        "Mean",
    }
)
MEMBER_LOGITS = "member_logits"


# --- a minimal ONNX reader (protobuf wire format; standard library only) ---------------------------
@dataclass(frozen=True)
class OnnxNode:
    """One node of an ONNX graph: enough to name TensorRT layers and follow tensors."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class OnnxSummary:
    """What the engine code needs from ``model.onnx``: nodes, inputs, outputs, metadata."""

    nodes: tuple[OnnxNode, ...]
    inputs: tuple[dict[str, Any], ...]  # {"name", "shape"} with str for symbolic dims
    outputs: tuple[str, ...]
    metadata: dict[str, str]


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) pairs of one protobuf message; length-delimited values as views."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | memoryview
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:  # a length runs past the end: the file was cut short
            raise ValueError("truncated: a field runs past the end of the data")
        yield number, value


def _text(value: int | memoryview) -> str:
    return bytes(value).decode("utf-8")  # type: ignore[arg-type]


def _value_info(buf: memoryview) -> dict[str, Any]:
    """ValueInfoProto -> {"name", "shape"} (TypeProto.tensor_type.shape.dim)."""
    name, shape = "", []
    for number, value in _fields(buf):
        if number == 1:
            name = _text(value)
        elif number == 2:  # TypeProto
            for tnum, tensor_type in _fields(value):  # type: ignore[arg-type]
                if tnum != 1:
                    continue
                for snum, shape_proto in _fields(tensor_type):  # type: ignore[arg-type]
                    if snum != 2:
                        continue
                    for dnum, dim in _fields(shape_proto):  # type: ignore[arg-type]
                        if dnum != 1:
                            continue
                        size: int | str = "?"
                        for knum, kval in _fields(dim):  # type: ignore[arg-type]
                            size = int(kval) if knum == 1 else _text(kval)  # type: ignore[arg-type]
                        shape.append(size)
    return {"name": name, "shape": shape}


def read_onnx(path: str | Path) -> OnnxSummary:
    """Read node names, op types, graph inputs/outputs and metadata from an ONNX file.

    Only the graph's structure is parsed (weights are skipped by length), so a ViT-B file reads in
    well under a second without the ``onnx`` package.
    """
    path = Path(path)
    try:
        data = memoryview(path.read_bytes())
    except OSError as err:
        raise EngineError(f"cannot read {str(path)!r}: {err.strerror or err}") from err
    nodes: list[OnnxNode] = []
    inputs: list[dict[str, Any]] = []
    outputs: list[str] = []
    initializers: set[str] = set()
    metadata: dict[str, str] = {}
    try:
        for number, value in _fields(data):
            if number == 14:  # ModelProto.metadata_props
                entry = dict(_fields(value))  # type: ignore[arg-type]
                metadata[_text(entry.get(1, b""))] = _text(entry.get(2, b""))
            elif number == 7:  # ModelProto.graph
                for gnum, gval in _fields(value):  # type: ignore[arg-type]
                    if gnum == 1:  # NodeProto
                        parts: dict[int, list[str]] = {1: [], 2: [], 3: [], 4: []}
                        for nnum, nval in _fields(gval):  # type: ignore[arg-type]
                            if nnum in parts:
                                parts[nnum].append(_text(nval))
                        nodes.append(
                            OnnxNode(
                                name=parts[3][0] if parts[3] else "",
                                op_type=parts[4][0] if parts[4] else "",
                                inputs=tuple(parts[1]),
                                outputs=tuple(parts[2]),
                            )
                        )
                    elif gnum == 5:  # TensorProto initializer: only its name (field 8)
                        for tnum, tval in _fields(gval):  # type: ignore[arg-type]
                            if tnum == 8:
                                initializers.add(_text(tval))
                    elif gnum == 11:
                        inputs.append(_value_info(gval))  # type: ignore[arg-type]
                    elif gnum == 12:
                        outputs.append(_value_info(gval)["name"])  # type: ignore[arg-type]
    except (ValueError, IndexError, UnicodeDecodeError) as err:
        raise EngineError(
            f"{str(path)!r} is not a readable ONNX file ({err}); re-export it with hydra-export"
        ) from err
    if not nodes:
        raise EngineError(f"{str(path)!r} holds no ONNX graph; re-export it with hydra-export")
    return OnnxSummary(
        nodes=tuple(nodes),
        inputs=tuple(i for i in inputs if i["name"] not in initializers),
        outputs=tuple(outputs),
        metadata=metadata,
    )


def fp32_layer_names(onnx: OnnxSummary) -> list[str]:
    """Layers a weakly typed reduced-precision build keeps in FP32, in graph order.

    Every LayerNormalization node, and the floating-point nodes of the ensemble head (everything
    computed from ``member_logits`` when the graph has uncertainty outputs). TensorRT's ONNX parser
    names the layer it creates for a node after the node, so these are the names
    ``--layerPrecisions`` and Polygraphy's ``SetLayerPrecisions`` match.
    """
    downstream = {MEMBER_LOGITS}
    names = []
    for node in onnx.nodes:  # ONNX nodes are stored in topological order
        in_head = any(i in downstream for i in node.inputs)
        if in_head:
            downstream.update(node.outputs)
        if node.op_type == "LayerNormalization" or (in_head and node.op_type in HEAD_FLOAT_OPS):
            if not node.name:
                raise EngineError(
                    f"a {node.op_type} node has no name, so no precision constraint can reach it; "
                    "re-export the model with hydra-export (it names every node)"
                )
            if "," in node.name or ":" in node.name:
                raise EngineError(
                    f"node name {node.name!r} contains ',' or ':', which trtexec's "
                    "--layerPrecisions cannot express; re-export the model with hydra-export"
                )
            names.append(node.name)
    return names


# --- export folders ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportSource:
    """An ONNX file and, when it sits in an export folder, that folder's ``hydra.json``."""

    onnx_path: Path
    folder: Path
    info: dict[str, Any] | None
    onnx: OnnxSummary

    @property
    def sha256(self) -> str:
        """The ONNX file's SHA-256 (from hydra.json when present, else computed)."""
        if self.info and self.info.get("onnx_sha256"):
            return str(self.info["onnx_sha256"])
        return file_sha256(self.onnx_path)

    @property
    def graph_precision(self) -> str:
        """fp32, or fp16/bf16 for a strongly typed graph that carries its own precision.

        From hydra.json, else the ONNX metadata (``hydra_precision``), else fp32.
        """
        if self.info is not None:
            precision = self.info.get("precision", "fp32")
        else:
            precision = self.onnx.metadata.get("hydra_precision", "fp32")
        if precision not in GRAPH_PRECISIONS:
            raise EngineError(
                f"hydra.json gives precision {precision!r}; expected one of {GRAPH_PRECISIONS}. "
                "Re-export the folder with hydra-export"
            )
        return precision

    @property
    def spec(self) -> dict[str, Any] | None:
        """The HydraSpec as a dict (hydra.json, else the ONNX metadata), or None."""
        if self.info and self.info.get("spec") is not None:
            return self.info["spec"]
        text = self.onnx.metadata.get("hydra_spec")
        return json.loads(text) if text else None

    def batch_profile(
        self, min_batch: int | None, opt_batch: int | None, max_batch: int | None
    ) -> tuple[int, int, int]:
        """(min, opt, max): the arguments given, else hydra.json's profile, else (1, 8, 32)."""
        where = self.folder / INFO_FILE
        saved = parse_batch_profile((self.info or {}).get("batch_profile"), where) or (1, 8, 32)
        saved = dict(zip(("min", "opt", "max"), saved, strict=True))
        lo = saved["min"] if min_batch is None else min_batch
        hi = saved["max"] if max_batch is None else max_batch
        opt = opt_batch if opt_batch is not None else min(max(saved["opt"], lo), hi)
        return check_batch_profile(lo, opt, hi)

    def input_shapes(self) -> list[tuple[str, list[int | str]]]:
        """(name, shape) of each model input; hydra.json's, else the ONNX file's."""
        if self.info and self.info.get("inputs"):
            inputs = self.info["inputs"]
            if not isinstance(inputs, list) or not all(
                isinstance(i, dict)
                and isinstance(i.get("name"), str)
                and isinstance(i.get("shape"), list)
                for i in inputs
            ):
                raise EngineError(
                    f"{str(self.folder / 'hydra.json')!r} has malformed inputs {inputs!r:.100} "
                    '(expected [{"name": ..., "shape": [...]}, ...]); re-export the folder with '
                    "hydra-export"
                )
            return [(i["name"], list(i["shape"])) for i in inputs]
        return [(i["name"], list(i["shape"])) for i in self.onnx.inputs]

    def sequence_profile(self) -> tuple[int, int, int]:
        """(min, opt, max) sequence length of a text model: 1, min(128, max), the tokenizer's
        maximum length (else the model's position embeddings)."""
        info = self.info or {}
        tokenizer, config = info.get("tokenizer"), info.get("backbone_config")
        longest = (tokenizer.get("max_length") if isinstance(tokenizer, dict) else None) or (
            config.get("max_position_embeddings") if isinstance(config, dict) else None
        )
        if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
            raise EngineError(
                f"{str(self.onnx_path)!r} has a dynamic sequence axis but its hydra.json records "
                "no maximum length (tokenizer.max_length); re-export it with hydra-export"
            )
        return 1, min(128, int(longest)), int(longest)

    def profile_shapes(self, batch: tuple[int, int, int]) -> dict[str, dict[str, list[int]]]:
        """{input: {"min": shape, "opt": shape, "max": shape}} with the batch axis filled in."""
        shapes: dict[str, dict[str, list[int]]] = {}
        for name, shape in self.input_shapes():
            if not shape or isinstance(shape[0], int):
                raise EngineError(
                    f"input {name!r} has shape {shape} without a dynamic batch axis first; "
                    "export with a dynamic batch (hydra-export does)"
                )
            rest = shape[1:]
            fixed = [d for d in rest if not (type(d) is int and d > 0)]  # not True, not 3.0
            if any(d != "sequence" for d in fixed):
                raise EngineError(
                    f"input {name!r} has shape {shape}: only the batch and a text model's sequence "
                    "axis may be dynamic for an engine profile; re-export with fixed sizes for the "
                    "other axes"
                )
            sequence = self.sequence_profile() if fixed else (0, 0, 0)
            shapes[name] = {
                k: [b, *(n if d == "sequence" else d for d in rest)]
                for k, b, n in zip(("min", "opt", "max"), batch, sequence, strict=True)
            }
        if not shapes:
            raise EngineError(f"{str(self.onnx_path)!r} has no inputs to build a profile for")
        return shapes


def check_batch_profile(min_batch: int, opt_batch: int, max_batch: int) -> tuple[int, int, int]:
    """Validate a (min, opt, max) batch profile; returns it as ints."""
    try:
        batch = tuple(int(b) for b in (min_batch, opt_batch, max_batch))
    except (TypeError, ValueError) as err:
        raise EngineError(f"batch sizes must be integers, got {err}") from err
    if not 1 <= batch[0] <= batch[1] <= batch[2]:
        raise EngineError(
            f"the batch profile must satisfy 1 <= min <= opt <= max, got min={batch[0]} "
            f"opt={batch[1]} max={batch[2]}; fix --min-batch/--opt-batch/--max-batch"
        )
    return batch  # type: ignore[return-value]


def load_source(path: str | Path) -> ExportSource:
    """An export folder, a ``hydra.json`` or a ``.onnx`` file -> :class:`ExportSource`.

    A ``.onnx`` file with a ``hydra.json`` beside it is read as that export; for a bare ``.onnx``
    file the spec and precision come from its metadata (hydra-export writes both), else FP32.
    """
    path = Path(path)
    if not path.exists():
        raise EngineError(
            f"{str(path)!r} does not exist; give an export folder made by hydra-export "
            "(model.onnx + hydra.json) or an .onnx file"
        )
    if path.is_dir():
        folder, onnx_path = path, path / MODEL_FILE
        read_info(folder)  # refuses a folder without hydra.json, as every consumer does
        if not onnx_path.is_file():
            raise EngineError(
                f"{str(path)!r} is not an export folder: {MODEL_FILE} is missing; make one with "
                "hydra-export --backbone NAME --out DIR"
            )
    elif path.name == INFO_FILE:
        folder, onnx_path = path.parent, path.parent / MODEL_FILE
    elif path.suffix == ".onnx":
        folder, onnx_path = path.parent, path
    else:
        raise EngineError(
            f"{str(path)!r} is neither an export folder nor an .onnx file; give the folder "
            "hydra-export wrote"
        )
    info = None
    if onnx_path.name == MODEL_FILE:  # an export folder's model: its hydra.json, checked
        export = read_info(folder / INFO_FILE, required=False)
        info = None if export is None else dict(export.record)
    if not onnx_path.is_file():
        raise EngineError(f"{str(onnx_path)!r} is missing; re-export the folder with hydra-export")
    onnx = read_onnx(onnx_path)
    if info is None and "member_logits" not in onnx.outputs:
        raise EngineError(
            f"{str(onnx_path)!r} is not a Hydra export: it has no member_logits output (outputs: "
            f"{list(onnx.outputs)}) and no hydra.json; build from a folder hydra-export wrote "
            "(other models: run trtexec on them directly)"
        )
    return ExportSource(onnx_path=onnx_path, folder=folder, info=info, onnx=onnx)


# --- precision rules ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrecisionChoice:
    """How an engine gets its precision on one TensorRT version (see :func:`choose_precision`)."""

    precision: str  # what the engine computes in: fp16, bf16 or fp32
    strongly_typed: bool
    builder_flags: tuple[str, ...]  # weak typing: "fp16" / "bf16" (trtexec --fp16 / --bf16)
    constrain_fp32: bool  # pin LayerNormalization and the ensemble head to FP32 (obey)
    notes: tuple[str, ...] = ()  # warnings for the user (fallbacks, deprecations)


def parse_version(version: str | Sequence[int]) -> tuple[int, int]:
    """``"10.13.0.35"`` or ``(10, 13)`` -> ``(10, 13)``."""
    if isinstance(version, str):
        parts = version.split(".")
        try:
            return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError as err:
            raise EngineError(f"cannot read TensorRT version {version!r}") from err
    return int(version[0]), int(version[1]) if len(version) > 1 else 0


def generation_of(version: str | Sequence[int]) -> str:
    """The trtexec generation (a key of :data:`GENERATIONS`) a TensorRT version belongs to."""
    major, minor = parse_version(version)
    if (major, minor) < (8, 6):
        raise EngineError(
            f"TensorRT {major}.{minor} is too old: the LayerNormalization op needs TensorRT 8.6 or "
            "newer; upgrade TensorRT (JetPack 6.0 ships 8.6.2, 6.1 and 6.2 ship 10.3)"
        )
    if major < 10:
        return "8.6" if major == 8 else "10"
    if major == 10:
        return "10.12" if minor >= 12 else "10"
    return "11"


def _bf16_problem(trt: tuple[int, int], sm: int | None) -> str | None:
    if trt < (10, 0):
        return f"BF16 needs TensorRT 10 or newer (this is TensorRT {trt[0]}.{trt[1]})"
    if sm is not None and sm < 80:
        return f"BF16 needs a GPU with compute capability 8.0 or newer (this one is {sm // 10}.{sm % 10})"
    return None


def choose_precision(
    requested: str | None,
    graph_precision: str,
    trt: str | Sequence[int],
    *,
    sm: int | None = None,
    strongly_typed: bool | None = None,
) -> PrecisionChoice:
    """Decide typing, builder flags and FP32 constraints for one build.

    Args:
        requested: fp16, bf16, fp32 or best (None: the graph's own precision if it carries one,
            else fp16). ``best`` is BF16 where the GPU (SM >= 80) and TensorRT (>= 10) support it,
            else FP16 with a note.
        graph_precision: the exported graph's precision (hydra.json ``precision``).
        trt: the TensorRT version (``"10.3"``, ``(10, 13)``) or a trtexec generation key.
        sm: the GPU's compute capability as ``10 * major + minor`` (None: unknown; the BF16 GPU
            check is then left to TensorRT).
        strongly_typed: force typing (None: strongly typed for graphs that carry their precision
            on TensorRT >= 10, and for every graph on TensorRT >= 10.12).

    Raises:
        EngineError: the combination cannot be built; the message says what to change.
    """
    trt = GENERATIONS[trt] if isinstance(trt, str) and trt in GENERATIONS else parse_version(trt)
    generation_of(trt)  # refuses TensorRT < 8.6
    version = f"{trt[0]}.{trt[1]}"
    if graph_precision not in GRAPH_PRECISIONS:
        raise EngineError(
            f"unknown graph precision {graph_precision!r}; expected {GRAPH_PRECISIONS}"
        )
    if requested is None:
        requested = graph_precision if graph_precision != "fp32" else "fp16"
    if requested not in PRECISIONS:
        raise EngineError(f"unknown precision {requested!r}; choose one of {', '.join(PRECISIONS)}")
    has_strong, weak_deprecated, weak_removed = trt >= (10, 0), trt >= (10, 12), trt >= (11, 0)
    if strongly_typed and not has_strong:
        raise EngineError(
            f"TensorRT {version} has no strongly typed networks (they came with TensorRT 10.0); "
            "build weakly typed (leave strongly_typed unset) or upgrade TensorRT"
        )
    if strongly_typed is False and weak_removed:
        raise EngineError(
            f"TensorRT {version} builds every network strongly typed; drop the weakly typed "
            "request (--weakly-typed / strongly_typed=False)"
        )
    notes: list[str] = []

    if graph_precision != "fp32":  # the graph carries its precision (Casts in the ONNX file)
        if requested == "best":
            requested = graph_precision
        if requested != graph_precision:
            raise EngineError(
                f"model.onnx was exported in {graph_precision} (its precision is in the graph); "
                f"build it with precision {graph_precision} (or best), or re-export with "
                f"hydra-export --from EXPORT_DIR --precision {requested} --out NEW_DIR"
            )
        problem = _bf16_problem(trt, sm) if graph_precision == "bf16" else None
        if problem:
            raise EngineError(
                f"{problem}; re-export in FP16: hydra-export --from EXPORT_DIR --precision fp16 "
                "--out NEW_DIR"
            )
        if has_strong and strongly_typed is not False:
            return PrecisionChoice(graph_precision, True, (), False, tuple(notes))
        if weak_deprecated:
            notes.append(f"weak typing is deprecated since TensorRT 10.12 (this is {version})")
        return PrecisionChoice(graph_precision, False, (graph_precision,), True, tuple(notes))

    if requested == "best":
        problem = _bf16_problem(trt, sm)
        if problem:
            notes.append(f"precision best: {problem}; building FP16 instead")
            requested = "fp16"
        else:
            requested = "bf16"
    if requested == "fp32":
        typed = strongly_typed if strongly_typed is not None else weak_deprecated
        return PrecisionChoice("fp32", typed, (), False, tuple(notes))
    if requested == "bf16":
        problem = _bf16_problem(trt, sm)
        if problem:
            raise EngineError(f"{problem}; use precision fp16 (or best, which falls back to FP16)")
    reexport = (
        f"export a graph that carries its precision instead: hydra-export --from EXPORT_DIR "
        f"--precision {requested} --out NEW_DIR"
    )
    if strongly_typed:
        raise EngineError(
            f"a strongly typed build of an FP32 graph computes in FP32, not {requested}; {reexport}"
        )
    if weak_removed:
        raise EngineError(
            f"TensorRT {version} removed weak typing (--fp16/--bf16), so an FP32 graph cannot be "
            f"built in {requested}; {reexport}"
        )
    if weak_deprecated:
        if strongly_typed is None:
            raise EngineError(
                f"TensorRT {version} deprecated weak typing (--fp16/--bf16 on an FP32 graph); "
                f"{reexport} (or ask for the deprecated path with --weakly-typed / "
                "strongly_typed=False)"
            )
        notes.append(f"weak typing is deprecated since TensorRT 10.12 (this is {version})")
    return PrecisionChoice(requested, False, (requested,), True, tuple(notes))


# --- file names ---------------------------------------------------------------------------------------
def engine_stem(sha256: str, precision: str, trt_tag: str, gpu_tag: str | None = None) -> str:
    """``model.<sha12>.<precision>[.<gpu>].trt<version>``: an engine fits one model, GPU and TRT."""
    parts = ["model", sha256[:12], precision]
    if gpu_tag:
        parts.append(gpu_tag)
    parts.append(f"trt{trt_tag}")
    return ".".join(parts)


def timing_cache_name(trt_tag: str, gpu_tag: str | None = None) -> str:
    """``timing[.<gpu>].trt<version>.cache``: timing caches are shared by models, not by GPUs."""
    return ".".join(["timing", *([gpu_tag] if gpu_tag else []), f"trt{trt_tag}", "cache"])


# --- the command ----------------------------------------------------------------------------------------
def _unnamed_on_trt86(onnx: OnnxSummary, names: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """TensorRT 8.6's ONNX parser leaves LayerNormalization layers unnamed: drop their names.

    onnx-tensorrt 8.6-GA's LayerNormalization importer returns without ``registerLayer`` (10.0
    registers it), so ``--layerPrecisions=LayerNormalization_0:fp32`` would match no layer and
    pin nothing, silently. What 8.6 does instead (NvInfer.h, ``INormalizationLayer::
    setComputePrecision``): the normalization is computed in FP32 whatever the builder flags, its
    inputs and outputs may still be FP16.
    """
    layernorms = {n.name for n in onnx.nodes if n.op_type == "LayerNormalization"}
    kept = [n for n in names if n not in layernorms]
    if len(kept) == len(names):
        return names, ()
    note = (
        f"TensorRT 8.6 cannot pin the {len(names) - len(kept)} LayerNormalization layers to FP32 "
        "from the command line (its ONNX parser leaves them unnamed, so --layerPrecisions matches "
        "none): TensorRT computes them in FP32 but may give them FP16 inputs and outputs; "
        "hydra-build pins them by layer type, or build with TensorRT 10"
    )
    return kept, (note,)


@dataclass(frozen=True)
class TrtexecCommand:
    """One trtexec invocation: ``argv`` (program first) and ``str(cmd)``, shell-quoted."""

    argv: tuple[str, ...]
    trt: str
    precision: str
    strongly_typed: bool
    engine: Path
    timing_cache: Path
    layer_info: Path | None
    notes: tuple[str, ...] = field(default=())

    @property
    def shell(self) -> str:
        """The command line as one shell-quoted string."""
        return shlex.join(self.argv)

    def __str__(self) -> str:
        return self.shell


def _shape_arg(shapes: dict[str, dict[str, list[int]]], key: str) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in s[key])}" for name, s in shapes.items())


def trtexec_command(
    export_dir_or_info: str | Path | ExportSource,
    *,
    precision: str | None = None,
    trt: str = "10.12",
    engine: str | Path | None = None,
    timing_cache: str | Path | None = None,
    layer_info: bool = True,
    min_batch: int | None = None,
    opt_batch: int | None = None,
    max_batch: int | None = None,
    out: str | Path | None = None,
    gpu: str | None = None,
    sm: int | None = None,
    strongly_typed: bool | None = None,
    extra: Sequence[str] = (),
) -> TrtexecCommand:
    """The exact trtexec command that builds an engine from an export folder.

    Args:
        export_dir_or_info: an export folder (or its model.onnx / hydra.json), or an
            :class:`ExportSource` from :func:`load_source`.
        precision: fp16, bf16, fp32 or best (None: the graph's own precision, else fp16). Without
            ``sm`` the GPU is unknown, so ``best`` means FP16 here.
        trt: the TensorRT generation the command is for: ``"8.6"`` (e.g. JetPack 6.0's 8.6.2),
            ``"10"`` (10.0-10.11, e.g. JetPack 6.1/6.2's 10.3), ``"10.12"`` or ``"11"``.
        engine, timing_cache: paths to write (default: in ``out``, named by model hash, precision,
            optional ``gpu`` tag and generation; see :func:`engine_stem`).
        layer_info: add ``--profilingVerbosity=detailed --dumpLayerInfo --exportLayerInfo=FILE`` so
            the layer list shows whether attention fused into one kernel.
        min_batch, opt_batch, max_batch: the batch profile (default: hydra.json's).
        out: folder for the engine, timing cache and layer info (default: the export folder).
        gpu: a tag such as ``orin-sm87`` put into the file names (the GPU is not known here).
        sm: the target GPU's compute capability (``10 * major + minor``) for the BF16 check.
        strongly_typed: force typing (see :func:`choose_precision`).
        extra: more trtexec arguments, appended as given (e.g. ``--useCudaGraph``, which only
            affects trtexec's own timing runs, and is a deprecated no-op on TensorRT 11, where
            CUDA graphs are the default).

    Raises:
        EngineError: unknown generation, a precision that generation cannot build, bad profile.
    """
    if trt not in GENERATIONS:
        raise EngineError(
            f"unknown TensorRT generation {trt!r}; choose one of {', '.join(GENERATIONS)}"
        )
    source = (
        export_dir_or_info
        if isinstance(export_dir_or_info, ExportSource)
        else load_source(export_dir_or_info)
    )
    best_note: tuple[str, ...] = ()
    if precision == "best" and sm is None and source.graph_precision == "fp32":
        precision = "fp16"  # BF16 needs SM >= 80, which only the target GPU can tell
        best_note = (
            "precision best: the target GPU is unknown here, so FP16 (ask for bf16 "
            "where the GPU has compute capability 8.0 or newer)",
        )
    choice = choose_precision(
        precision, source.graph_precision, trt, sm=sm, strongly_typed=strongly_typed
    )
    batch = source.batch_profile(min_batch, opt_batch, max_batch)
    shapes = source.profile_shapes(batch)
    folder = Path(out) if out is not None else source.folder
    stem = engine_stem(source.sha256, choice.precision, trt, gpu)
    engine_path = Path(engine) if engine is not None else folder / f"{stem}.engine"
    cache_path = (
        Path(timing_cache) if timing_cache is not None else folder / timing_cache_name(trt, gpu)
    )
    layers_path = engine_path.with_name(engine_path.name.removesuffix(".engine") + ".layers.json")

    argv = ["trtexec", f"--onnx={source.onnx_path}"]
    argv += [f"--{k}Shapes={_shape_arg(shapes, k)}" for k in ("min", "opt", "max")]
    if choice.strongly_typed:
        argv.append("--stronglyTyped")
    argv += [f"--{flag}" for flag in choice.builder_flags]
    notes: tuple[str, ...] = ()
    if choice.constrain_fp32:
        names = fp32_layer_names(source.onnx)
        if trt == "8.6":
            names, notes = _unnamed_on_trt86(source.onnx, names)
        if names:
            argv += [
                "--precisionConstraints=obey",
                "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in names),
            ]
    if choice.precision == "fp32":
        # trtexec enables TF32 unless --noTF32 (sampleOptions.cpp, strongly typed too); the Python
        # build (Polygraphy CreateConfig, tf32=False) does not: an FP32 engine means FP32
        argv.append("--noTF32")
    argv += [f"--saveEngine={engine_path}", f"--timingCacheFile={cache_path}"]
    if layer_info:
        argv += [
            "--profilingVerbosity=detailed",
            "--dumpLayerInfo",
            f"--exportLayerInfo={layers_path}",
        ]
    argv += list(extra)
    if trt == "11" and "--useCudaGraph" in extra:
        notes += (
            "--useCudaGraph is a deprecated no-op on TensorRT 11: trtexec uses CUDA graphs "
            "by default there (--noCudaGraph turns them off)",
        )
    return TrtexecCommand(
        argv=tuple(argv),
        trt=trt,
        precision=choice.precision,
        strongly_typed=choice.strongly_typed,
        engine=engine_path,
        timing_cache=cache_path,
        layer_info=layers_path if layer_info else None,
        notes=best_note + choice.notes + notes,
    )
