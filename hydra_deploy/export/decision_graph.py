"""The decisions of a :class:`~hydra_deploy.export_folder.DecisionRecord` as graph outputs
(``hydra-calibrate --in-graph``).

:func:`add_decisions` appends to an exported ``model.onnx`` the nodes that compute, from its
``member_logits`` [batch, M, C] output and in float32, the rules of
:func:`hydra_deploy.decisions.apply_decisions` (float64):

- ``calibrated_probs`` [B, C] float32: ``mean_m softmax(member_logits_m / T)``, each member's
  log-probabilities as ``z - max(z) - log(sum(exp(z - max(z))))`` (finite for tiny probabilities);
- ``prediction_set`` [B, C] bool (when the record has sets): ``class_room(p) >= set_floor(qhat)``
  (:func:`~hydra_deploy.decisions.class_room`, :func:`~hydra_deploy.decisions.set_floor`), the
  room built by the set score's own graph half
  (:meth:`~hydra_deploy.set_scores.SetScore.graph_room`, through :class:`_SetGraph`, the op
  builder this module supplies to the registry). LAC's room is p; APS/RAPS sort p with a TopK, take the mass ranked strictly below each rank as a
  MatMul with a constant strictly triangular 0/1 matrix (smallest terms included, never
  ``1 - cumulative``), subtract RAPS's ``lam * max(0, rank - k_reg)`` by rank and scatter the rooms
  back to class order (ScatterElements); a score that always holds the top class (APS, RAPS) has
  it added (the TopK's first index). ``qhat`` is one value or
  one per candidate class (class-conditional: a [C] floor). The TopK ranks ties by lower index
  in the ONNX spec (as numpy's stable sort; ONNX Runtime does); TensorRT documents no tie order,
  so an engine may rank exactly tied probabilities differently;
- ``accept`` [B] bool (when it has a selective rule):
  :func:`~hydra_deploy.decisions.accept_mask`: msp ``>= tau + decision_margin(tau)``, or the
  entropy / mutual information ``<= tau - decision_margin(tau)``;
- ``ood_flag`` [B] bool (when it has an OOD rule): :func:`~hydra_deploy.decisions.ood_mask`: the
  OOD score (msp negated, or the entropy / mutual information) ``> threshold +
  decision_margin(threshold)``.

Every threshold is computed in float64 by those functions and stored as the float32 constant
that makes one float32 comparison exact: ``v >= t`` is ``v > c`` with ``c`` the largest float32
below ``t``, ``v <= t`` is ``v < c`` with ``c`` the smallest float32 above it (and so on), for
every float32 ``v``; NaN compares False. So the graph and apply_decisions can differ only where
the float32 score itself lies on the other side of the float64 threshold: within the score's
float32 rounding (about 1e-6 relative) of it. A score exactly at tau or at the OOD threshold is
``decision_margin`` (1e-5) away from the comparison and gets the same answer on both paths.

As in ``apply_decisions(..., allow_nonfinite=True)``, an example whose member logits hold a NaN or
an infinity gets NaN probabilities, an empty set, accept False and ood_flag True.

:func:`remove_decisions` takes them out again (re-calibrating replaces the decisions). Every node
and initializer added is named ``decisions/...``.

TensorRT: every node becomes ONE layer that TensorRT's ONNX parser names after the node, so
``--layerPrecisions`` / ``ILayer.precision`` can pin each floating-point one to FP32 in a weakly
typed reduced-precision build (:func:`hydra_deploy.engines.onnx_summary.fp32_layer_names` lists
them). Read in onnx-tensorrt's importers, 8.6-GA (``builtin_op_importers.cpp``,
``onnx2trt_utils.cpp``) and 10.1-GA and main of May 2024 (``onnxOpImporters.cpp``,
``importerUtils.cpp``), where each calls ``ctx->registerLayer(layer, node)`` on the one layer:

- Add, Sub, Mul, Div, Max, Equal, Less, Greater, And, Or: ``elementwiseHelper``, one
  IElementWiseLayer (for two inputs of the same rank: a lower-rank input gets an IShuffleLayer
  that 8.6 leaves unnamed and 10.x names ``ONNXTRT_Broadcast``, ``broadcastTensor``; so every
  constant here has the rank of the tensor it meets);
- Exp, Log, Neg, Not: ``unaryHelper``, one IUnaryLayer (Not on BOOL; Neg on FP32);
- ReduceMax, ReduceSum: ``reduceTensor``, one IReduceLayer (axes an attribute or an initializer;
  ReduceMax takes them as an input only from opset 18, ReduceSum from 13: :func:`_Builder.reduce`;
  8.6's ReduceMax importer reads only the attribute, so it would reduce every axis of an opset-18
  graph, an opset 8.6 does not support);
- MatMul: one IMatrixMultiplyLayer (both operands rank 2: no unsqueeze/squeeze);
- TopK: one ITopKLayer (plus integer-only layers for K: a constant and a shuffle to a scalar;
  10.x casts the INT32 indices to INT64, an ICastLayer);
- ScatterElements: ``addScatterLayer``, one IScatterLayer (10.x casts the indices to INT32 first);
- Gather: one IGatherLayer (10.x casts INT64 indices of non-INT64 data to INT32).

The extra layers of TopK, ScatterElements and Gather carry integers only. Not used, because they
make more than one floating-point layer, or layers without our name: Softmax (ISoftMaxLayer and
an unnamed IShuffleLayer), LogSoftmax (ISoftMaxLayer, an unnamed IUnaryLayer Log and an unnamed
IShuffleLayer), CumSum (a loop whose running-sum IElementWiseLayer is unnamed),
LessOrEqual/GreaterOrEqual (``greaterLessOrEqual``: Less/Greater, Equal and Or, the last two named
``<node>_<n>``). The float initializers become IConstantLayers named after them
(``convertToTensor``). Every operator is supported for
the types used here in onnx-tensorrt's docs/operators.md at 8.6-GA and 10.1-GA (TensorRT 11's
ONNX guide points to the same table): FP32; Equal and Gather also on the INT32/INT64 TopK indices;
And, Or, Not on BOOL; ReduceMax/ReduceSum with ``axes`` an initializer; TopK with K an
initializer, sorted=1 and K < 3840 (:data:`TOPK_MAX_K`, checked). TensorRT 8.6 casts the INT64
initializers to INT32.

float32 against apply_decisions' float64: the probabilities agree within 1e-5, the bool outputs
wherever the defining score is not within float32's rounding of its threshold (and, for APS/RAPS,
no two probabilities are so close that float32 orders them otherwise). TF32: every trtexec line
that pins layers to FP32 has ``--noTF32`` (and the Python build sets no TF32 flag); a build by
hand that allows TF32 may run the FP32 MatMul of APS/RAPS in TF32 (10-bit mantissa) on Ampere and
newer GPUs. The float initializers' IConstantLayers are not in the pinned list (their values are
FP32 weights; a builder that chose an FP16 output for one would round a threshold to FP16).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cached_property

import numpy as np

from hydra_deploy.decisions import decision_margin, set_floor
from hydra_deploy.errors import ExportError, spelled
from hydra_deploy.export_folder import DECISION_OUTPUTS, DecisionRecord, SetRule
from hydra_deploy.optional import lazy_module
from hydra_deploy.set_scores import SET_SCORES

onnx = lazy_module("onnx", purpose="adding the decisions to model.onnx", error=ExportError)

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
#: ReduceSum takes its axes as an input from opset 13 on (the form used here)
MIN_OPSET = 13
#: ReduceMax takes its axes as an input from this opset on (an attribute before)
REDUCE_MAX_AXES_INPUT = 18
#: The largest K of TensorRT's TopK layer (its operator docs, 10.x and 11: k <= 3840; onnx-tensorrt's
#: table at 10.1-GA: "less than 3840"; TensorRT 8.6.0 EA's operator docs said k <= 1024). A set
#: score that ranks the classes (APS/RAPS) sorts all C with one TopK, so it is refused above it
TOPK_MAX_K = 3840

#: Every operator the decisions use: each one TensorRT layer named after its node (see the module
#: docstring for the importers read)
DECISION_OPS = (
    "Add",
    "And",
    "Div",
    "Equal",
    "Exp",
    "Gather",
    "Greater",
    "Less",
    "Log",
    "MatMul",
    "Max",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "ReduceMax",
    "ReduceSum",
    "ScatterElements",
    "Sub",
    "TopK",
)

_LOGITS = "member_logits"
_TINY = 1e-30  # log(max(p, tiny)): 0 log 0 = 0, as heads.py


# --- float32 constants that make one comparison exact ---------------------------------------------
def _float32_next(value: np.ndarray, up: bool) -> np.ndarray:
    return np.nextafter(value, np.float32(np.inf if up else -np.inf), dtype=np.float32)


def _float32_bound(threshold, relation: str) -> np.ndarray:
    """The float32 ``c`` for which, for every float32 ``v``, ``v <relation> threshold`` (float64)
    is ``v > c`` (relations ``>=``, ``>``) or ``v < c`` (``<=``, ``<``)."""
    t = np.asarray(threshold, dtype=np.float64)
    with np.errstate(over="ignore"):
        c = t.astype(np.float32)  # the nearest float32
    wide = c.astype(np.float64)
    if relation == ">=":  # v >= t  <=>  v > (the largest float32 below t)
        return np.where(wide >= t, _float32_next(c, up=False), c)
    if relation == ">":  # v > t  <=>  v > (the largest float32 at most t)
        return np.where(wide > t, _float32_next(c, up=False), c)
    if relation == "<=":  # v <= t  <=>  v < (the smallest float32 above t)
        return np.where(wide <= t, _float32_next(c, up=True), c)
    if relation == "<":  # v < t  <=>  v < (the smallest float32 at least t)
        return np.where(wide < t, _float32_next(c, up=True), c)
    raise ValueError(f"unknown relation {relation!r}")


# --- building the nodes -------------------------------------------------------------------------------
class _Builder:
    """Nodes and initializers named ``decisions/<name>``; each node's output is its name."""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}

    def const(
        self, name: str, value, dtype=np.float32, shape: tuple[int, ...] | None = None
    ) -> str:
        """An initializer (one per name: a second call with the name reuses the first), of
        ``shape`` when given: the rank of the tensor it meets, so that TensorRT's parser adds no
        broadcasting layer."""
        name = PREFIX + name
        if name not in self.initializers:
            array = np.asarray(value, dtype=dtype)
            if shape is not None:
                array = array.reshape(shape)
            self.initializers[name] = onnx.numpy_helper.from_array(array, name)
        return name

    def axes(self, *axes: int) -> str:
        return self.const("axes_" + "_".join(map(str, axes)), list(axes), np.int64)

    def op(self, op_type: str, inputs: Iterable[str], name: str, outputs: int = 1, **attrs):
        """Add a node; returns its output name (``name``, or a public output's name), or the list
        of its ``outputs`` names."""
        node_name = name if name in DECISION_OUTPUTS else PREFIX + name
        names = [node_name] if outputs == 1 else [f"{node_name}:{i}" for i in range(outputs)]
        self.nodes.append(
            onnx.helper.make_node(op_type, list(inputs), names, name=PREFIX + name, **attrs)
        )
        return names[0] if outputs == 1 else names

    def reduce(self, op_type: str, data: str, axes: tuple[int, ...], name: str, keepdims: int):
        """ReduceSum / ReduceMax over ``axes``: an initializer input where the opset takes one
        (ReduceSum from 13, ReduceMax from 18), the ``axes`` attribute before."""
        as_input = self.opset >= (REDUCE_MAX_AXES_INPUT if op_type == "ReduceMax" else MIN_OPSET)
        if as_input:
            return self.op(op_type, [data, self.axes(*axes)], name, keepdims=keepdims)
        return self.op(op_type, [data], name, axes=list(axes), keepdims=keepdims)

    def compare(self, value: str, relation: str, threshold, name: str, shape: tuple[int, ...]):
        """``value <relation> threshold`` (float64 threshold, one or [C]) as one Greater or Less
        with a float32 constant of ``shape``, exact for every float32 value (NaN: False)."""
        bound = self.const(name + "_bound", _float32_bound(threshold, relation), shape=shape)
        op_type = "Greater" if relation in (">=", ">") else "Less"
        return self.op(op_type, [value, bound], name)


class _Scores:
    """The calibrated probabilities and the scores the rules read, built on first use."""

    def __init__(self, g: _Builder, temperature: float, members: int) -> None:
        self.g = g
        # 0 where the example's logits are finite, NaN where any is NaN or infinite: [B, 1, 1]
        zero = g.const("zero", 0.0, shape=(1, 1, 1))
        zeros = g.op("Mul", [_LOGITS, zero], "logits_times_zero")
        self.guard = g.reduce("ReduceSum", zeros, (1, 2), "nonfinite_guard", keepdims=1)
        t = g.const("temperature", temperature, shape=(1, 1, 1))
        scaled = g.op("Div", [_LOGITS, t], "scaled_logits")
        guarded = g.op("Add", [scaled, self.guard], "guarded_logits")  # [B, M, C]
        # log-softmax from its parts: z - max - log(sum(exp(z - max))), each one named layer
        top = g.reduce("ReduceMax", guarded, (2,), "member_max_logit", keepdims=1)  # [B, M, 1]
        shifted = g.op("Sub", [guarded, top], "shifted_logits")
        exp = g.op("Exp", [shifted], "exp_logits")
        total = g.reduce("ReduceSum", exp, (2,), "exp_sum", keepdims=1)  # [B, M, 1]
        self._shifted, self._total = shifted, total
        self.member_p = g.op("Div", [exp, total], "member_probs")  # [B, M, C]
        summed = g.reduce("ReduceSum", self.member_p, (1,), "member_probs_sum", keepdims=0)
        self.members = float(members)
        m = g.const("members", self.members, shape=(1, 1))
        self.probs = g.op("Div", [summed, m], "calibrated_probs")  # [B, C]

    @cached_property
    def log_p(self) -> str:
        """[B, M, C]: each member's log-probabilities (mutual information only)."""
        g = self.g
        log_total = g.op("Log", [self._total], "log_exp_sum")
        return g.op("Sub", [self._shifted, log_total], "member_log_probs")

    @cached_property
    def finite(self) -> str:
        """[B] bool: the example's logits are all finite (its guard is 0, not NaN)."""
        g = self.g
        guard = g.reduce("ReduceSum", self.guard, (1, 2), "nonfinite_guard_1d", keepdims=0)
        return g.op("Less", [guard, g.const("one", 1.0, shape=(1,))], "finite")

    @cached_property
    def finite_2d(self) -> str:
        """[B, 1] bool: :attr:`finite`, a column."""
        g = self.g
        guard = g.reduce("ReduceSum", self.guard, (2,), "nonfinite_guard_2d", keepdims=0)
        return g.op("Less", [guard, g.const("one_2d", 1.0, shape=(1, 1))], "finite_2d")

    @cached_property
    def msp(self) -> str:
        return self.g.reduce("ReduceMax", self.probs, (1,), "msp", keepdims=0)  # [B]

    @cached_property
    def predictive_entropy(self) -> str:
        g = self.g
        clamped = g.op("Max", [self.probs, g.const("tiny", _TINY, shape=(1, 1))], "probs_clamped")
        plogp = g.op("Mul", [self.probs, g.op("Log", [clamped], "log_probs")], "plogp")
        total = g.reduce("ReduceSum", plogp, (1,), "plogp_sum", keepdims=0)  # [B]
        return g.op("Neg", [total], "predictive_entropy")

    @cached_property
    def mutual_information(self) -> str:
        g = self.g
        plogp = g.op("Mul", [self.member_p, self.log_p], "member_plogp")  # [B, M, C]
        total = g.reduce("ReduceSum", plogp, (1, 2), "member_plogp_sum", keepdims=0)  # [B]
        m = g.const("members_1d", self.members, shape=(1,))
        expected = g.op("Neg", [g.op("Div", [total, m], "mean_plogp")], "exp_entropy")
        gap = g.op("Sub", [self.predictive_entropy, expected], "entropy_gap")
        zero = g.const("zero_1d", 0.0, shape=(1,))
        return g.op("Max", [gap, zero], "mutual_information")  # [B]


class _SetGraph:
    """The op builder a set score's graph half calls (:class:`~hydra_deploy.set_scores.SetGraph`):
    ``g``'s nodes and initializers, the calibrated probabilities, and the classes ranked once."""

    def __init__(self, g: _Builder, probs: str, classes: int, method: str) -> None:
        self.const, self.op = g.const, g.op
        self.probs, self.classes, self.method = probs, classes, method

    @cached_property
    def _ranked(self) -> tuple[str, str]:
        # TensorRT's TopK takes K <= TOPK_MAX_K; LAC sorts nothing
        if self.classes > TOPK_MAX_K:
            raise ExportError(
                f"{self.method.upper()} sets sort all {self.classes} classes with one TopK, and "
                f"TensorRT's TopK takes K <= {TOPK_MAX_K}: calibrate with LAC sets "
                + spelled("(sets='lac')", "(--sets lac)")
                + ", or keep the decisions out of the graph"
            )
        k = self.const("k_classes", [self.classes], np.int64)
        # [B, C] each: p descending, ties by lower class index; order[b, r] = the class ranked r + 1
        sorted_p, order = self.op(
            "TopK", [self.probs, k], "sorted", 2, axis=-1, largest=1, sorted=1
        )
        return sorted_p, order

    def ranked(self) -> tuple[str, str]:
        return self._ranked

    def by_class(self, by_rank: str, name: str) -> str:
        # by_class[b, order[b, r]] = by_rank[b, r]: every entry written (order is a permutation)
        order = self._ranked[1]
        return self.op("ScatterElements", [by_rank, order, by_rank], name, axis=1)

    def top_class(self) -> str:
        """[B, C] bool: the class ranked first."""
        rank_1 = self.const("rank_1", [0], np.int64)
        first = self.op("Gather", [self._ranked[1], rank_1], "top_class", axis=1)  # [B, 1]
        class_ids = self.const("class_ids", np.arange(self.classes), np.int64, (1, self.classes))
        return self.op("Equal", [class_ids, first], "is_top")


def _prediction_set(g: _Builder, scores: _Scores, rule: SetRule, classes: int) -> str:
    score = SET_SCORES[rule.method]
    graph = _SetGraph(g, scores.probs, classes, rule.method)
    room = score.graph_room(graph, rule.params)  # [B, C] in class order
    # room >= set_floor(qhat): one floor, or one per candidate class; NaN rooms: False
    floor = set_floor(np.asarray(rule.qhat, dtype=np.float64))
    shape = (1, classes) if rule.class_conditional else (1, 1)
    if not score.top_always_in:
        return g.compare(room, ">=", floor, "prediction_set", shape)
    in_set = g.compare(room, ">=", floor, "room_over_floor", shape)
    top = g.op("And", [graph.top_class(), scores.finite_2d], "top_if_finite")
    return g.op("Or", [in_set, top], "prediction_set")  # [B, C]


def _accept(g: _Builder, scores: _Scores, name: str, tau: float) -> str:
    # decisions.accept_mask: msp >= tau + margin, an entropy <= tau - margin (NaN: False)
    if name == "msp":
        passed = g.compare(scores.msp, ">=", tau + decision_margin(tau), "passes_tau", (1,))
    else:
        value = getattr(scores, name)
        passed = g.compare(value, "<=", tau - decision_margin(tau), "passes_tau", (1,))
    return g.op("And", [passed, scores.finite], "accept")  # [B]


def _ood_flag(g: _Builder, scores: _Scores, name: str, threshold: float) -> str:
    # decisions.ood_mask: score > threshold + margin; the score of msp is -msp
    bar = threshold + decision_margin(threshold)
    if name == "msp":  # -msp > bar  <=>  msp < -bar (negation is exact)
        unusual = g.compare(scores.msp, "<", -bar, "ood_score_over", (1,))
    else:
        unusual = g.compare(getattr(scores, name), ">", bar, "ood_score_over", (1,))
    nonfinite = g.op("Not", [scores.finite], "nonfinite")
    return g.op("Or", [unusual, nonfinite], "ood_flag")  # [B]


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
    if elem != onnx.TensorProto.FLOAT:
        raise ExportError(
            f"member_logits is {onnx.helper.tensor_dtype_to_string(elem)}, not float32: re-export the "
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
    return logits


# --- public ---------------------------------------------------------------------------------------
def add_decisions(model: onnx.ModelProto, record: DecisionRecord) -> onnx.ModelProto:
    """A copy of ``model`` with the decisions of ``record`` as extra outputs: ``calibrated_probs``
    [B, C] float32, and for each rule the record holds ``prediction_set`` [B, C], ``accept`` [B],
    ``ood_flag`` [B] (bool), computed in float32 from ``member_logits``.

    Refused (:class:`ExportError`) for a model without a float32 ``member_logits`` [B, M, C]
    output (M fixed), an opset before 13, a class count other than ``record.num_classes``, a model
    that already has decision outputs (see :func:`remove_decisions`), and sets of a score that
    ranks the classes (APS, RAPS) over more than :data:`TOPK_MAX_K` classes."""
    logits = _check(model, record)
    batch, members, classes = _dims(logits)
    g = _Builder(_opset(model))
    scores = _Scores(g, record.temperature, members)
    shapes = {"calibrated_probs": (onnx.TensorProto.FLOAT, [batch, classes])}
    if record.sets is not None:
        _prediction_set(g, scores, record.sets, record.num_classes)
        shapes["prediction_set"] = (onnx.TensorProto.BOOL, [batch, classes])
    if record.selective is not None:
        _accept(g, scores, record.selective.score, record.selective.tau)
        shapes["accept"] = (onnx.TensorProto.BOOL, [batch])
    if record.ood is not None:
        _ood_flag(g, scores, record.ood.score, record.ood.threshold)
        shapes["ood_flag"] = (onnx.TensorProto.BOOL, [batch])

    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.extend(g.nodes)
    out.graph.initializer.extend(g.initializers.values())
    out.graph.output.extend(
        onnx.helper.make_tensor_value_info(name, elem, shape)
        for name, (elem, shape) in shapes.items()
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
