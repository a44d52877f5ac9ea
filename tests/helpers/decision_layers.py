"""The floating-point TensorRT layers TensorRT's ONNX parser makes of the decision nodes of
``hydra-calibrate --in-graph`` (named ``decisions/...``), for the trtexec and Polygraphy stand-ins:
on a weakly typed reduced-precision build each must be pinned to FP32 by its name.

What the parser makes, from onnx-tensorrt's importers (8.6-GA ``builtin_op_importers.cpp`` /
``onnx2trt_utils.cpp``, 10.1-GA ``onnxOpImporters.cpp`` / ``importerUtils.cpp``):

- a node of a one-layer operator: one layer named after the node (``ctx->registerLayer(layer,
  node)``), a floating-point one when the node reads or writes a float tensor;
- Softmax, LogSoftmax, CumSum, LessOrEqual, GreaterOrEqual: more floating-point layers, some
  unnamed (Softmax/LogSoftmax: an IShuffleLayer, and LogSoftmax's IUnaryLayer Log; CumSum: the
  loop's running-sum IElementWiseLayer; ``greaterLessOrEqual``: Equal and Or named
  ``<node>_<n>``), which no layer precision can reach by our name;
- an elementwise node whose float inputs differ in rank: an IShuffleLayer that broadcasts the
  lower-rank one (``broadcastTensor``: unnamed on 8.6, ``ONNXTRT_Broadcast`` on 10.x).
"""

from __future__ import annotations

from pathlib import Path

PREFIX = "decisions/"
SPLIT_OPS = frozenset({"Softmax", "LogSoftmax", "CumSum", "LessOrEqual", "GreaterOrEqual"})
ELEMENTWISE_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Equal", "Less", "Greater", "And", "Or"}
)
FLOAT_TYPES = frozenset({1, 10, 11, 16})  # FLOAT, FLOAT16, DOUBLE, BFLOAT16 (onnx.proto)


def decision_layers(path: str | Path) -> tuple[list[str], list[str]]:
    """(the decision nodes that become one floating-point layer named after them, what the parser
    makes of the others that no name of ours reaches: "<node> (<why>)"). Both empty for a graph
    without decisions."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.name.startswith(PREFIX)]
    if not nodes:
        return [], []
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # a graph onnx cannot infer: the types the file states
        graph = model.graph
    types, ranks = {}, {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        types[value.name] = tensor.elem_type
        if tensor.HasField("shape"):
            ranks[value.name] = len(tensor.shape.dim)
    for tensor in graph.initializer:
        types[tensor.name], ranks[tensor.name] = tensor.data_type, len(tensor.dims)

    named, unreachable = [], []
    for node in nodes:
        tensors = [t for t in (*node.input, *node.output) if t]
        if not any(types.get(t) in FLOAT_TYPES for t in tensors):
            continue  # integers and booleans only
        if node.op_type in SPLIT_OPS:
            unreachable.append(f"{node.name} ({node.op_type}: several layers, some unnamed)")
            continue
        named.append(node.name)
        if node.op_type in ELEMENTWISE_OPS:
            float_ranks = {ranks.get(t) for t in node.input if types.get(t) in FLOAT_TYPES}
            if len(float_ranks) > 1:
                unreachable.append(f"{node.name} (an unnamed shuffle broadcasts an input's rank)")
    return named, unreachable


def uncovered_decision_layers(
    path: str | Path, pinned_fp32: set[str], layer_names: set[str]
) -> list[str]:
    """The decision layers of ``path`` that a weakly typed reduced-precision build leaves to
    TensorRT's choice of precision: floating-point layers not among ``pinned_fp32`` (names given
    FP32) that are layers of the network (``layer_names``), and those no name reaches."""
    named, unreachable = decision_layers(path)
    covered = pinned_fp32 & layer_names
    return [n for n in named if n not in covered] + unreachable
