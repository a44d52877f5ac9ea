"""What TensorRT's ONNX parser does with every operator and attribute hydra-deploy's exports use.

:data:`SUPPORT` is the table of docs/tensorrt.md ("ONNX operators per TensorRT release"): each
operator the exports write (tiny ViT, BERT and OpenCLIP at FP32, FP16, BF16, static and dynamic
INT8, opset 17) and the decisions of ``hydra-calibrate --in-graph``
(:data:`hydra_deploy.export.decision_graph.DECISION_OPS`), with the attributes and input forms
the exports give it, read against onnx-tensorrt's importers:

- ``8.6``: branch 8.6-GA, ``builtin_op_importers.cpp`` and ``onnx2trt_utils.cpp`` (the same
  importers through 9.3 where a note says so);
- ``10``: branch 10.1-GA, ``onnxOpImporters.cpp`` and ``importerUtils.cpp`` (10.0-GA and main of
  May 2024, 10.0.1, read the same);
- ``newest``: the newest ``onnxOpImporters.cpp`` read (commit 0137504e, whose changelog's top entry
  is 10.6 GA); rows not re-read there are marked "as 10".

:func:`parser_problems` lists, for a model and a TensorRT version, every node that version's
parser refuses or reads differently from ONNX Runtime (the rules of the table's notes); the
stand-in parser of the tests refuses a graph for which it finds any.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra_deploy.engines.precision_rules import parse_version
from hydra_deploy.errors import EngineError, counted
from hydra_deploy.optional import lazy_module

onnx = lazy_module("onnx", purpose="checking an ONNX file against TensorRT", error=EngineError)
numpy_helper = lazy_module("onnx.numpy_helper", purpose="reading ONNX weights", error=EngineError)

#: the table's release columns
RELEASES = ("8.6", "10", "newest")
#: TensorRT's TopK layer takes K <= 3840 (onnx-tensorrt docs/operators.md 10.1-GA line 207)
TOPK_MAX_K = 3840


@dataclass(frozen=True)
class Support:
    """One row of the table: per release "yes", "restricted" (a form the exports avoid is
    refused or mis-read) or "no"; ``note`` says what, and where it was read."""

    op: str
    used: str  # the attributes and input forms the exports give it
    trt86: str
    trt10: str
    newest: str
    note: str


_Y, _R, _N = "yes", "restricted", "no"
_E = "elementwise helper, FP32/FP16 (BF16 from 9.0)"
SUPPORT: tuple[Support, ...] = (
    Support("Add, Sub, Mul, Div", "none", _Y, _Y, _Y, f"{_E}; 8.6 l.154/4798/3057/1321, 10 l.177"),
    Support("Max", "none (decisions: FP32)", _Y, _Y, _Y, f"{_E}; 8.6 l.2947, 10 l.3460"),
    Support("Neg, Exp, Log, Sqrt, Erf, Tanh", "none", _Y, _Y, _Y, f"unary; {_E}; 8.6 l.3117-4813"),
    Support("And, Or, Not", "none (decisions: BOOL)", _Y, _Y, _Y, "BOOL; 8.6 l.129/3244/3207"),
    Support(
        "Equal, GreaterOrEqual, LessOrEqual",
        "INT64 mask / class ids (8.6: cast to INT32), FP32",
        _Y,
        _Y,
        _Y,
        "8.6 l.1424/1713/2317, 10 l.1796/2142/2817; Greater/LessOrEqual become three layers "
        "(Less/Greater, Equal, Or: greaterLessOrEqual, onnx2trt_utils.cpp 8.6 l.1186, 10 "
        "importerUtils.cpp l.866), two of them not named after the node, so the decisions use "
        "Greater and Less",
    ),
    Support(
        "Greater, Less",
        "FP32 score and a same-rank FP32 constant (decisions)",
        _Y,
        _Y,
        _Y,
        "one ElementWise layer named after the node (elementwiseHelper); 8.6 l.1708/2312, "
        "10 l.2137/2812",
    ),
    Support(
        "ReduceMax",
        "axes an attribute below opset 18, an INT64 initializer from 18 (decisions)",
        _R,
        _Y,
        _Y,
        "8.6 l.3681 reads only the axes attribute (an opset-18 axes input is ignored: every "
        "axis reduced); 10 l.4335 takes the attribute or an initializer (reduceTensor)",
    ),
    Support(
        "Cast",
        "to=1 (FLOAT), 10 (FLOAT16), 16 (BFLOAT16)",
        _R,
        _Y,
        _Y,
        "8.6 l.285: convertDtype (onnx2trt_utils.cpp l.346) has no BFLOAT16: a BF16 export "
        "(to=16, bf16 weights) is refused; BF16 from 9.0",
    ),
    Support(
        "Clip",
        "min (and max) as initializers",
        _Y,
        _Y,
        _Y,
        "8.6 l.462: min/max initializers -> activation; tensors -> elementwise",
    ),
    Support("Concat", "axis 0/1 (INT64 shapes, float)", _Y, _Y, _Y, "8.6 l.539, 10 l.649"),
    Support(
        "Conv",
        "2-D, group 1, kernel = stride 4 or 8, pads 0, weight and bias initializers",
        _Y,
        _Y,
        _Y,
        "patch embedding; 8.6 l.632, 10 l.737",
    ),
    Support(
        "CumSum",
        "axis an INT64 initializer; no exclusive/reverse (decisions)",
        _Y,
        _Y,
        _Y,
        "axis must be an initializer (assertIsWeights): 8.6 l.1022, 10 l.1136",
    ),
    Support(
        "DequantizeLinear",
        "INT8 input, FP32 scale, INT8 zero point 0, axis=1 per channel (static INT8)",
        _R,
        _R,
        _R,
        "QuantDequantLinearHelper (8.6 l.1157, 10 l.1346): input INT8 only (UINT8 refused; 10: "
        "also FP8, INT4; docs/operators.md 8.6 l.50, 10.1 l.61), zero point all 0. An INT32 input "
        "(ORT's quantized Gemm bias) is refused: static INT8 keeps Gemm biases float",
    ),
    Support(
        "QuantizeLinear",
        "FP32 input, FP32 scale, INT8 zero point 0 (static INT8)",
        _R,
        _R,
        _R,
        "8.6 l.1165: a UINT8 zero point is refused; 10 l.1459: taken as INT8 with a warning "
        "(mis-read); non-zero zero points refused (shiftIsAllZeros) on both",
    ),
    Support(
        "DynamicQuantizeLinear, MatMulInteger",
        "dynamic INT8 (ONNX Runtime's integer operators)",
        _N,
        _N,
        _N,
        "no importer (docs/operators.md 8.6 l.54/99, 10.1 l.65/112: N): dynamic INT8 is a CPU "
        "format, hydra-build refuses it",
    ),
    Support(
        "Expand",
        "shape: a 1-D INT64 tensor (Shape -> Concat) or initializer",
        _Y,
        _Y,
        _Y,
        "shape must be 1-D; 8.6 l.1439-1448, 10 l.1811",
    ),
    Support(
        "Gather",
        "axis 0/1/2, INT64 indices (initializer, or TopK's indices in the decisions)",
        _Y,
        _Y,
        _Y,
        "8.6 l.1549 (negative indices native since 8.2), 10 l.1924",
    ),
    Support(
        "Gemm",
        "not written by ViT/BERT/OpenCLIP exports; quantized by static INT8 if present",
        _Y,
        _Y,
        _Y,
        "8.6 l.1598, 10 l.2009; see DequantizeLinear for its bias under INT8",
    ),
    Support(
        "LayerNormalization",
        "axis=-1, epsilon, stash_type=1, one output (Y)",
        _R,
        _Y,
        _Y,
        "8.6 l.2270: no registerLayer (an unnamed layer, no --layerPrecisions by name); only Y "
        "is produced (docs 10.1 l.100: 'Only the first output Y is supported'); 8.5 has none",
    ),
    Support("LogSoftmax, Softmax", "axis=-1", _Y, _Y, _Y, "8.6 l.2328/4567, 10 l.2829/5404"),
    Support("MatMul", "FP32/FP16/BF16 operands", _Y, _Y, _Y, "8.6 l.2894, 10 l.3407"),
    Support(
        "Range",
        "INT64 start/delta initializers, limit a runtime scalar (BERT positions)",
        _Y,
        _Y,
        _Y,
        "8.6 l.3574 (INT64 cast to INT32), 10 l.4180",
    ),
    Support(
        "ReduceSum",
        "axes an INT64 initializer, keepdims 0/1, noop_with_empty_axes=0",
        _R,
        _Y,
        _Y,
        "axes must be an initializer (reduceTensor: 8.6 onnx2trt_utils.cpp l.1613, 10 "
        "importerUtils.cpp l.1474); 8.6 ignores noop_with_empty_axes (10 reads it, l.1453)",
    ),
    Support(
        "Reshape",
        "shape tensor or initializer, allowzero 0 and 1",
        _Y,
        _Y,
        _Y,
        "allowzero read from opset 5 on: 8.6 l.3909-3952, 10 l.4647",
    ),
    Support(
        "ScatterElements",
        "axis=1, no reduction (decisions: APS/RAPS scores back in class order)",
        _R,
        _Y,
        _Y,
        "8.6 l.4406: 'reduction' ignored (mis-read when not 'none'); read from 10.0 EA "
        "(10 l.5195, newest the same)",
    ),
    Support(
        "Shape",
        "start/end: the dynamo exporter's start=0 end=1 (batch), start=1 end=2 (BERT length)",
        _R,
        _Y,
        _Y,
        "8.6 l.4434 (9.3 l.4839 the same): addShape(input) only, start/end ignored (the whole "
        "shape: mis-read); 10 l.5224 and newest read them. The exports write a plain Shape and "
        "a Slice (surgery.plain_shapes)",
    ),
    Support(
        "Slice",
        "starts/ends (and axes) INT64 initializers, 3 or 4 inputs",
        _R,
        _R,
        _Y,
        "axes must be known: 8.6 l.4493, 10 l.5322 ('does not support dynamic axes'); newest "
        "takes tensor axes (changelog 10.3)",
    ),
    Support(
        "Squeeze",
        "axes an INT64 initializer; BERT: no axes on a static [1] tensor",
        _R,
        _R,
        _R,
        "axes must be an initializer (8.6 l.4749, 10 l.5619); without axes the input shape must "
        "be static (8.6 l.4773, 10 l.5648)",
    ),
    Support(
        "TopK",
        "K an INT64 initializer (1; decisions: C classes), axis=-1, largest=1, sorted=1",
        _R,
        _R,
        _R,
        "K <= 3840 (TensorRT's TopK layer; docs/operators.md 10.1 l.207); 8.6 l.4848 and 10 "
        "l.5724 read no 'sorted' (the layer sorts); K as a tensor from 8.6",
    ),
    Support(
        "Transpose",
        "perm (0,2,1), (0,2,1,3), (1,0,2), (2,0,3,1,4)",
        _Y,
        _Y,
        _Y,
        "8.6 l.4923, 10 l.5790",
    ),
    Support(
        "Unsqueeze",
        "axes an INT64 initializer",
        _Y,
        _Y,
        _Y,
        "axes must be constant: 8.6 l.5010, 10 l.5874",
    ),
    Support(
        "Where",
        "BOOL condition, FP32/FP16 branches (BERT attention mask)",
        _Y,
        _Y,
        _Y,
        "8.6 l.5134, 10 l.6028",
    ),
)

#: every operator the table covers
COVERED_OPS = frozenset(op.strip() for row in SUPPORT for op in row.op.split(","))

#: operators no TensorRT release imports (ONNX Runtime's integer and contrib operators)
NO_IMPORTER = frozenset(
    {
        "ConvInteger",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "QLinearConv",
        "QLinearMatMul",
    }
)
_ONNX_DOMAINS = ("", "ai.onnx")
_BFLOAT16, _INT8, _UINT8, _INT4, _FP8 = 16, 3, 2, 22, (17, 18, 19, 20)


@dataclass(frozen=True)
class _Graph:
    """What the rules read of a graph: each tensor's ONNX type and shape (inferred where onnx can;
    None for a dynamic dimension), and its weights (initializers and Constant nodes)."""

    types: dict[str, int]
    shapes: dict[str, list]
    weights: dict[str, Any]

    def values(self, name: str) -> Any:
        """A weight's values (numpy), None for a computed tensor."""
        return numpy_helper.to_array(self.weights[name]) if name in self.weights else None


def _read_graph(model: Any) -> _Graph:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a graph onnx cannot infer: the types the file states
        inferred = model
    graph = inferred.graph
    types: dict[str, int] = {}
    shapes: dict[str, list] = {}
    for value in (*graph.input, *graph.output, *graph.value_info):
        tensor_type = value.type.tensor_type
        types[value.name] = tensor_type.elem_type
        if tensor_type.HasField("shape"):
            shapes[value.name] = [
                d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim
            ]
    weights = {t.name: t for t in graph.initializer}
    for node in graph.node:  # onnx-tensorrt imports Constant nodes as weights
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    weights[node.output[0]] = attribute.t
    types.update((name, t.data_type) for name, t in weights.items())
    shapes.update((name, list(t.dims)) for name, t in weights.items())
    return _Graph(types, shapes, weights)


def parser_problems(model: Any, version: str | Sequence[int]) -> list[str]:
    """What TensorRT ``version``'s ONNX parser refuses or reads otherwise than ONNX Runtime in
    ``model`` (an ``onnx.ModelProto`` or the path of an ``.onnx`` file), one line per node:
    "<node>: <op> ... (refused|mis-read on TensorRT x.y)". Empty when the table finds nothing.
    """
    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(str(model), load_external_data=False)
    release = parse_version(version)
    graph = _read_graph(model)
    where = f"TensorRT {release[0]}.{release[1]}"
    found: list[str] = []
    if release < (10, 0):
        bf16 = sorted(name for name, kind in graph.types.items() if kind == _BFLOAT16)
        if bf16:
            found.append(
                f"{counted(len(bf16), 'BFLOAT16 tensor')}, e.g. {bf16[0]!r}: TensorRT before 9.0 "
                "has no "
                f"BF16 (refused on {where})"
            )
    for node in model.graph.node:
        for what, refused in _node_problems(node, graph, release):
            how = "refused" if refused else "mis-read"
            found.append(f"{node.name or node.op_type}: {node.op_type} {what} ({how} on {where})")
    return found


def _node_problems(node: Any, graph: _Graph, release: tuple[int, int]) -> list[tuple[str, bool]]:
    """(what, refused: else mis-read) for each rule of the table one node breaks."""
    if node.domain not in _ONNX_DOMAINS:
        return [(f"of domain {node.domain!r}: no importer", True)]
    return _operator_problems(node, graph, release) + _attribute_problems(node, release)


def _operator_problems(
    node: Any, graph: _Graph, release: tuple[int, int]
) -> list[tuple[str, bool]]:
    """The operator's own rules: importers, Q/DQ types and zero points, weights-only inputs."""
    old = release < (10, 0)
    op, inputs = node.op_type, list(node.input)
    attrs = {a.name: a for a in node.attribute}
    found: list[tuple[str, bool]] = []
    if op in NO_IMPORTER:
        found.append(("has no importer (an ONNX Runtime integer operator)", True))
    elif op == "Shape" and old and ("end" in attrs or ("start" in attrs and attrs["start"].i)):
        found.append(("with start/end: the parser ignores them and takes the whole shape", False))
    elif op == "Cast" and old and "to" in attrs and attrs["to"].i == _BFLOAT16:
        found.append(("to BFLOAT16", True))
    elif op in ("QuantizeLinear", "DequantizeLinear"):
        found += _quantize_problems(op, inputs, graph, old)
    elif op == "TopK" and len(inputs) > 1:
        k = graph.values(inputs[1])
        if k is not None and int(k.ravel()[0]) > TOPK_MAX_K:
            found.append((f"with K {int(k.ravel()[0])} > {TOPK_MAX_K}", True))
    elif op == "Squeeze":
        if len(inputs) > 1 and inputs[1] and inputs[1] not in graph.weights:
            found.append(("with axes that are not an initializer", True))
        elif len(inputs) < 2 or not inputs[1]:
            shape = graph.shapes.get(inputs[0])
            if shape is None or None in shape:
                found.append(("without axes on a tensor of dynamic shape", True))
    elif op in ("Unsqueeze", "ReduceSum", "CumSum") and len(inputs) > 1 and inputs[1]:
        if inputs[1] not in graph.weights:
            found.append(("with axes that are not an initializer", True))
    elif op == "Slice" and len(inputs) > 3 and inputs[3] and inputs[3] not in graph.weights:
        if release < (10, 3):
            found.append(("with axes that are not an initializer", True))
    elif op == "LayerNormalization" and len([o for o in node.output if o]) > 1:
        found.append(("with Mean/InvStdDev outputs (only Y is produced)", True))
    return found


def _quantize_problems(
    op: str, inputs: list[str], graph: _Graph, old: bool
) -> list[tuple[str, bool]]:
    """A Q/DQ node's: the type it dequantizes, its zero point (TensorRT is symmetric)."""
    found: list[tuple[str, bool]] = []
    kind = graph.types.get(inputs[0])
    allowed = {_INT8} if old else {_INT8, _INT4, *_FP8}
    if op == "DequantizeLinear" and kind is not None and kind not in allowed:
        found.append(
            (
                f"over a tensor of ONNX type {kind} (TensorRT dequantizes INT8"
                + ("" if old else ", FP8, INT4")
                + " only)",
                True,
            )
        )
    zero = inputs[2] if len(inputs) > 2 and inputs[2] else None
    if zero is not None:
        point = graph.values(zero)
        if graph.types.get(zero) == _UINT8:
            found.append(("with a UINT8 zero point" + ("" if old else ": taken as INT8"), old))
        elif point is not None and point.any():
            found.append(("with a non-zero zero point (TensorRT quantizes symmetrically)", True))
    return found


def _attribute_problems(node: Any, release: tuple[int, int]) -> list[tuple[str, bool]]:
    """Attributes TensorRT before 10.0 reads otherwise (reductions and their axes)."""
    if release >= (10, 0):
        return []
    op, inputs = node.op_type, list(node.input)
    attrs = {a.name: a for a in node.attribute}
    found: list[tuple[str, bool]] = []
    reduction = attrs["reduction"].s.decode() if "reduction" in attrs else "none"
    if op == "ScatterElements" and reduction != "none":
        found.append(("with a reduction: the parser ignores it", False))
    if op == "ReduceMax" and len(inputs) > 1 and inputs[1]:
        found.append(
            ("with axes as an input (opset 18): the parser reads only the attribute", True)
        )
    no_axes = len(inputs) < 2 or not inputs[1]
    noop = "noop_with_empty_axes" in attrs and attrs["noop_with_empty_axes"].i == 1
    if op == "ReduceSum" and noop and no_axes:
        found.append(("with noop_with_empty_axes=1: the parser reduces every axis", False))
    return found


def table_markdown() -> str:
    """:data:`SUPPORT` as the Markdown table of docs/tensorrt.md."""
    lines = [
        "| operator | what the exports use | 8.6 | 10.x | newest | notes (onnx-tensorrt source) |",
        "|---|---|---|---|---|---|",
    ]
    for row in SUPPORT:
        lines.append(
            f"| {row.op} | {row.used} | {row.trt86} | {row.trt10} | {row.newest} | {row.note} |"
        )
    return "\n".join(lines)
