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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _producer(tensor):
    return tensor.inputs[0] if getattr(tensor, "inputs", None) else None


def _scalar_constant(node) -> tuple[int, np.ndarray] | None:
    """(index, value) of the single-element constant input of a binary node, if it has one."""
    import onnx_graphsurgeon as gs

    for index, tensor in enumerate(node.inputs):
        if isinstance(tensor, gs.Constant) and tensor.values.size == 1:
            return index, tensor.values
    return None


def fold_attention_scale(graph) -> int:
    """Put the attention scale on Q only: MatMul(q*a, kT*b) -> Softmax becomes MatMul(q*(a*b), kT)."""
    import onnx_graphsurgeon as gs

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


@contextlib.contextmanager
def quiet_graphsurgeon() -> Iterator[None]:
    """onnx-graphsurgeon's logger at ERROR, without colours, for the duration.

    Folding weights (transposes, scale multiplications) makes large constants on purpose; its
    "Large tensors" warning and the "colored module is not installed" note that comes with any
    warning are noise a user can do nothing about.
    """
    from onnx_graphsurgeon.logger import G_LOGGER

    severity, colors = G_LOGGER.severity, G_LOGGER.colors
    G_LOGGER.severity, G_LOGGER.colors = G_LOGGER.ERROR, False
    try:
        yield
    finally:
        G_LOGGER.severity, G_LOGGER.colors = severity, colors


def cleanup(graph) -> int:
    """Fold constants, drop dead nodes, sort topologically and give nodes stable names."""
    import onnxruntime

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

    With ``precision`` "fp16" or "bf16" the graph is then rewritten strongly typed in that
    precision (:func:`hydra_deploy.export.precision.to_low_precision`; report key ``precision``).
    """
    import onnx
    import onnx_graphsurgeon as gs

    from hydra_deploy.errors import ExportError
    from hydra_deploy.export.precision import check_precision, to_low_precision

    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ExportError(f"unknown graph pass(es) {unknown}; choose from {sorted(PASSES)}")
    model = onnx.load(str(path))
    metadata = {p.key: p.value for p in model.metadata_props}
    # shapes let constant folding resolve Shape -> Gather -> Sqrt chains (the TorchScript
    # exporter computes the attention scale from the head size that way)
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    report: dict[str, Any] = {name: 0 for name in passes}
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
