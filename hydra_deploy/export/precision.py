"""FP16/BF16 graphs: a strongly typed rewrite of the FP32 export, and the matching PyTorch reference.

TensorRT 10.12 deprecated weak typing and TensorRT 11 builds every network strongly typed: the
types written in the ONNX file decide each layer's precision. ``to_low_precision`` rewrites an
FP32 graph (onnx-graphsurgeon) so that:

- weights and every computing node (MatMul, Conv, Add, GELU's Erf, the attention's Softmax, ...)
  run in the low precision (float16 or bfloat16); weights are converted once, round to nearest;
- ``LayerNormalization`` (whose statistics overflow in FP16) and every node downstream of
  ``member_logits`` (the ensemble head: softmaxes, entropies, MI, MSP) run in float32, with their
  constants left in float32;
- explicit ``Cast`` nodes sit where a tensor crosses between the two, one per tensor and type,
  never inside the attention's MatMul -> Softmax -> MatMul (so TensorRT fuses it);
- the graph's inputs and outputs keep float32, so runners feed and read float32 whatever the
  precision (``member_logits`` is cast back to float32 at the end).

``reference_model`` is the same policy in PyTorch (weights and computation in the low precision,
LayerNorms in float32, output cast to float32): the file is checked against it, and its drift from
the FP32 model is what the precision costs.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.errors import ExportError
from hydra_deploy.fusion.layers import StreamLayerNorm
from hydra_deploy.optional import lazy_module

onnx = lazy_module("onnx", purpose="low-precision export", error=ExportError)
gs = lazy_module("onnx_graphsurgeon", purpose="low-precision export", error=ExportError)
ml_dtypes = lazy_module("ml_dtypes", purpose="bfloat16 weights", error=ExportError)

PRECISIONS = ("fp32", "fp16", "bf16")
FP32_OPS = ("LayerNormalization",)
# ops whose float inputs may have any type (they read shapes or convert): never cast into them
TYPE_AGNOSTIC_OPS = ("Shape", "Size", "Cast", "CastLike")

_FLOAT = 1  # onnx.TensorProto.FLOAT
_FLOAT16 = 10
_BFLOAT16 = 16
_FLOAT_TYPES = (_FLOAT, _FLOAT16, _BFLOAT16, 11)  # 11: DOUBLE


def onnx_type(precision: str) -> int:
    """The ONNX element type of a precision name."""
    return {"fp32": _FLOAT, "fp16": _FLOAT16, "bf16": _BFLOAT16}[check_precision(precision)]


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    return precision


def _numpy_type(elem_type: int):
    return {_FLOAT: np.float32, _FLOAT16: np.float16, _BFLOAT16: ml_dtypes.bfloat16}[elem_type]


def _to_type(values: np.ndarray, elem_type: int) -> np.ndarray:
    """float32 values in ``elem_type``, rounded to nearest; beyond its range they saturate at its
    largest finite value (an additive mask's float32 minimum would become -inf in FP16, and an
    all-masked row NaN), so the file holds no infinity it was not given."""
    kind = _numpy_type(elem_type)
    info = ml_dtypes.finfo(kind)
    finite = np.isfinite(values)
    clipped = np.where(finite, np.clip(values, float(info.min), float(info.max)), values)
    return clipped.astype(kind)


def _elem_type(tensor) -> int | None:
    """The ONNX element type of a gs tensor (None when unknown)."""
    dtype = tensor.values.dtype if isinstance(tensor, gs.Constant) else tensor.dtype
    if dtype is None:
        return None
    if isinstance(dtype, int):
        return dtype
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (KeyError, TypeError, ValueError):
        return None


def _downstream(tensors: Iterable) -> set[int]:
    """ids of every node that (transitively) consumes one of ``tensors``."""
    seen: set[int] = set()
    stack = [node for t in tensors for node in t.outputs]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(consumer for out in node.outputs for consumer in out.outputs)
    return seen


def to_low_precision(
    graph,
    precision: str,
    *,
    fp32_ops: Sequence[str] = FP32_OPS,
    fp32_after: Sequence[str] = ("member_logits",),
) -> dict[str, int]:
    """Rewrite the FP32 ``gs.Graph`` in place into a strongly typed ``precision`` graph.

    ``fp32_ops``: op types kept in float32; ``fp32_after``: tensor names every consumer of which
    (transitively) stays float32. Returns counts: low-precision and float32 nodes, casts inserted,
    constants converted. The tensors' types are cleared for shape inference to fill in again.
    """
    low = onnx_type(precision)
    if low == _FLOAT:
        return {
            "low_precision_nodes": 0,
            "fp32_nodes": len(graph.nodes),
            "casts": 0,
            "constants": 0,
        }
    if any(
        attr for node in graph.nodes for attr in node.attrs.values() if isinstance(attr, gs.Graph)
    ):
        raise ExportError(
            "the graph holds sub-graphs (If/Loop); low-precision export needs a flat graph"
        )
    graph.toposort()
    fp32_nodes, unsupported = _fp32_nodes(graph, low, fp32_ops, fp32_after)
    retyping = _Retyping(graph)
    for node in list(graph.nodes):
        retyping.retype(node, _FLOAT if id(node) in fp32_nodes else low)
    graph.nodes.extend(retyping.new_nodes)
    graph.cleanup().toposort()
    report = dict(retyping.report)
    report["fp32_for_lack_of_kernels"] = sorted(unsupported)  # the opset has no such typed op
    return report


def _fp32_nodes(
    graph, low: int, fp32_ops: Sequence[str], fp32_after: Sequence[str]
) -> tuple[set[int], set[str]]:
    """ids of the nodes that stay float32 (``fp32_ops``, everything after ``fp32_after``, ops
    the opset has no ``low`` kernel of), and those ops."""
    tensors = graph.tensors()
    anchors = [tensors[name] for name in fp32_after if name in tensors]
    fp32_nodes = _downstream(anchors) | {id(n) for n in graph.nodes if n.op in fp32_ops}
    opset = int(graph.opset)
    unsupported = {
        n.op for n in graph.nodes if id(n) not in fp32_nodes and not _allows(n.op, opset, low)
    }
    return fp32_nodes | {id(n) for n in graph.nodes if n.op in unsupported}, unsupported


class _Retyping:
    """The rewrite of one graph, node by node in topological order: each float variable's type
    after the rewrite, the converted constants and the casts made (one per tensor and type,
    shared by its consumers), the new Cast nodes and the counts reported."""

    def __init__(self, graph) -> None:
        self.versions: dict[tuple[str, int], Any] = {}  # (tensor name, type) -> tensor holding it
        self.types: dict[str, int] = {}  # float variable -> its type after the rewrite
        for tensor in graph.inputs:
            if _elem_type(tensor) in _FLOAT_TYPES:
                self.types[tensor.name] = _elem_type(tensor)
        self.report: Counter = Counter()
        self.new_nodes: list = []
        self.graph_outputs = {t.name for t in graph.outputs}

    def retype(self, node, target: int) -> None:
        """``node`` computing in ``target``: its float inputs cast (or converted) to it, its
        attributes and outputs following; a graph output stays float32 behind a Cast."""
        self.report["fp32_nodes" if target == _FLOAT else "low_precision_nodes"] += 1
        if node.op not in TYPE_AGNOSTIC_OPS:
            for index, tensor in enumerate(node.inputs):
                if tensor is not None and tensor.name and _is_float(tensor, self.types):
                    node.inputs[index] = self.as_type(tensor, target)
        _retarget_attributes(node, target)
        for index, out in enumerate(node.outputs):
            if not _produces_float(node, out):
                continue
            self.types[out.name] = target
            is_output = out.name in self.graph_outputs
            out.dtype, out.shape = (out.dtype, out.shape) if is_output else (None, None)
            if is_output and target != _FLOAT:
                # graph outputs stay float32: the node writes a low-precision copy, a Cast the output
                low_out = gs.Variable(f"{out.name}_{_NAMES[target]}")
                node.outputs[index] = low_out
                self.new_nodes.append(
                    gs.Node("Cast", f"{out.name}_to_float", {"to": _FLOAT}, [low_out], [out])
                )
                self.types[low_out.name], self.types[out.name] = target, _FLOAT
                self.versions[(out.name, target)] = low_out
                self.report["casts"] += 1

    def as_type(self, tensor, target: int):
        """``tensor`` holding ``target``: itself, a converted constant, or a (shared) Cast."""
        if isinstance(tensor, gs.Constant):
            source = _elem_type(tensor)
            if source not in _FLOAT_TYPES or source == target:
                return tensor
            key = (tensor.name, target)
            if key not in self.versions:
                values = _to_type(np.asarray(tensor.values, dtype=np.float32), target)
                self.versions[key] = gs.Constant(f"{tensor.name}_{_NAMES[target]}", values)
                self.report["constants"] += 1
            return self.versions[key]
        source = self.types.get(tensor.name)
        if source is None or source == target:
            return tensor
        key = (tensor.name, target)
        if key not in self.versions:
            cast_out = gs.Variable(f"{tensor.name}_{_NAMES[target]}")
            self.new_nodes.append(
                gs.Node(
                    "Cast",
                    f"{tensor.name}_to_{_NAMES[target]}",
                    {"to": target},
                    [tensor],
                    [cast_out],
                )
            )
            self.types[cast_out.name] = target
            self.versions[key] = cast_out
            self.report["casts"] += 1
        return self.versions[key]


def _allows(op: str, opset: int, elem_type: int) -> bool:
    """Whether op ``op`` at ``opset`` accepts ``elem_type`` for its first input (ONNX schema)."""
    if op in TYPE_AGNOSTIC_OPS:
        return True
    try:
        schema = onnx.defs.get_schema(op, max_inclusive_version=opset, domain="")
    except onnx.defs.SchemaError:
        return True  # not a standard op: leave it to the engine
    wanted = f"tensor({_TYPE_STRINGS[elem_type]})"
    constraints = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    # the first input that takes floats decides (Where: X, not cond); ops without one (e.g.
    # ConstantOfShape) are decided by their float outputs
    for formal in [*schema.inputs, *schema.outputs]:
        allowed = constraints.get(formal.type_str, [formal.type_str])
        if "tensor(float)" in allowed:
            return wanted in allowed
    return True


_TYPE_STRINGS = {_FLOAT: "float", _FLOAT16: "float16", _BFLOAT16: "bfloat16"}


_NAMES = {_FLOAT: "fp32", _FLOAT16: "fp16", _BFLOAT16: "bf16"}


def _is_float(tensor, types: dict[str, int]) -> bool:
    if isinstance(tensor, gs.Constant):
        return _elem_type(tensor) in _FLOAT_TYPES
    return tensor.name in types and types[tensor.name] in _FLOAT_TYPES


def _produces_float(node, out) -> bool:
    """Whether ``out`` is a float tensor whose type follows the node's precision."""
    if node.op == "Cast":
        return node.attrs.get("to") in _FLOAT_TYPES
    if node.op in (
        "Shape",
        "Size",
        "ArgMax",
        "ArgMin",
        "NonZero",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "Not",
        "And",
        "Or",
        "IsNaN",
        "IsInf",
    ):
        return False
    if node.op == "TopK" and out is not node.outputs[0]:
        return False  # the indices
    return _elem_type(out) in _FLOAT_TYPES or out.dtype is None


def _retarget_attributes(node, target: int) -> None:
    """Type-carrying attributes follow the node's precision (Cast's ``to``, constants' values)."""
    if node.op == "Cast" and node.attrs.get("to") in _FLOAT_TYPES:
        node.attrs["to"] = target
    elif node.op in ("ConstantOfShape", "Constant"):
        value = node.attrs.get("value")
        if isinstance(value, gs.Constant) and _elem_type(value) in _FLOAT_TYPES:
            node.attrs["value"] = gs.Constant(
                value.name, _to_type(np.asarray(value.values, np.float32), target)
            )


# --- checking what a file computes in ------------------------------------------------------------
def compute_types(model) -> dict[str, dict[str, int]]:
    """Per op type, how many nodes compute in each float type (from their first float input)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    }
    types.update({t.name: t.data_type for t in inferred.graph.initializer})
    counts: dict[str, Counter] = {}
    for node in inferred.graph.node:
        if node.op_type in TYPE_AGNOSTIC_OPS:
            continue
        float_inputs = [types.get(name) for name in node.input if types.get(name) in _FLOAT_TYPES]
        if float_inputs:
            name = onnx.helper.tensor_dtype_to_string(float_inputs[0]).removeprefix("TensorProto.")
            counts.setdefault(node.op_type, Counter())[name.lower()] += 1
    return {op: dict(c) for op, c in sorted(counts.items())}


def attention_casts(model) -> int:
    """How many attention Softmaxes have a Cast between them and their MatMuls (0 is right).

    An attention Softmax is one whose output feeds a MatMul (directly or through a Cast); the
    ensemble head's softmaxes feed none and are not counted.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    broken = 0
    for node in model.graph.node:
        if node.op_type != "Softmax":
            continue
        after = consumers.get(node.output[0], [])
        cast_to_matmul = any(
            c.op_type == "Cast"
            and any(n.op_type == "MatMul" for n in consumers.get(c.output[0], []))
            for c in after
        )
        if not cast_to_matmul and not any(c.op_type == "MatMul" for c in after):
            continue  # not an attention softmax
        before = producers.get(node.input[0])
        cast_from_matmul = (
            before is not None
            and before.op_type == "Cast"
            and getattr(producers.get(before.input[0]), "op_type", None) == "MatMul"
        )
        broken += int(cast_to_matmul or cast_from_matmul)
    return broken


def upcast_model(model):
    """A float32 copy of a low-precision file: same graph, every bf16/fp16 value widened exactly.

    ONNX Runtime's CPU kernels do not run BF16 MatMul/Softmax; the widened copy runs there and
    computes with the file's own (rounded) weights and constants, which checks the file's wiring.
    """
    model = copy.deepcopy(model)
    graph = model.graph
    for index, init in enumerate(graph.initializer):
        if init.data_type in (_FLOAT16, _BFLOAT16):
            wide = onnx.numpy_helper.to_array(init).astype(np.float32)
            graph.initializer[index].CopyFrom(onnx.numpy_helper.from_array(wide, init.name))
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i in (_FLOAT16, _BFLOAT16):
                attr.i = _FLOAT
            if attr.name == "value" and attr.t.data_type in (_FLOAT16, _BFLOAT16):
                attr.t.CopyFrom(
                    onnx.numpy_helper.from_array(
                        onnx.numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name
                    )
                )
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model)


# --- the PyTorch side --------------------------------------------------------------------------
def torch_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        check_precision(precision)
    ]


# torch modules that run the ONNX ops a low-precision graph may have to keep in float32
_MODULES_OF_OPS = {"Conv": (nn.Conv1d, nn.Conv2d)}


def reference_model(
    module: nn.Module,
    precision: str,
    *,
    compute: str | None = None,
    fp32_ops: Sequence[str] = (),
) -> nn.Module:
    """``module`` under the graph's precision policy, as a new PyTorch module.

    Weights are rounded to ``precision``; computation runs in ``compute`` (default: the same
    precision; ``"fp32"`` computes with the rounded weights in float32, the twin of
    :func:`upcast_model`); LayerNorms, and the modules behind ``fp32_ops`` (the ops the graph
    kept in float32 for lack of a typed kernel, ``"Conv"`` for BF16 below opset 22), keep float32
    weights and compute in float32; the input is cast in and every output is float32.
    """
    low, run = torch_dtype(precision), torch_dtype(compute or precision)
    inner = copy.deepcopy(module).eval()
    kept = (
        nn.LayerNorm,
        StreamLayerNorm,
        *(t for op in fp32_ops for t in _MODULES_OF_OPS.get(op, ())),
    )
    norms = [name for name, m in inner.named_modules() if isinstance(m, kept)]
    saved = {name: copy.deepcopy(inner.get_submodule(name)).float() for name in norms}
    inner = inner.to(low).to(run)
    for name, norm in saved.items():
        parent_name, _, child = name.rpartition(".")
        parent = inner.get_submodule(parent_name) if parent_name else inner
        if isinstance(norm, StreamLayerNorm) and norm.per_stream:
            # exported as LayerNormalization without affine, then a low-precision Mul/Add with
            # the per-stream weights: normalise in float32, apply rounded weights in ``run``
            setattr(parent, child, _Float32Norm(norm, affine=norm.to(low).to(run)))
        else:
            setattr(parent, child, _Float32Norm(norm))

    class Reference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *inputs: torch.Tensor):
            # float inputs (pixels) are cast in; integer ones (token ids, masks) pass as they are
            out = self.inner(*(x.to(run) if x.is_floating_point() else x for x in inputs))
            if isinstance(out, tuple):
                return tuple(o.float() for o in out)
            return out.float()

    return Reference().eval()


class _Float32Norm(nn.Module):
    """A LayerNorm computed in float32 whatever its input's type; output in the input's type.

    With ``affine`` (a per-stream StreamLayerNorm in the compute precision) only the normalisation
    runs in float32 and the per-stream scale and shift in the input's type, as in the graph.
    """

    def __init__(self, norm: nn.Module, affine: nn.Module | None = None) -> None:
        super().__init__()
        self.norm, self.affine = norm, affine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.affine is None:
            return self.norm(x.float()).to(x.dtype)
        a = self.affine
        y = F.layer_norm(x.float(), (a.dim,), None, None, a.eps).to(x.dtype)
        if a.weight is not None:
            y = y * a.weight.view(a.weight.shape[0], *([1] * (y.dim() - 2)), a.weight.shape[-1])
        if a.bias is not None:
            y = y + a.bias.view(a.bias.shape[0], *([1] * (y.dim() - 2)), a.bias.shape[-1])
        return y
