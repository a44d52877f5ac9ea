"""INT8 graphs: ONNX Runtime's quantization of an FP32 export's matrix products.

:func:`quantize_export` turns a validated FP32 ``model.onnx`` into an INT8 one and returns the
record ``hydra.json`` keeps as ``"int8"``:

- ``dynamic``: weights only, no data (``onnxruntime.quantization.quantize_dynamic``): int8 weights
  symmetric per output channel (ORT's default, one scale per tensor, moved a fine-tuned MiniLM's
  accuracy and AUROC by up to 4 points on WordNet; per channel kept them within 0.5 at the same
  speed, measured), activations quantized to uint8 per batch at run time
  (``DynamicQuantizeLinear -> MatMulInteger``). A CPU (ONNX Runtime) format: TensorRT does not
  build it.
- ``static``: QDQ (``quantize_static``): ``QuantizeLinear``/``DequantizeLinear`` pairs in front of
  each matrix product, int8 weights symmetric per output channel, int8 activations symmetric
  (zero point 0, as TensorRT's explicit quantization requires), their ranges calibrated on the
  user's data (MinMax, Entropy or Percentile 99.999). The form TensorRT builds from and ONNX
  Runtime runs as integer kernels. MinMax is calibrated here a batch at a time, to ONNX Runtime's
  ranges (:func:`_calibrate_minmax`), and the FP32 outputs of that run are kept for validation
  (``quantize_export(..., fp32_runs=[])``); the other methods run ONNX Runtime's calibrators.

Only the matrix products with a weight are quantized (``MatMul``/``Gemm`` with a constant operand:
the grouped Q/K/V and output projections, the MLP, the classifier, named in ``nodes_to_quantize``);
``LayerNormalization``, the attention's ``MatMul -> Softmax -> MatMul`` (both operands
activations) and the ensemble (uncertainty) head stay float32 (``nodes_to_exclude``), as does the
patch-embedding ``Conv`` (the input layer, where quantization costs most accuracy; one product).
The loop lowering's member products multiply 2-D activations; in the static graph their bias is
added as [1, 1, out] and squeezed back, so that ONNX Runtime's MatMul+Add -> Gemm fusion (which
runs before its QDQ fusions and leaves a float Gemm over dequantized weights) does not take them
and every quantized product runs as an integer kernel (``MatMulIntegerToFloat``), recorded as
``bias_kept_apart``. A ``Gemm``'s bias stays float (ORT's ``QuantizeBias`` off): quantized, it
would be INT32 behind a ``DequantizeLinear``, which TensorRT refuses (it dequantizes INT8, FP8 and
INT4 only; :mod:`hydra_deploy.engines.onnx_support`). The quantized file's ``Shape`` nodes are
plain (:func:`hydra_deploy.export.surgery.plain_shapes`).

Products written as ``Einsum`` (``lowering="einsum"``) or grouped ``Conv`` (``"conv1d"``) are
refused: ORT quantizes neither, so the export would be INT8 in name only.

With the default ``loop`` lowering every member's projection is its own 2-D weight, so scales are
per member and output channel. The ``bmm`` lowering stores [M, in, out] weights, which get one
scale per tensor (all members together): ONNX's ``DequantizeLinear`` scales along one axis only,
and ONNX Runtime's integer MatMul refuses per-channel scales on a batched weight at run time
(measured: "MatmulInteger : b zero point is not valid"); the record says so. The dynamic quantizer
chooses per channel or per tensor for the whole graph, so a dynamic ``bmm`` export is per tensor
throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import io
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import ExportError, spelled
from hydra_deploy.export.surgery import plain_shapes, unique_name
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import CALIBRATION_METHODS, INT8_METHODS, MIN_CALIBRATION_EXAMPLES
from hydra_deploy.progress import progress
from hydra_deploy.threads import ort_threads

onnx = lazy_module("onnx", purpose="INT8 export", error=ExportError)
onnxruntime = lazy_module("onnxruntime", purpose="INT8 export", error=ExportError)
quantization = lazy_module("onnxruntime.quantization", purpose="INT8 export", error=ExportError)

logger = logging.getLogger("hydra_deploy")

__all__ = [
    "CALIBRATION_METHODS",
    "INT8_METHODS",
    "MIN_CALIBRATION_EXAMPLES",
    "calibration_rows",
    "calibration_sha256",
    "quantize_export",
]

#: the op types quantized: the matrix products with a weight
QUANTIZED_OP_TYPES = ("MatMul", "Gemm")
#: examples per batch of the calibration run (memory holds one batch's activations)
CALIBRATION_BATCH = 8
#: the Percentile calibration's percentile (ONNX Runtime's default)
PERCENTILE = 99.999
HEAD_OUTPUT = "member_logits"  # every node after it is the ensemble head

_FLOAT_REASONS = {
    "LayerNormalization": "its mean and variance need float",
    "Softmax": "the attention's softmax, between two products of activations",
    "attention MatMul": "the attention's scores and weighted sums: both operands are activations",
    "ensemble head": "the ensemble (uncertainty) head: softmaxes, entropies, MI, MSP in float32",
    "Conv": "the patch embedding: the input layer, where quantization costs most accuracy",
    "Gemm": "ONNX Runtime's dynamic quantization has no Gemm kernel",
}


def _static_advice() -> str:
    return spelled("Int8Options(method='static')", "--int8-method static")


def _dynamic_advice() -> str:
    return spelled("Int8Options(method='dynamic')", "--int8-method dynamic")


def _loop_advice() -> str:
    return spelled("fuse(..., lowering='loop')", "--lowering loop")


def calibration_rows(count: int, size: int, seed: int = 0) -> np.ndarray:
    """Which of ``count`` examples calibrate when at most ``size`` may: all, or a seeded random
    subset in ascending order (a folder sorted by class would give its first classes only)."""
    if count <= size:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, size, replace=False))


def calibration_sha256(calibration: Mapping[str, np.ndarray]) -> str:
    """The SHA-256 of calibration inputs: each array's name, dtype, shape and bytes, by name."""
    digest = hashlib.sha256()
    for name in sorted(calibration):
        array = np.ascontiguousarray(calibration[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def quantize_export(
    fp32_onnx: str | os.PathLike,
    out_onnx: str | os.PathLike,
    *,
    method: str,
    calibration: Mapping[str, np.ndarray] | None = None,
    calibrate_method: str = "minmax",
    fp32_runs: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] | None = None,
) -> dict[str, Any]:
    """Quantize ``fp32_onnx`` (an FP32 export's ``model.onnx``) into ``out_onnx`` (may be the same
    path; written atomically) and return the JSON-ready record of what was done.

    ``method``: ``"dynamic"`` (weights only, no data) or ``"static"`` (QDQ; ``calibration``: the
    model's inputs by name, at least :data:`MIN_CALIBRATION_EXAMPLES` rows, calibrated by
    ``calibrate_method`` ``"minmax"``, ``"entropy"`` or ``"percentile"``). The record: ``method``,
    ``calibration_method``, ``num_calibration``, ``calibration_sha256`` (None for dynamic),
    ``quantized_ops`` (op type -> nodes now computing on int8), ``integer_ops`` (the quantization
    nodes in the file), ``kept_float`` (op -> nodes left in float and why), ``weights`` and
    ``activations`` (the schemes), ``bias_kept_apart`` (static: the 2-D products whose bias is kept
    out of ONNX Runtime's float Gemm fusion), ``onnxruntime_version``.

    ``fp32_runs``, a list, receives what the FP32 file computed while it was calibrated: (batch
    of inputs, the FP32 file's outputs on it) per batch; nothing where none was run (dynamic, and
    the entropy and percentile methods, which ONNX Runtime's own calibrators collect). The
    exporter validates the INT8 file on those batches without running the FP32 file again.
    """
    if method not in INT8_METHODS:
        raise ExportError(f"unknown INT8 method {method!r}; choose one of {INT8_METHODS}")
    if calibrate_method not in CALIBRATION_METHODS:
        raise ExportError(
            f"unknown calibration method {calibrate_method!r}; choose one of {CALIBRATION_METHODS}"
        )
    fp32_onnx, out_onnx = Path(fp32_onnx), Path(out_onnx)
    model = onnx.load(str(fp32_onnx))
    _refuse_unquantizable(model)
    excluded, kept = _float_nodes(model)
    # named: ORT's QDQ quantizer ignores MatMulConstBOnly, and would quantize the attention's
    # products of activations too
    chosen = [n.name for n in _weight_products(model) if n.name and n.name not in excluded]
    feeds: Mapping[str, np.ndarray] | None = None
    if method == "static":
        feeds = _check_calibration(model, calibration)
    elif calibration is not None:
        raise ExportError(
            "dynamic INT8 quantizes weights only and takes no calibration data; drop it, or "
            f"quantize statically ({_static_advice()})"
        )
    plan = _Plan(method, feeds, chosen, excluded, calibrate_method)
    if fp32_runs is not None:
        plan.fp32_runs = fp32_runs
    record = _quantize_file(fp32_onnx, out_onnx, model, plan, kept)
    if feeds is not None:
        record.update(
            calibration_method=calibrate_method,
            num_calibration=len(next(iter(feeds.values()))),
            calibration_sha256=calibration_sha256(feeds),
        )
    record["onnxruntime_version"] = onnxruntime.__version__
    return record


@dataclasses.dataclass
class _Plan:
    """What to quantize and how; ``fp32_runs`` fills in as the FP32 file is calibrated."""

    method: str
    feeds: Mapping[str, np.ndarray] | None
    chosen: list[str]
    excluded: list[str]
    calibrate_method: str
    fp32_runs: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = dataclasses.field(
        default_factory=list
    )


def _quantize_file(
    fp32_onnx: Path, out_onnx: Path, model, plan: _Plan, kept: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Run ONNX Runtime's quantizer on ``fp32_onnx`` (``model``) into a temporary file, make its
    Shapes plain (and, static, its 2-D products' biases apart), move it to ``out_onnx``; the
    record of the file."""
    method, chosen, excluded = plan.method, plan.chosen, plan.excluded
    temporary = out_onnx.with_name(f".{out_onnx.name}.int8-{os.getpid()}.tmp")
    try:
        if method == "static":
            batched = _batched_weights(model, chosen)
            batches = _calibration_batches(model, plan.feeds)
            _quantize_static(fp32_onnx, temporary, model, batches, plan, batched)
        else:
            per_channel = not _batched_weights(model, chosen)
            logger.info("int8: quantizing %d products (weights only)", len(chosen))
            with _quiet_onnxruntime():
                _quantize_dynamic(fp32_onnx, temporary, chosen, excluded, per_channel)
        quantized = onnx.load(str(temporary))
        # the FP32 file's Shapes are plain already (run_passes); any the quantizer wrote are not
        changed = plain_shapes(quantized)
        record = _record(model, quantized, method, kept)
        if method == "static":
            record["bias_kept_apart"] = _keep_bias_apart(model, quantized)
            changed += record["bias_kept_apart"]
        if changed:
            onnx.save(quantized, str(temporary))
        os.replace(temporary, out_onnx)
        return record
    except ExportError:
        raise
    except Exception as err:  # onnxruntime's and onnx's own error types
        raise ExportError(
            f"ONNX Runtime could not quantize {fp32_onnx} ({type(err).__name__}: "
            f"{str(err).strip()[:300]}); export fp32 or fp16 instead, and report the model"
        ) from err
    finally:
        temporary.unlink(missing_ok=True)


# --- what the graph holds ---------------------------------------------------------------------------
def _constants(model) -> set[str]:
    names = {t.name for t in model.graph.initializer}
    names |= {out for n in model.graph.node if n.op_type == "Constant" for out in n.output}
    return names


def _weight_products(model, op_types=QUANTIZED_OP_TYPES) -> list:
    constants = _constants(model)
    return [
        n
        for n in model.graph.node
        if n.op_type in op_types and any(i in constants for i in n.input)
    ]


def _refuse_unquantizable(model) -> None:
    """Matrix products in ops ONNX Runtime does not quantize: the einsum and conv1d lowerings."""
    shapes = {t.name: len(t.dims) for t in model.graph.initializer}
    einsum = _weight_products(model, ("Einsum",))
    conv1d = [n for n in model.graph.node if n.op_type == "Conv" and shapes.get(n.input[1]) == 3]
    for nodes, op, lowering in ((einsum, "Einsum", "einsum"), (conv1d, "Conv", "conv1d")):
        if nodes:
            raise ExportError(
                f"cannot quantize this graph: {len(nodes)} of its matrix products are {op} nodes "
                f"(e.g. {nodes[0].name!r}; the {lowering} lowering), and ONNX Runtime quantizes "
                "MatMul and Gemm only; re-export with the loop lowering "
                f"({_loop_advice()}, the default)"
            )
    if not _weight_products(model):
        ops = ", ".join(sorted({n.op_type for n in model.graph.node}))
        raise ExportError(
            f"cannot quantize this graph: it holds no MatMul or Gemm with a weight (its ops: "
            f"{ops}); export fp32 or fp16"
        )


def _downstream(model, tensor: str) -> list:
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    seen: dict[int, Any] = {}
    stack = list(consumers.get(tensor, ()))
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            stack.extend(c for out in node.output for c in consumers.get(out, ()))
    return list(seen.values())


def _float_nodes(model) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """(names of the nodes ORT must leave alone, op -> {"nodes", "why"} of what stays float)."""
    head = _downstream(model, HEAD_OUTPUT)
    head_ids = {id(n) for n in head}
    constants = _constants(model)
    groups: dict[str, list] = {"ensemble head": head}
    for node in model.graph.node:
        if id(node) in head_ids:
            continue
        if node.op_type in ("LayerNormalization", "Softmax"):
            groups.setdefault(node.op_type, []).append(node)
        elif node.op_type == "MatMul" and not any(i in constants for i in node.input):
            groups.setdefault("attention MatMul", []).append(node)
        elif node.op_type == "Conv":
            groups.setdefault("Conv", []).append(node)
    excluded = [n.name for nodes in groups.values() for n in nodes if n.name]
    kept = {
        key: {"nodes": len(nodes), "why": _FLOAT_REASONS[key]}
        for key, nodes in groups.items()
        if nodes
    }
    return excluded, kept


def _record(fp32, quantized, method: str, kept: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the quantized file holds: the products now on int8, the quantization nodes, what stayed
    float (a weight product ORT left alone too), the schemes."""
    producers = {out: n for n in quantized.graph.node for out in n.output}
    ops = Counter(n.op_type for n in quantized.graph.node)
    if method == "static":
        on_int8 = [
            n
            for n in quantized.graph.node
            if n.op_type in QUANTIZED_OP_TYPES
            and sum(getattr(producers.get(i), "op_type", "") == "DequantizeLinear" for i in n.input)
            >= 2
        ]
        quantized_ops = dict(Counter(n.op_type for n in on_int8))
        integer = ("QuantizeLinear", "DequantizeLinear")
    else:
        on_int8 = [n for n in quantized.graph.node if n.op_type == "MatMulInteger"]
        quantized_ops = {"MatMul": len(on_int8)} if on_int8 else {}
        integer = ("DynamicQuantizeLinear", "MatMulInteger")
    done = {n.name for n in on_int8} if method == "static" else set()
    left = Counter(n.op_type for n in _weight_products(quantized) if n.name not in done)
    kept = dict(kept)
    for op, count in left.items():
        if count:
            why = _FLOAT_REASONS["Gemm"] if (op, method) == ("Gemm", "dynamic") else None
            kept[f"{op} (with a weight)"] = {
                "nodes": count,
                "why": why or "left in float by ONNX Runtime's quantizer",
            }
    if not quantized_ops:
        raise ExportError(
            "ONNX Runtime quantized none of the graph's matrix products "
            f"({', '.join(f'{n} {op}' for op, n in left.items()) or 'none found'}); export fp32 or "
            "fp16"
        )
    three_d = any(
        len(t.dims) == 3
        for n in _weight_products(fp32)
        for t in fp32.graph.initializer
        if t.name in n.input
    )
    if method == "static":
        weights = "int8, symmetric, per output channel" + (
            " (the bmm lowering's 3-D weights: one scale per tensor, as ONNX Runtime's integer "
            "MatMul takes no per-channel scales on batched weights)"
            if three_d
            else ""
        )
        activations = "int8, symmetric (zero point 0), ranges calibrated on the data"
    else:
        weights = (
            "int8, symmetric, one scale per tensor (the bmm lowering's 3-D weights: ONNX "
            "Runtime's integer MatMul takes no per-channel scales on batched weights, and the "
            "dynamic quantizer chooses for the whole graph)"
            if three_d
            else "int8, symmetric, per output channel"
        )
        activations = "uint8, quantized per batch at run time (DynamicQuantizeLinear)"
    return {
        "method": method,
        "format": "QDQ" if method == "static" else "QOperator (MatMulInteger)",
        "weights": weights,
        "activations": activations,
        "calibration_method": None,
        "num_calibration": 0,
        "calibration_sha256": None,
        "quantized_ops": quantized_ops,
        "integer_ops": {op: ops[op] for op in integer if ops.get(op)},
        "kept_float": kept,
        "bias_kept_apart": 0,
    }


def _input_ranks(model, nodes: set[str]) -> dict[str, int]:
    """node name -> the rank of its first input, for the named nodes, from ONNX shape inference
    on a copy of ``model`` without its large weights (their dims are all inference needs)."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    for tensor in light.graph.initializer:
        if tensor.ByteSize() > 4096:  # weights, not the small shape constants Reshape reads
            tensor.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data"):
                tensor.ClearField(field)
    inferred = onnx.shape_inference.infer_shapes(light)
    ranks = {}
    for value in (*inferred.graph.value_info, *inferred.graph.input):
        if value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    return {n.name: ranks.get(n.input[0], -1) for n in model.graph.node if n.name in nodes}


def _keep_bias_apart(fp32, quantized) -> int:
    """Keep ONNX Runtime from running the static graph's 2-D products in float; returns how many
    were changed.

    The loop lowering's member products multiply a 2-D activation, ``MatMul(x [R, in], W) + b``.
    ONNX Runtime's ``MatMulAddFusion`` (a level-1 optimization, before its QDQ fusions) turns
    such a pair into a float ``Gemm`` whose weight is dequantized on every run, and its QDQ
    ``Gemm`` selector takes no float bias (it wants an int32 one, which TensorRT refuses): the
    Hydra graph ran 1.5 x slower than FP32 that way (measured, ViT-B/16). Fed a [1, 1, out] bias
    (then ``Squeeze`` back to [R, out]), the fusion does not match (a 2-D Gemm's bias is [out] or
    [1, out]); the DQ-MatMul pair becomes ``MatMulIntegerToFloat``, as in a one-model graph,
    and TensorRT reads the same standard operators. The values are unchanged."""
    producers = {out: n for n in quantized.graph.node for out in n.output}
    consumers: dict[str, list] = {}
    for node in quantized.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    initializers = {t.name: t for t in quantized.graph.initializer}
    outputs = {o.name for o in quantized.graph.output}
    integer = [
        n
        for n in quantized.graph.node
        if n.op_type == "MatMul"
        and all(getattr(producers.get(i), "op_type", "") == "DequantizeLinear" for i in n.input)
    ]
    ranks = _input_ranks(fp32, {n.name for n in integer})
    taken = {t.name for t in quantized.graph.initializer} | {n.name for n in quantized.graph.node}
    taken |= {name for n in quantized.graph.node for name in (*n.input, *n.output)}

    def fresh(name: str) -> str:
        return unique_name(name, taken)

    nodes = list(quantized.graph.node)
    widened: dict[str, str] = {}  # one [1, 1, out] copy per bias (exporters share equal ones)
    axes = None
    changed = 0
    for matmul in integer:
        after = consumers.get(matmul.output[0], [])
        if ranks.get(matmul.name) != 2 or len(after) != 1 or matmul.output[0] in outputs:
            continue
        add = after[0]
        bias = next((i for i in add.input if i != matmul.output[0]), None)
        if add.op_type != "Add" or bias not in initializers or len(initializers[bias].dims) != 1:
            continue
        if bias not in widened:
            wide = onnx.numpy_helper.from_array(
                onnx.numpy_helper.to_array(initializers[bias]).reshape(1, 1, -1),
                fresh(f"{bias}_1x1"),
            )
            quantized.graph.initializer.append(wide)
            widened[bias] = wide.name
        if axes is None:
            axes = fresh("int8_bias_squeeze_axes")
            quantized.graph.initializer.append(
                onnx.numpy_helper.from_array(np.array([0], dtype=np.int64), axes)
            )
        result, broadcast = add.output[0], fresh(f"{add.output[0]}_1xR")
        add.input[list(add.input).index(bias)] = widened[bias]
        add.output[0] = broadcast
        squeeze = onnx.helper.make_node(
            "Squeeze", [broadcast, axes], [result], name=fresh(f"{add.name or result}_squeeze")
        )
        nodes.insert(nodes.index(add) + 1, squeeze)
        changed += 1
    if changed:
        quantized.graph.ClearField("node")
        quantized.graph.node.extend(nodes)
        used = {i for n in quantized.graph.node for i in n.input}
        kept = [t for t in quantized.graph.initializer if t.name in used]
        quantized.graph.ClearField("initializer")
        quantized.graph.initializer.extend(kept)
        onnx.checker.check_model(quantized, full_check=False)
    return changed


# --- running ONNX Runtime's quantizer ----------------------------------------------------------------
def _check_calibration(model, calibration: Any) -> dict[str, np.ndarray]:
    """The calibration inputs by graph input name, as the graph's types; enough, finite rows."""
    data = spelled("int8 calibration data (Int8Options(calib=...))", "--int8-calib DATA")
    if calibration is None:
        raise ExportError(
            "static INT8 calibrates the activations' ranges on data: give "
            f"{data} (a few hundred of the model's inputs), or quantize dynamically "
            f"({_dynamic_advice()}, weights only)"
        )
    if not isinstance(calibration, Mapping):
        raise ExportError(
            f"the INT8 calibration data must map input names to arrays, got "
            f"{type(calibration).__name__}"
        )
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name not in calibration:
            raise ExportError(
                f"the INT8 calibration data holds no {value.name!r} (it holds "
                f"{sorted(calibration)}); give the model's inputs {[v.name for v in model.graph.input]}"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = np.ascontiguousarray(np.asarray(calibration[value.name]).astype(dtype))
    counts = {name: len(a) for name, a in feeds.items()}
    if len(set(counts.values())) != 1:
        raise ExportError(f"the INT8 calibration arrays differ in length: {counts}")
    count = next(iter(counts.values()))
    if count < MIN_CALIBRATION_EXAMPLES:
        raise ExportError(
            f"the INT8 calibration data holds {count} example{'s' * (count != 1)}; static "
            f"calibration needs at least {MIN_CALIBRATION_EXAMPLES} (a few hundred is better): "
            f"give more in {data}, or quantize dynamically "
            f"({_dynamic_advice()}, no data needed)"
        )
    for name, array in feeds.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ExportError(f"the INT8 calibration input {name!r} holds NaN or inf; fix the data")
    return feeds


def _calibration_batches(model, feeds: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """``feeds`` in batches of CALIBRATION_BATCH. Text (a right-padded ``attention_mask`` and a
    symbolic sequence axis): examples grouped by length and each batch cut to its longest, so
    the activation ranges are those of tokens, not of padding columns no example of the batch
    uses (at run time padding is masked out of every output)."""
    count = len(next(iter(feeds.values())))
    order = np.arange(count)
    lengths = None
    mask = feeds.get("attention_mask")
    symbolic = {
        v.name
        for v in model.graph.input
        if len(v.type.tensor_type.shape.dim) == 2 and v.type.tensor_type.shape.dim[1].dim_param
    }
    if mask is not None and mask.ndim == 2 and "attention_mask" in symbolic:
        counted = (mask != 0).sum(1)
        if ((mask != 0) == (np.arange(mask.shape[1]) < counted[:, None])).all():
            lengths, order = counted, np.argsort(counted, kind="stable")
    batches = []
    for start in range(0, count, CALIBRATION_BATCH):
        rows = order[start : start + CALIBRATION_BATCH]
        if lengths is None:
            batches.append({n: a[start : start + CALIBRATION_BATCH] for n, a in feeds.items()})
            continue
        width = max(int(lengths[rows].max()), 1)
        batches.append(
            {
                n: a[rows, :width] if n in symbolic and a.shape == mask.shape else a[rows]
                for n, a in feeds.items()
            }
        )
    return batches


def _feed_reader(batches: list[dict[str, np.ndarray]]):
    """ORT's CalibrationDataReader over ``batches``, with the ``set_range`` ORT uses to collect
    one batch at a time (memory: one batch's intermediate tensors)."""

    class Feeds(quantization.CalibrationDataReader):
        def __init__(self) -> None:
            self.range = (0, len(batches))
            self.pending: Iterator[dict[str, np.ndarray]] | None = None

        def __len__(self) -> int:
            return len(batches)

        def set_range(self, start_index: int, end_index: int) -> None:
            self.range, self.pending = (start_index, end_index), None

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.pending is None:
                self.pending = iter(batches[self.range[0] : self.range[1]])
            return next(self.pending, None)

    return Feeds()


def _batched_weights(model, chosen: list[str]) -> list[str]:
    """The 3-D (batched, the ``bmm`` lowering's [M, in, out]) weights of the chosen products:
    ONNX Runtime's integer MatMul (``MatMulIntegerToFloat``) refuses per-channel scales on them
    at run time ("b zero point is not valid"), so they are quantized per tensor."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    names = set(chosen)
    return sorted(
        {i for n in model.graph.node if n.name in names for i in n.input if ranks.get(i, 0) >= 3}
    )


def _quantize_static(
    source: Path,
    target: Path,
    model,
    batches: list[dict[str, np.ndarray]],
    plan: _Plan,
    batched: list[str],
) -> None:
    """ONNX Runtime's static QDQ quantization. MinMax ranges are calibrated here, a batch at a
    time (:func:`_calibrate_minmax`: the FP32 file's outputs kept for validation), and handed to
    ONNX Runtime as its calibration cache; the entropy and percentile methods run ONNX Runtime's
    own calibrators, one batch at a time (``CalibStridedMinMax``)."""
    methods = {
        "minmax": quantization.CalibrationMethod.MinMax,
        "entropy": quantization.CalibrationMethod.Entropy,
        "percentile": quantization.CalibrationMethod.Percentile,
    }
    count = sum(len(next(iter(b.values()))) for b in batches)
    own = plan.calibrate_method == "minmax" and _takes_a_cache()
    with tempfile.TemporaryDirectory(prefix="hydra-int8-") as folder:
        arguments: dict[str, Any] = {}
        if own:
            ranges = _calibrate_minmax(model, batches, plan, count)
            arguments["calibration_cache_path"] = Path(folder) / "ranges.json"
            quantization.calibrate.save_tensors_data(
                quantization.calibrate.TensorsData(methods["minmax"], ranges),
                arguments["calibration_cache_path"],
            )
            logger.info("int8: quantizing %d products", len(plan.chosen))
        else:
            arguments["calibration_data_reader"] = _feed_reader(batches)
            logger.info(
                "int8: calibrating on %d examples (%s, ONNX Runtime) and quantizing %d products",
                count,
                plan.calibrate_method,
                len(plan.chosen),
            )
        with _quiet_onnxruntime():
            quantization.quantize_static(
                str(source),
                str(target),
                quant_format=quantization.QuantFormat.QDQ,
                op_types_to_quantize=list(QUANTIZED_OP_TYPES),
                per_channel=True,
                reduce_range=False,
                activation_type=quantization.QuantType.QInt8,
                weight_type=quantization.QuantType.QInt8,
                nodes_to_quantize=list(plan.chosen),
                nodes_to_exclude=list(plan.excluded),
                calibrate_method=methods[plan.calibrate_method],
                extra_options=_static_options(batched),
                **arguments,
            )


def _takes_a_cache() -> bool:
    """Whether this ONNX Runtime's ``quantize_static`` takes ranges computed beforehand (its
    ``calibration_cache_path``; older releases calibrate themselves)."""
    return "calibration_cache_path" in inspect.signature(quantization.quantize_static).parameters


def _static_options(batched: list[str]) -> dict[str, Any]:
    return {
        "ActivationSymmetric": True,  # zero point 0: TensorRT's explicit quantization
        "WeightSymmetric": True,
        "MatMulConstBOnly": True,  # the products with a weight; attention stays float
        "QDQOpTypePerChannelSupportToAxis": {"MatMul": -1},  # output channels, 2-D or 3-D
        "OpTypesToExcludeOutputQuantization": list(QUANTIZED_OP_TYPES),  # float accumulators
        "DedicatedQDQPair": True,  # TensorRT cannot share a Q/DQ pair between consumers
        # a Gemm's bias stays float: ORT would write it as INT32 behind a DequantizeLinear,
        # whose input TensorRT takes in INT8/FP8/INT4 only (onnx-tensorrt 8.6-GA and 10.x
        # QuantizeDequantizeLinearHelper); no int32 bias, so no weight scale widened for it
        "QuantizeBias": False,
        "QDQDisableWeightAdjustForInt32Bias": True,
        "CalibStridedMinMax": 1,  # collect one feed at a time (every method)
        "CalibPercentile": PERCENTILE,
        "TensorQuantOverrides": {name: [{"symmetric": True}] for name in batched},
    }


def _calibrated_tensors(model, chosen: list[str]) -> list[str]:
    """The activations the quantizer reads ranges for: the inputs of the chosen products that
    are not weights."""
    constants, names = _constants(model), set(chosen)
    found: dict[str, None] = {}
    for node in model.graph.node:
        if node.name in names:
            found.update((i, None) for i in node.input if i and i not in constants)
    return list(found)


def _calibrate_minmax(
    model, batches: list[dict[str, np.ndarray]], plan: _Plan, count: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each calibrated activation's (lowest, highest) over ``batches``, run one at a time: what
    ONNX Runtime's MinMax calibrator computes (the same ``ReduceMin``/``ReduceMax`` on the
    unoptimized graph, as float32 arrays of one value), holding one batch's outputs rather than
    every batch's. The FP32 outputs of each batch go to ``plan.fp32_runs``. The session runs
    without ONNX Runtime's memory arena, which otherwise keeps its largest batch's memory."""
    tensors = _calibrated_tensors(model, plan.chosen)
    outputs = [o.name for o in model.graph.output]
    taken = {n for node in model.graph.node for n in (*node.input, *node.output)}
    reduced = []
    nodes, graph_outputs = len(model.graph.node), len(model.graph.output)
    for tensor in tensors:
        pair = [unique_name(f"{tensor}_{op}", taken) for op in ("min", "max")]
        for op, name in zip(("ReduceMin", "ReduceMax"), pair, strict=True):
            taken.add(name)
            model.graph.node.append(onnx.helper.make_node(op, [tensor], [name], keepdims=1))
            model.graph.output.append(
                onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
        reduced.append(pair)
    try:
        augmented = model.SerializeToString()
    finally:  # the model as it was: its appended nodes and outputs removed
        del model.graph.node[nodes:]
        del model.graph.output[graph_outputs:]
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3
    if ort_threads():  # the command's --threads
        options.intra_op_num_threads = ort_threads()
    session = onnxruntime.InferenceSession(augmented, options, providers=["CPUExecutionProvider"])
    del augmented
    names = [o.name for o in session.get_outputs()]
    lowest: dict[str, np.ndarray] = {}
    highest: dict[str, np.ndarray] = {}
    with progress(len(batches), desc=f"calibrating {count} examples", unit="batch") as bar:
        for batch in batches:
            values = dict(zip(names, session.run(None, batch), strict=True))
            plan.fp32_runs.append((batch, {name: values[name] for name in outputs}))
            for tensor, (low, high) in zip(tensors, reduced, strict=True):
                low_value = np.asarray(values[low], np.float32).reshape(-1)
                high_value = np.asarray(values[high], np.float32).reshape(-1)
                # np.fmin/fmax: ORT's nanmin/nanmax over the batches
                lowest[tensor] = np.fmin(lowest.get(tensor, low_value), low_value)
                highest[tensor] = np.fmax(highest.get(tensor, high_value), high_value)
            bar.update()
    return {t: (lowest[t], highest[t]) for t in tensors}


def _quantize_dynamic(
    source: Path, target: Path, chosen: list[str], excluded: list[str], per_channel: bool
) -> None:
    """``per_channel``: one scale per output channel of each weight (axis -1 of a MatMul's
    [in, out]); ORT's default is one per tensor."""
    quantization.quantize_dynamic(
        str(source),
        str(target),
        op_types_to_quantize=list(QUANTIZED_OP_TYPES),
        per_channel=per_channel,
        reduce_range=False,
        weight_type=quantization.QuantType.QInt8,
        nodes_to_quantize=list(chosen),
        nodes_to_exclude=list(excluded),
        extra_options={"MatMulConstBOnly": True},
    )


@contextlib.contextmanager
def _quiet_onnxruntime() -> Iterator[None]:
    """ORT's quantizer logs advice (pre-processing) on the root logger and prints its histogram
    progress: not the user's concern."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)
