"""Graph surgery on the exported ONNX file, as named passes over an onnx-graphsurgeon graph.

Each pass takes a ``gs.Graph``, edits it in place and returns how many places it changed:

- ``fold_attention_scale``: torch decomposes scaled-dot-product attention as
  ``MatMul(q * sqrt(s), k^T * sqrt(s)) -> [Add(mask)] -> Softmax -> MatMul``; the pass moves the
  whole scale onto Q (``MatMul(q * s, k^T)``), the pattern TensorRT fuses into its attention
  kernels (and one rounded constant instead of two in FP16/BF16 graphs). It needs the
  scale as a constant: the dynamo exporter's graphs have it; the TorchScript exporter computes it
  from runtime shapes, and there the pass changes nothing (its report says 0);
- ``order_gelu``: the dynamo exporter writes erf-GELU as ``x * (0.5 * (1 + erf(x / sqrt 2)))``,
  which ONNX Runtime's ``GeluFusion`` does not match (it wants ``(x * 0.5) * (1 + erf(...))``), so
  each GELU ran as five elementwise kernels: a quarter of the INT8 Hydra graph's time on a CPU
  (ViT-B/16, measured). The pass reorders the two products; a product with 0.5 is exact, so the
  values are bit-identical. TorchScript exports are already in the fused form (the pass counts 0);
- ``cleanup``: constant folding, dead nodes removed, topological order, stable node names
  (``<op>_<index>`` in topological order), so two exports of one model diff cleanly.

:func:`plain_shapes` is not optional: :func:`run_passes` applies it to every export before the
chosen passes (report key ``plain_shapes``), and :func:`hydra_deploy.export.int8.quantize_export`
again to the quantized file. The dynamo exporter reads the batch size as ``Shape(start=0,
end=1)`` (opset 15's slice of the shape); TensorRT's ONNX parser ignores ``start`` and ``end``
up to 9.3 (onnx-tensorrt 8.6-GA ``builtin_op_importers.cpp``, ``DEFINE_BUILTIN_OP_IMPORTER(Shape)``:
``addShape(input)`` only), so 8.6 would take the whole shape where the graph wants its first
element. The pass writes each such node as a plain ``Shape`` and a ``Slice`` of it (the same
values: ``Slice`` clamps and counts negative indices from the back as ``Shape`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import ExportError
from hydra_deploy.export.precision import check_precision, to_low_precision
from hydra_deploy.optional import lazy_module

onnx = lazy_module("onnx", purpose="graph surgery on exported models", error=ExportError)
gs = lazy_module("onnx_graphsurgeon", purpose="graph surgery on exported models", error=ExportError)
onnxruntime = lazy_module("onnxruntime", purpose="folding constants", error=ExportError)


def _producer(tensor):
    return tensor.inputs[0] if getattr(tensor, "inputs", None) else None


def _scalar_constant(node) -> tuple[int, np.ndarray] | None:
    """(index, value) of the single-element constant input of a binary node, if it has one."""
    for index, tensor in enumerate(node.inputs):
        if isinstance(tensor, gs.Constant) and tensor.values.size == 1:
            return index, tensor.values
    return None


def fold_attention_scale(graph) -> int:
    """Put the attention scale on Q only: MatMul(q*a, kT*b) -> Softmax becomes MatMul(q*(a*b), kT)."""
    changed = 0
    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        scores = _producer(softmax.inputs[0])
        if scores is not None and scores.op == "Add":  # an additive (padding) mask: look through
            scores = next(
                (p for p in map(_producer, scores.inputs) if p is not None and p.op == "MatMul"),
                None,
            )
        if scores is None or scores.op != "MatMul":
            continue
        q_mul, k_mul = (_producer(t) for t in scores.inputs)
        if q_mul is None or k_mul is None or q_mul.op != "Mul" or k_mul.op != "Mul":
            continue
        q_const, k_const = _scalar_constant(q_mul), _scalar_constant(k_mul)
        if q_const is None or k_const is None:
            continue
        if len(q_mul.outputs[0].outputs) != 1 or len(k_mul.outputs[0].outputs) != 1:
            continue  # the scaled tensors are used elsewhere too: leave them
        (qi, a), (ki, b) = q_const, k_const
        scale = (a.astype(np.float64) * b.astype(np.float64)).astype(a.dtype).reshape(a.shape)
        q_mul.inputs[qi] = gs.Constant(f"{q_mul.name}_attention_scale", scale)
        scores.inputs[1] = k_mul.inputs[1 - ki]  # K^T unscaled
        k_mul.outputs.clear()
        changed += 1
    graph.cleanup()
    return changed


def _is_scalar(node, value: float) -> int | None:
    """The index of ``node``'s single-element constant input when it equals ``value``."""
    found = _scalar_constant(node)
    if found is None or not np.isclose(float(found[1].ravel()[0]), value, rtol=1e-6, atol=0):
        return None
    return found[0]


def _only_consumer(tensor, op: str):
    consumers = list(tensor.outputs)
    if len(consumers) != 1 or consumers[0].op != op:
        return None
    return consumers[0]


def order_gelu(graph) -> int:
    """``x * (0.5 * (1 + erf(x / sqrt 2)))`` -> ``(x * 0.5) * (1 + erf(x / sqrt 2))`` (ONNX
    Runtime's GeluFusion pattern); returns how many GELUs were reordered."""
    changed = 0
    for erf in [n for n in graph.nodes if n.op == "Erf"]:
        div = _producer(erf.inputs[0])
        if div is None or div.op != "Div" or _is_scalar(div, float(np.sqrt(2.0))) != 1:
            continue
        x = div.inputs[0]
        one = _only_consumer(erf.outputs[0], "Add")
        if one is None or _is_scalar(one, 1.0) is None:
            continue
        half = _only_consumer(one.outputs[0], "Mul")
        index = None if half is None else _is_scalar(half, 0.5)
        if index is None or half.inputs[1 - index] is not one.outputs[0]:
            continue
        outer = _only_consumer(half.outputs[0], "Mul")
        if outer is None or not any(t is x for t in outer.inputs):
            continue
        # half: x * 0.5 (the constant kept); outer: (x * 0.5) * (1 + erf)
        half.inputs[1 - index] = x
        outer.inputs.clear()
        outer.inputs.extend([half.outputs[0], one.outputs[0]])
        changed += 1
    if changed:
        graph.toposort()
    return changed


#: ``Shape``'s attributes that select part of the shape (opset 15)
SHAPE_SLICE_ATTRIBUTES = ("start", "end")
_INT64_MAX = 2**63 - 1


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ...: the first not in ``taken`` (which it joins)."""
    found, count = base, 0
    while found in taken:
        count += 1
        found = f"{base}_{count}"
    taken.add(found)
    return found


def plain_shapes(model) -> int:
    """Rewrite every ``Shape`` node with ``start``/``end`` (an ``onnx.ModelProto``, in place, its
    subgraphs too) as a plain ``Shape`` and a ``Slice`` of its output; returns how many.

    The ``Slice`` writes the original output tensor, so nothing downstream changes; its starts,
    ends and axes are INT64 initializers, resolved to ``0 <= start <= end <= rank`` where the
    input's rank is known (shape inference or the graph's value infos), else as written (``Slice``
    clamps and counts negative indices from the back the way ``Shape`` does; an omitted ``end``
    is the largest INT64). ``start=0`` without ``end`` (the whole shape) only loses the attribute.
    New nodes and initializers get names no other node, tensor or initializer has, free of ',' and
    ':' (trtexec's ``--layerPrecisions`` separators), and so does a ``Shape`` that had none.
    """
    ranks, taken = _ranks_and_names(model)

    def fresh(base: str) -> str:
        return unique_name(base.replace(",", "_").replace(":", "_") or "shape", taken)

    changed = 0
    for graph in _graphs(model.graph):
        nodes = []
        for node in graph.node:
            nodes.append(node)
            if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
                continue
            attributes = {a.name: a.i for a in node.attribute if a.name in SHAPE_SLICE_ATTRIBUTES}
            if not attributes:
                continue
            kept = [a for a in node.attribute if a.name not in SHAPE_SLICE_ATTRIBUTES]
            del node.attribute[:]
            node.attribute.extend(kept)
            if not node.name:
                node.name = fresh("Shape")
            changed += 1
            bounds = _slice_bounds(attributes, ranks.get(node.input[0]))
            if bounds is not None:  # None: the whole shape
                nodes.append(_slice_after(graph, node, *bounds, fresh))
        if len(nodes) != len(graph.node):
            del graph.node[:]
            graph.node.extend(nodes)
    return changed


def _ranks_and_names(model) -> tuple[dict[str, int], set[str]]:
    """The rank of every tensor whose rank is known (shape inference, else the graph's value
    infos and initializers), and every name the model uses (nodes, tensors, initializers)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # an unusual graph: the ranks are then the ones the file states
        inferred = model
    ranks: dict[str, int] = {}
    taken: set[str] = set()
    for graph in _graphs(inferred.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            if value.type.tensor_type.HasField("shape"):
                ranks[value.name] = len(value.type.tensor_type.shape.dim)
        ranks.update((t.name, len(t.dims)) for t in graph.initializer)
    for graph in _graphs(model.graph):
        taken.update(n.name for n in graph.node)
        taken.update(t.name for t in graph.initializer)
        taken.update(v.name for v in (*graph.input, *graph.output, *graph.value_info))
        taken.update(name for n in graph.node for name in (*n.input, *n.output))
    return ranks, taken


def _slice_bounds(attributes: dict[str, int], rank: int | None) -> tuple[int, int | None] | None:
    """A ``Shape``'s ``start``/``end`` as the ``Slice`` bounds of its output, resolved to
    ``0 <= start <= end <= rank`` where the rank is known (opset 15: negative counts from the
    back, then clamp to [0, rank]); None when they take the whole shape."""
    start, end = attributes.get("start", 0), attributes.get("end")
    if rank is None:
        return None if (start == 0 and end is None) else (start, end)
    start, end = (
        min(max(v + rank if v < 0 else v, 0), rank) for v in (start, rank if end is None else end)
    )
    end = max(start, end)
    return None if (start, end) == (0, rank) else (start, end)


def _slice_after(graph, node, start: int, end: int | None, fresh: Callable[[str], str]):
    """``node`` (a ``Shape``) writes the whole shape under a new name; the returned ``Slice``
    writes its original output from it, its bounds as INT64 initializers of ``graph``."""
    result = node.output[0]
    node.output[0] = fresh(f"{result}_whole")
    bounds = []
    for what, value in (
        ("starts", start),
        ("ends", _INT64_MAX if end is None else end),
        ("axes", 0),
    ):
        tensor = onnx.numpy_helper.from_array(
            np.array([value], dtype=np.int64), fresh(f"{node.name}_slice_{what}")
        )
        graph.initializer.append(tensor)
        bounds.append(tensor.name)
    return onnx.helper.make_node(
        "Slice", [node.output[0], *bounds], [result], name=fresh(f"{node.name}_slice")
    )


def _graphs(graph) -> Iterator:
    """``graph`` and every subgraph of its nodes (If branches, Loop bodies), depth first."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _graphs(sub)


@contextlib.contextmanager
def quiet_graphsurgeon() -> Iterator[None]:
    """onnx-graphsurgeon's logger at ERROR, without colours, for the duration.

    Folding weights (transposes, scale multiplications) makes large constants on purpose; its
    "Large tensors" warning and the "colored module is not installed" note that comes with any
    warning are noise a user can do nothing about.
    """
    G_LOGGER = gs.logger.G_LOGGER
    severity, colors = G_LOGGER.severity, G_LOGGER.colors
    G_LOGGER.severity, G_LOGGER.colors = G_LOGGER.ERROR, False
    try:
        yield
    finally:
        G_LOGGER.severity, G_LOGGER.colors = severity, colors


def cleanup(graph) -> int:
    """Fold constants, drop dead nodes, sort topologically and give nodes stable names."""
    before = len(graph.nodes)
    onnxruntime.set_default_logger_severity(3)  # constant folding runs ORT; keep its notes quiet
    with quiet_graphsurgeon():
        graph.fold_constants().cleanup().toposort()
    stable_names(graph)
    return before - len(graph.nodes)


def stable_names(graph) -> None:
    """Name every node ``<op>_<index>`` in topological order."""
    counts: dict[str, int] = {}
    for node in graph.toposort().nodes:
        index = counts.get(node.op, 0)
        counts[node.op] = index + 1
        node.name = f"{node.op}_{index}"


PASSES: dict[str, Callable] = {
    "fold_attention_scale": fold_attention_scale,
    "order_gelu": order_gelu,
    "cleanup": cleanup,
}
DEFAULT_PASSES = ("cleanup", "fold_attention_scale", "order_gelu")


def run_passes(
    path: str | Path, passes: Sequence[str] = DEFAULT_PASSES, *, precision: str = "fp32"
) -> dict[str, Any]:
    """Apply ``passes`` to the ONNX file at ``path`` (rewritten in place); returns changes per pass.

    :func:`plain_shapes` runs first whatever ``passes`` says (report key ``plain_shapes``).

    With ``precision`` "fp16" or "bf16" the graph is then rewritten strongly typed in that
    precision (:func:`hydra_deploy.export.precision.to_low_precision`; report key ``precision``).
    """

    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ExportError(f"unknown graph pass(es) {unknown}; choose from {sorted(PASSES)}")
    model = onnx.load(str(path))
    metadata = {p.key: p.value for p in model.metadata_props}
    sliced = plain_shapes(model)  # every export: TensorRT 8.6 reads no Shape start/end
    # shapes let constant folding resolve Shape -> Gather -> Sqrt chains (the TorchScript
    # exporter computes the attention scale from the head size that way)
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    report: dict[str, Any] = {"plain_shapes": sliced, **{name: 0 for name in passes}}
    for name in passes:
        report[name] += int(PASSES[name](graph))
    if check_precision(precision) != "fp32":
        report["precision"] = to_low_precision(graph, precision)
        stable_names(graph)
    out = gs.export_onnx(graph)
    out.ir_version, out.producer_name = model.ir_version, model.producer_name
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    for key, value in metadata.items():
        prop = out.metadata_props.add()
        prop.key, prop.value = key, value
    if precision != "fp32":  # the rewritten tensors' types come back from inference
        out = onnx.shape_inference.infer_shapes(out, strict_mode=True)
    onnx.save(out, str(path))
    return report
