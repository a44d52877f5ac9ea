"""What the engine code reads of ``model.onnx``: a minimal ONNX reader (protobuf wire format, standard
library only, so a Jetson without the onnx package can build), the layers a weakly typed
reduced-precision build keeps in FP32, and whether the graph is quantized in a form TensorRT takes
(:func:`explicit_quantization`: QuantizeLinear/DequantizeLinear pairs, decided from the operators).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_deploy.errors import EngineError

# Ops of the ensemble head (and of hydra-calibrate --in-graph's decisions: log-softmax parts, sums
# of probabilities, the tail-mass MatMul and the comparisons with thresholds) that compute in
# floating point or compare floats; with weak typing they are pinned to FP32 like
# LayerNormalization (shape-only ops, the head's TopK and Casts are left to TensorRT). CumSum,
# LessOrEqual and GreaterOrEqual: decision graphs written before issue 34 (named layers of them
# are pinned; TensorRT's parser leaves their inner layers unnamed).
HEAD_FLOAT_OPS = frozenset(
    {
        "CumSum",
        "LessOrEqual",
        "GreaterOrEqual",
        "Less",
        "Greater",
        "MatMul",
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
#: hydra-calibrate --in-graph names every decision node so (decision_graph.PREFIX; not imported:
#: this module reads ONNX files without the onnx package)
DECISION_PREFIX = "decisions/"
#: ... and these of its ops also carry floats into a comparison (the sorted probabilities and the
#: class rooms), so they are pinned too; its Equal, Gather, And, Or and Not compute on integers
#: and booleans only and are left to TensorRT
DECISION_FLOAT_OPS = HEAD_FLOAT_OPS | {"TopK", "ScatterElements"}

#: An explicitly quantized graph: TensorRT's explicit quantization builds INT8 kernels from these
#: pairs (onnx-tensorrt docs/operators.md, 8.6-GA lines 50 and 127, 10.0-GA lines 58 and 138).
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
#: ONNX Runtime's integer operators (``quantize_dynamic``; ``quantize_static`` in the QOperator
#: format; every ``QLinear*``), which TensorRT's ONNX parser cannot import: onnx-tensorrt
#: docs/operators.md marks ConvInteger, DynamicQuantizeLinear, MatMulInteger, QLinearConv and
#: QLinearMatMul "N" (8.6-GA lines 43, 54, 99, 125, 126; 10.0-GA lines 51, 62, 109, 136, 137); the
#: others are com.microsoft operators, outside ONNX, for which it has no importer at all.
INTEGER_OPS = frozenset(
    {
        "ConvInteger",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QGemm",
        "QAttention",
        "QEmbedLayerNormalization",
        "DynamicQuantizeLSTM",
    }
)
#: ONNX TensorProto.DataType codes of the zero points TensorRT sees (onnx.proto).
ONNX_UINT8, ONNX_INT8 = 2, 3


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
    # the zero points of QuantizeLinear/DequantizeLinear nodes that are initializers:
    # {name: (ONNX data type, all zeros? None when the values are in an external file)}
    zero_points: dict[str, tuple[int, bool | None]] = field(default_factory=dict)


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


def _zero_point(buf: memoryview) -> tuple[int, bool | None]:
    """A TensorProto -> (data type, whether every value is zero; None for external data)."""
    data_type, zeros, external = 0, True, False
    for number, value in _fields(buf):
        if number == 2:  # data_type
            data_type = int(value)  # type: ignore[arg-type]
        elif number in (5, 9):  # int32_data (packed or one varint) / raw_data: zero bytes only
            zeros = zeros and (value == 0 if isinstance(value, int) else not any(bytes(value)))
        elif number == 14 and value == 1:  # data_location: EXTERNAL
            external = True
    return data_type, None if external else zeros


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
    initializers: dict[str, memoryview] = {}  # name -> the TensorProto, not copied
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
                    elif gnum == 5:  # TensorProto initializer: its name (field 8), kept unread
                        for tnum, tval in _fields(gval):  # type: ignore[arg-type]
                            if tnum == 8:
                                initializers[_text(tval)] = gval  # type: ignore[assignment]
                    elif gnum == 11:
                        inputs.append(_value_info(gval))  # type: ignore[arg-type]
                    elif gnum == 12:
                        outputs.append(_value_info(gval)["name"])  # type: ignore[arg-type]
        zero_points = {
            node.inputs[2]: _zero_point(initializers[node.inputs[2]])
            for node in nodes
            if node.op_type in QDQ_OPS and len(node.inputs) > 2 and node.inputs[2] in initializers
        }
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
        zero_points=zero_points,
    )


def fp32_layer_names(onnx: OnnxSummary) -> list[str]:
    """Layers a weakly typed reduced-precision build keeps in FP32, in graph order.

    Every LayerNormalization node, the floating-point nodes of the ensemble head (everything
    computed from ``member_logits`` when the graph has uncertainty outputs), and every decision
    node of ``hydra-calibrate --in-graph`` (named ``decisions/...``) that computes in floating
    point or hands floats to a comparison (:data:`DECISION_FLOAT_OPS`). TensorRT's ONNX parser
    names the layer it creates for a node after the node, so these are the names
    ``--layerPrecisions`` and Polygraphy's ``SetLayerPrecisions`` match (each decision node is one
    such layer: :mod:`hydra_deploy.export.decision_graph`).
    """
    downstream = {MEMBER_LOGITS}
    names = []
    for node in onnx.nodes:  # ONNX nodes are stored in topological order
        in_head = any(i in downstream for i in node.inputs)
        if in_head:
            downstream.update(node.outputs)
        float_ops = DECISION_FLOAT_OPS if node.name.startswith(DECISION_PREFIX) else HEAD_FLOAT_OPS
        if node.op_type == "LayerNormalization" or (in_head and node.op_type in float_ops):
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


_STATIC = "hydra-export --from EXPORT_DIR --precision int8 --int8-method static --int8-calib DATA --out NEW_DIR"


def explicit_quantization(onnx: OnnxSummary, path: str | Path) -> bool:
    """Whether ``model.onnx`` is explicitly quantized: QuantizeLinear/DequantizeLinear pairs, which
    TensorRT turns into INT8 kernels with the graph's own scales (no calibration in TensorRT).

    Decided from the graph's operators alone, as the standard-library scripts in ``engines/``
    decide it, so hydra.json's word is not needed (a bare ``.onnx`` file is read the same way).

    Raises:
        EngineError: the graph holds ONNX Runtime's integer operators (``--int8-method dynamic``),
            which TensorRT cannot import; or a Q/DQ zero point TensorRT refuses: onnx-tensorrt
            takes only signed INT8 with all-zero zero points (8.6-GA builtin_op_importers.cpp
            lines 1160-1166 refuse UINT8 as a DequantizeLinear input and a QuantizeLinear zero
            point, 1216-1221 non-zero values; 10.1-GA onnxOpImporters.cpp lines 1348-1354 and
            1491-1494 the same).
    """
    found = sorted(
        {
            n.op_type
            for n in onnx.nodes
            if n.op_type in INTEGER_OPS or n.op_type.startswith("QLinear")
        }
    )
    if found:
        raise EngineError(
            f"{str(path)!r} is quantized with ONNX Runtime's integer operators ({', '.join(found)}; "
            "hydra-export --int8-method dynamic), which TensorRT's ONNX parser cannot import; "
            "re-export with --int8-method static, whose QuantizeLinear/DequantizeLinear pairs "
            f"TensorRT builds in INT8: {_STATIC}"
        )
    qdq = [n for n in onnx.nodes if n.op_type in QDQ_OPS]
    refused = []
    for node in qdq:
        if len(node.inputs) < 3 and node.op_type == "QuantizeLinear":
            refused.append(
                f"{node.name or node.op_type}: no zero point, so ONNX quantizes to uint8"
            )
            continue
        # a zero point made by a Constant node is left to TensorRT's parser (it reads those too)
        zero_point = node.inputs[2] if len(node.inputs) > 2 else ""
        data_type, zeros = onnx.zero_points.get(zero_point, (ONNX_INT8, True))
        if data_type == ONNX_UINT8:
            refused.append(f"{node.name or node.op_type}: a uint8 zero point")
        elif data_type != ONNX_INT8:
            refused.append(f"{node.name or node.op_type}: a zero point of ONNX type {data_type}")
        elif zeros is False:
            refused.append(f"{node.name or node.op_type}: a zero point that is not 0")
    if refused:
        raise EngineError(
            f"{str(path)!r} quantizes in a form TensorRT refuses ({len(refused)} "
            f"QuantizeLinear/DequantizeLinear nodes, e.g. {refused[0]}): TensorRT takes only "
            "symmetric signed INT8 (int8 zero points, all 0); re-export with symmetric int8 "
            f"activations and weights: {_STATIC}"
        )
    return bool(qdq)
