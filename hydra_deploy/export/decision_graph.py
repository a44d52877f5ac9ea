"""The decisions of a :class:`~hydra_deploy.export_folder.DecisionRecord` as graph outputs
(``hydra-calibrate --in-graph``).

:func:`add_decisions` appends to an exported ``model.onnx`` the nodes that compute, from its
``member_logits`` [batch, M, C] output and in float32, what
:func:`hydra_deploy.decisions.apply_decisions` computes in float64:

- ``calibrated_probs`` [B, C] float32: ``mean_m softmax(member_logits_m / T)``;
- ``prediction_set`` [B, C] bool (when the record has sets): LAC ``1 - p_y <= qhat``; APS/RAPS the
  cumulative sum of p sorted descending up to y, plus ``lam * max(0, rank - k_reg)``,
  ``<= qhat``, plus the top class; ``qhat`` one value or one per candidate class y
  (class-conditional). The sort is a TopK, whose ties the ONNX spec ranks by lower index (as
  numpy's stable sort; ONNX Runtime does); TensorRT documents no tie order, so an engine may rank
  exactly tied probabilities differently;
- ``accept`` [B] bool (when it has a selective rule): msp >= tau, or the entropy / mutual
  information <= tau;
- ``ood_flag`` [B] bool (when it has an OOD rule): the OOD score (msp negated, or the entropy /
  mutual information) > threshold.

As in ``apply_decisions(..., allow_nonfinite=True)``, an example whose member logits hold a NaN or
an infinity gets NaN probabilities, an empty set, accept False and ood_flag True.

:func:`remove_decisions` takes them out again (re-calibrating replaces the decisions). Every node
and initializer added is named ``decisions/...``. The nodes use only operators that
onnx-tensorrt lists as supported for TensorRT 8.6, 10.x and 11 (:data:`DECISION_OPS`).

float32 against apply_decisions' float64: the probabilities agree within 1e-5, the bool outputs
wherever the defining score is not within float32's rounding of its threshold (and, for APS/RAPS,
no two probabilities are so close that float32 orders them otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from hydra_deploy.decisions import set_threshold
from hydra_deploy.errors import ExportError
from hydra_deploy.export_folder import DECISION_OUTPUTS, DecisionRecord, SetRule

__all__ = [
    "DECISION_OPS",
    "DECISION_OUTPUTS",
    "MIN_OPSET",
    "PREFIX",
    "TOPK_MAX_K",
    "add_decisions",
    "remove_decisions",
]

#: names of every node and initializer add_decisions adds start with it
PREFIX = "decisions/"
#: ReduceSum and Squeeze take their axes as an input from opset 13 on (the forms used here)
MIN_OPSET = 13
#: The largest K of TensorRT's TopK layer (its operator docs, 10.x and 11: k <= 3840; onnx-tensorrt's
#: table at 10.1-GA: "less than 3840"; TensorRT 8.6.0 EA's operator docs said k <= 1024). APS/RAPS
#: sort all C classes with one TopK, so they are refused above it
TOPK_MAX_K = 3840

# Every op checked in onnx-tensorrt's docs/operators.md at 8.6-GA (TensorRT 8.6, opsets <= 17) and
# at 10.1-GA and main (TensorRT 10.x, opsets 9-20; TensorRT 11's ONNX guide points to the same
# table): each "Y" for the types used here, FP32 (Equal, Gather, ScatterElements also on the
# INT32/INT64 TopK indices; And, Or, Not on BOOL). Their restrictions, all met: ReduceSum (10.x)
# and Squeeze: axes an initializer; CumSum: axis an initializer; TopK: K an initializer (8.5's
# table), sorted=1 and K < 3840 (10.1's table; see TOPK_MAX_K, checked). TensorRT 8.6 casts the
# INT64 initializers to INT32.
DECISION_OPS = (
    "Add",
    "And",
    "CumSum",
    "Div",
    "Equal",
    "Exp",
    "Gather",
    "GreaterOrEqual",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "Max",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "ReduceSum",
    "ScatterElements",
    "Squeeze",
    "Sub",
    "TopK",
)

_LOGITS = "member_logits"
_TINY = 1e-30  # log(max(p, tiny)): 0 log 0 = 0, as heads.py


class _Builder:
    """Nodes and initializers named ``decisions/<name>``; each node's output is its name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}

    def const(self, name: str, value, dtype=np.float32) -> str:
        """An initializer (one per name: a second call with the name reuses the first)."""
        name = PREFIX + name
        if name not in self.initializers:
            array = np.asarray(value, dtype=dtype)
            self.initializers[name] = numpy_helper.from_array(array, name)
        return name

    def axes(self, *axes: int) -> str:
        return self.const("axes_" + "_".join(map(str, axes)), list(axes), np.int64)

    def op(self, op_type: str, inputs: Iterable[str], name: str, outputs: int = 1, **attrs):
        """Add a node; returns its output name (``name``, or a public output's name), or the list
        of its ``outputs`` names."""
        node_name = name if name in DECISION_OUTPUTS else PREFIX + name
        names = [node_name] if outputs == 1 else [f"{node_name}:{i}" for i in range(outputs)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), names, name=PREFIX + name, **attrs)
        )
        return names[0] if outputs == 1 else names


class _Scores:
    """The calibrated probabilities and the scores the rules read, built on first use."""

    def __init__(self, g: _Builder, temperature: float, members: int) -> None:
        self.g = g
        # 0 where the example's logits are finite, NaN where any is NaN or infinite: [B, 1, 1]
        zeros = g.op("Mul", [_LOGITS, g.const("zero", 0.0)], "logits_times_zero")
        self.guard = g.op("ReduceSum", [zeros, g.axes(1, 2)], "nonfinite_guard", keepdims=1)
        scaled = g.op("Div", [_LOGITS, g.const("temperature", temperature)], "scaled_logits")
        guarded = g.op("Add", [scaled, self.guard], "guarded_logits")  # [B, M, C]
        self.log_p = g.op("LogSoftmax", [guarded], "member_log_probs", axis=-1)  # [B, M, C]
        self.member_p = g.op("Exp", [self.log_p], "member_probs")  # [B, M, C]
        self.members = g.const("members", float(members))
        summed = g.op("ReduceSum", [self.member_p, g.axes(1)], "member_probs_sum", keepdims=0)
        self.probs = g.op("Div", [summed, self.members], "calibrated_probs")  # [B, C]

    @cached_property
    def finite(self) -> str:
        """[B, 1] bool: the example's logits are all finite."""
        g = self.g
        ok = g.op("Equal", [self.guard, self.guard], "finite_3d")  # [B, 1, 1]; NaN != NaN
        return g.op("Squeeze", [ok, g.axes(2)], "finite")

    @cached_property
    def msp(self) -> str:
        g = self.g
        top, _ = g.op("TopK", [self.probs, g.const("k_1", [1], np.int64)], "top1", 2, axis=-1)
        return g.op("Squeeze", [top, g.axes(1)], "msp")  # [B]

    @cached_property
    def predictive_entropy(self) -> str:
        g = self.g
        clamped = g.op("Max", [self.probs, g.const("tiny", _TINY)], "probs_clamped")
        plogp = g.op("Mul", [self.probs, g.op("Log", [clamped], "log_probs")], "plogp")
        total = g.op("ReduceSum", [plogp, g.axes(1)], "plogp_sum", keepdims=0)  # [B]
        return g.op("Neg", [total], "predictive_entropy")

    @cached_property
    def mutual_information(self) -> str:
        g = self.g
        plogp = g.op("Mul", [self.member_p, self.log_p], "member_plogp")  # [B, M, C]
        total = g.op("ReduceSum", [plogp, g.axes(1, 2)], "member_plogp_sum", keepdims=0)  # [B]
        expected = g.op("Neg", [g.op("Div", [total, self.members], "mean_plogp")], "exp_entropy")
        gap = g.op("Sub", [self.predictive_entropy, expected], "entropy_gap")
        return g.op("Max", [gap, g.const("zero_floor", 0.0)], "mutual_information")  # [B]


def _set_scores(g: _Builder, probs: str, rule: SetRule, classes: int) -> tuple[str, str | None]:
    """(scores [B, C] in class order, the top class [B, C] bool or None for LAC)."""
    if rule.method == "lac":
        return g.op("Sub", [g.const("one", 1.0), probs], "lac_scores"), None
    k = g.const("k_classes", [classes], np.int64)
    # [B, C] each: p descending, ties by lower class index; order[b, r] = the class ranked r + 1
    sorted_p, order = g.op("TopK", [probs, k], "sorted", 2, axis=-1, largest=1, sorted=1)
    axis = g.const("cumsum_axis", 1, np.int64)
    cumulative = g.op("CumSum", [sorted_p, axis], "cumulative")  # [B, C], by rank
    if rule.method == "raps":
        ranks = np.arange(1, classes + 1, dtype=np.float64)
        penalty = g.const("raps_penalty", rule.lam * np.maximum(0.0, ranks - rule.k_reg))  # [C]
        cumulative = g.op("Add", [cumulative, penalty], "raps_cumulative")
    # scores[b, order[b, r]] = cumulative[b, r]: back in class order
    scores = g.op(
        "ScatterElements", [cumulative, order, cumulative], "aps_scores", axis=1
    )  # [B, C]
    first = g.op("Gather", [order, g.const("rank_1", [0], np.int64)], "top_class", axis=1)
    classes_ids = g.const("class_ids", np.arange(classes), np.int64)  # [C]
    return scores, g.op("Equal", [classes_ids, first], "is_top")  # [B, C]


def _prediction_set(g: _Builder, scores: _Scores, rule: SetRule, classes: int) -> str:
    values, top = _set_scores(g, scores.probs, rule, classes)
    # [1], or [C]: one per candidate class; ties within rounding inside, as in numpy
    qhat = g.const("qhat", set_threshold(rule.qhat).tolist())
    name = "prediction_set" if top is None else "under_qhat"
    in_set = g.op("LessOrEqual", [values, qhat], name)  # NaN scores: False
    if top is None:
        return in_set
    top = g.op("And", [top, scores.finite], "top_if_finite")
    return g.op("Or", [in_set, top], "prediction_set")  # [B, C]


def _accept(g: _Builder, scores: _Scores, name: str, tau: float) -> str:
    value, threshold = getattr(scores, name), g.const("tau", tau)
    if name == "msp":
        return g.op("GreaterOrEqual", [value, threshold], "accept")  # [B]
    return g.op("LessOrEqual", [value, threshold], "accept")


def _ood_flag(g: _Builder, scores: _Scores, name: str, threshold: float) -> str:
    value = getattr(scores, name)
    if name == "msp":
        value = g.op("Neg", [value], "neg_msp")  # higher = more unusual
    # not (score <= threshold): score > threshold, and True where the score is NaN
    usual = g.op("LessOrEqual", [value, g.const("ood_threshold", threshold)], "ood_usual")
    return g.op("Not", [usual], "ood_flag")  # [B]


# --- checks ---------------------------------------------------------------------------------------
def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in value.type.tensor_type.shape.dim
    ]


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _names(graph: onnx.GraphProto) -> Iterator[str]:
    """The names of the graph's nodes, tensors and outputs."""
    yield from (n.name for n in graph.node)
    yield from (t for n in graph.node for t in n.output)
    yield from (v.name for v in [*graph.input, *graph.initializer, *graph.output])


def _check(model: onnx.ModelProto, record: DecisionRecord) -> onnx.ValueInfoProto:
    """The ``member_logits`` output, once the model is one decisions can be added to."""
    graph = model.graph
    names = set(_names(graph))
    present = [name for name in DECISION_OUTPUTS if name in names]
    if present or any(name.startswith(PREFIX) for name in names):
        raise ExportError(
            f"the model already has decisions ({', '.join(present) or PREFIX + '... nodes'}): call "
            "remove_decisions(model) first, or re-export the model"
        )
    logits = next((o for o in graph.output if o.name == _LOGITS), None)
    if logits is None:
        raise ExportError(
            "the model has no 'member_logits' output: decisions go into a Hydra export's "
            "model.onnx (make one with hydra-export)"
        )
    if _opset(model) < MIN_OPSET:
        raise ExportError(
            f"the model's opset is {_opset(model)}; decisions need opset {MIN_OPSET} or newer: "
            "re-export it (hydra-export --opset 17)"
        )
    elem = logits.type.tensor_type.elem_type
    if elem != TensorProto.FLOAT:
        raise ExportError(
            f"member_logits is {helper.tensor_dtype_to_string(elem)}, not float32: re-export the "
            "model with hydra-export (its member_logits output is float32 at every precision)"
        )
    dims = _dims(logits)
    if len(dims) != 3 or not isinstance(dims[1], int):
        raise ExportError(
            f"member_logits must be [batch, members, classes] with a fixed member count, got "
            f"{dims}; re-export the model with hydra-export"
        )
    if isinstance(dims[2], int) and dims[2] != record.num_classes:
        raise ExportError(
            f"the decisions were fitted for {record.num_classes} classes but the model has "
            f"{dims[2]}; calibrate this model (hydra-calibrate) before adding its decisions"
        )
    sets = record.sets
    if sets is not None and sets.method != "lac" and record.num_classes > TOPK_MAX_K:
        raise ExportError(
            f"{sets.method.upper()} sets sort all {record.num_classes} classes with one TopK, and "
            f"TensorRT's TopK takes K <= {TOPK_MAX_K}: calibrate with LAC sets (--sets lac), or "
            "keep the decisions out of the graph"
        )
    return logits


# --- public ---------------------------------------------------------------------------------------
def add_decisions(model: onnx.ModelProto, record: DecisionRecord) -> onnx.ModelProto:
    """A copy of ``model`` with the decisions of ``record`` as extra outputs: ``calibrated_probs``
    [B, C] float32, and for each rule the record holds ``prediction_set`` [B, C], ``accept`` [B],
    ``ood_flag`` [B] (bool), computed in float32 from ``member_logits``.

    Refused (:class:`ExportError`) for a model without a float32 ``member_logits`` [B, M, C]
    output (M fixed), an opset before 13, a class count other than ``record.num_classes``, a model
    that already has decision outputs (see :func:`remove_decisions`), and APS/RAPS sets over more
    than :data:`TOPK_MAX_K` classes."""
    logits = _check(model, record)
    batch, members, classes = _dims(logits)
    g = _Builder()
    scores = _Scores(g, record.temperature, members)
    shapes = {"calibrated_probs": (TensorProto.FLOAT, [batch, classes])}
    if record.sets is not None:
        _prediction_set(g, scores, record.sets, record.num_classes)
        shapes["prediction_set"] = (TensorProto.BOOL, [batch, classes])
    if record.selective is not None:
        _accept(g, scores, record.selective.score, record.selective.tau)
        shapes["accept"] = (TensorProto.BOOL, [batch])
    if record.ood is not None:
        _ood_flag(g, scores, record.ood.score, record.ood.threshold)
        shapes["ood_flag"] = (TensorProto.BOOL, [batch])

    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.extend(g.nodes)
    out.graph.initializer.extend(g.initializers.values())
    out.graph.output.extend(
        helper.make_tensor_value_info(name, elem, shape) for name, (elem, shape) in shapes.items()
    )
    return out


def _inputs(node: onnx.NodeProto) -> Iterator[str]:
    """The tensors a node reads, those its subgraphs read from outside included."""
    yield from node.input
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in sub.node:
                yield from _inputs(inner)


def _upstream(nodes: list[onnx.NodeProto], names: Iterable[str]) -> set[int]:
    """Indices of the nodes that ``names`` (tensor names) depend on."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}
    seen: set[int] = set()
    stack = [producer[n] for n in names if n in producer]
    while stack:
        index = stack.pop()
        if index not in seen:
            seen.add(index)
            stack.extend(producer[n] for n in _inputs(nodes[index]) if n in producer)
    return seen


def remove_decisions(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the decision outputs (:data:`DECISION_OUTPUTS`) and the nodes
    and initializers that only they use; a model without them comes back unchanged."""
    graph = model.graph
    removed = [o.name for o in graph.output if o.name in DECISION_OUTPUTS]
    kept = [o for o in graph.output if o.name not in DECISION_OUTPUTS]
    nodes = list(graph.node)
    dead = _upstream(nodes, removed) - _upstream(nodes, [o.name for o in kept])
    live = [node for i, node in enumerate(nodes) if i not in dead]
    gone = {t for i in dead for t in nodes[i].output}
    used = {t for node in live for t in _inputs(node)} | {o.name for o in kept}
    unused = {t for i in dead for t in _inputs(nodes[i])} - used  # read by removed nodes only

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for field, values in (
        (out.graph.output, kept),
        (out.graph.node, live),
        (out.graph.initializer, [t for t in graph.initializer if t.name not in unused]),
        (out.graph.value_info, [v for v in graph.value_info if v.name not in gone]),
    ):
        del field[:]
        field.extend(values)
    return out
